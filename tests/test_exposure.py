"""Anonymous access on a non-loopback address: the decision, the start-up warning and
/readyz. The service under test always listens on 127.0.0.1; the public address is the
configured one (BAGSERVE_HOST), which is what the check reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from bagserve.core.demo import build_demo_models
from bagserve.service.exposure import anonymous_exposure, is_loopback
from bagserve.service.settings import Settings

from .service_harness import free_port, wait_ready

LOOPBACK = ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost.", "a.localhost"]
LOOPBACK += ["::ffff:127.0.0.1"]
PUBLIC = ["0.0.0.0", "::", "10.0.0.5", "192.168.1.20", "2001:db8::1", "::ffff:10.0.0.1"]
PUBLIC += ["example.org", "localhost.example.org", "127.0.0.1.nip.io", ""]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_addresses(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", PUBLIC)
def test_other_addresses_are_public(host):
    assert not is_loopback(host)


def test_the_warning_names_the_host_and_both_ways_out():
    message = anonymous_exposure(Settings(host="0.0.0.0"))
    assert message is not None
    assert "0.0.0.0" in message and "anonymous access on a public address" in message
    assert "BAGSERVE_API_KEYS" in message and "BAGSERVE_ALLOW_ANONYMOUS=true" in message


def test_keys_loopback_or_explicit_permission_silence_it(monkeypatch):
    assert anonymous_exposure(Settings(host="0.0.0.0", api_keys=["admin:k1"])) is None
    assert anonymous_exposure(Settings(host="0.0.0.0", allow_anonymous=True)) is None
    assert anonymous_exposure(Settings(host="127.0.0.1")) is None
    # From the environment, as the image sets it.
    monkeypatch.setenv("BAGSERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("BAGSERVE_ALLOW_ANONYMOUS", "true")
    assert Settings().allow_anonymous is True and anonymous_exposure(Settings()) is None
    monkeypatch.setenv("BAGSERVE_ALLOW_ANONYMOUS", "false")
    assert anonymous_exposure(Settings()) is not None
    monkeypatch.setenv("BAGSERVE_API_KEYS", "k1,read:k2")
    assert anonymous_exposure(Settings()) is None


# The real app under uvicorn, bound to 127.0.0.1 whatever BAGSERVE_HOST says.
_SERVE = """
import sys, uvicorn
from bagserve.service.app import create_app
from bagserve.service.settings import Settings
uvicorn.run(create_app(Settings()), host="127.0.0.1", port=int(sys.argv[1]), log_config=None)
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    build_demo_models(directory)
    return directory


def serve(models: Path, tmp_path: Path, **env: str) -> tuple[dict, list[dict]]:
    """Start the app with these BAGSERVE_* settings, return /readyz and its log lines."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BAGSERVE_")}
    environ.update(
        BAGSERVE_MODELS_DIR=str(models),
        BAGSERVE_DATA_DIR=str(tmp_path / "data"),
        BAGSERVE_WORKERS="1",
        BAGSERVE_LOG_FORMAT="json",
        **env,
    )
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(port)], env=environ, stdout=log, stderr=log
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc)
            r = httpx.get(f"{url}/readyz", timeout=10)
            assert r.status_code == 200, r.text
            ready = r.json()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    return ready, lines


def test_anonymous_public_service_warns_at_start_and_in_readyz(models, tmp_path):
    ready, lines = serve(models, tmp_path, BAGSERVE_HOST="0.0.0.0")
    # Reported, not a reason to be unready: the image's health check reads this probe.
    assert ready["status"] == "ready" and ready["reasons"] == []
    assert ready["anonymous_public"] is True
    (warning,) = ready["warnings"]
    assert "0.0.0.0" in warning and "BAGSERVE_ALLOW_ANONYMOUS=true" in warning
    logged = [r for r in lines if r["level"] == "warning"]
    assert [r["message"] for r in logged] == [warning] and logged[0]["host"] == "0.0.0.0"
    # Said before the service reports it is serving.
    messages = [r["message"] for r in lines]
    assert messages.index(warning) < messages.index("serving")


def test_allow_anonymous_silences_the_warning(models, tmp_path):
    ready, lines = serve(models, tmp_path, BAGSERVE_HOST="0.0.0.0", BAGSERVE_ALLOW_ANONYMOUS="true")
    assert ready["status"] == "ready"
    assert ready["anonymous_public"] is False and ready["warnings"] == []
    assert "serving" in [r["message"] for r in lines]
    assert not [r for r in lines if r["level"] == "warning"]
