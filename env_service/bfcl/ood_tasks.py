"""Out-of-distribution tasks: bfcl-eval's V4 memory and web-search categories, evaluate-only.

They are never trained on: the service refuses them in ``train`` mode, and the launcher refuses training data
that names them. Ids and category names are bfcl's own:

* memory (``memory_kv``, ``memory_rec_sum``, ``memory_vector``): per scenario (student, customer, finance,
  healthcare, notetaker) a chain of *prerequisite conversations* (``memory_kv_prereq_22-student-0``, ``-1``, ...)
  in which the model stores what it learns through the memory backend's tools, then the *questions*
  (``memory_kv_0-customer-0``, single turn) that start from the memory the chain left. A prerequisite is not
  scored; a question's verdict is bfcl's ``agentic_checker`` on the model's final answer.
* web search (``web_search_base``, ``web_search_no_snippet``): single-turn questions answered with live
  search (SerpAPI, ``$SERPAPI_API_KEY``); same verdict.

What cannot run here is named by :func:`unavailable_reason`: the vector backend needs the sentence-transformers
model ``all-MiniLM-L6-v2`` in the local Hugging Face cache (bfcl loads it when its module is imported), web search
needs the key. Tasks are loaded from the pinned bfcl-eval package once per process and category;
:func:`load_ood_task` returns a deep copy.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import threading
from dataclasses import dataclass

from env_service.bfcl import upstream

MEMORY_CATEGORIES: tuple[str, ...] = ("memory_kv", "memory_rec_sum", "memory_vector")
WEB_SEARCH_CATEGORIES: tuple[str, ...] = ("web_search_base", "web_search_no_snippet")
OOD_CATEGORIES: tuple[str, ...] = MEMORY_CATEGORIES + WEB_SEARCH_CATEGORIES
MEMORY_SCENARIOS: tuple[str, ...] = tuple(upstream.MEMORY_SCENARIO_NAME)

KIND_PREREQ = "memory_prereq"  # a prerequisite conversation: fills the memory, not scored
KIND_QUESTION = "memory_question"
KIND_WEB_SEARCH = "web_search"

#: The environment variable bfcl's web-search backend reads its SerpAPI key from.
SERPAPI_KEY_ENV = "SERPAPI_API_KEY"
#: The embedding model bfcl's vector memory backend loads at import (a sentence-transformers hub id).
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
EMBEDDING_REPO = f"sentence-transformers/{EMBEDDING_MODEL}"

#: The largest memory snapshot an episode takes or hands back (JSON bytes). bfcl's backends cap their content
#: (key-value: 7 core entries of 300 characters and 50 archival entries of 2,000; summary: 10,000 characters).
MAX_SNAPSHOT_BYTES = 1 << 20

if set(MEMORY_CATEGORIES) != set(upstream.MEMORY_CATEGORY) or set(WEB_SEARCH_CATEGORIES) != set(
    upstream.WEB_SEARCH_CATEGORY
):  # pragma: no cover - a bfcl-eval release with other categories
    raise RuntimeError(
        f"bfcl-eval's agentic categories changed: {upstream.MEMORY_CATEGORY + upstream.WEB_SEARCH_CATEGORY}"
    )


@dataclass(frozen=True)
class OodTask:
    """One bfcl memory or web-search entry.

    ``question``: the user turns (bfcl's messages; a question's first turn starts with bfcl's answer-format system
    message). ``functions``: the backend's docs (without bfcl's Python-syntax hint). ``backend``: bfcl's class
    name (``MemoryAPI_kv``, ``WebSearchAPI``, ...). ``possible_answers``: what the checker accepts ([] for a
    prerequisite). ``prereqs``: the prerequisite ids this entry depends on, in order (bfcl's ``depends_on``).
    """

    id: str
    category: str
    kind: str
    scenario: str | None
    question: list[list[dict]]
    functions: list[dict]
    backend: str
    possible_answers: list[str]
    prereqs: tuple[str, ...]

    #: The episode mechanics read this: OOD backends have no long-context variant.
    long_context = False

    @property
    def data_source(self) -> str:
        return self.category

    @property
    def num_turns(self) -> int:
        return len(self.question)

    @property
    def holdout_functions(self) -> dict[int, list[dict]]:
        """No function is held out in these categories."""
        return {}

    @property
    def involved_classes(self) -> list[str]:
        return [self.backend]

    @property
    def is_memory(self) -> bool:
        return self.kind in (KIND_PREREQ, KIND_QUESTION)

    @property
    def system_text(self) -> str:
        """bfcl's system message of the first turn ("" when it has none)."""
        first = self.question[0] if self.question else []
        return first[0]["content"] if first and first[0].get("role") == "system" else ""


def ood_category(task_id: object) -> str | None:
    """The OOD category of a task id (``memory_kv_prereq_3-customer-3`` -> ``memory_kv``), None for any other id."""
    if not isinstance(task_id, str):
        return None
    for category in OOD_CATEGORIES:
        rest = task_id[len(category) + 1 :] if task_id.startswith(category + "_") else ""
        if rest and (rest[0].isdigit() or rest.startswith("prereq_")):
            return category
    return None


def is_ood_task(task_id: object) -> bool:
    return ood_category(task_id) is not None


_LOAD_LOCK = threading.Lock()


def _tasks(category: str) -> dict[str, OodTask]:
    if category not in OOD_CATEGORIES:
        raise ValueError(f"unknown OOD category {category!r}; expected one of {OOD_CATEGORIES}")
    with _LOAD_LOCK:
        return _build_tasks(category)


@functools.cache
def _build_tasks(category: str) -> dict[str, OodTask]:
    """Every entry of ``category`` (memory: prerequisites included), in bfcl's order. Private: shared objects."""
    entries = upstream.load_dataset_entry(category, include_prereq=True, include_language_specific_hint=False)
    answers = upstream.load_ground_truth_entry(category)
    family = "memory" if category in MEMORY_CATEGORIES else "web_search"
    # bfcl renames the package's ids (``memory_0-customer-0``) to the category's and aligns answers by position.
    by_id = {answer["id"].replace(family, category, 1): answer["ground_truth"] for answer in answers}
    tasks: dict[str, OodTask] = {}
    for entry in entries:
        prereq = "prereq" in entry["id"]
        kind = KIND_PREREQ if prereq else KIND_QUESTION if family == "memory" else KIND_WEB_SEARCH
        if not prereq and entry["id"] not in by_id:
            raise RuntimeError(f"bfcl data: no possible answer for {entry['id']}")
        (backend,) = entry["involved_classes"]
        tasks[entry["id"]] = OodTask(
            id=entry["id"],
            category=category,
            kind=kind,
            scenario=entry.get("scenario"),
            question=entry["question"],
            functions=entry["function"],
            backend=backend,
            possible_answers=[] if prereq else list(by_id[entry["id"]]),
            prereqs=tuple(entry.get("depends_on", ())),
        )
    return tasks


def load_ood_task(task_id: str) -> OodTask:
    """The task with this id, as a fresh deep copy. KeyError for an unknown id."""
    category = ood_category(task_id)
    task = _tasks(category).get(task_id) if category else None
    if task is None:
        raise KeyError(f"unknown OOD task id {task_id!r}; the OOD categories are {', '.join(OOD_CATEGORIES)}")
    return copy.deepcopy(task)


def shared_ood_task(task_id: str) -> OodTask:
    """The table's own copy of the task, not a deep copy: for reading only. KeyError for an unknown id."""
    return _tasks(ood_category(task_id))[task_id]


def ood_task_ids(category: str, include_prereq: bool = False) -> list[str]:
    """The scored entries of ``category`` in bfcl's order (with ``include_prereq``, the prerequisites too)."""
    return [t.id for t in _tasks(category).values() if include_prereq or t.kind != KIND_PREREQ]


def all_ood_task_ids() -> list[str]:
    """Every OOD id the service knows (prerequisites included)."""
    return [t for category in OOD_CATEGORIES for t in ood_task_ids(category, include_prereq=True)]


def prereq_chain(category: str, scenario: str) -> list[str]:
    """The prerequisite conversations of a memory scenario, in the order they must run."""
    if category not in MEMORY_CATEGORIES or scenario not in MEMORY_SCENARIOS:
        raise ValueError(f"no prerequisite chain for {category!r}/{scenario!r}")
    return [t.id for t in _tasks(category).values() if t.kind == KIND_PREREQ and t.scenario == scenario]


def scenario_of(task_id: str) -> str | None:
    """The memory scenario of a memory task (None for web search)."""
    return load_ood_task(task_id).scenario


# ---- what can run here ---------------------------------------------------------------------------------------


def _hub_cache_dir() -> str:
    """Where huggingface_hub keeps downloaded models, read from the environment now ($HF_HUB_CACHE, $HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def embedding_model_available() -> bool:
    """Whether ``all-MiniLM-L6-v2`` can load without a network: in the local Hugging Face cache (or a folder of
    that name in the working directory, which sentence-transformers also accepts). Looks at files only."""
    if os.path.isfile(os.path.join(EMBEDDING_MODEL, "modules.json")):
        return True
    snapshots = os.path.join(_hub_cache_dir(), "models--" + EMBEDDING_REPO.replace("/", "--"), "snapshots")
    try:
        revisions = os.listdir(snapshots)
    except OSError:
        return False
    return any(
        all(os.path.exists(os.path.join(snapshots, rev, name)) for name in ("modules.json", "config.json"))
        for rev in revisions
    )


#: The Python modules each OOD backend imports beyond what the multi-turn backends need (its pip packages).
BACKEND_MODULES: dict[str, dict[str, str]] = {
    "memory_kv": {"rank_bm25": "rank-bm25"},
    "memory_rec_sum": {},
    "memory_vector": {"sentence_transformers": "sentence-transformers", "faiss": "faiss-cpu"},
    "web_search_base": {"html2text": "html2text", "bs4": "beautifulsoup4", "serpapi": "google-search-results"},
}
BACKEND_MODULES["web_search_no_snippet"] = BACKEND_MODULES["web_search_base"]


def unavailable_reason(category: str) -> str | None:
    """Why ``category`` cannot be evaluated on this machine (None when it can): the message a skip prints."""
    problems = []
    if category == "memory_vector" and not embedding_model_available():
        problems.append(
            f"bfcl's vector memory backend needs the sentence-transformers model {EMBEDDING_MODEL!r} "
            f"({EMBEDDING_REPO}) in the local Hugging Face cache ({_hub_cache_dir()}), and it is not there; download "
            f"it once where the hub is reachable (`huggingface-cli download {EMBEDDING_REPO}`) or point $HF_HOME at a "
            f"cache that has it"
        )
    if category in WEB_SEARCH_CATEGORIES and not os.environ.get(SERPAPI_KEY_ENV):
        problems.append(
            f"bfcl's web-search backend queries SerpAPI and needs a key in ${SERPAPI_KEY_ENV}, which is not set"
        )
    missing = [pkg for module, pkg in BACKEND_MODULES.get(category, {}).items() if not importlib.util.find_spec(module)]
    if missing:
        problems.append(
            f"bfcl's backend for it needs the Python package(s) {', '.join(missing)}, which are not installed "
            f"(`pip install {' '.join(missing)}`)"
        )
    return f"{category} skipped: " + "; ".join(problems) if problems else None


__all__ = [
    "shared_ood_task",
    "EMBEDDING_MODEL",
    "KIND_PREREQ",
    "KIND_QUESTION",
    "KIND_WEB_SEARCH",
    "MAX_SNAPSHOT_BYTES",
    "MEMORY_CATEGORIES",
    "MEMORY_SCENARIOS",
    "OOD_CATEGORIES",
    "SERPAPI_KEY_ENV",
    "WEB_SEARCH_CATEGORIES",
    "OodTask",
    "all_ood_task_ids",
    "embedding_model_available",
    "is_ood_task",
    "load_ood_task",
    "ood_category",
    "ood_task_ids",
    "prereq_chain",
    "scenario_of",
    "unavailable_reason",
]
