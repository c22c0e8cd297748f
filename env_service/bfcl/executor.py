"""Safe, isolated execution of BFCL tool calls — bfcl-eval's result strings without ``eval``.

bfcl-eval's ``execute_multi_turn_func_call`` turns every call into a Python string, rewrites
``f(`` into ``<instance>.f(`` and ``eval``s it; a model-chosen name such as
``(lambda: __import__('os').getpid())`` runs. Here a call is a :class:`ToolCall` (name + JSON
arguments) dispatched with ``getattr`` on the backend instance that owns the method; nothing
model-produced is ever ``eval``-ed, ``exec``-ed or compiled (``ast.parse`` is used only to reproduce
the exact text of bfcl's ``SyntaxError`` messages).

Result strings equal bfcl's for the same call string ``name(k=repr(v),...)``:

* deny-list ``kill, exit, quit, remove, unlink, popen, Popen, run`` (checked on the call string
  exactly as bfcl does) -> ``Error during execution: Function call X is not allowed.``;
* argument names that are not plain identifiers -> the ``SyntaxError`` text bfcl's ``eval`` reports;
* unknown function name -> ``Error during execution: name 'X' is not defined``;
* ``nan`` / ``inf`` floats (``repr`` gives a bare name) -> ``name 'nan' is not defined``;
* results: exact ``str`` kept, exact ``dict`` ``json.dumps``-ed (``str`` on failure), else ``str()``;
* exceptions -> ``Error during execution: {e}``.

Known, deliberate divergences from bfcl (none affects any ground-truth call; see tests):

1. bfcl's ``_process_method_calls`` regex also rewrites ``word(`` *inside string arguments* when
   ``word`` is a method of an involved class (``echo(content='ls(')`` writes
   ``'<model>_<id>_GorillaFileSystem_instance.ls('`` into the file). The injected text contains the
   registry name, which differs between the model and ground-truth namespaces, so in bfcl such a call
   can never match the ground truth. We pass string arguments through unchanged. No GT call of the
   800 tasks contains such a string.
2. Names bfcl would resolve in its own module globals or in builtins (``print``, ``len``, ``json``,
   ``open``, ...), expressions we do not model (``(lambda: ...)()``), and call strings injected through
   an argument name (``"x=1,y"``) are never evaluated: they get a refusal message, where bfcl would
   execute them. Other unknown names get exactly bfcl's text: the ``SyntaxError`` of the call string,
   else ``NameError`` for the first name Python would look up (``a.b`` -> ``a``, ``not x`` -> ``x``).
   With ``enforce_available_tools`` these calls never reach the executor anyway.
3. Arguments must be JSON values (str, int, float, bool, None, list, dict with str keys); anything
   else (tuples, sets, objects) is refused with an error string. JSON input cannot produce them.

Isolation: every :class:`BackendSession` builds fresh backend instances and deep-copies their state
after ``_load_scenario`` so that no instance references module-level data (long-context TravelAPI
inserts the module's credit-card and booking dicts by reference and then decrements balances in
place, leaking across episodes in bfcl). The one module dict a backend still writes (long-context
VehicleControlAPI's weather, overwritten and returned whole) gets the same value for the same call, so
episodes in one process never see each other's state through it.

Budgets: ``execute(call, time_limit_s=..., memory_limit_bytes=...)`` interrupts a call that runs longer
than its limit or grows the process's resident memory by more than its budget (a ``SIGALRM`` timer that
ticks every 20 ms, so only on the main thread of a process: the service's worker processes; elsewhere the
limits are not enforced) and raises :class:`CallOverBudget`. Interrupted pure-Python work (a traversal of a
file system whose directories alias each other) stops at once; C-level work cannot be interrupted, which
is why :func:`_resource_guard` refuses the known numeric blow-ups before they start.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import gc
import json
import keyword
import logging
import math
import os
import re
import signal
import threading
import time
import traceback
import types
import unicodedata
from collections.abc import Mapping
from typing import Any

from env_service.bfcl import upstream
from env_service.bfcl.calls import ToolCall, backend_class, format_call_string, public_method_names
from env_service.vocabulary import EXECUTION_ERROR_PREFIX

log = logging.getLogger(__name__)

# bfcl's _process_method_calls pattern: an identifier directly followed by "(".
_METHOD_CALL_PATTERN = re.compile(r"\b([a-zA-Z_]\w*)\s*(?=\()")

# Placeholder for bfcl's registry name when we rebuild its processed call string (only used to
# reproduce deny-list and SyntaxError texts, which do not depend on the name; no "." inside).
_PLACEHOLDER_INSTANCE = "seal_instance"


class ToolNotAvailable(Exception):
    """A known tool that the session's ``allowed`` set does not currently expose."""

    def __init__(self, name: str):
        super().__init__(f"Tool '{name}' is not available in the current tool list.")
        self.name = name


