"""Deployment files: the image's properties, its exact command served from a clean
environment, the compose file and the example requests of the README (the wheel and the
locks: test_packaging.py)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import yaml
from bagserve.core.demo import build_demo_models

from .service_harness import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, argument) pairs, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def env_of_image() -> dict[str, str]:
    env: dict[str, str] = {}
    stages = [i for i, (w, _) in enumerate(dockerfile()) if w == "FROM"]
    for word, arg in dockerfile()[stages[-1] :]:
        if word == "ENV":
            for item in shlex.split(arg):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def test_dockerfile_properties():
    ins = dockerfile()
    froms = [a for w, a in ins if w == "FROM"]
    assert len(froms) == 2 and all(a.startswith("python:3.11-slim") for a in froms)
    assert "AS build" in froms[0] and any(w == "COPY" and "--from=build" in a for w, a in ins)
    runtime = ins[[w for w, _ in ins].index("FROM", 1) :]
    users = [a for w, a in runtime if w == "USER"]
    assert users and users[-1] not in ("root", "0")
    health = next(a for w, a in runtime if w == "HEALTHCHECK")
    assert "/readyz" in health
    assert json.loads(next(a for w, a in runtime if w == "CMD")) == ["bagserve", "serve"]
    assert json.loads(next(a for w, a in runtime if w == "VOLUME")) == ["/models", "/data"]
    env = env_of_image()
    assert env["BAGSERVE_MODELS_DIR"] == "/models" and env["BAGSERVE_PORT"] == "8000"


def test_compose_file_properties():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = compose["services"]["bagserve"]
    assert svc["build"] == "."
    assert any(v.endswith(":/models:ro") for v in svc["volumes"])
    limits = svc["deploy"]["resources"]["limits"]
    assert float(limits["cpus"]) > 0 and limits["memory"]
    assert svc["read_only"] is True
    assert all(p.startswith("127.0.0.1:") for p in svc["ports"])
    assert {"BAGSERVE_WORKERS", "BAGSERVE_QUEUE_SIZE", "BAGSERVE_API_KEYS"} <= set(
        svc["environment"]
    )


def image_bin() -> Path:
    """Where the image's command is found: the image's environment that `make image-env`
    built (the wheel on the image's lock; CI sets BAGSERVE_IMAGE_ENV), else this one."""
    env = os.environ.get("BAGSERVE_IMAGE_ENV")
    return Path(env) / "bin" if env else Path(sys.executable).parent


def test_image_command_serves_from_a_clean_environment(tmp_path):
    """Run the image's exact CMD with the image's ENV (only the models directory and
    the port moved), from an empty working directory, and ask it for a prediction."""
    models = tmp_path / "models"
    build_demo_models(models)
    port = free_port()
    env = {"PATH": str(image_bin()) + os.pathsep + "/usr/bin:/bin", **env_of_image()}
    env.update(
        BAGSERVE_MODELS_DIR=str(models),
        BAGSERVE_DATA_DIR=str(tmp_path / "data"),
        BAGSERVE_PORT=str(port),
        HOME=str(tmp_path),
    )
    env["MPLCONFIGDIR"] = str(tmp_path / "mpl")
    cmd = json.loads(next(a for w, a in dockerfile()[::-1] if w == "CMD"))
    workdir = tmp_path / "empty"
    workdir.mkdir()
    proc = subprocess.Popen(
        cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        url = f"http://127.0.0.1:{port}"
        ready = wait_ready(url, proc)
        assert set(ready["models"]) == {"demo-dose/1", "demo-gating/1"}
        body = json.loads((ROOT / "examples" / "requests" / "dose_bag.json").read_text())
        r = httpx.post(f"{url}/v1/models/demo-dose/predict", json=body, timeout=60)
        assert r.status_code == 200 and abs(r.json()["predictions"][0]["prediction"] - 0.26) < 0.2
        csv_body = (ROOT / "examples" / "requests" / "gating_sample.csv").read_bytes()
        r = httpx.post(
            f"{url}/v1/models/demo-gating/predict",
            content=csv_body,
            headers={"content-type": "text/csv"},
            timeout=60,
        )
        assert r.status_code == 200 and len(r.json()["predictions"][0]["labels"]) == 1000
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
