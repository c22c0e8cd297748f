"""Replies as strict JSON and valid text: every response of the service passes through here, whatever an episode put
in it.

:func:`json_safe` is the fast path (a JSON round trip, which also deep-copies); :func:`sanitise` the slow one for values
that do not encode (NaN, unknown types, hostile input echoed back thousands of levels deep, text that is not valid
Unicode). :func:`valid_text` is the one check of a reply's text: a model message can name a tool or write a value with
a surrogate escape (``{"name": "\\ud800"}``, ``'\\udfff'`` in a Python call), which decodes to a lone surrogate; a
reply that echoes it would reach the trainer's tokenizer, which refuses such text (``TypeError``), and strict UTF-8,
which cannot encode it. Every other code point, control characters included, tokenizes and encodes (measured on the
Qwen tokenizer and the small byte-level BPEs of ``seal.cpu.tiny_model``), so text is changed only there.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_text(text: str) -> str:
    """``text`` with each lone surrogate shown as its escape (the six characters ``\\ud800``), so that the reply says
    what the model wrote in text every tokenizer and encoder takes; valid text is returned as it is."""
    return text if _encodes(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_safe(value: Any) -> Any:
    """A deep copy of ``value`` that encodes as strict JSON (NaN/inf -> None, tuples -> lists) and holds valid text
    only (:func:`valid_text`).

    Responses leave the episode registry through this so that callers never share mutable state with a live
    episode and the in-process client returns exactly what the HTTP client would decode.
    """
    try:
        encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
        if _encodes(encoded):
            return json.loads(encoded)
    except (ValueError, TypeError, RecursionError):
        pass
    # Rare (a non-finite float, a non-JSON type, text that is not valid Unicode, or hostile input echoed back many
    # levels deep): sanitise with an explicit depth bound instead of failing the whole response.
    return json.loads(json.dumps(sanitise(value), allow_nan=False))


_MAX_RESPONSE_DEPTH = 64


def sanitise(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON types and valid text at any cost: non-finite floats -> None, unknown types -> ``str``,
    lone surrogates -> their escapes, huge integers and nesting deeper than ``_MAX_RESPONSE_DEPTH`` -> a short marker
    text."""
    if depth > _MAX_RESPONSE_DEPTH:
        return "<truncated: nested too deeply>"
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, int):  # beyond ~4300 digits int -> str raises ValueError
        return value if value.bit_length() < 14000 else "<integer too large>"
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {valid_text(str(k)): sanitise(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitise(v, depth + 1) for v in value]
    return valid_text(str(value))


__all__ = ["json_safe", "sanitise", "valid_text"]
