"""A tool call as data, and the call strings bfcl writes: ``ToolCall``, ``format_call_string``, ``parse_call_string``.

Both the model's side (the parser turns ``<tool_call>`` JSON into :class:`ToolCall`) and the ground truth's
(bfcl's Python-syntax strings such as ``cd(folder='docs')``) meet here, so the parser, the executor and
the verifier share one definition. Call strings are read with ``ast.parse`` and ``ast.literal_eval``
only, never evaluated. Positional ground-truth arguments are named through the backend method's
signature, which is why the backend class lookups live here too.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from env_service.bfcl import upstream


@dataclass
class ToolCall:
    """One tool call: ``name`` and keyword ``arguments`` (JSON values)."""

    name: str
    arguments: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


def format_call_string(call: ToolCall) -> str:
    """``name(k=repr(v),k2=repr(v2))`` — bfcl's ``convert_to_function_call`` format ("," separator)."""
    return f"{call.name}({','.join(f'{k}={repr(v)}' for k, v in call.arguments.items())})"


# ---------------------------------------------------------------------------------------------
# Backend classes: which class owns a tool, and its positional parameters
# ---------------------------------------------------------------------------------------------


@functools.cache
def backend_class(class_name: str) -> type:
    if class_name not in upstream.CLASS_FILE_PATH_MAPPING:
        raise ValueError(f"unknown BFCL backend class {class_name!r}")
    module = importlib.import_module(upstream.CLASS_FILE_PATH_MAPPING[class_name])
    return getattr(module, class_name)


def public_method_names(instance: object) -> list[str]:
    # Same rule as bfcl: bound methods whose name does not start with "_".
    return [name for name, _ in inspect.getmembers(instance, predicate=inspect.ismethod) if not name.startswith("_")]


@functools.cache
def _class_method_names(class_name: str) -> tuple[str, ...]:
    return tuple(public_method_names(backend_class(class_name)()))


def _method_owner_map(involved_classes: Iterable[str]) -> dict[str, str]:
    """method name -> owning class; a later class wins, like bfcl's mapping dict."""
    owners: dict[str, str] = {}
    for class_name in involved_classes:
        for name in _class_method_names(class_name):
            owners[name] = class_name
    return owners


@functools.cache
def _parameter_names(class_name: str, method_name: str) -> tuple[str, ...]:
    method = getattr(backend_class(class_name), method_name)
    params = list(inspect.signature(method).parameters.values())[1:]  # drop self
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def tool_parameter_names(name: str, involved_classes: Iterable[str]) -> tuple[str, ...]:
    """Positional parameter names of tool ``name`` among ``involved_classes`` (KeyError if unknown)."""
    owners = _method_owner_map(involved_classes)
    if name not in owners:
        raise KeyError(f"unknown tool {name!r} for classes {list(involved_classes)}")
    return _parameter_names(owners[name], name)


# ---------------------------------------------------------------------------------------------
# Parsing ground-truth call strings
# ---------------------------------------------------------------------------------------------


def parse_call_string(s: str, task) -> ToolCall:
    """Parse a Python-syntax call string (bfcl GT format) into a :class:`ToolCall`.

    Only ``ast.parse`` + ``ast.literal_eval`` of argument nodes; positional arguments are mapped to
    parameter names through the backend method's signature. ValueError when malformed.
    """
    if not isinstance(s, str):
        raise ValueError(f"call string must be a str, got {type(s).__name__}")
    try:
        node = ast.parse(s.strip(), mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"unparseable call string {s!r}: {error}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {s!r}")
    name = node.func.id
    arguments: dict[str, Any] = {}
    if node.args:
        try:
            params = tool_parameter_names(name, task.involved_classes)
        except KeyError:
            raise ValueError(f"positional arguments for unknown tool {name!r} in {s!r}") from None
        if len(node.args) > len(params):
            raise ValueError(f"too many positional arguments in {s!r}")
        for param, arg in zip(params, node.args):
            arguments[param] = _literal(arg, s)
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError(f"'**' arguments are not supported: {s!r}")
        if kw.arg in arguments:
            raise ValueError(f"argument {kw.arg!r} given twice in {s!r}")
        arguments[kw.arg] = _literal(kw.value, s)
    return ToolCall(name=name, arguments=arguments)


def _literal(node: ast.expr, source: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"non-literal argument in {source!r}") from None