# ---------------------------------------------------------------------------------------------
# Budgets: time per call, size of results and of retained state
# ---------------------------------------------------------------------------------------------


class CallOverBudget(Exception):
    """A backend call was interrupted (too long, or too much memory); its effects so far stay in the state."""


class _Interrupted(BaseException):
    """Raised by the timer inside the backend; a BaseException so backends' ``except Exception`` pass it on."""


_TICK_S = 0.02  # how often a running call's clock and memory are checked
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is missing: no memory budget there)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


@contextlib.contextmanager
def time_limit(seconds: float | None, memory_bytes: int | None = None):
    """Interrupt the body after ``seconds``, or once it has grown the process by ``memory_bytes``
    (:class:`CallOverBudget`); a no-op off the main thread or for ``seconds=None``."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    armed, why = True, ""
    deadline = time.monotonic() + seconds
    memory_cap = resident_bytes() + memory_bytes if memory_bytes else 0

    def on_tick(signum, frame):
        nonlocal why
        # Interrupt once: ticks keep coming while the stopped call unwinds and its garbage is freed (which can take
        # longer than a tick), and one raised then would escape the cleanup below instead of the budget's error.
        if not armed or why:
            return
        if time.monotonic() >= deadline:
            why = f"the call was stopped after {round(seconds, 2):g} s, its time budget"
        elif memory_cap and resident_bytes() > memory_cap:
            why = f"the call was stopped: it used more than {memory_bytes // 2**20} MiB of memory, its budget"
        else:
            return
        raise _Interrupted

    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)  # e.g. a test runner's own alarm
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_tick)
    signal.setitimer(signal.ITIMER_REAL, min(max(float(seconds), 1e-4), _TICK_S), _TICK_S)
    try:
        yield
    except _Interrupted as interrupted:
        # Free what the stopped call built (e.g. a traversal's list) now, not whenever the cyclic GC runs.
        traceback.clear_frames(interrupted.__traceback__)
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay:  # give the outer alarm back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(outer_delay - (time.monotonic() - started), 1e-3), outer_interval)
    if why:
        raise CallOverBudget(why)


_CLIP_MARKER = "\n[TRUNCATED: {left} more bytes; the environment returns at most {limit} bytes per reply]"


def clip_text(text: str, max_bytes: int) -> str:
    """``text`` cut to ``max_bytes`` of UTF-8, the marker saying how much was left out included (so a clipped
    text clipped again is unchanged, and a reply is never over its limit because of the marker)."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return text
    room = max(max_bytes - len(_CLIP_MARKER.format(left=len(data), limit=max_bytes).encode()), 0)
    kept = data[:room].decode("utf-8", "ignore")
    return kept + _CLIP_MARKER.format(left=len(data) - len(kept.encode("utf-8")), limit=max_bytes)


def clip_texts(texts: list[str], max_bytes: int) -> list[str]:
    """The messages of one reply within ``max_bytes`` together: each keeps what the ones before it left."""
    clipped, room = [], max_bytes
    for text in texts:
        kept = clip_text(text, max(room, 0))
        room -= len(kept.encode("utf-8", "surrogatepass"))
        clipped.append(kept)
    return clipped


# ---------------------------------------------------------------------------------------------
# Backend instances
# ---------------------------------------------------------------------------------------------


def _fresh_instance(class_name: str, initial_config: Mapping, long_context: bool) -> object:
    instance = backend_class(class_name)()
    if class_name not in upstream.STATELESS_CLASSES:
        instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})), long_context=long_context)
    # Detach the instance from module-level data that _load_scenario inserted by reference
    # (long-context TravelAPI credit cards / bookings). The memo keeps self-references pointing here.
    state = copy.deepcopy(vars(instance), {id(instance): instance})
    vars(instance).clear()
    vars(instance).update(state)
    return instance


# ---------------------------------------------------------------------------------------------
# Argument checks that reproduce bfcl's texts without evaluating anything
# ---------------------------------------------------------------------------------------------


