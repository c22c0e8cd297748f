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
_LEAVES = frozenset({str, bytes, bytearray, int, float, complex, bool, type(None)})
_SEQUENCES = frozenset({list, tuple, set, frozenset})
_UNKNOWN_BYTES = 64  # an object that cannot say its size (rare: extension types without __sizeof__)
_SLOTS: dict[type, tuple[str, ...]] = {}  # class -> the names of its __slots__ (its whole MRO's)


def measured_bytes(root: Any, limit: int = sys.maxsize, leaves: bool = True) -> int:
    """Bytes the objects reachable from ``root`` occupy (containers, instances' ``__dict__`` and ``__slots__``), each
    counted once; the walk stops as soon as the total passes ``limit``, so measuring a huge graph against a limit
    costs no more than the limit's worth of objects.

    ``leaves=False``: strings, numbers and the like are not counted, only what holds them. That is what a deep copy
    costs (``copy.deepcopy`` shares immutable objects with its original): an episode's copy of its task holds half the
    bytes the task's whole graph does."""
    total, stack, seen, getsizeof = 0, [root], set(), sys.getsizeof
    while stack and total <= limit:
        value = stack.pop()
        kind = type(value)
        if kind in _LEAVES and not leaves:
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if kind in _LEAVES:
            total += getsizeof(value)
        elif kind is dict:
            total += getsizeof(value)
            stack.extend(value.keys())
            stack.extend(value.values())
        elif kind in _SEQUENCES:
            total += getsizeof(value)
            stack.extend(value)
        elif not isinstance(value, _SHARED):
            try:
                total += getsizeof(value)
            except TypeError:
                total += _UNKNOWN_BYTES
            if isinstance(value, dict | list | tuple | set | frozenset):  # their subclasses
                stack.extend(value.items() if isinstance(value, dict) else value)
            else:
                stack.extend(_attributes(value))
    return total


def _attributes(value: Any) -> list:
    """What an instance holds: its ``__dict__`` and the values of its ``__slots__``."""
    held = []
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        held.append(attributes)
    kind = type(value)
    if kind not in _SLOTS:
        declared = [getattr(cls, "__slots__", ()) for cls in kind.__mro__]
        _SLOTS[kind] = tuple(
            name
            for slots in declared
            for name in ((slots,) if isinstance(slots, str) else slots)
            if name not in ("__dict__", "__weakref__")
        )
    held.extend(getattr(value, name) for name in _SLOTS[kind] if hasattr(value, name))
    return held


__all__ = ["measured_bytes"]
