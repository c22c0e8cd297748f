"""Config blocks as validated, immutable dataclasses read from plain mappings: the one way a block of a recipe is
checked, for the environment's blocks (``env_service/bfcl/config.py``) and seal's (``seal/apatch.py``).

Validation is strict on purpose: a misspelt switch (``observation_lite.enabel``) would otherwise silently leave a
feature off and change an experiment without anyone noticing. So an unknown key raises ``ValueError`` naming the key
and the allowed keys, and a value of the wrong type or out of range raises ``ValueError`` naming the key's path, what
was expected and what was given.

A block is a frozen dataclass deriving from :class:`ConfigBlock` whose fields are made with :func:`setting` (a
default and the validator :meth:`ConfigBlock.from_dict` applies). A validator takes ``(value, key path)`` and returns
the normalised value or raises ``ValueError``. Rules between fields go in the block's ``check_fields``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import field, fields
from typing import Any

Check = Callable[[Any, str], Any]


class ConfigBlock:
    """``from_dict`` / ``to_dict`` / ``replace`` for the frozen config dataclasses that derive from it."""

    @classmethod
    def from_dict(cls, data: Any, *, path: str = ""):
        """The block from a mapping (None: the defaults); every key known, every value validated."""
        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = [key for key in data if key not in known]
        if unknown:
            where = f" in '{path}'" if path else ""
            raise ValueError(
                f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)}"
                f"{where}; allowed keys: {', '.join(sorted(known))}"
            )
        values = {
            key: known[key].metadata["check"](value, f"{path}.{key}" if path else key) for key, value in data.items()
        }
        block = cls(**values)
        block.check_fields(path)
        return block

    def check_fields(self, path: str) -> None:
        """Rules between this block's fields (one field's validator sees only its own value); none by default."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ConfigBlock):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out

    def replace(self, **changes):
        """A copy with some fields changed (validated like ``from_dict``)."""
        merged = self.to_dict()
        merged.update(changes)
        return type(self).from_dict(merged)


def setting(default: Any, check: Check) -> Any:
    """A dataclass field with a default and the validator ``from_dict`` applies to it."""
    if isinstance(default, (dict, list)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: default, metadata={"check": check})
    return field(default=default, metadata={"check": check})


def key_error(key: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"config key '{key}': expected {expected}, got {type(value).__name__} {value!r}")


def boolean(value: Any, key: str) -> bool:
    # bool only: 0/1 or "true" are almost always a templating mistake in a recipe.
    if not isinstance(value, bool):
        raise key_error(key, "a boolean", value)
    return value


def integer(minimum: int | None = None) -> Check:
    def check(value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise key_error(key, "an integer", value)
        if minimum is not None and value < minimum:
            raise ValueError(f"config key '{key}': must be >= {minimum}, got {value}")
        return value

    return check


def number(lo: float | None = None, hi: float | None = None, above: float | None = None) -> Check:
    """A finite number within ``[lo, hi]`` (either end open when None) and, with ``above``, greater than it."""

    def check(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise key_error(key, "a number", value)
        value = float(value)
        if value != value:  # NaN would make every threshold comparison false
            raise ValueError(f"config key '{key}': must not be NaN")
        if math.isinf(value):  # an infinite budget or scale is no budget or scale at all
            raise ValueError(f"config key '{key}': must be finite, got {value}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(f"config key '{key}': must be within [{lo}, {hi}], got {value}")
        if above is not None and value <= above:
            raise ValueError(f"config key '{key}': must be > {above}, got {value}")
        return value

    return check


def string(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise key_error(key, "a string", value)
    return value


def nonempty_string(value: Any, key: str) -> str:
    if not string(value, key):
        raise ValueError(f"config key '{key}': must not be empty")
    return value


def strings(value: Any, key: str) -> tuple[str, ...]:
    """A list of strings (one string is refused: it would read as a list of its characters)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise key_error(key, "a list of strings", value)
    return tuple(value)


def choice(choices: tuple[str, ...]) -> Check:
    def check(value: Any, key: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"config key '{key}': expected one of {', '.join(choices)}; got {value!r}")
        return value

    return check


def optional(inner: Check) -> Check:
    """None, or what ``inner`` accepts."""

    def check(value: Any, key: str) -> Any:
        return None if value is None else inner(value, key)

    return check


def block(cls: type[ConfigBlock]) -> Check:
    def check(value: Any, key: str):
        return cls.from_dict(value, path=key)

    return check


__all__ = [
    "ConfigBlock",
    "block",
    "boolean",
    "choice",
    "integer",
    "key_error",
    "nonempty_string",
    "number",
    "optional",
    "setting",
    "string",
    "strings",
]