def _non_json_value(value: Any, path: str) -> str | None:
    """Describe the first non-JSON value inside ``value`` (None when it is all JSON)."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return None
    if kind is list:
        for i, item in enumerate(value):
            problem = _non_json_value(item, f"{path}[{i}]")
            if problem:
                return problem
        return None
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return f"{path} has a non-string key {key!r}"
            problem = _non_json_value(item, f"{path}[{key!r}]")
            if problem:
                return problem
        return None
    return f"{path} has a non-JSON value of type {kind.__name__}"


def _first_non_finite(value: Any) -> str | None:
    """bfcl would ``eval`` ``repr(value)``: the first nan/inf (evaluation order) is a NameError."""
    if type(value) is float and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    if type(value) is list:
        items = value
    elif type(value) is dict:
        items = value.values()
    else:
        return None
    for item in items:
        name = _first_non_finite(item)
        if name:
            return name
    return None


def _is_plain_identifier(text: str) -> bool:
    return text.isascii() and text.isidentifier() and not keyword.iskeyword(text)


def _bfcl_processed(call_string: str, owners: Mapping[str, str]) -> str:
    """bfcl's ``_process_method_calls`` with a placeholder registry name (text only, never run)."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        return f"{_PLACEHOLDER_INSTANCE}.{name}" if name in owners else name

    return _METHOD_CALL_PATTERN.sub(replace, call_string)


def _denied_name(processed: str) -> str | None:
    # bfcl: text before the first "(", then the part after the first "." (method calls).
    head = processed.split("(")[0] if "(" in processed else processed
    if "." in head:
        head = head.split(".")[1]
    return head if head in upstream.DENIED_FUNCTION_NAMES else None


def _syntax_error_text(error: SyntaxError) -> str:
    return EXECUTION_ERROR_PREFIX + str(error)


def _parse_processed(processed: str) -> ast.expr | str:
    """The parsed expression, or bfcl's error text when ``eval`` would not compile it."""
    try:
        tree = ast.parse(processed, filename="<string>", mode="eval")
    except SyntaxError as error:
        return _syntax_error_text(error)
    except (UnicodeEncodeError, ValueError) as error:  # e.g. a lone surrogate in a name: what eval would report
        return f"{EXECUTION_ERROR_PREFIX}{error}"
    # CPython reports repeated keyword arguments at compile time, not in ast.parse.
    calls = sorted(
        (node for node in ast.walk(tree) if isinstance(node, ast.Call)),
        key=lambda node: (node.lineno, node.col_offset),
    )
    for call in calls:
        seen: set[str] = set()
        for kw in call.keywords:
            if kw.arg is not None and kw.arg in seen:
                return f"{EXECUTION_ERROR_PREFIX}keyword argument repeated: {kw.arg} (<string>, line {kw.lineno})"
            if kw.arg is not None:
                seen.add(kw.arg)
    return tree.body


# Arguments that would make a backend compute for minutes or exhaust memory inside C code, where the time
# budget cannot interrupt it: MathAPI sets mpmath/decimal precision from the call (mpmath also accepts the
# precision as a numeric string), rounds ints to a number of digits (``round(5, -10**9)`` builds 10**10**9)
# and raises ints to int powers. bfcl has no such limit; the ground truth stays far below these.
MAX_PRECISION = 1000
MAX_INT_EXPONENT = 10_000
MAX_POWER_BITS = 1_000_000  # bits of an integer power's result (10**4000 ** 10000 would have 1.3e8)


def _as_number(value: Any) -> int | float | None:
    """``value`` as the number mpmath would make of it (a number, or a string through ``int``), else None."""
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _resource_guard(owner: str, name: str, kwargs: dict) -> str | None:
    if owner != "MathAPI":
        return None
    precision = _as_number(kwargs.get("precision"))
    if name in ("logarithm", "square_root") and precision is not None and precision > MAX_PRECISION:
        return f"precision {kwargs['precision']!r} exceeds this environment's limit of {MAX_PRECISION}"
    places = kwargs.get("decimal_places")
    if name == "round_number" and isinstance(places, int) and places < -MAX_PRECISION:
        return f"decimal_places {places} is below this environment's limit of {-MAX_PRECISION}"
    base, exponent = kwargs.get("base"), kwargs.get("exponent")
    if name == "power" and isinstance(base, int) and isinstance(exponent, int):
        if abs(exponent) > MAX_INT_EXPONENT:
            return f"exponent {exponent} exceeds this environment's limit of {MAX_INT_EXPONENT} for integer powers"
        if exponent > 0 and abs(base).bit_length() * exponent > MAX_POWER_BITS:
            return (
                f"the integer power would have about {abs(base).bit_length() * exponent} bits; this "
                f"environment's limit is {MAX_POWER_BITS}"
            )
    return None


