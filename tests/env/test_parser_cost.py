"""What reading model text costs per byte: linear for every parser entry point and every regex the service applies
to text a model wrote (issue 41: a fence pattern was cubic on runs of blanks, so a 1 KiB toolace reply of blanks held
a worker for seconds, and 64 KiB ran into the message budget).

Each adversarial message is timed at 1 KiB and at 64 KiB, in CPU time (a loaded machine stretches wall time, not
this); the larger may cost at most ``MAX_COST_RATIO`` times the smaller: 64 for a linear reader, 4,096 for a
quadratic one. A reader that goes past the bound is interrupted there (``re`` and Python code both check for signals),
so a polynomial one fails in a fraction of a second instead of hanging the suite. The parsers' results on ordinary
messages are checked by the differential tests (``test_parser.py``, where the fence reader is checked against the
pattern it replaces, ``test_toolace_format.py``, ``test_model_output*.py``).
"""

from __future__ import annotations

import contextlib
import signal
import time

import pytest

from env_service.bfcl import executor
from env_service.bfcl.interface import diagnose_tool_error
from env_service.bfcl.parser import (
    find_tool_call_blocks,
    parse_assistant,
    parse_python_calls,
    parse_tool_calls,
)

SMALL, LARGE = 1024, 64 * 1024
#: 64 for a linear reader; room for noise and cache effects, far below the 4,096 of a quadratic one.
MAX_COST_RATIO = 200
TRIES = 3  # each timing is the best of this many: a stray interruption (another process's cache traffic) is not cost
MIN_BATCH_S = 0.002  # CPU time of the smallest batch measured (see ``_per_read_s``)


