"""The example flows' command lines, built from the flows' own signatures.

``add_flow_parameters(parser, __file__, "pretrain")`` adds one argument for each parameter of
the ``@flow``-decorated function ``pretrain`` in that file: a parameter with a default becomes a
flag (``checkpoint_minutes`` -> ``--checkpoint-minutes``) of the annotation's type, one without
a default a positional argument; ``--help`` shows each one's type and default, and the flow's
docstring. The signature is read from the source (``ast``), not from the imported flow: a
command line that runs the training alone, as a gang's ranks do, need not import Prefect.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TYPES = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class FlowParameter:
    name: str
    annotation: str  # as written, e.g. "int"; "" when there is none
    default: Any
    required: bool


@dataclass(frozen=True)
class FlowSignature:
    name: str  # the flow's name: @flow(name=...), else the function's
    parameters: tuple[FlowParameter, ...]
    doc: str


def flow_signature(source: str | Path, function: str) -> FlowSignature:
    """The signature and docstring of the ``@flow`` function ``function`` in ``source``
    (defined at any depth: the examples define theirs inside ``_prefect_flow()``)."""
    tree = ast.parse(Path(source).read_text(), filename=str(source))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            flow = next((d for d in node.decorator_list if _is_flow(d)), None)
            if flow is not None:
                return FlowSignature(_flow_name(flow, function), _parameters(node.args),
                                     ast.get_docstring(node) or "")  # fmt: skip
    raise LookupError(f"no @flow function {function!r} in {source}")


def add_flow_parameters(
    parser: argparse.ArgumentParser,
    source: str | Path,
    function: str,
    defaults: dict[str, Any] | None = None,
) -> FlowSignature:
    """Add the flow's parameters to ``parser`` (``defaults`` replaces some of the flow's
    defaults for the command line); the parsed value of each is ``args.<parameter name>``."""
    signature = flow_signature(source, function)
    defaults = defaults or {}
    group = parser.add_argument_group(
        f"the flow's parameters ({signature.name})",
        signature.doc.split("\n\n")[0].replace("\n", " ") or None,
    )
    for p in signature.parameters:
        kind = TYPES.get(p.annotation)
        if p.annotation == "bool":
            kind = None
        about = p.annotation or "any"
        if p.required and p.name not in defaults:
            group.add_argument(p.name, type=kind or str, metavar=p.name.upper(), help=about)
            continue
        flag = "--" + p.name.replace("_", "-")
        default = defaults.get(p.name, p.default)
        if p.annotation == "bool":
            group.add_argument(
                flag, dest=p.name, action=argparse.BooleanOptionalAction, default=default,
                help=f"{about}, default {default}".replace("%", "%%"),
            )  # fmt: skip
            continue
        changed = "" if p.name not in defaults else f" here; the flow's: {p.default!r}"
        group.add_argument(
            flag,
            dest=p.name,
            type=kind or str,
            default=default,
            metavar=p.name.upper(),
            help=f"{about}, default {default!r}{changed}".replace("%", "%%"),
        )
    return signature


def flow_arguments(args: argparse.Namespace, signature: FlowSignature) -> dict[str, Any]:
    """The flow's parameters from the parsed command line, by name."""
    return {p.name: getattr(args, p.name) for p in signature.parameters}


def _is_flow(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "flow") or (
        isinstance(target, ast.Attribute) and target.attr == "flow"
    )


def _flow_name(decorator: ast.expr, function: str) -> str:
    if isinstance(decorator, ast.Call):
        for keyword in decorator.keywords:
            if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                return str(keyword.value.value)
    return function.replace("_", "-")


def _parameters(arguments: ast.arguments) -> tuple[FlowParameter, ...]:
    positional = [*arguments.posonlyargs, *arguments.args]
    padded = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    pairs = [
        *zip(positional, padded, strict=True),
        *zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True),
    ]
    return tuple(
        FlowParameter(
            name=arg.arg,
            annotation=ast.unparse(arg.annotation) if arg.annotation is not None else "",
            default=ast.literal_eval(default) if default is not None else None,
            required=default is None,
        )
        for arg, default in pairs
    )
