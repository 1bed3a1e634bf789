"""nginx in front of several replicas: the ``scale`` profile of ``docker-compose.yml``.

``deploy/nginx/nginx.conf`` is read the way nginx reads it and compared with the compose
file and the service's settings (body limit, timeouts, the replicas); Debian's nginx
checks it with ``nginx -t``; and two replicas run as plain processes behind that very
configuration on 127.0.0.1 (only the upstream addresses, the listen address and the
prefix differ from what the container runs).

nginx comes from Debian's package (``apt-get install nginx-light``). Without it the
tests that run nginx are skipped, unless ``BAGSERVE_REQUIRE_NGINX=1`` (as ``.ci/run``
sets), where a missing nginx is a failure: CI must not lose these tests silently.
"""

from __future__ import annotations

import http.client
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
import yaml
from bagserve.core.demo import build_demo_models
from bagserve.service.settings import Settings

from .service_harness import free_port, logged, metric_samples, wait_ready

ROOT = Path(__file__).resolve().parents[1]
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
DOSE_BAG = ROOT / "examples" / "requests" / "dose_bag.json"
PREDICT = "/v1/models/demo-dose/predict"


# -- reading the configuration -------------------------------------------------------


@dataclass
class Directive:
    """One nginx directive: its name, its arguments (quotes removed) and its block."""

    name: str
    args: list[str]
    block: list[Directive] | None = None

    def find(self, name: str, *args: str) -> list[Directive]:
        """The directives ``name`` directly in this block whose arguments start with ``args``."""
        return [d for d in self.block or [] if d.name == name and d.args[: len(args)] == [*args]]

    def one(self, name: str, *args: str) -> Directive:
        (found,) = self.find(name, *args)
        return found

    def value(self, name: str) -> str:
        return " ".join(self.one(name).args)


_TOKEN = re.compile(
    r"""\s+|\#[^\n]*|'(?P<single>(?:[^'\\]|\\.)*)'|"(?P<double>(?:[^"\\]|\\.)*)"|(?P<punct>[{};])|(?P<word>[^\s{};'"]+)"""
)


def parse_nginx(text: str) -> Directive:
    """The configuration as a tree of directives (enough of nginx's syntax for ours)."""
    root = Directive("main", [], [])
    stack, words = [root], []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m, f"cannot read the nginx configuration at {text[pos : pos + 40]!r}"
        pos = m.end()
        punct = m["punct"]
        if punct is None:
            for kind in ("single", "double", "word"):
                if m[kind] is not None:
                    words.append(m[kind])
            continue
        if punct == "}":
            assert not words and len(stack) > 1, "unbalanced braces"
            stack.pop()
            continue
        directive = Directive(words[0], words[1:], [] if punct == "{" else None)
        stack[-1].block.append(directive)
        if punct == "{":
            stack.append(directive)
        words = []
    assert len(stack) == 1 and not words, "unterminated block or directive"
    return root


def walk(directive: Directive) -> Iterator[Directive]:
    """Every directive under ``directive``, depth first."""
    for d in directive.block or []:
        yield d
        yield from walk(d)


def nginx_size(text: str) -> int:
    """An nginx size (``512``, ``64k``, ``256m``, ``1g``) in bytes."""
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", text)
    assert m, text
    return int(m[1]) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m[2].lower()]


def nginx_seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", text)
    assert m, text
    return int(m[1]) * {"ms": 1e-3, "s": 1, None: 1, "m": 60, "h": 3600}[m[2]]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def replica_services(doc: dict) -> dict[str, dict]:
    """The services that run the bagserve image: the default one and the scale profile's."""
    return {n: s for n, s in doc["services"].items() if s.get("image", "").startswith("bagserve:")}


def scale_replicas(doc: dict) -> dict[str, dict]:
    """The replicas behind nginx: the scale profile's bagserve services."""
    return {n: s for n, s in replica_services(doc).items() if s.get("profiles") == ["scale"]}


def http_block() -> Directive:
    return parse_nginx(NGINX_CONF.read_text()).one("http")


def location(server: Directive, *args: str) -> Directive:
    return server.one("location", *args)


PREDICT_LOCATION = (
    "~",
    "^/(v1/models/[^/]+(/versions/[^/]+)?/predict|v2/models/[^/]+(/versions/[^/]+)?/infer)$",
)


# -- the configuration against the compose file and the settings ----------------------


