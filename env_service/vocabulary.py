"""The words the environment service and the trainer share: diagnosis tags and labels, task categories,
episode modes, and how an error looks in an observation.

The environment writes these words (the verifier tags turns, the episode marks its replies, the tasks carry
their category); the trainer reads them (the capability state counts tags, A-Patch weighs them, validation
averages categories). Both sides import them from here, so a word is spelt in exactly one place. This module
imports nothing from the project: it is the bottom layer.
"""

from __future__ import annotations

import json
import re

# ---- progress tags: one per ground-truth user turn, from the verifier (the released code's vocabulary) -------

TAG_PASS = "pass"
TAG_CORRECT_ABSTENTION = "correct_abstention"  # nothing was to be called, and nothing was
TAG_SPURIOUS_TOOL_CALL = "spurious_tool_call"  # nothing was to be called, but something was
TAG_EMPTY_TURN = "empty_turn_model_response"  # something was to be called, but nothing was
TAG_INSTANCE_MISMATCH = "instance_mismatch"
TAG_STATE_MISMATCH = "state_mismatch"
TAG_RESPONSE_MISMATCH = "response_mismatch"
TAG_CHECKER_ERROR = "checker_error"  # the checker itself raised
TAG_GT_ERROR = "gt_error"  # a ground-truth call could not be parsed or executed
TAG_BUDGET_EXCEEDED = "budget_exceeded"  # a model call of the turn was stopped or skipped by a service budget
PROGRESS_TAGS: tuple[str, ...] = (
    TAG_PASS,
    TAG_CORRECT_ABSTENTION,
    TAG_SPURIOUS_TOOL_CALL,
    TAG_EMPTY_TURN,
    TAG_INSTANCE_MISMATCH,
    TAG_STATE_MISMATCH,
    TAG_RESPONSE_MISMATCH,
    TAG_CHECKER_ERROR,
    TAG_GT_ERROR,
    TAG_BUDGET_EXCEEDED,
)

#: Problems of the scorer, not behaviour of the model: A-Patch and the closed loop do not count them.
SCORER_TAGS: tuple[str, ...] = (TAG_CHECKER_ERROR, TAG_GT_ERROR)

#: What the trainer records for a trajectory that carries no tag or label at all.
UNKNOWN = "unknown"

# ---- paper labels (the paper's Table 5): one per ground-truth user turn --------------------------------------

LABEL_PASS = TAG_PASS
LABEL_INVALID_TOOL_CALL = "invalid_tool_call"  # unparseable call, or a tool that does not exist
LABEL_ARGUMENT_MISMATCH = "argument_mismatch"  # right tool, wrong field / type / value
LABEL_STATE_MISMATCH = TAG_STATE_MISMATCH  # executed, but the observable state is wrong
LABEL_RECOVERY_FAILURE = "recovery_failure"  # got an execution error and did not recover
LABEL_MISSING_TOOL_CALL = "missing_tool_call"  # skipped a needed call, or answered too early
LABEL_RESPONSE_MISMATCH = TAG_RESPONSE_MISMATCH  # the interaction looked fine, the answer fails the verifier
#: The failure labels, highest priority first (a turn showing several signals gets the first).
PAPER_LABELS: tuple[str, ...] = (
    LABEL_INVALID_TOOL_CALL,
    LABEL_ARGUMENT_MISMATCH,
    LABEL_STATE_MISMATCH,
    LABEL_RECOVERY_FAILURE,
    LABEL_MISSING_TOOL_CALL,
    LABEL_RESPONSE_MISMATCH,
)
LABELS: tuple[str, ...] = (LABEL_PASS, *PAPER_LABELS, *SCORER_TAGS)

#: Tags and labels that name no failure of the model: never turned into a capability-cue guideline.
NOT_FAILURES: frozenset[str] = frozenset({TAG_PASS, TAG_CORRECT_ABSTENTION, UNKNOWN, *SCORER_TAGS})

# ---- task categories -----------------------------------------------------------------------------------------

CATEGORY_PREFIX = "multi_turn_"
#: Short names, as in task ids ``multi_turn_<category>_<index>`` and in the service's config.
CATEGORIES: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")
#: Full names: bfcl's category names, verl's ``data_source`` and the validation metric keys.
CATEGORY_NAMES: tuple[str, ...] = tuple(CATEGORY_PREFIX + c for c in CATEGORIES)
#: The category of a trajectory whose task id says nothing.
NO_CATEGORY = "_none"

_BFCL_TASK_ID = re.compile(rf"^{CATEGORY_PREFIX}({'|'.join(CATEGORIES)})_\d+$")
_TRAILING_INDEX = re.compile(r"_\d+$")


def short_category(name: str) -> str:
    """``multi_turn_base`` -> ``base``; a short name (or any other name) is returned as it is."""
    return name.removeprefix(CATEGORY_PREFIX)


def task_category(task_id: str | None) -> str:
    """The full category name of a task id: ``multi_turn_<category>_<n>`` -> ``multi_turn_<category>``; any other
    id loses a trailing ``_<n>``; an empty id is :data:`NO_CATEGORY`."""
    if not task_id:
        return NO_CATEGORY
    match = _BFCL_TASK_ID.match(task_id)
    if match:
        return CATEGORY_PREFIX + match.group(1)
    return _TRAILING_INDEX.sub("", task_id) or NO_CATEGORY


# ---- episode modes -------------------------------------------------------------------------------------------

MODE_TRAIN = "train"  # the train-only interface may be active
MODE_VALIDATE = "validate"  # always the original interface
EPISODE_MODES: tuple[str, ...] = (MODE_TRAIN, MODE_VALIDATE)


def mode_for_split(split: str | None) -> str:
    """Training-split tasks run in train mode; every other task in validate mode."""
    return MODE_TRAIN if split == "train" else MODE_VALIDATE


# ---- errors in observations ----------------------------------------------------------------------------------

#: Starts every message in which the environment itself rejects or stops something (bad call format, unknown
#: tool, a limit reached).
ERROR_MARKER = "[ERROR]"
INVALID_TOOL_CALL_PREFIX = f"{ERROR_MARKER} Invalid tool call format: "
#: bfcl's rendering of a tool call that raised (or that our executor refused in bfcl's words).
EXECUTION_ERROR_PREFIX = "Error during execution: "

#: ``info["error_type"]`` of a step reply: why the reply is an error (None: it is not).
STEP_PARSE_ERROR = "parse_error"  # the message could not be parsed into calls
STEP_UNAVAILABLE_TOOL = "unavailable_tool"  # a well-formed call to a tool the episode does not offer now
STEP_TOOL_ERROR = "tool_error"  # a call ran and its result is an error
STEP_BUDGET_EXCEEDED = TAG_BUDGET_EXCEEDED  # a call was stopped or skipped by a time budget, or the state limit
STEP_LIMIT_EXCEEDED = "limit_exceeded"  # too many calls in one message, or too many steps
STEP_ERROR_TYPES: tuple[str, ...] = (
    STEP_PARSE_ERROR,
    STEP_UNAVAILABLE_TOOL,
    STEP_TOOL_ERROR,
    STEP_BUDGET_EXCEEDED,
    STEP_LIMIT_EXCEEDED,
)


def is_execution_error(text: str) -> bool:
    """True when one tool result is an error, in any of bfcl's forms: ``Error during execution: ...`` (a call that
    raised), ``{"error": ...}`` (a backend's error dict, rendered as JSON) or ``['Error: ...']``."""
    if text.startswith(EXECUTION_ERROR_PREFIX) or text.startswith("['Error:"):
        return True
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return False
        return isinstance(parsed, dict) and "error" in parsed
    return False