def _first_loaded_name(node: ast.expr) -> str | None:
    """The first name Python would look up when evaluating ``node`` (None if it loads no name).

    Covers the expression kinds a call string can plausibly take (names, attributes, calls,
    operators, subscripts, displays); anything else (lambda, comprehension, starred, ...) raises
    :class:`_Unsupported`.
    """
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant):
        return None
    children: list[ast.expr]
    if isinstance(node, ast.Attribute):
        children = [node.value]
    elif isinstance(node, ast.Call):
        children = [node.func, *node.args, *(kw.value for kw in node.keywords)]
    elif isinstance(node, ast.UnaryOp):
        children = [node.operand]
    elif isinstance(node, ast.BinOp):
        children = [node.left, node.right]
    elif isinstance(node, ast.BoolOp):
        children = list(node.values)
    elif isinstance(node, ast.Compare):
        children = [node.left, *node.comparators]
    elif isinstance(node, ast.Subscript):
        children = [node.value, node.slice]
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        children = list(node.elts)
    elif isinstance(node, ast.Dict):
        children = [x for pair in zip(node.keys, node.values) for x in pair if x is not None]
    else:
        raise _Unsupported
    for child in children:
        name = _first_loaded_name(child)
        if name is not None:
            return name
    return None


class _Unsupported(Exception):
    """An expression kind whose evaluation we do not model."""


# ---------------------------------------------------------------------------------------------
# Sessions
# ---------------------------------------------------------------------------------------------


