"""Data that ship inside a package on PyPI: the archive fetched once with ``pip download``
into ``bench/.cache`` and checked against a pinned sha256 (none of it is kept in the
repository)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"


def pypi_archive(requirement: str, filename: str, sha256: str, *, sdist: bool = False) -> Path:
    """The archive ``filename`` of ``requirement``, downloaded once and checked.

    Parameters
    ----------
    requirement : str
        A pinned requirement, ``name==version``.
    filename : str
        The archive's file name as the index serves it.
    sha256 : str
        Its expected digest; any other file stops the benchmark.
    sdist : bool
        Fetch the source distribution (where a package keeps its test data) rather
        than the wheel. pip prepares its metadata, which runs the package's build
        backend.
    """
    path = CACHE / filename
    if not path.exists():
        CACHE.mkdir(exist_ok=True)
        binary = ["--no-binary", ":all:"] if sdist else []
        command = [sys.executable, "-m", "pip", "download", "--no-deps", *binary, requirement]
        subprocess.run([*command, "-d", str(CACHE), "-q"], check=True)
        if not path.exists():
            raise SystemExit(f"pip download {requirement} did not write {path}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {sha256}")
    return path
