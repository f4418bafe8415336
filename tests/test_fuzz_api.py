"""Schemathesis against a live stories260K server: requests generated from its /openapi.json,
valid and invalid, each answered with a status the document declares, never a 5xx and never
later than REQUEST_TIMEOUT_S; afterwards the server is healthy and its KV pool intact.

The document allows any output length (the context bounds it, not the schema), so the
`map_body` hook below shortens each generated request before it is sent: at most
MAX_FUZZ_TOKENS new tokens. The request keeps every other generated field; the document stays
what the API accepts. Set WEFT_FUZZ_EXAMPLES for a longer run (the default keeps CI short).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from weft.runtime.server.openapi import OPERATIONS

from server_utils import ServerProcess, stories_args

EXAMPLES = int(os.environ.get("WEFT_FUZZ_EXAMPLES", "25"))  # per operation, valid and invalid
REQUEST_TIMEOUT_S = 20.0  # a grammar may take 3 backends x the 2 s compile timeout
MAX_FUZZ_TOKENS = 4
LENGTH_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens")
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def server(stories_dir):
    srv = ServerProcess(
        *stories_args(stories_dir),
        "--grammar-compile-timeout",
        "2",
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def api(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", timeout=30)
    schema.hook(map_body)
    return schema


def map_body(context: Any, body: Any) -> Any:
    """Cap the output length of a generated request (schemathesis calls this by its name)."""
    if isinstance(body, dict):
        _cap(body)
        if body.get("sampling_params") is None and context.operation.path == "/generate":
            body["sampling_params"] = {}
        params = body.get("sampling_params")
        for item in params if isinstance(params, list) else [params]:
            if isinstance(item, dict):
                _cap(item)
                if item.get("max_new_tokens") is None:  # the default is 128
                    item["max_new_tokens"] = MAX_FUZZ_TOKENS
    return body


def _cap(fields: dict[str, Any]) -> None:
    for name in LENGTH_FIELDS:
        value = fields.get(name)
        if type(value) is int and value > MAX_FUZZ_TOKENS:
            fields[name] = MAX_FUZZ_TOKENS


def _cases(operation: Any) -> st.SearchStrategy[Any]:
    modes = [operation.as_strategy(GenerationMode.POSITIVE)]
    if operation.body or operation.path_parameters:  # something that can be made invalid
        modes.append(operation.as_strategy(GenerationMode.NEGATIVE))
    return st.one_of(modes)


@pytest.mark.parametrize("method,path", sorted(OPERATIONS), ids=lambda x: str(x))
def test_operation_answers_as_documented(api, server, method, path):
    operation = api[path][method.upper()]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_cases(operation))
    def run(case: Any) -> None:
        response = case.call(base_url=server.url, timeout=REQUEST_TIMEOUT_S)
        case.validate_response(response, checks=CHECKS)

    run()


def test_still_serving_after_the_fuzzing(server):
    assert server.get("/health").status_code == 200
    out = server.generate({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4}})
    assert len(out["output_ids"]) == 4
    assert server.output.count("Traceback") == 0, server.output


def test_the_document_describes_the_bodies(server):
    doc = server.get("/openapi.json").json()
    paths = doc["paths"]
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].startswith("#/components/schemas/"), path
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["SamplingParams"]["additionalProperties"] is False
    top_p = schemas["SamplingParams"]["properties"]["top_p"]["anyOf"][0]
    assert top_p == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    for path, methods in paths.items():
        for method, op in methods.items():
            assert (method, path) in OPERATIONS, f"{method} {path} is not described"
            assert "500" not in op["responses"] and "422" not in op["responses"]
    assert set(paths["/generate"]["post"]["responses"]) == {"200", "400", "413", "503", "504"}
    assert "securitySchemes" not in doc["components"]  # no --api-key
