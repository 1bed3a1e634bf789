"""MkDocs hook: the API reference reads the package from the folders setuptools maps.

The folders ``core/`` and ``service/`` install as ``bagserve.core`` and
``bagserve.service`` (``[tool.setuptools.package-dir]`` in pyproject.toml). mkdocstrings
reads docstrings with griffe, which parses the source without importing it and expects
``bagserve/core/``. This hook lays the package out as it installs, with symbolic links in
a temporary directory, and gives that directory to mkdocstrings as its search path: the
reference is built from the working tree, whatever is installed.

The docstrings cross-reference in Sphinx's roles (``:class:`~core.Bags```), which
Markdown leaves as text; the rendered pages show them as code, as Sphinx would.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]

# A Sphinx role as Markdown renders it: :class:<code>~core.Bags</code>.
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def package_tree() -> Path:
    """A directory holding ``bagserve/`` as it installs, its files linked to the sources."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"bagserve": "bagserve", **setuptools["package-dir"]}
    tree = Path(tempfile.mkdtemp(prefix="bagserve-docs-"))
    atexit.register(shutil.rmtree, tree, ignore_errors=True)
    for package, folder in sorted(folders.items()):
        target = tree.joinpath(*package.split("."))
        if package == "bagserve":
            target.mkdir(parents=True)
            for source in (ROOT / folder).glob("*.py"):
                (target / source.name).symlink_to(source)
        else:
            target.symlink_to(ROOT / folder, target_is_directory=True)
    return tree


@event_priority(100)  # before mkdocstrings reads its configuration
def on_config(config: Any) -> Any:
    handlers = config.plugins["mkdocstrings"].config.handlers
    handlers.setdefault("python", {})["paths"] = [str(package_tree())]
    return config


def _role_as_code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_role_as_code, html)
