"""The service's endpoints, written once: the HTTP routes (``service.py``) and the in-process client
(``client.py``) are both built from :data:`ENDPOINTS`.

Each endpoint names the :class:`~env_service.episodes.manager.EpisodeManager` method it calls; the body's fields are
that method's keyword arguments, so a request means the same on both transports. ``/health`` is not here:
each transport answers it itself (the HTTP one adds the worker processes and the service id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from env_service.vocabulary import MODE_TRAIN, MODE_VALIDATE

if TYPE_CHECKING:
    from env_service.episodes.manager import EpisodeManager


class _Body(BaseModel):
    # Unknown fields are refused: a misspelt field name ("instanceid") must not be silently ignored.
    model_config = ConfigDict(extra="forbid")


class CreateRequest(_Body):
    task_id: str
    mode: Literal[MODE_TRAIN, MODE_VALIDATE]
    params: dict[str, Any] = Field(default_factory=dict)
    # The caller's key for this create (a retry gets the same episode); the instance id is minted by the service.
    request_id: str | None = None
    # OOD memory tasks: the memory the episode starts from (a prerequisite's evaluation hands it back)
    memory_snapshot: dict[str, Any] | None = None


class StepRequest(_Body):
    instance_id: str
    content: str
    seq: Annotated[int, Field(ge=0, strict=True)] | None = None


class EvaluateRequest(_Body):
    instance_id: str
    reward: dict[str, Any] | None = None
    release: bool = False  # release the episode once evaluated (saves the /release round trip)


class ReleaseRequest(_Body):
    instance_id: str


class TouchRequest(_Body):
    instance_id: str


class ProfileRequest(_Body):
    profile: dict[str, Any]


class CreateResponse(BaseModel):
    instance_id: str
    messages: list[dict[str, Any]]
    info: dict[str, Any]


class StepResponse(BaseModel):
    message: dict[str, Any]
    extra_messages: list[dict[str, Any]] = []  # ipython mode: one message per tool result
    terminated: bool
    info: dict[str, Any]


@dataclass(frozen=True)
class Caller:
    """Who sent a request. ``run_id``: whose failure profile it reads or writes (None: the anonymous run).
    ``owner``: whose episodes it may see and use (its run, else its client). ``client``: whom the limits that protect
    other clients count it against, whatever run ids it names (over HTTP its address; None: its owner)."""

    run_id: str | None
    owner: str
    client: str | None = None


@dataclass(frozen=True)
class Endpoint:
    """``method`` ``/path`` calls ``manager.<manager_method>(**body, **caller)``.

    ``caller``: the :class:`Caller` fields the method takes (the HTTP route reads and validates the run id
    header only for these endpoints). ``reply_key``: the method's result is answered as ``{reply_key: result}``.
    """

    path: str
    method: Literal["GET", "POST"]
    manager_method: str
    body: type[_Body] | None = None
    response: type[BaseModel] | None = None
    caller: tuple[str, ...] = ()
    reply_key: str | None = None
    # Whether a request whose client is gone is dropped before its work starts (``env_service.abandon``): a release
    # is carried out anyway (it frees what the client asked to free, and costs less than keeping the episode).
    abandonable: bool = True
    # The manager method that undoes what the request made, for a result no one will read: ``(result, owner)``.
    undo: str | None = None

    def __call__(self, manager: EpisodeManager, body: dict[str, Any], caller: Caller) -> Any:
        result = getattr(manager, self.manager_method)(**body, **{name: getattr(caller, name) for name in self.caller})
        return result if self.reply_key is None else {self.reply_key: result}

    def abandoned(self, manager: EpisodeManager, result: Any, caller: Caller) -> None:
        """Undo what this request made, its client gone before the answer (an episode created for no one)."""
        if self.undo is not None and isinstance(result, dict):
            getattr(manager, self.undo)(result, caller.owner)


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "create", "POST", "create", CreateRequest, CreateResponse, caller=("owner", "run_id", "client"), undo="unmake"
    ),
    Endpoint("step", "POST", "step", StepRequest, StepResponse, caller=("owner",)),
    Endpoint("evaluate", "POST", "evaluate", EvaluateRequest, caller=("owner", "client")),
    Endpoint("release", "POST", "release", ReleaseRequest, reply_key="released", caller=("owner",), abandonable=False),
    Endpoint("touch", "POST", "touch", TouchRequest, reply_key="live", caller=("owner",)),
    Endpoint("profile", "POST", "set_profile", ProfileRequest, caller=("run_id", "client")),
    Endpoint("profile", "GET", "get_profile", caller=("run_id",)),
)

#: (method, path) -> endpoint
BY_ROUTE: dict[tuple[str, str], Endpoint] = {(e.method, e.path): e for e in ENDPOINTS}


__all__ = [
    "BY_ROUTE",
    "ENDPOINTS",
    "Caller",
    "CreateRequest",
    "CreateResponse",
    "Endpoint",
    "EvaluateRequest",
    "ProfileRequest",
    "ReleaseRequest",
    "StepRequest",
    "StepResponse",
]
