"""How many bytes an object graph occupies, measured: what the interpreter allocated for each object reachable from it
(``sys.getsizeof``, each object once), not an estimate from its JSON or its length.

The episodes' budgets (``max_state_bytes``, ``max_episode_bytes``) and what a client keeps (``max_owner_bytes``) are in
these bytes; a Python object costs many times its JSON (a 1 MiB memory snapshot of short entries held ~9 MiB), so a
budget counted in JSON bytes said far less than it held.
"""

from __future__ import annotations

import sys
import types
from typing import Any

#: Objects that belong to no one holder (classes, modules, functions): never counted, never walked into.
_SHARED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None))
_UNKNOWN_BYTES = 64  # an object that cannot say its size (rare: extension types without __sizeof__)


def measured_bytes(root: Any, limit: int = sys.maxsize, leaves: bool = True) -> int:
    """Bytes the objects reachable from ``root`` occupy (containers, instances' ``__dict__`` and ``__slots__``), each
    counted once; the walk stops as soon as the total passes ``limit``, so measuring a huge graph against a limit
    costs no more than the limit's worth of objects.

    ``leaves=False``: strings, numbers and the like are not counted, only what holds them. That is what a deep copy
    costs (``copy.deepcopy`` shares immutable objects with its original): an episode's copy of its task holds half the
    bytes the task's whole graph does."""
    total, stack, seen = 0, [root], set()
    while stack and total <= limit:
        value = stack.pop()
        if id(value) in seen or isinstance(value, _SHARED):
            continue
        seen.add(id(value))
        if isinstance(value, _LEAVES):
            total += sys.getsizeof(value) if leaves else 0
            continue
        try:
            total += sys.getsizeof(value)
        except TypeError:
            total += _UNKNOWN_BYTES
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        else:
            stack.extend(_attributes(value))
    return total


def _attributes(value: Any) -> list:
    """What an instance holds: its ``__dict__`` and the values of its ``__slots__``."""
    held = []
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        held.append(attributes)
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                held.append(getattr(value, name))
    return held


__all__ = ["measured_bytes"]
