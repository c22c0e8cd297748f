"""The errors a caller of the environment service can act on, each with its HTTP status and short code.

The episode registry (``manager.py``) raises them; the HTTP service answers ``{"error": code, "detail":
message}`` with ``status``, and the in-process client turns them into the same ``EnvServiceError``.
"""

from __future__ import annotations


class ManagerError(Exception):
    """Base of the errors a caller can act on. ``status``: the HTTP status the service answers."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"error": self.code, "detail": self.message}


class BadRequest(ManagerError):
    status, code = 400, "bad_request"


class InvalidConfig(BadRequest):
    """``params`` / ``reward`` rejected by the config validator (unknown key, wrong type)."""

    status, code = 422, "invalid_config"


class InvalidContent(BadRequest):
    """The assistant text cannot be processed at all (e.g. lone surrogates: not valid Unicode)."""

    status, code = 422, "invalid_content"


class UnknownTask(ManagerError):
    status, code = 404, "unknown_task"


class EvaluateOnly(BadRequest):
    """An out-of-distribution task (bfcl's memory / web-search categories) asked for in train mode."""

    status, code = 403, "evaluate_only"


class TaskUnavailable(ManagerError):
    """A task that cannot run on this machine (a missing local model or API key); the detail says what."""

    status, code = 422, "task_unavailable"


class UnknownInstance(ManagerError):
    status, code = 404, "unknown_instance"


class Conflict(ManagerError):
    """The request contradicts the episode's state (duplicate id, stepping a finished episode, ...)."""

    status, code = 409, "conflict"


class EpisodeBusy(Conflict):
    """Another request on the same episode is running; the client may retry once it has answered."""

    status, code = 409, "episode_busy"


class PayloadTooLarge(ManagerError):
    status, code = 413, "payload_too_large"


class CapacityExceeded(ManagerError):
    """Too many live episodes; retry later (the service answers 503 so clients back off and retry)."""

    status, code = 503, "capacity_exceeded"


class CreateInProgress(ManagerError):
    """A create with the same ``request_id`` is still running (a retry that overlaps its original) and did not finish
    within the retry's wait; retry later to get its episode (503: clients back off and retry)."""

    status, code = 503, "create_in_progress"


class OwnerMemoryExceeded(ManagerError):
    """The client's live episodes keep more than ``max_owner_bytes`` together; it must release some before it creates
    or steps more (429: a client backs off and retries, and its other episodes may be released meanwhile)."""

    status, code = 429, "owner_memory_exceeded"


class ClientGone(ManagerError):
    """The client that sent the request disconnected before its work started (``env_service.abandon``); no one reads
    the answer, which says so for the log."""

    status, code = 499, "client_gone"


class EpisodeFailure(ManagerError):
    """An unexpected exception inside an episode (a bug on our side; logged with its traceback)."""

    status, code = 500, "episode_failure"


class EpisodeLost(ManagerError):
    """The worker process holding the episode died or was killed (it stopped answering); start a new one."""

    status, code = 500, "episode_lost"


__all__ = [
    "BadRequest",
    "CapacityExceeded",
    "ClientGone",
    "Conflict",
    "CreateInProgress",
    "EpisodeBusy",
    "EpisodeFailure",
    "EpisodeLost",
    "EvaluateOnly",
    "InvalidConfig",
    "InvalidContent",
    "ManagerError",
    "OwnerMemoryExceeded",
    "PayloadTooLarge",
    "TaskUnavailable",
    "UnknownInstance",
    "UnknownTask",
]
