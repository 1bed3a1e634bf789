"""The OpenAPI file matches the app, its examples work, and a bounded schemathesis run
against the live server finds nothing the document does not say.

The run's checks: no 5xx; every status sent is documented for its operation; every
response body conforms to the documented schema; every content type sent is
documented. Counts of the requests and statuses are printed (``pytest -s``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from bagserve.cli.serve import openapi_document

from .service_harness import build_models, running_service

OPENAPI = Path(__file__).resolve().parents[1] / "openapi" / "openapi.json"
#: A repository load answers 202 after half a second; these wait for it to be done.
WAIT = {"Prefer": "wait=60"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    response_schema_conformance,
    content_type_conformance,
]


def test_openapi_file_is_generated_from_the_app():
    committed = json.loads(OPENAPI.read_text())
    assert committed == json.loads(json.dumps(openapi_document())), (
        "openapi/openapi.json is stale: regenerate it with "
        "`.venv/bin/bagserve openapi --output openapi/openapi.json`"
    )
    predict = committed["paths"]["/v1/models/{name}/predict"]["post"]
    content = predict["requestBody"]["content"]
    assert {"application/json", "text/csv", "application/x-npy", "multipart/form-data"} <= set(
        content
    )
    assert content["application/json"]["example"]["bags"][0]["points"]
    # Every operation that reads a body or names a model says what it answers when
    # they are wrong; every operation but the three static ones, while starting.
    for path, operations in committed["paths"].items():
        for method, op in operations.items():
            codes = set(op["responses"])
            if "requestBody" in op:
                assert {"400", "413", "415", "422", "503"} <= codes, (method, path)
            if "{name}" in path:
                assert "404" in codes, (method, path)
            if path not in ("/healthz", "/v2", "/v2/health/live"):
                assert "503" in codes, (method, path)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    models = build_models(tmp_path_factory.mktemp("openapi") / "models")
    with running_service(models, BAGSERVE_WORKERS="1") as url:
        yield url


def _load_demo_dose(live: str) -> None:
    """Serve demo-dose again (the unload examples unload it), once the load is done."""
    r = httpx.post(f"{live}/v2/repository/models/demo-dose/load", headers=WAIT, timeout=90)
    assert r.status_code == 200, r.text


def _example_value(parameter: dict):
    if "example" in parameter:
        return parameter["example"]
    examples = parameter.get("examples") or parameter.get("schema", {}).get("examples")
    if isinstance(examples, dict):
        return next(iter(examples.values()))["value"]
    return examples[0] if examples else None


def test_bounded_schemathesis_run_finds_nothing_undocumented(live):
    # Hypothesis-generated requests for every operation of the committed schema (valid
    # and invalid bodies, paths, headers), against the live app. Random model names
    # (mostly 404s), then the real model so bodies reach the workers.
    schema = schemathesis.openapi.from_path(OPENAPI)
    statuses: Counter[int] = Counter()
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        fixed = [None]
        if "{name}" in operation.path:
            fixed.append(
                {"name": "demo-dose", "version": "1"}
                if "{version}" in operation.path
                else {"name": "demo-dose"}
            )
        for mode, params in [
            (m, p) for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) for p in fixed
        ]:

            @settings(
                max_examples=12,
                deadline=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            @given(case=operation.as_strategy(generation_mode=mode, path_parameters=params))
            def run(case):
                response = case.call_and_validate(base_url=live, checks=CHECKS)
                statuses[response.status_code] += 1

            try:
                run()
            except Unsatisfiable:
                # Nothing in this operation can be made invalid (e.g. GET /healthz).
                assert mode is GenerationMode.NEGATIVE, operation.label
        if operation.path.endswith("/unload"):  # its examples unload the demo model
            _load_demo_dose(live)
    print(
        f"\nschemathesis: {operations} operations, {sum(statuses.values())} requests, "
        f"statuses {dict(sorted(statuses.items()))}"
    )
    documented = json.loads(OPENAPI.read_text())["paths"]
    assert operations == sum(len(ops) for ops in documented.values())
    assert not any(code >= 500 for code in statuses)


def test_the_documents_own_examples_are_accepted(live):
    """Every operation with an example for each of its required parameters, sent with
    its examples only, is answered 2xx, with an answer that conforms to the document."""
    schema = schemathesis.openapi.from_path(OPENAPI)
    raw = json.loads(OPENAPI.read_text())
    tried = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        spec = raw["paths"][operation.path][operation.method.lower()]
        values: dict[str, dict] = {"path": {}, "query": {}, "header": {}}
        complete = True
        for parameter in spec.get("parameters", []):
            value = _example_value(parameter)
            if value is None:
                complete &= not parameter.get("required", False)
            elif parameter["in"] in values:
                values[parameter["in"]][parameter["name"]] = value
        body = media = None
        for media_type, content in (spec.get("requestBody") or {}).get("content", {}).items():
            if "example" in content:
                body, media = content["example"], media_type
                break
        if not complete or (spec.get("requestBody", {}).get("required") and media is None):
            continue
        case = operation.Case(
            path_parameters=values["path"] or None,
            query=values["query"] or None,
            headers=values["header"] or None,
            body=body if media is not None else schemathesis.core.NOT_SET,
            media_type=media,
        )
        response = case.call_and_validate(base_url=live, checks=CHECKS)
        assert response.status_code < 300, (operation.label, response.text[:300])
        tried += 1
        if operation.path.endswith("/unload"):  # serve it again for the next examples
            _load_demo_dose(live)
    assert tried >= 25
