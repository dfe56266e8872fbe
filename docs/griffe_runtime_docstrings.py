"""A griffe extension for the API reference: the package as it is installed, docstrings as Python sees them.

- ``datamodules.callbacks`` is the repository's ``callbacks/`` folder (``package-dir`` in
  ``pyproject.toml``); griffe reads the source tree, so the folder is attached where it is installed.
- ``expand_argument_docs`` rewrites a DataModule's or source's ``Args:`` at import, so that an argument
  it forwards (``path, tokenizer, ...: see ``ImageTextSource``.``) gets the defining class's own
  description, as ``help()`` and LightningCLI's ``--help`` show it. Griffe reads the shorthand; each
  class whose ``__doc__`` differs after import is given that docstring instead.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import griffe

ROOT = Path(__file__).parents[1]


class RuntimeDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: object) -> None:
        if pkg.path == "datamodules":
            callbacks = griffe.load(
                "callbacks",
                search_paths=[ROOT],
                docstring_parser=loader.docstring_parser,
                docstring_options=loader.docstring_options,
            )
            pkg.set_member("callbacks", callbacks)

    def on_class_members(self, *, cls: griffe.Class, **kwargs: object) -> None:
        if not cls.path.startswith("datamodules.") or cls.docstring is None:
            return
        runtime = inspect.cleandoc(griffe.dynamic_import(cls.path).__doc__ or "")
        if runtime != cls.docstring.value:
            cls.docstring.value = runtime
