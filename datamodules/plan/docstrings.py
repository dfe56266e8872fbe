"""Docstrings with one ``Args:`` entry per argument, as LightningCLI's ``--help`` (jsonargparse) and
``help()`` read them, from the shorthand the classes here are documented in.

The shorthand keeps each argument documented once, where it is defined: ``a, b: text`` for arguments
that share a description, ``a, b: see ``Owner``.`` for arguments a wrapper forwards to the class that
defines them, and ``a: short. b: short.`` on one line.
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap

_ENTRY = re.compile(r"(?P<names>[A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*):\s+(?P<text>.*)", re.DOTALL)
_SEE = re.compile(r"see ``(?P<owner>\w+)``[.;,]?\s*(?P<rest>.*)", re.DOTALL)


def _section(doc: str) -> tuple[int, int, int]:
    """``(first line, end line, indent)`` of the entries of ``doc``'s ``Args:`` section; empty if none."""
    lines = doc.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.strip() == "Args:"), len(lines))
    indent = len(lines[start]) - len(lines[start].lstrip()) if start < len(lines) else 0
    end = start
    while end < len(lines) and lines[end].strip() and len(lines[end]) - len(lines[end].lstrip()) >= indent:
        end += 1
    return start, end, indent


def _entries(lines: list[str], indent: int) -> list[list[str]]:
    """The section's lines grouped by entry (an entry's first line is at ``indent``)."""
    entries: list[list[str]] = []
    for line in lines:
        if len(line) - len(line.lstrip()) == indent or not entries:
            entries.append([])
        entries[-1].append(line)
    return entries


def argument_docs(cls: type) -> dict[str, str]:
    """Each argument's description in ``cls``'s ``Args:`` section (as ``expand_argument_docs`` left it)."""
    doc = cls.__doc__ or ""
    start, end, indent = _section(doc)
    docs = {}
    for entry in _entries(doc.splitlines()[start:end], indent):
        found = _ENTRY.fullmatch(" ".join(line.strip() for line in entry))
        if found:
            docs[found["names"]] = found["text"]
    return docs


def _arguments(cls: type) -> set[str]:
    """The arguments ``cls`` itself declares: dataclass fields, or its own ``__init__``'s parameters."""
    names = set(cls.__dict__.get("__annotations__", {}))
    if "__init__" in cls.__dict__:
        names |= set(inspect.signature(cls.__dict__["__init__"]).parameters) - {"self"}
    return names


def _owner(name: str, namespace: dict[str, object]) -> type | None:
    """The class ``name`` in ``namespace`` (a module's), else in a module of this package loaded by now."""
    modules = [namespace, *(vars(m) for key, m in list(sys.modules.items()) if key.startswith("datamodules.") and m)]
    return next((m[name] for m in modules if isinstance(m.get(name), type)), None)


def _described(names: list[str], text: str, namespace: dict[str, object]) -> list[tuple[str, str]]:
    """``(name, description)`` for each of ``names`` sharing ``text``: an owner's own description where
    ``text`` is ``see ``Owner``[; more]`` (``more`` goes with the names it mentions, else with each)."""
    see = _SEE.fullmatch(text)
    owner = _owner(see["owner"], namespace) if see else None
    if owner is None:
        return [(name, text) for name in names]
    docs, rest = argument_docs(owner), see["rest"]
    mentioned = [name for name in names if f"``{name}``" in rest] or names
    own = [docs.get(name, f"see ``{see['owner']}``.") for name in names]
    return [(name, f"{doc} {rest}" if name in mentioned else doc) for name, doc in zip(names, own, strict=True)]


def expand_argument_docs(cls: type) -> None:
    """Rewrites ``cls.__doc__`` so that every argument in its ``Args:`` section has an entry of its own
    (see the module's docstring for the shorthand it expands); other entries stay as written."""
    doc = cls.__doc__
    if not doc:
        return
    lines = doc.splitlines()
    start, end, indent = _section(doc)
    namespace = vars(sys.modules[cls.__module__])
    inline = re.compile(rf"(?<=\.)\s+(?=(?:{'|'.join(map(re.escape, _arguments(cls))) or '(?!)'}):\s)")
    section = []
    for entry in _entries(lines[start:end], indent):
        text = " ".join(line.strip() for line in entry)
        parts = [_ENTRY.fullmatch(part) for part in inline.split(text)]
        single = len(parts) == 1 and parts[0] and "," not in parts[0]["names"] and not _SEE.fullmatch(parts[0]["text"])
        if single or not all(parts):  # one argument described here, or no entry at all: as written
            section += entry
            continue
        for part in parts:
            names = [name.strip() for name in part["names"].split(",")]
            for name, description in _described(names, part["text"], namespace):
                wrapped = textwrap.wrap(f"{name}: {description}", 100 - indent, subsequent_indent="    ")
                section += [" " * indent + line for line in wrapped]
    cls.__doc__ = "\n".join([*lines[:start], *section, *lines[end:]])
