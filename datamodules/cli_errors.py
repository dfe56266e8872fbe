"""One-line errors for the command line: jsonargparse's tree of reasons cut to where, why and the
nearest valid names, and a ``ckpt_path`` checked before anything is built."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import pkgutil
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from datamodules.storage.locations import is_url


def fail(message: str) -> NoReturn:
    """Ends the command with ``message`` on one line (exit code 2, as argparse's errors)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# jsonargparse's errors are a tree: the keys and class paths a value sits under, each alternative of a
# union, and at the leaves the reasons. A context line opens a level; its reason may follow on the line.
_CONTEXT = re.compile(
    r"""^(?:Parser key "(?P<key>[^"]+)"|Problem with given class_path '(?P<cls>[^']+)'):\s*(?P<rest>.*)$"""
)


def innermost_reason(message: str) -> tuple[list[str], list[str], str]:
    """``(keys, class paths, reason)`` of the deepest reason in a jsonargparse error (the first of
    equally deep ones: a union's first alternative is the type the value was meant to be)."""
    stack: list[tuple[int, str | None, str | None]] = []
    best: tuple[int, list[tuple[str | None, str | None]], str] = (-1, [], message.strip())
    for line in message.splitlines():
        text = line.strip().removeprefix("- ")
        if not text:
            continue
        depth = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= depth:
            stack.pop()
        context = _CONTEXT.match(text)
        if context:
            stack.append((depth, context["key"], context["cls"]))
            text, depth = context["rest"], depth + 1
        if text and depth > best[0]:
            best = (depth, [(key, cls) for _, key, cls in stack], text)
    _, levels, reason = best
    return [k for k, _ in levels if k], [c for _, c in levels if c], reason


def nearest(name: str, valid: Iterable[str], show_all: int = 0) -> str:
    """``"; did you mean 'x'?"`` for the valid name closest to ``name``; without one, the valid names
    themselves when there are at most ``show_all`` of them."""
    valid = sorted(set(valid))
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; the options are {', '.join(valid)}" if 0 < len(valid) <= show_all else ""


def init_parameters(class_path: str) -> list[str]:
    """The arguments the class at ``class_path`` takes (none if it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        signature = inspect.signature(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.kind not in kinds]


def public_names(module: str) -> list[str]:
    try:
        return [f"{module}.{name}" for name in dir(importlib.import_module(module)) if not name.startswith("_")]
    except ImportError:
        return []


def module_names(parent: str) -> list[str]:
    """The modules inside package ``parent``, or the top-level ones for ``""``."""
    try:
        path = importlib.import_module(parent).__path__ if parent else None
    except (ImportError, AttributeError):
        return []
    return [f"{parent}.{m.name}" if parent else m.name for m in pkgutil.iter_modules(path)]


def short_error(message: str, parser: LightningArgumentParser) -> str:
    """jsonargparse's error ``message`` as one line: where, why, and the nearest valid names."""
    keys, classes, reason = innermost_reason(message)
    options = [s.lstrip("-") for s in getattr(parser, "_option_string_actions", {})]
    where = ".".join(keys) + ": " if keys else ""
    for pattern, explain in _REASONS:
        found = re.fullmatch(pattern, reason, flags=re.DOTALL)
        if found:
            return where + explain(found.groupdict(), classes, options)
    return where + re.sub(r"<class '([\w.]+)'>", r"\1", reason)


def _no_option(found: dict[str, str], classes: list[str], options: list[str]) -> str:
    owner = classes[-1] if classes else "this class"
    valid = init_parameters(classes[-1]) if classes else []
    return f"{owner} has no option {found['name']!r}{nearest(found['name'], valid, show_all=40)}"


def _no_class(found: dict[str, str], classes: list[str], options: list[str]) -> str:
    module, name = found["module"], found["name"]
    inside = public_names(module) + module_names(module)
    return f"no {name!r} in module {module}{nearest(f'{module}.{name}', inside)}"


def _no_module(found: dict[str, str], classes: list[str], options: list[str]) -> str:
    module = found["module"]
    return f"no module {module!r}{nearest(module, module_names(module.rpartition('.')[0]))}"


def _not_accepted(found: dict[str, str], classes: list[str], options: list[str]) -> str:
    return f"no option {found['name']!r}{nearest(found['name'], options)}"


def _unrecognized(found: dict[str, str], classes: list[str], options: list[str]) -> str:
    named = [arg[2:].split("=")[0] for arg in found["args"].split() if arg.startswith("--")]
    if not named:
        return f"unrecognized arguments: {found['args']}"
    dashed = [f"--{option}" for option in options]
    return "; ".join(f"no option --{name}{nearest(f'--{name}', dashed)}" for name in named)


def _wrong_type(found: dict[str, str], classes: list[str], options: list[str]) -> str:
    return f"expected {found['type'].rpartition('.')[2]}, got {found['value']!r}"


_REASONS: list[tuple[str, Callable[[dict[str, str], list[str], list[str]], str]]] = [
    (r"Option '(?P<name>\w+)' is not accepted", _no_option),
    (r"module '(?P<module>[\w.]+)' has no attribute '(?P<name>\w+)'", _no_class),
    (r"No module named '(?P<module>[\w.]+)'", _no_module),
    (r"(?:Subcommand '\w+' does not accept option|Key) '(?P<name>[\w.]+)'.*", _not_accepted),
    (r"unrecognized arguments: (?P<args>.*)", _unrecognized),
    (r"Expected an? <class '(?P<type>[\w.]+)'>\. Got value: (?P<value>.*)", _wrong_type),
]


class ShortErrorParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one line (where, why, the nearest valid names) instead of
    the usage of every option and jsonargparse's tree of union alternatives. ``JSONARGPARSE_DEBUG=1``
    shows the tree."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)
        fail(short_error(message, getattr(ex, "subcommand_parser", None) or self))


# Lightning's names for a checkpoint it finds itself, rather than a path.
CHECKPOINT_NAMES = ("best", "last", "hpc", "registry")


def check_checkpoint_path(ckpt_path: str | None) -> None:
    """A local ``ckpt_path`` must exist: else one line naming it and the nearest checkpoints beside it,
    before the model and the data are built."""
    if not ckpt_path or is_url(ckpt_path) or ckpt_path.split(":")[0] in CHECKPOINT_NAMES:
        return
    path = Path(ckpt_path)
    if path.exists():
        return
    if not path.parent.is_dir():
        fail(f"ckpt_path {ckpt_path!r}: there is no folder {str(path.parent)!r}")
    beside = [str(p) for p in path.parent.glob("*.ckpt")]
    fail(f"ckpt_path {ckpt_path!r} does not exist{nearest(str(path), beside, show_all=5)}")