def test_compose_scale_profile_leaves_the_default_alone():
    doc = compose()
    services = doc["services"]
    # `docker compose up` without a profile starts what it started before: bagserve only,
    # its state in SQLite on its own data volume.
    assert [n for n, s in services.items() if not s.get("profiles")] == ["bagserve"]
    base = services["bagserve"]
    assert "BAGSERVE_DATABASE_URL" not in base["environment"]
    assert "./models:/models:ro" in base["volumes"] and "bagserve-data:/data" in base["volumes"]
    replicas = scale_replicas(doc)
    assert len(replicas) >= 2
    for name, svc in replicas.items():
        assert svc["profiles"] == ["scale"] and "ports" not in svc, name
        # The default service's settings plus the shared database, nothing else.
        env = dict(svc["environment"])
        url = env.pop("BAGSERVE_DATABASE_URL")
        assert re.fullmatch(
            r"postgresql://bagserve:\$\{BAGSERVE_DB_PASSWORD:-[^}]+\}@postgres:5432/bagserve", url
        )
        assert env.pop("BAGSERVE_DATA_DIR").startswith("/tmp/")
        assert env == base["environment"], name
        same = {
            k: v
            for k, v in svc.items()
            if k not in ("profiles", "volumes", "environment", "depends_on")
        }
        assert same == {
            k: v for k, v in base.items() if k not in ("ports", "volumes", "environment")
        }
        assert svc["volumes"] == ["./models:/models:ro"]
        assert svc["depends_on"] == {"postgres": {"condition": "service_healthy"}}

    postgres = services["postgres"]
    assert postgres["profiles"] == ["scale"] and "ports" not in postgres
    assert re.fullmatch(r"postgres:\d+\.\d+(-alpine)?", postgres["image"]), "pin the image"
    (volume,) = postgres["volumes"]
    name, target = volume.split(":")
    assert name in doc["volumes"] and target == "/var/lib/postgresql/data"
    assert postgres["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert postgres["environment"]["POSTGRES_USER"] == "bagserve"
    assert postgres["environment"]["POSTGRES_DB"] == "bagserve"

    nginx = services["nginx"]
    assert nginx["profiles"] == ["scale"]
    assert re.fullmatch(r"nginx:\d+\.\d+\.\d+(-alpine)?", nginx["image"]), "pin the image"
    (mount,) = nginx["volumes"]
    source, target, mode = mount.split(":")
    assert (ROOT / source).resolve() == NGINX_CONF and target == "/etc/nginx/nginx.conf"
    assert mode == "ro" and nginx["read_only"] is True and "/tmp" in nginx["tmpfs"]
    assert nginx["command"][:3] == ["nginx", "-p", "/tmp/"]
    assert nginx["ports"] == ["127.0.0.1:8080:8080"]
    assert nginx["depends_on"] == {n: {"condition": "service_healthy"} for n in replicas}
    assert any("/nginx-health" in part for part in nginx["healthcheck"]["test"])


def test_body_limit_agrees_with_the_service():
    limit = Settings.model_fields["max_body_bytes"].default
    for name, svc in replica_services(compose()).items():
        assert int(svc["environment"]["BAGSERVE_MAX_BODY_BYTES"]) == limit, name
    server = http_block().one("server")
    assert nginx_size(server.value("client_max_body_size")) == limit
    # No location may loosen or tighten it, and nginx's 413 states the same number.
    assert not [loc for loc in server.find("location") if loc.find("client_max_body_size")]
    too_large = location(server, "@too_large").one("return")
    assert too_large.args[0] == "413"
    assert json.loads(too_large.args[1].replace("$bagserve_request_id", "x"))["detail"].endswith(
        f"limit of {limit} bytes"
    )


def test_upstreams_are_the_compose_replicas():
    http = http_block()
    replicas = set(scale_replicas(compose()))
    expected = {f"{name}:8000" for name in replicas}
    # One pool for everything: jobs and idempotency records are in the shared database,
    # so nothing is pinned to a replica (no hash on keys, no jobs-only upstream).
    assert [u.args for u in http.find("upstream")] == [["bagserve"]]
    upstream = http.one("upstream", "bagserve")
    assert upstream.find("least_conn")
    servers = upstream.find("server")
    assert {s.args[0] for s in servers} == expected
    # Passive health checks: open-source nginx has no active ones.
    for s in servers:
        assert {a.split("=")[0] for a in s.args[1:]} >= {"max_fails", "fail_timeout"}
    # Reused connections must be dropped before uvicorn drops them on its side.
    uvicorn_keep_alive = uvicorn.Config(app=None).timeout_keep_alive
    for upstream in http.find("upstream"):
        assert nginx_seconds(upstream.value("keepalive_timeout")) < uvicorn_keep_alive


def test_timeouts_and_retries_fit_the_service():
    env = replica_services(compose())["bagserve"]["environment"]
    workers, queue = int(env["BAGSERVE_WORKERS"]), int(env["BAGSERVE_QUEUE_SIZE"])
    request_timeout = float(env["BAGSERVE_REQUEST_TIMEOUT"])
    server = http_block().one("server")
    predict = location(server, *PREDICT_LOCATION)
    # The longest a prediction can take in the service: waiting behind the whole queue,
    # then computing; nginx must not give up (504) before the service does.
    worst = (math.ceil(queue / workers) + 1) * request_timeout
    assert nginx_seconds(predict.value("proxy_read_timeout")) >= worst
    assert predict.value("proxy_request_buffering") == "off"
    # POSTs are never repeated once sent: no non_idempotent anywhere.
    assert predict.one("proxy_next_upstream").args == ["error", "timeout"]
    jobs = location(server, "/v1/jobs")
    assert jobs.one("proxy_next_upstream").args == ["error", "timeout"]
    assert jobs.value("proxy_pass") == "http://bagserve"
    assert predict.value("proxy_pass") == "http://bagserve"
    rest = location(server, "/")
    assert "http_503" in rest.one("proxy_next_upstream").args
    assert not [d for d in walk(server) if "non_idempotent" in d.args]
    assert "X-Request-ID" in [d.args[0] for d in server.find("proxy_set_header")]
    assert location(server, "=", "/nginx-health").one("return").args[0] == "200"


def test_predict_location_matches_the_prediction_routes():
    pattern = re.compile(PREDICT_LOCATION[1])
    app_paths = json.loads((ROOT / "openapi" / "openapi.json").read_text())["paths"]
    # Jobs and the repository operations have locations of their own.
    posts = [
        p
        for p, ops in app_paths.items()
        if "post" in ops and p != "/v1/jobs" and not p.startswith("/v2/repository/")
    ]
    assert posts
    for path in posts:
        concrete = path.replace("{name}", "demo-dose").replace("{version}", "1")
        assert pattern.match(concrete), path
    for path in ("/v1/models", "/v1/models/demo-dose", "/v1/jobs", "/readyz"):
        assert not pattern.match(path)


# -- running nginx ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def nginx_exe() -> str:
    # /usr/sbin is not on every user's PATH, and that is where Debian puts nginx.
    found = shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))
    if found is None:
        reason = "nginx is not installed (Debian: apt-get install nginx-light)"
        if os.environ.get("BAGSERVE_REQUIRE_NGINX") == "1":
            pytest.fail(f"{reason}, and BAGSERVE_REQUIRE_NGINX=1 requires it")
        pytest.skip(f"{reason}; BAGSERVE_REQUIRE_NGINX=1 turns this skip into a failure")
    return found


