"""Which part of the package may import which: the spine (``plan``, ``storage``) imports no family; a
family imports the spine, and ``speculative`` builds on ``chat``; nothing imports a family above it.
Every import counts, a function's deferred ones too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
SPINE = {"plan", "storage"}
# Beyond the spine, what each part may import; the package's entry points (``__init__``, ``cli``) may
# import anything.
ALLOWED = {"chat": set(), "speculative": {"chat"}, "text": set(), "vision": set(), "mixture": set(), "callbacks": set()}


def part_of(path: Path) -> str:
    """The part a file belongs to: its subpackage, or its module's name at the top of the package."""
    if path.is_relative_to(ROOT / "callbacks"):  # installed as datamodules.callbacks
        return "callbacks"
    relative = path.relative_to(ROOT / "datamodules")
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_parts(path: Path) -> set[str]:
    """The parts of the package ``path`` imports (``datamodules.<part>...``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            if node.module == "datamodules":  # from datamodules import text
                names += [f"datamodules.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return {name.split(".")[1] for name in names if name.startswith("datamodules.")}


def test_each_part_imports_only_the_spine_and_the_families_below_it() -> None:
    files = sorted((ROOT / "datamodules").rglob("*.py")) + sorted((ROOT / "callbacks").rglob("*.py"))
    wrong = []
    for path in files:
        part = part_of(path)
        if part in ("__init__", "cli", "cli_errors"):
            continue
        allowed = SPINE if part in SPINE else SPINE | ALLOWED[part] | {part}
        wrong += [f"{path.relative_to(ROOT)} ({part}) imports {other}" for other in imported_parts(path) - allowed]
    assert not wrong, "\n".join(wrong)
    assert len(files) > 50  # the whole package was read


def test_the_rule_catches_a_family_importing_upward(tmp_path: Path) -> None:
    module = tmp_path / "upward.py"
    module.write_text(
        "def f():\n    from datamodules.speculative.generate import main\n    import datamodules.vision.images\n"
    )
    assert imported_parts(module) == {"speculative", "vision"}
