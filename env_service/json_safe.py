"""Replies as strict JSON: every response of the service passes through here, whatever an episode put in it.

:func:`json_safe` is the fast path (a JSON round trip, which also deep-copies); :func:`sanitise` the slow
one for values that do not encode (NaN, unknown types, hostile input echoed back thousands of levels deep).
"""

from __future__ import annotations

import json
import math
from typing import Any


def json_safe(value: Any) -> Any:
    """A deep copy of ``value`` that encodes as strict JSON (NaN/inf -> None, tuples -> lists).

    Responses leave the episode registry through this so that callers never share mutable state with a live
    episode and the in-process client returns exactly what the HTTP client would decode.
    """
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (ValueError, TypeError, RecursionError):
        # Rare (a non-finite float, a non-JSON type, or hostile input echoed back many levels
        # deep): sanitise with an explicit depth bound instead of failing the whole response.
        return json.loads(json.dumps(sanitise(value), allow_nan=False))


_MAX_RESPONSE_DEPTH = 64


def sanitise(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON types at any cost: non-finite floats -> None, unknown types -> ``str``,
    huge integers and nesting deeper than ``_MAX_RESPONSE_DEPTH`` -> a short marker text."""
    if depth > _MAX_RESPONSE_DEPTH:
        return "<truncated: nested too deeply>"
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):  # beyond ~4300 digits int -> str raises ValueError
        return value if value.bit_length() < 14000 else "<integer too large>"
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): sanitise(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitise(v, depth + 1) for v in value]
    return str(value)


__all__ = ["json_safe", "sanitise"]
