"""A throw-away PostgreSQL server for the tests, from Debian's packages.

``postgres_server()`` runs ``initdb`` into a fresh directory and starts ``postgres``
listening on 127.0.0.1 only, on a free port, with trust authentication for the local
test user; it yields the URL and removes everything afterwards. PostgreSQL refuses to
run as root, so under root the server runs as the ``postgres`` system user the Debian
package creates. Without PostgreSQL the tests that need it skip, unless
``BAGSERVE_REQUIRE_POSTGRES=1`` (set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
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
    """The server's URL, with outages to stage.

    ``stop()`` shuts the server down (an orderly outage); ``crash()`` stops it at once
    (``pg_ctl stop -m immediate``: every process quits without a checkpoint) and
    ``start()`` starts it again on the same port and data; ``freeze()`` stops every
    process of the server with SIGSTOP (a paused VM or container: the kernel still
    accepts connections and acknowledges what is sent, nobody answers) and ``thaw()``
    lets them go on.
    """

    stop: Callable[[], None]
    crash: Callable[[], None]
    start: Callable[[], None]
    freeze: Callable[[], None]
    thaw: Callable[[], None]


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


def _server_processes(data: Path) -> list[int]:
    """The server's processes: the postmaster (its pid file's first line) and its
    children (from /proc)."""
    postmaster = int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command may hold spaces and parentheses: the fields follow the last ")".
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == postmaster:
            children.append(int(stat.parent.name))
    return [postmaster, *children]


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
    server: subprocess.Popen[bytes] | None = None
    frozen: list[int] = []

    def start() -> None:
        nonlocal server
        server = subprocess.Popen(
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
                return
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start (see {log})")
            time.sleep(0.1)

    def stop() -> None:
        if server is None or server.poll() is not None:
            return
        thaw()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    def crash() -> None:
        assert server is not None
        thaw()
        # SIGQUIT is the immediate shutdown: the postmaster has every child quit at once.
        os.kill(_server_processes(data)[0], signal.SIGQUIT)
        server.wait(timeout=30)

    def freeze() -> None:
        # The postmaster first: it would start new children meanwhile.
        for pid in _server_processes(data):
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)

    def thaw() -> None:
        if frozen and server is not None and server.pid not in frozen:
            # runuser stops itself when its child stops (as su does), and stays stopped.
            frozen.append(server.pid)
        while frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen.pop(), signal.SIGCONT)

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
        start()
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
        url.stop, url.crash, url.start = stop, crash, start
        url.freeze, url.thaw = freeze, thaw
        yield url
    finally:
        stop()
        shutil.rmtree(root, ignore_errors=True)
