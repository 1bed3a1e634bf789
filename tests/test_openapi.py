"""The OpenAPI file matches the app, and a bounded schemathesis run finds no 5xx."""

from __future__ import annotations

import json
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from bagserve.cli import openapi_document

from .service_harness import build_models, running_service

OPENAPI = Path(__file__).resolve().parents[1] / "openapi" / "openapi.json"


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


def test_bounded_schemathesis_run_finds_no_server_errors(tmp_path):
    # Hypothesis-generated requests for every operation of the committed schema (valid
    # and invalid bodies, paths, headers), against the live app: never a 5xx.
    models = build_models(tmp_path / "models")
    schema = schemathesis.openapi.from_path(OPENAPI)
    with running_service(models, BAGSERVE_WORKERS="1") as url:
        for result in schema.get_all_operations():
            operation = result.ok()
            # Random model names (mostly 404s), then the real model so bodies reach
            # decoding, validation and the workers.
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
                    max_examples=15,
                    deadline=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                    database=None,
                )
                @given(case=operation.as_strategy(generation_mode=mode, path_parameters=params))
                def run(case):
                    case.call_and_validate(base_url=url, checks=[not_a_server_error])

                try:
                    run()
                except Unsatisfiable:
                    # Nothing in this operation can be made invalid (e.g. GET /healthz).
                    assert mode is GenerationMode.NEGATIVE, operation.label
