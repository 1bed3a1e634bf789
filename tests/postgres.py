"""A throw-away PostgreSQL server for the tests, from Debian's packages.

``postgres_server()`` runs ``initdb`` into a fresh directory and starts ``postgres``
listening on 127.0.0.1 only, on a free port, with trust authentication for the local
test user; it yields the URL and removes everything afterwards. PostgreSQL refuses to
run as root, so under root the server runs as the ``postgres`` system user the Debian
package creates. Without PostgreSQL the tests that need it skip, unless
``BAGSERVE_REQUIRE_POSTGRES=1`` (set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .service_harness import free_port

__all__ = ["PostgresURL", "postgres_bin", "postgres_server"]


class PostgresURL(str):
    """The server's URL; ``stop()`` shuts the server down early (an outage)."""

    stop: Callable[[], None]


def postgres_bin() -> Path | None:
    """The directory of ``initdb`` and ``postgres`` (newest installed), or None."""
    found = shutil.which("initdb")
    if found:
        # Debian links initdb into PATH but not its siblings: the real directory.
        return Path(found).resolve().parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(candidates[-1]).parent if candidates else None


def _require() -> Path:
    bindir = postgres_bin()
    if bindir is None:
        if os.environ.get("BAGSERVE_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL is required (BAGSERVE_REQUIRE_POSTGRES=1) but not installed")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    return bindir


@contextmanager
def postgres_server() -> Iterator[PostgresURL]:
    """Start a private PostgreSQL on 127.0.0.1; yields ``postgresql://...``."""
    bindir = _require()
    # Not under pytest's tmp_path: its parents are private to root, and the server
    # may run as another user.
    root = Path(tempfile.mkdtemp(prefix="bagserve-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data, sockets = root / "data", root / "sockets"
    port = free_port()
    log = root / "postgres.log"
    proc = None
    try:
        subprocess.run([*prefix, "mkdir", str(sockets)], check=True, capture_output=True, text=True)
        subprocess.run(
            [
                *prefix,
                str(bindir / "initdb"),
                "-D",
                str(data),
                "-U",
                "bagserve",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        proc = subprocess.Popen(
            [
                *prefix,
                str(bindir / "postgres"),
                "-D",
                str(data),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-k",
                str(sockets),
                # A throw-away server: durability against power loss is not tested here.
                "-c",
                "fsync=off",
                "-c",
                "max_connections=200",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            ready = subprocess.run(
                [str(bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                capture_output=True,
            )
            if ready.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start (see {log})")
            time.sleep(0.1)
        subprocess.run(
            [
                str(bindir / "createdb"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-U",
                "bagserve",
                "bagserve",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        url = PostgresURL(f"postgresql://bagserve@127.0.0.1:{port}/bagserve")
        server = proc

        def stop() -> None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()

        url.stop = stop
        yield url
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(root, ignore_errors=True)
