"""The BFCL environment service: episodes of BFCL V3 multi-turn (and V4 out-of-distribution) tasks behind an HTTP API.

Layers, top to bottom; a layer imports only the layers below it (``tests/house/test_imports.py`` checks it):

* ``http/``: the HTTP front and its limits (the FastAPI app, connection and request budgets, the shared secret,
  the endpoint table).
* ``episodes/``: the service's episodes and their budgets: who owns which episode, what each client may hold
  and keep, when an episode is reclaimed, and which worker runs it.
* ``workers/``: the worker processes that run episodes, their fair scheduling and their supervision.
* ``bfcl/``: the BFCL adapters: tasks, the model-message parser, the safe executor, the verifier, prompts and the
  training interface, one episode's mechanics, the out-of-distribution tasks.
* the shared words and helpers every layer may use: ``vocabulary``, ``errors``, ``files``, ``json_safe``.

Above them: ``client`` (the trainer's client, over HTTP or in-process), ``replay`` (ground truth played through
a client) and ``__main__`` (``python -m env_service serve | replay | ...``).
"""