class BackendSession:
    """Fresh, isolated backend instances for one task (one episode side).

    ``allowed``: optional set of tool names that may be dispatched (the episode passes the tools it
    currently exposes; may be reassigned as tools are revealed). ``None`` allows every tool.
    ``instances``: backend instances the caller has already set up (class name -> instance; the memory
    backends, loaded from a snapshot by bfcl's own ``_load_scenario``); by default fresh ones from the task.
    """

    def __init__(self, task, allowed: set[str] | None = None, instances: Mapping[str, object] | None = None):
        self.task_id: str = task.id
        self.allowed: set[str] | None = None if allowed is None else set(allowed)
        self._instances: dict[str, object] = dict(instances or {})
        self._owners: dict[str, str] = {}
        self._closed = False
        if instances is None:
            for class_name in task.involved_classes:
                self._instances[class_name] = _fresh_instance(class_name, task.initial_config, task.long_context)
        for class_name, instance in self._instances.items():
            for name in public_method_names(instance):
                self._owners[name] = class_name

    # -- introspection ---------------------------------------------------------------------

    @property
    def tool_names(self) -> frozenset[str]:
        """Public method names of the involved classes (what bfcl would dispatch)."""
        return frozenset(self._owners)

    @property
    def instances(self) -> Mapping[str, object]:
        """Class name -> live backend instance, read-only view (for the state checker)."""
        self._check_open()
        return types.MappingProxyType(self._instances)

    def owner_of(self, name: str) -> str | None:
        return self._owners.get(name)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop the backend instances; the session cannot execute afterwards."""
        self._instances.clear()
        self._owners.clear()
        self._closed = True

    def __enter__(self) -> BackendSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"BackendSession for {self.task_id} is closed")

    # -- execution -------------------------------------------------------------------------

    def execute(self, call: ToolCall, time_limit_s: float | None = None, memory_limit_bytes: int | None = None) -> str:
        """Execute one call and return bfcl's result string.

        Raises :class:`ToolNotAvailable` for a known tool outside ``allowed`` and :class:`CallOverBudget`
        when the backend method runs longer than ``time_limit_s`` or grows the process by more than
        ``memory_limit_bytes`` (see the module docstring); every other
        problem (unknown name, bad arguments, backend exception) is reported in the returned string.
        """
        self._check_open()
        try:
            return self._execute(call, time_limit_s, memory_limit_bytes)
        except (ToolNotAvailable, CallOverBudget):
            raise
        except (RecursionError, MemoryError) as error:
            # Model text can be shaped to exhaust the parser's or our checks' depth (a tool name of 5,000
            # chained attributes): the same text for the episode and the verifier's replay, never a 500.
            return (
                f"{EXECUTION_ERROR_PREFIX}the call is too deeply nested or too large to read ({type(error).__name__})"
            )
        except Exception as error:  # noqa: BLE001 - anything model text can trigger is the model's error
            log.warning("call %.80r raised %r; answered as an execution error", call.name, error)
            return f"{EXECUTION_ERROR_PREFIX}the call could not be read ({type(error).__name__})"

    def _execute(self, call: ToolCall, time_limit_s: float | None, memory_limit_bytes: int | None) -> str:
        name, arguments = call.name, call.arguments
        if type(name) is not str:
            return f"{EXECUTION_ERROR_PREFIX}tool name must be a string, got {type(name).__name__}"
        if type(arguments) is not dict:
            return f"{EXECUTION_ERROR_PREFIX}tool arguments must be a JSON object, got {type(arguments).__name__}"
        problem = _non_json_value(arguments, "arguments")
        if problem:
            return f"{EXECUTION_ERROR_PREFIX}{problem}; tool arguments must be JSON values"
        try:
            call_string = format_call_string(call)
        except ValueError as error:  # e.g. an int too large for repr
            return f"{EXECUTION_ERROR_PREFIX}{error}"

        processed = _bfcl_processed(call_string, self._owners)
        denied = _denied_name(processed)
        if denied:
            return f"{EXECUTION_ERROR_PREFIX}Function call {denied} is not allowed."

        known = name in self._owners
        if known and self.allowed is not None and name not in self.allowed:
            raise ToolNotAvailable(name)

        if not known:
            return self._unknown_name_result(processed)

        kwargs = arguments
        if not all(_is_plain_identifier(key) for key in arguments):
            kwargs_or_error = self._normalised_keywords(processed, arguments)
            if isinstance(kwargs_or_error, str):
                return kwargs_or_error
            kwargs = kwargs_or_error

        for value in kwargs.values():
            bad_float = _first_non_finite(value)
            if bad_float:
                return f"{EXECUTION_ERROR_PREFIX}name '{bad_float}' is not defined"

        too_costly = _resource_guard(self._owners[name], name, kwargs)
        if too_costly:
            return f"{EXECUTION_ERROR_PREFIX}{too_costly}"

        # eval would build fresh argument objects; never let a backend alias the caller's values.
        kwargs = copy.deepcopy(kwargs)
        method = getattr(self._instances[self._owners[name]], name)
        try:
            with time_limit(time_limit_s, memory_limit_bytes):
                try:
                    return _result_to_string(method(**kwargs))
                except Exception as error:  # bfcl catches Exception around eval and conversion
                    return f"{EXECUTION_ERROR_PREFIX}{error}"
        except CallOverBudget as error:
            why = str(error)
        # bfcl's traversals (find, du) build their results inside a recursive nested function, a reference
        # cycle: only the cyclic GC frees what a stopped one built (once its traceback is gone), so run it now.
        gc.collect()
        raise CallOverBudget(why)

    def _unknown_name_result(self, processed: str) -> str:
        """What bfcl's ``eval`` reports for a name that is no tool: a SyntaxError or NameError text.

        When the expression would first load a name that exists in bfcl's eval namespace (a builtin
        such as ``print``/``open``, or one of its module globals) bfcl would really run code; we refuse.
        """
        parsed = _parse_processed(processed)
        if isinstance(parsed, str):
            return parsed
        try:
            first = _first_loaded_name(parsed)
        except _Unsupported:
            first = None
        if first is not None and first not in upstream.EVAL_NAMESPACE_NAMES and first != _PLACEHOLDER_INSTANCE:
            return f"{EXECUTION_ERROR_PREFIX}name '{first}' is not defined"
        return f"{EXECUTION_ERROR_PREFIX}invalid function name; only the listed tools can be called"

    def _normalised_keywords(self, processed: str, arguments: dict) -> dict | str:
        """Argument names that are not plain ASCII identifiers: reproduce what Python would do.

        A ``SyntaxError`` gives bfcl's text; non-ASCII identifiers are NFKC-normalised exactly as
        the Python parser does; any other shape (an argument name that injects more syntax) is
        refused instead of being evaluated.
        """
        parsed = _parse_processed(processed)
        if isinstance(parsed, str):
            return parsed
        keywords = parsed.keywords if isinstance(parsed, ast.Call) else []
        names = [unicodedata.normalize("NFKC", key) for key in arguments]
        if not isinstance(parsed, ast.Call) or parsed.args or [kw.arg for kw in keywords] != names:
            return f"{EXECUTION_ERROR_PREFIX}invalid argument name(s) {list(arguments)!r}"
        return dict(zip(names, arguments.values()))


def _result_to_string(result: Any) -> str:
    # bfcl: exact str kept; exact dict json.dumps-ed (str() if that fails); else str().
    if type(result) == str:  # noqa: E721  (exact type, like bfcl)
        return result
    if type(result) == dict:  # noqa: E721
        try:
            return json.dumps(result)
        except Exception:
            return str(result)
    return str(result)
