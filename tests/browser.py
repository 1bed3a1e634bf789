"""A headless Chromium (Debian's package) driven over the DevTools protocol.

Enough of the protocol to load a page, run JavaScript in it, record every request it
makes and take a screenshot. Chromium's resolver maps every host but 127.0.0.1 to
nothing, so a page that tried to reach the internet fails (and the test that looks
at the requests says so) instead of sending traffic anywhere.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

__all__ = ["Browser", "chromium_or_skip"]


def chromium_or_skip() -> str:
    """Chromium's path; a skip without it, a failure if BAGSERVE_REQUIRE_CHROMIUM=1."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    message = (
        "chromium is not installed (Debian: apt-get install chromium); "
        "BAGSERVE_REQUIRE_CHROMIUM=1 turns this skip into a failure"
    )
    if os.environ.get("BAGSERVE_REQUIRE_CHROMIUM") == "1":
        pytest.fail(message)
    pytest.skip(message)


class Browser:
    """One headless Chromium with one page (use as a context manager)."""

    def __init__(self, executable: str, width: int = 1280, height: int = 1000) -> None:
        self.profile = tempfile.mkdtemp(prefix="bagserve-chromium-")
        self.proc = subprocess.Popen(
            [
                executable,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [
            t
            for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            if t["type"] == "page"
        ]
        self.ws_url = pages[0]["webSocketDebuggerUrl"]
        self.loop = asyncio.new_event_loop()
        self.ids = itertools.count(1)
        self.requests: list[str] = []
        self.failed: list[str] = []
        self.console_errors: list[str] = []
        self.ws = self.loop.run_until_complete(self._connect())
        for method in ("Page.enable", "Network.enable", "Runtime.enable"):
            self.call(method)

    async def _connect(self) -> Any:
        import websockets

        return await websockets.connect(self.ws_url, max_size=None)

    async def _call(self, method: str, params: dict[str, Any], timeout: float) -> Any:
        msg_id = next(self.ids)
        await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            raw = await asyncio.wait_for(self.ws.recv(), max(0.1, deadline - time.monotonic()))
            msg = json.loads(raw)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Network.loadingFailed":
            self.failed.append(f"{params.get('errorText')} ({params.get('requestId')})")
        elif method == "Runtime.exceptionThrown":
            self.console_errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])

    def call(self, method: str, timeout: float = 60, **params: Any) -> Any:
        """One DevTools command; its result."""
        return self.loop.run_until_complete(self._call(method, params, timeout))

    def goto(self, url: str, settle: float = 1.0) -> None:
        """Load ``url`` and wait for its load event, then ``settle`` seconds more."""
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")
        time.sleep(settle)

    def evaluate(self, expression: str, timeout: float = 60) -> Any:
        """The value of a JavaScript expression (a promise is awaited)."""
        result = self.call(
            "Runtime.evaluate",
            timeout=timeout,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout: float = 60) -> None:
        """Poll a JavaScript condition until it holds."""
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"Boolean({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true within {timeout} s: {condition}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> bytes:
        """A PNG of the whole page, written to ``path``."""
        data = base64.b64decode(
            self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        )
        path.write_bytes(data)
        return data

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.ws.close())
        finally:
            self.loop.close()
            self.proc.kill()
            self.proc.wait(timeout=10)
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
