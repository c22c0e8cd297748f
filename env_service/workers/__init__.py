"""Worker processes that run episodes (``pool``: ``python -m env_service.workers.pool``), who goes next on a busy
worker (``fair_gate``), and how a process follows the one that started it (``parent_watch``)."""
