"""The pages, in a real headless Chromium: offline API docs, the console, screenshots.

Every page must load with no request leaving 127.0.0.1 (Chromium resolves no other
host, and the recorded requests are checked). Screenshots go to
``BAGSERVE_SCREENSHOTS`` when set (for release notes), else to a temporary folder;
each is checked to show something (not a blank page).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
from bagserve.core.demo import build_demo_models, demo_samples

from .browser import Browser, chromium_or_skip
from .service_harness import running_service


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("console") / "models"
    build_demo_models(directory)
    return directory


@pytest.fixture(scope="module")
def url(models):
    with running_service(models) as u:
        yield u


@pytest.fixture(scope="module")
def browser():
    with Browser(chromium_or_skip()) as b:
        yield b


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    target = os.environ.get("BAGSERVE_SCREENSHOTS")
    path = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def assert_not_blank(png: bytes) -> None:
    """The screenshot shows content: many distinct colours, not one flat page."""
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    distinct = np.unique(pixels[:: max(1, pixels.shape[0] // 200_000)], axis=0).shape[0]
    assert distinct > 50 and pixels.std() > 10, (distinct, pixels.std())


def assert_local_only(browser: Browser, url: str) -> None:
    outside = [
        u
        for u in browser.requests
        if not (u.startswith(url) or u.startswith(("data:", "blob:", "about:")))
    ]
    assert not outside, f"pages asked for external resources: {outside}"


def csv_of(points: np.ndarray, markers: list[str]) -> str:
    rows = [",".join(markers), *(",".join(f"{v:.17g}" for v in r) for r in points)]
    return "\n".join(rows) + "\n"


def predict_in_page(browser: Browser, text: str, name: str) -> None:
    """What choosing a file and pressing Predict does, with a File made in the page."""
    file = f"new File([{json.dumps(text)}], {json.dumps(name)}, {{type: 'text/csv'}})"
    browser.evaluate(f"window.bagserve.predictFiles([{file}])")


def test_api_docs_render_offline_with_an_authorize_button(url, browser, shots):
    browser.requests.clear()
    browser.goto(f"{url}/docs")
    browser.wait_for("document.querySelector('.swagger-ui .info .title')")
    browser.wait_for("document.querySelector('.swagger-ui .btn.authorize')")
    title = browser.evaluate("document.querySelector('.swagger-ui .info .title').textContent")
    assert title.startswith("bagserve")
    operations = browser.evaluate("document.querySelectorAll('.opblock').length")
    assert operations >= 20
    assert_not_blank(browser.screenshot(shots / "docs.png"))
    browser.goto(f"{url}/redoc")
    browser.wait_for("document.querySelector('.api-content h1')")
    assert browser.evaluate("document.querySelector('.api-content h1').textContent").startswith(
        "bagserve"
    )
    assert_not_blank(browser.screenshot(shots / "redoc.png"))
    assert_local_only(browser, url)
    assert not browser.console_errors, browser.console_errors


def test_the_console_predicts_a_sample_in_a_real_browser(url, browser, shots):
    browser.requests.clear()
    browser.goto(f"{url}/")
    browser.wait_for("document.querySelectorAll('#models li').length >= 2")
    names = browser.evaluate(
        "[...document.querySelectorAll('#models li')].map(l => l.dataset.model)"
    )
    assert names == ["demo-dose", "demo-gating"]
    # The model card of the selected model is shown.
    browser.wait_for("document.querySelector('#card h3')")
    assert "Model card: demo-dose" in browser.evaluate(
        "document.querySelector('#card').textContent"
    )

    # A bag model: the value, its interval and the domain flag, as the API answers.
    bags, _, markers = demo_samples("dose", 1, 9)
    sample = csv_of(np.asarray(bags[0]), markers)
    predict_in_page(browser, sample, "patient-dose.csv")
    browser.wait_for("document.querySelector('#results .value')")
    shown = browser.evaluate("document.querySelector('#results .value').textContent")
    api = httpx.post(
        f"{url}/v1/models/demo-dose/predict",
        params={"interval": "0.9"},
        files=[("files", ("patient-dose.csv", sample.encode(), "text/csv"))],
        timeout=60,
    ).json()["predictions"][0]
    assert float(shown) == pytest.approx(api["prediction"], rel=1e-3)
    text = browser.evaluate("document.querySelector('#results').textContent")
    assert "90 % interval" in text and "within the applicability domain" in text
    assert_not_blank(browser.screenshot(shots / "console-prediction.png"))
    # Why this prediction: the explanation's baseline and markers, and the sample's cells
    # coloured by their contribution (red raises the answer, blue lowers it).
    browser.wait_for("document.querySelector('#results .explanation')")
    browser.wait_for("document.querySelector('#results canvas')")
    why = browser.evaluate("document.querySelector('#results .explanation').textContent")
    assert "Why this prediction" in why and "baseline" in why
    hues = browser.evaluate(
        """(() => { const c = document.querySelector('#results canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let red = 0, blue = 0;
        for (let i = 0; i < d.length; i += 4) {
          if (d[i + 3] === 0) continue;
          if (d[i] > d[i + 2] + 60) red++; else if (d[i + 2] > d[i] + 60) blue++;
        }
        return [red, blue]; })()"""
    )
    assert hues[0] > 0 and hues[1] > 0, hues
    browser.evaluate("document.querySelector('#results .bag').scrollIntoView()")
    assert_not_blank(browser.screenshot(shots / "console-explanation.png"))
    status = browser.evaluate("document.querySelector('#results .status').textContent")
    assert status == api["status"] == "final"
    assert f"file sha256 {api['input_sha256'][:16]}" in text
    # A sample far from the training bags, with a channel the model does not use: the
    # flag is the one warning and the answer is preliminary; the channel is a note.
    far = 40 * np.asarray(bags[0])
    extra = np.hstack([far, np.arange(far.shape[0], dtype=float)[:, None]])
    predict_in_page(browser, csv_of(extra, [*markers, "Time"]), "far.csv")
    browser.wait_for("document.querySelector('#results .status.preliminary')")
    warnings = browser.evaluate(
        "[...document.querySelectorAll('#results .warning')].map(e => e.textContent)"
    )
    notes = browser.evaluate(
        "[...document.querySelectorAll('#results .note')].map(e => e.textContent)"
    )
    assert len(warnings) == 1 and "'far.csv'" in warnings[0] and "preliminary" in warnings[0]
    assert notes == ["bag 'far.csv': channels the model does not use: ['Time']"]
    assert "outside the applicability domain" in browser.evaluate(
        "document.querySelector('#results').textContent"
    )
    assert_not_blank(browser.screenshot(shots / "console-preliminary.png"))

    # A per-cell model: the population summary and the scatter of cells by label.
    browser.evaluate("window.bagserve.selectModel('demo-gating')")
    browser.wait_for("document.querySelector('#model-title').textContent.startsWith('demo-gating')")
    tasks, _, gating_markers = demo_samples("gating", 1, 4)
    cells = csv_of(np.asarray(tasks[0]), gating_markers)
    predict_in_page(browser, cells, "patient-cells.csv")
    browser.wait_for("document.querySelector('#results table')")
    browser.wait_for("document.querySelector('#results canvas')")
    rows = browser.evaluate(
        "[...document.querySelectorAll('#results table tr')].slice(1)"
        ".map(r => [...r.cells].map(c => c.textContent))"
    )
    answer = httpx.post(
        f"{url}/v1/models/demo-gating/predict",
        params={"cells": "false"},
        files=[("files", ("patient-cells.csv", cells.encode(), "text/csv"))],
        timeout=60,
    ).json()["predictions"][0]
    assert [[r[0], int(r[1])] for r in rows] == [
        [str(p["class"]), p["count"]] for p in answer["population"]
    ]
    # The canvas holds drawn cells in more than one colour.
    colours = browser.evaluate(
        """(() => { const c = document.querySelector('#results canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const seen = new Set();
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0) seen.add(d[i] + ',' + d[i + 1]);
        return seen.size; })()"""
    )
    assert colours >= len(answer["population"])
    # The audit trail lists the two predictions, newest first.
    browser.wait_for("document.querySelectorAll('#audit tbody tr').length >= 2")
    first = browser.evaluate("document.querySelector('#audit tbody tr').textContent")
    assert "demo-gating/1" in first and "200" in first
    # Each answer's status and domain flag, bag by bag, not only the HTTP code: the
    # far sample's answer was preliminary, out of the model's domain.
    browser.wait_for("document.querySelectorAll('#audit tbody tr').length >= 3")
    answers = browser.evaluate(
        "[...document.querySelectorAll('#audit tbody tr')].slice(0, 3)"
        ".map(r => r.querySelector('td.answers').textContent)"
    )
    assert answers == ["final", "preliminary out of domain", "final"], answers
    assert_not_blank(browser.screenshot(shots / "console-cells.png"))
    assert_local_only(browser, url)
    assert not browser.console_errors, browser.console_errors


def test_pages_are_open_and_the_api_behind_them_is_not(models, tmp_path):
    key = "k-" + "3" * 30
    with running_service(models, BAGSERVE_API_KEYS=key) as u:
        for page in ("/", "/docs", "/redoc", "/static/console/console.js", "/openapi.json"):
            assert httpx.get(f"{u}{page}").status_code == 200, page
        assert httpx.get(f"{u}/v1/audit").status_code == 401
        doc = httpx.get(f"{u}/openapi.json").json()
        security = doc["paths"]["/v1/models"]["get"]["security"]
        assert {} not in security and {"HTTPBearer": []} in security
        entries = httpx.get(f"{u}/v1/audit", headers={"x-api-key": key}).json()
        assert entries["entries"] == [] and entries["key_id"]