def render(listen: int, replicas: dict[str, int]) -> str:
    """The shipped configuration with compose's replicas (``replica-1``, ``replica-2``,
    ...) replaced by ``127.0.0.1`` ports, those not given dropped, and the listen
    address moved to 127.0.0.1."""

    def server(m: re.Match[str]) -> str:
        port = replicas.get(m["host"])
        return "" if port is None else f"{m['indent']}server 127.0.0.1:{port}{m['params']};"

    text, n = re.subn(
        r"^(?P<indent>[ \t]*)server (?P<host>replica-\d+):8000(?P<params>[^;]*);$",
        server,
        NGINX_CONF.read_text(),
        flags=re.MULTILINE,
    )
    assert n >= 3
    text, n = re.subn(r"^(\s*)listen 8080;$", rf"\1listen 127.0.0.1:{listen};", text, flags=re.M)
    assert n == 1
    if os.geteuid() == 0:
        # As root, nginx would hand its workers to `nobody`, who cannot enter the test's
        # private tmp directory.
        text = f"user root;\n{text}"
    return text


def nginx_command(exe: str, prefix: Path, *extra: str) -> list[str]:
    return [exe, "-p", f"{prefix}/", "-c", str(prefix / "nginx.conf"), *extra]


def test_nginx_accepts_the_configuration(nginx_exe, tmp_path):
    (tmp_path / "nginx.conf").write_text(render(free_port(), {"replica-1": free_port()}))
    r = subprocess.run(nginx_command(nginx_exe, tmp_path, "-t"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "test is successful" in r.stderr


@dataclass
class Stack:
    """Two replicas and nginx, as processes on 127.0.0.1."""

    nginx: str
    replicas: list[str]
    procs: list[subprocess.Popen[bytes]]
    access_log: Path


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def replicas_behind_nginx(nginx_exe: str, root: Path) -> Iterator[Stack]:
    models = root / "models"
    build_demo_models(models)
    with ExitStack() as stack:
        ports, procs, logs = [free_port(), free_port()], [], []
        exe = Path(sys.executable).parent / "bagserve"
        base = {k: v for k, v in os.environ.items() if not k.startswith("BAGSERVE_")}
        # Started together, waited for together: the replicas start in parallel.
        for i, port in enumerate(ports):
            env = {
                **base,
                "BAGSERVE_MODELS_DIR": str(models),
                "BAGSERVE_DATA_DIR": str(root / f"data-{i}"),
                # Replicas on one host share state in one SQLite file (PostgreSQL
                # across hosts: tests/test_shared_state.py).
                "BAGSERVE_DATABASE_URL": f"sqlite:///{root / 'state.sqlite3'}",
                "BAGSERVE_HOST": "127.0.0.1",
                "BAGSERVE_PORT": str(port),
                "BAGSERVE_WORKERS": "1",
                "BAGSERVE_LOG_FORMAT": "json",
            }
            logs.append(root / f"replica-{i}.log")
            out = stack.enter_context(open(logs[-1], "wb"))
            proc = subprocess.Popen(
                [str(exe), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT
            )
            stack.callback(_stop, proc)
            procs.append(proc)
        urls = [f"http://127.0.0.1:{p}" for p in ports]

        prefix = root / "nginx"
        prefix.mkdir()
        listen = free_port()
        conf = render(listen, {"replica-1": ports[0], "replica-2": ports[1]})
        (prefix / "nginx.conf").write_text(conf)
        logs.append(prefix / "nginx.log")
        out = stack.enter_context(open(logs[-1], "wb"))
        nginx = subprocess.Popen(
            nginx_command(nginx_exe, prefix, "-g", "daemon off;"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        stack.callback(_stop, nginx)

        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc, timeout=60)
        url = f"http://127.0.0.1:{listen}"
        deadline = time.monotonic() + 10
        while True:
            assert nginx.poll() is None, logs[-1].read_text()
            try:
                if httpx.get(f"{url}/nginx-health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
        yield Stack(url, urls, procs, logs[-1])


def predict_count(url: str) -> float:
    """Predictions a replica has answered (its own /metrics, asked directly)."""
    return sum(
        s.value
        for s in metric_samples(url, "bagserve_requests_total")
        if s.labels["route"].endswith("/predict")
    )


def test_replicas_behind_nginx(nginx_exe, tmp_path):
    body = json.loads(DOSE_BAG.read_text())
    with replicas_behind_nginx(nginx_exe, tmp_path) as st, httpx.Client(timeout=30) as client:
        # Through nginx, the same answer as from a replica directly.
        direct = client.post(f"{st.replicas[0]}{PREDICT}", json=body)
        via = client.post(f"{st.nginx}{PREDICT}", json=body)
        assert direct.status_code == via.status_code == 200, via.text
        expected = direct.json()["predictions"]
        assert via.json()["predictions"] == expected
        assert via.headers["x-model-sha256"] == direct.headers["x-model-sha256"]

        # Spread over both replicas (least_conn between idle replicas takes turns).
        before = [predict_count(u) for u in st.replicas]
        for _ in range(6):
            assert client.post(f"{st.nginx}{PREDICT}", json=body).status_code == 200
        after = [predict_count(u) for u in st.replicas]
        gained = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(gained) == 6 and min(gained) >= 1, gained

        # Request ids: the client's goes through; otherwise nginx's own, in both logs.
        r = client.get(f"{st.nginx}/v1/models", headers={"X-Request-ID": "run-42.a_b"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "run-42.a_b"
        r = client.get(f"{st.nginx}/v1/models", headers={"X-Request-ID": "not valid!"})
        generated = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", generated)
        records = logged(lambda: [st.access_log], lambda e: e["request_id"] == generated)
        assert any(e["request_id"] == generated and e["status"] == 200 for e in records)

        # The service's own redirects lead back through nginx (Host passed with its port).
        r = client.get(f"{st.nginx}/v1/models/")
        assert r.status_code == 307 and r.headers["location"] == f"{st.nginx}/v1/models"

        # A key's answer is replayed by whichever replica gets the retry (shared state).
        for key in ("k-1", "k-2", "k-3", "k-4"):
            first = client.post(f"{st.nginx}{PREDICT}", json=body, headers={"Idempotency-Key": key})
            again = client.post(f"{st.nginx}{PREDICT}", json=body, headers={"Idempotency-Key": key})
            assert first.status_code == again.status_code == 200
            assert again.headers.get("idempotent-replayed") == "true", key

        # Jobs: submitted to one replica, polled through either.
        r = client.post(f"{st.nginx}/v1/jobs", params={"model": "demo-dose"}, json=body)
        assert r.status_code == 202, r.text
        job = r.headers["location"]
        deadline = time.monotonic() + 30
        while (state := client.get(f"{st.nginx}{job}").json())["status"] not in (
            "succeeded",
            "failed",
        ):
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        assert state["status"] == "succeeded"
        for _ in range(4):
            assert client.get(f"{st.nginx}{job}").status_code == 200

        # Repository operations would change one replica only: refused, saying how.
        r = client.post(f"{st.nginx}/v2/repository/index")
        assert r.status_code == 409 and "SIGHUP" in r.json()["error"]
        assert r.headers["content-type"] == "application/json"
        r = client.post(f"{st.nginx}/v2/repository/models/demo-dose/unload")
        assert r.status_code == 409
        assert client.post(f"{st.nginx}{PREDICT}", json=body).status_code == 200

        # 8 MB of NPY streams through unchanged.
        rng = np.random.default_rng(0)
        points = rng.normal(loc=(2.0, 1.2, 0.5), scale=0.5, size=(350_000, 3))
        buf = io.BytesIO()
        np.save(buf, points)
        npy = buf.getvalue()
        assert len(npy) > 8_000_000
        npy_request = {
            "content": npy,
            "params": {"markers": "FSC-A,SSC-A,GFP"},
            "headers": {"content-type": "application/x-npy"},
        }
        direct = client.post(f"{st.replicas[1]}{PREDICT}", **npy_request)
        via = client.post(f"{st.nginx}{PREDICT}", **npy_request)
        assert direct.status_code == via.status_code == 200, via.text
        assert via.headers["x-input-sha256"] == direct.headers["x-input-sha256"]
        assert via.json()["predictions"] == direct.json()["predictions"]

        # Over the limit: nginx refuses from the Content-Length alone, before any byte of
        # the body, and no replica sees the request.
        counts = [predict_count(u) for u in st.replicas]
        limit = Settings.model_fields["max_body_bytes"].default
        conn = http.client.HTTPConnection("127.0.0.1", int(st.nginx.rsplit(":", 1)[1]), timeout=10)
        try:
            conn.putrequest("POST", PREDICT)
            conn.putheader("Content-Type", "application/x-npy")
            conn.putheader("Content-Length", str(limit + 1))
            conn.endheaders()
            refused = conn.getresponse()
            problem = json.loads(refused.read())
        finally:
            conn.close()
        assert refused.status == 413
        assert refused.getheader("content-type") == "application/problem+json"
        assert problem["status"] == 413 and str(limit) in problem["detail"]
        assert problem["request_id"] == refused.getheader("x-request-id")
        assert [predict_count(u) for u in st.replicas] == counts

        # One replica dies: the other answers everything (the refused connections move
        # both GETs and POSTs on), and nginx still reports ready.
        st.procs[1].kill()
        st.procs[1].wait()
        for _ in range(4):
            assert client.get(f"{st.nginx}/v1/models").status_code == 200
            r = client.post(f"{st.nginx}{PREDICT}", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["predictions"] == expected
        r = client.post(f"{st.nginx}{PREDICT}", json=body, headers={"Idempotency-Key": "k-5"})
        assert r.status_code == 200
        assert client.get(f"{st.nginx}/readyz").status_code == 200
