"""Argument checks every DataModule, source and command shares (no torch: the prepare command uses them)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

# Whether the code running was called from a command line, whose options are flags (``options_as_flags``).
_FLAGS: ContextVar[bool] = ContextVar("options_as_flags", default=False)


@contextmanager
def options_as_flags() -> Iterator[None]:
    """Errors raised inside name options as a command line spells them (``option``): for a command's ``main``."""
    token = _FLAGS.set(True)
    try:
        yield
    finally:
        _FLAGS.reset(token)


def option(name: str, value: object = None) -> str:
    """Option ``name`` (set to ``value``) as the interface that raised an error spells it: a keyword
    argument from Python (``on_bad_row='skip'``), a flag inside ``options_as_flags`` (``--on-bad-row
    skip``). ``True`` is a switch: ``add_bos=True``, ``--add-bos``."""
    if not _FLAGS.get():
        return name if value is None else f"{name}={value!r}"
    flag = "--" + name.replace("_", "-")
    return flag if value is None or value is True else f"{flag} {shlex.quote(str(value))}"


def require_int(name: str, value: object, minimum: int, error: type[Exception] = ValueError) -> int:
    """``value`` if it is an integer ``>= minimum``; a float such as ``64.0`` is refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise error(f"{option(name)} must be {what}, got {value!r}")
    return value


def program_name(module: str) -> str:
    """How a command was started, for its ``--help`` and errors: its console-script name
    (``lm-datamodules-prepare``), else ``python -m <module>``."""
    name = Path(sys.argv[0]).name
    return name if name.startswith("lm-datamodules") else f"python -m {module}"


def quickstart_hint(name: str) -> str:
    """What to add to the error about a missing ``name`` that lies in the quickstart's data folder."""
    quickstart = "; the configs read the quickstart's data: run `python -m examples.quickstart` first"
    return quickstart if ".cache/quickstart" in name else ""


def looks_local(name: str) -> bool:
    """Whether ``name`` can only be a local path (not a hub name): it starts with ``.``, ``/`` or ``~``,
    or a folder it names exists here."""
    parent = Path(name).expanduser().parent
    return name.startswith((".", "/", "~")) or (parent != Path(".") and parent.exists())


def require_existing(option: str, path: object, only_if_local: bool = False) -> None:
    """An error naming ``option`` at construction when ``path`` is a local path that does not exist
    (a URL, ``None``, or with ``only_if_local`` a name that may be a hub name, passes)."""
    if path is None or "://" in str(path):
        return
    name = str(path)
    if (only_if_local and not looks_local(name)) or Path(name).expanduser().exists():
        return
    raise ValueError(f"{option} {name!r} does not exist{quickstart_hint(name)}")


def check_held_out(option: tuple[str, object, str, float], other_fraction: float = 0.0) -> None:
    """A held-out split given as its own data (``option[:2]``, e.g. ``("val_dir", path)``) or as a
    fraction of the training data (``option[2:]``), not both; fractions in [0, 1) that leave training
    data (``other_fraction``: the other held-out split's)."""
    own, value, fraction_name, fraction = option
    if not (isinstance(fraction, (int, float)) and 0.0 <= fraction < 1.0):
        raise ValueError(f"{fraction_name} must be in [0, 1), got {fraction}")
    if value is not None and fraction > 0:
        raise ValueError(f"give {own} ({value!r}) or {fraction_name} ({fraction}), not both")
    if fraction + other_fraction >= 1.0:
        raise ValueError(f"{fraction_name}={fraction} and val_fraction={other_fraction} leave no training data")


def check_split_options(split: str, val_split: str | None, val_fraction: float, test_split: str | None,
                        test_fraction: float) -> None:  # fmt: skip
    """A dataset's held-out splits: each named or a fraction (``check_held_out``), never the training split."""
    check_held_out(("val_split", val_split, "val_fraction", val_fraction))
    check_held_out(("test_split", test_split, "test_fraction", test_fraction), val_fraction)
    for option, held, role in (("val_split", val_split, "validate"), ("test_split", test_split, "test")):
        if held is not None and held == split:
            raise ValueError(f"{option} {held!r} is the training split: it would {role} on the training rows")
