"""The documentation: the site builds offline with no broken link or reference, the
README's links resolve, and the README's first request answers what the README shows."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
from bagserve.core.demo import build_demo_models
from bagserve.service.settings import Settings

from .service_harness import running_service

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# [text](target) and ![alt](target); autolinks (<http://...>) are not relative links.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def build_site(site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` into ``site``, with every proxy pointing at a closed
    port: a plugin or theme that fetched anything would fail the build."""
    dead = "http://127.0.0.1:9"
    env = {**os.environ, "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "ALL_PROXY": dead}
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_site_builds_offline_with_no_warning(tmp_path):
    result = build_site(tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("*")}
    assert {"index.html", "guide/training.html", "reference/estimators.html"} <= pages
    # The API reference was generated from the docstrings, not left as ::: blocks.
    estimators = (tmp_path / "site" / "reference" / "estimators.html").read_text()
    assert "DistributionRidge" in estimators and ":::" not in estimators
    assert "Kernel ridge regression from bags" in estimators
    # Nothing the pages load comes from elsewhere (the site reads offline).
    remote = re.compile(r"<(?:script|link|img)\b[^>]*(?:src|href)=\"(https?:[^\"]+)")
    for page in (tmp_path / "site").rglob("*.html"):
        assert not remote.findall(page.read_text()), page


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", text, re.M)}


def broken_links(markdown: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", markdown.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (markdown.parent / path).resolve() if path else markdown
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


def test_readme_links_resolve():
    links = LINK.findall(README.read_text())
    assert any(t.startswith("docs/guide/") for t in links)
    assert not broken_links(README)


def test_readme_link_check_can_fail(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("[gone](docs/guide/gone.md) [anchor](README.md#no-such-heading)\n")
    assert len(broken_links(readme)) == 2


def test_readme_first_screen():
    """A newcomer's first screen: the screenshot, the two commands and a first request."""
    screen = "\n".join(README.read_text().splitlines()[:40])
    assert "](docs/screenshots/" in screen
    assert "make serve" in screen and "make test" in screen
    assert "curl " in screen


def readme_first_request() -> httpx.Request:
    """The first curl of the README, as the request it sends."""
    block = next(b for b in FENCE.findall(README.read_text()) if "curl " in b)
    command = block.split("\n", 1)[1].rsplit("```", 1)[0].replace("\\\n", " ").strip()
    words = shlex.split(command.splitlines()[0])
    assert words[0] == "curl"
    headers, body, url = {}, None, None
    rest = iter(words[1:])
    for word in rest:
        if word == "-s":
            continue
        if word == "-H":
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word in ("--data", "--data-binary"):
            body = (ROOT / next(rest).removeprefix("@")).read_bytes()
        elif not word.startswith("-"):
            url = word
        else:
            raise AssertionError(f"the test does not know curl's {word}")
    return httpx.Request("POST" if body else "GET", url, headers=headers, content=body)


def test_readme_first_request_answers_as_shown(tmp_path):
    """The first curl against `make serve`'s demo models: the fields the README and
    the getting-started page show, with their values."""
    request = readme_first_request()
    assert request.url.host == "127.0.0.1" and request.url.port == 8000
    build_demo_models(tmp_path / "models")
    with running_service(tmp_path / "models") as base:
        url = request.url.copy_with(port=httpx.URL(base).port)
        answer = httpx.request(
            request.method, url, headers=request.headers, content=request.content, timeout=60
        ).json()
    (bag,) = answer["predictions"]
    shown = README.read_text()
    assert f'"status": "{bag["status"]}"' in shown
    number = re.search(r'"prediction": ([-\d.]+)', shown).group(1)
    assert round(bag["prediction"], len(number.split(".")[1])) == float(number)
    # The demo is seeded as a whole: the interval is the README's, to its two decimals.
    shown_interval = re.search(r'"interval": \[([-\d.]+), ([-\d.]+)\]', shown).groups()
    assert [round(v, 2) for v in bag["interval"]] == [float(v) for v in shown_interval]
    assert f'"nearest": {json.dumps(bag["domain"]["nearest"])}' in shown
    assert f'"out_of_range": {json.dumps(bag["domain"]["out_of_range"])}' in shown
    # The getting-started page shows the whole answer: the same fields, no more, no less.
    page = (ROOT / "docs" / "getting-started.md").read_text()
    full = json.loads(next(b for b in FENCE.findall(page) if b.startswith("```json\n{\n"))[7:-3])
    assert full.keys() == answer.keys()
    assert full["predictions"][0].keys() == bag.keys()
    assert full["predictions"][0]["domain"].keys() == bag["domain"].keys()


def test_every_setting_is_documented():
    page = (ROOT / "docs" / "guide" / "settings.md").read_text()
    missing = [
        f"BAGSERVE_{n.upper()}"
        for n in Settings.model_fields
        if f"`BAGSERVE_{n.upper()}`" not in page
    ]
    assert not missing, f"add a row to docs/guide/settings.md for {missing}"
