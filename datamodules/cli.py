"""LightningCLI entry point: ``python -m datamodules.cli fit --config configs/token_shards.yaml``."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import logging
import os
import pkgutil
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from datamodules.callbacks.epoch_progress_bar import EpochProgressBar
from datamodules.callbacks.progress_lines import ProgressLines
from datamodules.storage.locations import is_url


def show_datamodule_logs() -> None:
    """INFO records of ``datamodules`` (what the data is, at the start of fit) on stderr, as Lightning's own."""
    logger = logging.getLogger("datamodules")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def raised_by_datamodules(err: BaseException | None) -> BaseException | None:
    """The error this package raised (a check of the user's input, whose message is the whole story)
    that ``err`` is or was raised while handling (jsonargparse wraps the errors of a class it builds)."""
    while err is not None:
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("datamodules"):
            return err if isinstance(err, (ValueError, OSError)) else None
        err = err.__cause__ or err.__context__
    return None


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


class DataModulesCLI(LightningCLI):
    """LightningCLI with one-line errors (``ShortErrorParser``, a checked ``ckpt_path``) and progress
    that shows in a log file (``progress_display``), unless the config chooses a bar or none."""

    def before_instantiate_classes(self) -> None:
        if self.subcommand is not None:
            check_checkpoint_path(self.config[self.subcommand].get("ckpt_path"))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = config.get("trainer") or {}
        callbacks = trainer.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        chosen = any(isinstance(c, ProgressBar) for c in callbacks) or trainer.get("enable_progress_bar") is False
        bar = None if chosen else progress_display()
        if bar is not None:
            kwargs["callbacks"] = [*callbacks, bar]
        return super().instantiate_trainer(**kwargs)


def progress_display() -> ProgressBar | None:
    """Plain lines off a terminal (a log file, a pipe), where a live bar shows nothing; on one, the rich
    bar with resumed epochs shown right (``None``, Lightning's default bar, without ``rich``)."""
    if not sys.stdout.isatty():
        return ProgressLines()
    return EpochProgressBar() if importlib.util.find_spec("rich") else None


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Any LightningModule and DataModule by ``class_path``, as the YAML names them. A bad path, option
    or dataset that this package's checks refuse ends the run with their one-line message (exit code
    2), not a traceback through Lightning."""
    show_datamodule_logs()
    try:
        return DataModulesCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_class=ShortErrorParser,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
        )
    except (ValueError, OSError) as err:
        ours = raised_by_datamodules(err)
        if ours is None:
            raise
        fail(str(ours))


if __name__ == "__main__":
    main()