def _repeat_to(piece: str, size: int, head: str = "", tail: str = "") -> str:
    body = piece * ((size - len(head) - len(tail)) // len(piece) + 1)
    return head + body[: size - len(head) - len(tail)] + tail


#: Message shapes that make a backtracking pattern work hard: runs of blanks around optional parts (fences, tags,
#: ``\s*`` next to other quantifiers), names that never reach their parenthesis, unterminated blocks.
ADVERSARIAL = {
    "blanks after an opening fence": lambda n: _repeat_to(" ", n, head="```", tail="x"),
    "tabs and blanks after a fenced info string": lambda n: _repeat_to(" \t", n, head="```python", tail="x"),
    "a newline, then blanks, in a fence": lambda n: _repeat_to(" ", n, head="```\n", tail="\nx"),
    "blank lines in an unclosed fence": lambda n: _repeat_to("\n \t", n, head="```", tail="x"),
    "blanks before a closing fence": lambda n: _repeat_to(" ", n, head="x", tail="```"),
    "fences over and over": lambda n: _repeat_to("``` \n", n),
    "blanks after a bracket": lambda n: _repeat_to(" ", n, head="[", tail="x"),
    "a name that never opens its call": lambda n: _repeat_to("a", n, head="["),
    "names and blanks without a call": lambda n: _repeat_to("[a.b ", n),
    "blanks after an opening tag": lambda n: _repeat_to(" ", n, head="<tool_call>", tail="{"),
    "an unterminated block of blanks": lambda n: _repeat_to(" \n", n, head="<tool_call>{", tail="}"),
    "unterminated blocks over and over": lambda n: _repeat_to('<tool_call>\n{"name": "ls"}\n', n),
    "blank lines after a block": lambda n: _repeat_to(" \n", n, head='<tool_call>{"name": "ls"}</tool_call>\n'),
    "blanks and newlines": lambda n: _repeat_to(" \t\n\r\u00a0", n),
    "calls that never close": lambda n: _repeat_to("a(", n),
}


def _processed(text: str) -> str:
    return executor._bfcl_processed(text, {"ls": "GorillaFileSystem"})


#: Every reader of model text: both parsers in both modes (and the dispatcher), the ``<tool_call>`` matcher, and the
#: other regexes the service runs over text a model wrote (a call string as bfcl reads it, a tool error that may echo
#: the model's arguments).
READERS = {
    "parse_tool_calls strict": lambda text: parse_tool_calls(text, strict=True),
    "parse_tool_calls lenient": lambda text: parse_tool_calls(text, strict=False),
    "parse_python_calls strict": lambda text: parse_python_calls(text, strict=True),
    "parse_python_calls lenient": lambda text: parse_python_calls(text, strict=False),
    "parse_assistant toolace_llama": lambda text: parse_assistant(text, "toolace_llama"),  # the episode's entry
    "find_tool_call_blocks": find_tool_call_blocks,
    "bfcl's call-string rewrite": _processed,
    "tool error hints": lambda text: diagnose_tool_error("ls", "missing 1 required positional argument: " + text),
}


class _OverBound(BaseException):
    """Not an Exception: the parsers turn any Exception into an error text, which would hide the interruption."""


@contextlib.contextmanager
def _cpu_limit(seconds: float):
    """Interrupt the block once this process has used ``seconds`` of CPU (user time)."""

    def over(signum, frame):
        raise _OverBound

    previous = signal.signal(signal.SIGVTALRM, over)
    signal.setitimer(signal.ITIMER_VIRTUAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


def _batch_cpu_s(read, text: str, repeats: int, bound_s: float | None = None) -> float | None:
    """CPU time of ``repeats`` reads of ``text``; None when interrupted past ``bound_s``."""
    started = time.process_time()
    try:
        with _cpu_limit(bound_s) if bound_s is not None else contextlib.nullcontext():
            for _ in range(repeats):
                read(text)
    except _OverBound:
        return None
    return time.process_time() - started


def _per_read_s(read, text: str) -> tuple[float, int]:
    """(best CPU time of one read of ``text``, the repeats per batch that measured it): batches long enough to take
    ``MIN_BATCH_S`` (a reading of microseconds is below what a CPU clock measures reliably everywhere), best of
    ``TRIES``."""
    repeats = 1
    while (spent := _batch_cpu_s(read, text, repeats)) < MIN_BATCH_S and repeats < 1 << 16:
        repeats *= 2
    best = min([spent, *(_batch_cpu_s(read, text, repeats) for _ in range(TRIES - 1))])
    # A coarse CPU clock (some kernels and sandboxes count it in ticks) can read a batch as 0 s: the batch that ended
    # the doubling took MIN_BATCH_S, so a read costs no less than about half that per repeat.
    return max(best, MIN_BATCH_S / 2) / repeats, repeats


def _within(read, text: str, repeats: int, bound_s: float) -> float | None:
    """Best CPU time of ``repeats`` reads of ``text`` within ``bound_s``, over up to ``TRIES``; None when every try
    ran past it (interrupted there)."""
    for _ in range(TRIES):
        spent = _batch_cpu_s(read, text, repeats, bound_s)
        if spent is not None and spent <= bound_s:
            return spent
    return None


@pytest.mark.parametrize("shape", ADVERSARIAL)
@pytest.mark.parametrize("reader", READERS)
def test_reading_costs_at_most_linear_per_byte(reader, shape):
    """64 KiB costs at most ``MAX_COST_RATIO`` x 1 KiB. 2 KiB is held to the same cost per byte first: a polynomial
    reader fails there after seconds, not after minutes at 64 KiB."""
    read, make = READERS[reader], ADVERSARIAL[shape]
    small_s, repeats = _per_read_s(read, make(SMALL))
    per_byte_slack = MAX_COST_RATIO / (LARGE // SMALL)
    for size in (2 * SMALL, LARGE):
        text = make(size)
        assert len(text) == size
        times = max(repeats * SMALL // size, 1)  # each batch reads as many bytes as the small one did, or more
        bound_s = per_byte_slack * small_s * size / SMALL * times
        spent = _within(read, text, times, bound_s)
        assert spent is not None, (
            f"{reader} on {shape!r}: {size // 1024} KiB cost more than {per_byte_slack * size / SMALL:.0f}x 1 KiB "
            f"({small_s * 1e6:.1f} us) in every try: worse than linear"
        )
