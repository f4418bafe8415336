"""The OpenAPI document at /openapi.json: FastAPI's paths, with the bodies and status codes the
handlers really take and give.

The handlers decode their JSON bodies themselves (msgspec), so FastAPI knows nothing of them.
The body schemas here come from the same msgspec structs (`msgspec.json.schema_components`);
the fields those structs type as Any (a scalar or a per-prompt list, checked by hand) are spelled
out below, and the value ranges and SGLang's extra keys come from the table `SamplingParams`
validates with (`weft.runtime.sampling_params`). A schema-valid body can
still be a 400 (a prompt longer than the context, a grammar that does not compile): every
operation that takes a body declares it.

With an API key set the document is behind the key like the API it describes (only the probes
and /metrics are open), and it declares the bearer scheme and the 401; with tenants
(--api-keys-file), the routes that reach every tenant declare the 403 a tenant's key gets.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from weft.runtime.sampling_params import (
    ALIASES,
    CONSTRAINT_FIELDS,
    MAX_TOP_LOGPROBS_NUM,
    RANGES,
    SGLANG_EXTRAS,
    THINKING_BUDGET,
    SamplingParams,
)
from weft.runtime.server.chat import RESERVED_KWARGS
from weft.runtime.server.native_api import UNSUPPORTED_FIELDS, GenerateReqInput
from weft.runtime.server.openai_api import MAX_TOP_LOGPROBS, RESPONSE_FORMATS
from weft.runtime.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RenderChatRequest,
)

_REF = "#/components/schemas/{name}"
NULL = {"type": "null"}
STRING = {"type": "string"}
TEXT = {"type": "string", "minLength": 1}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
OBJECT = {"type": "object"}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

# What SamplingParams.validate accepts, by field name (its own, OpenAI's and SGLang's spellings),
# and the ranges of the request-level logprob fields the intake checks.
_RANGES: dict[str, dict[str, Any]] = {
    **{name: bounds.schema() for name, bounds in RANGES.items()},
    **{alias: RANGES[name].schema() for alias, name in ALIASES.items()},
    "thinking_budget": THINKING_BUDGET.schema(),
    "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "top_logprobs_num": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS_NUM},
    "logprob_start_len": {"minimum": -1},
}
# SGLang's sampling_params keys that are not SamplingParams fields: accepted only with the
# values listed (anything else is a 400 "not supported"), or accepted and without effect.
_SGLANG_EXTRAS = {name: extra.schema for name, extra in SGLANG_EXTRAS.items()}
_JSON_CONSTRAINTS = ("json_schema", "structural_tag")
# extra chat template variables; the names apply_chat_template takes itself are a 400
_TEMPLATE_KWARGS = {
    "type": "object",
    "propertyNames": {"not": {"enum": sorted(RESERVED_KWARGS)}},
    "description": 'extra chat template variables, e.g. {"enable_thinking": false}',
}
_NOT_SUPPORTED_YET: dict[str, Any] = {
    "enum": [None, False, [], {}],
    "description": "not supported yet",
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(name=name)}


def _object(properties: dict[str, Any], required: Sequence[str] | None = None) -> dict[str, Any]:
    """An object schema; `required` defaults to every property."""
    schema = {"type": "object", "properties": properties}
    names = list(properties) if required is None else list(required)
    return {**schema, "required": names} if names else schema


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or null (a null field means its default)."""
    if not schema or schema == NULL:
        return schema
    branches = schema["anyOf"] if list(schema) == ["anyOf"] else [schema]
    return schema if NULL in branches else {"anyOf": [*branches, NULL]}


def _one_or_list(schema: dict[str, Any]) -> dict[str, Any]:
    """A value for every prompt, or a list with one per prompt of a batch."""
    return _nullable({"anyOf": [schema, _list_of(schema)]})


def _with_range(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The field's schema with its range on the numeric branch."""
    bounds = _RANGES.get(name)
    if bounds is None:
        return schema
    if schema.get("type") in ("integer", "number"):
        return {**schema, **bounds}
    if "anyOf" in schema:
        return {**schema, "anyOf": [_with_range(name, branch) for branch in schema["anyOf"]]}
    return schema


def _request_schemas() -> dict[str, Any]:
    structs = [
        GenerateReqInput,
        CompletionRequest,
        ChatCompletionRequest,
        RenderChatRequest,
        SamplingParams,
    ]
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    del components["GrammarSpec"]  # SamplingParams.grammar: parsed by validate, not sent
    del components["SamplingParams"]["properties"]["grammar"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "GenerateReqInput"):
        props = components[name]["properties"]
        for field, schema in props.items():
            props[field] = _with_range(field, schema)
    _sampling_params(components["SamplingParams"])
    _generate_body(components["GenerateReqInput"])
    openai_prompt = [TEXT, _list_of(TEXT), TOKEN_IDS, _list_of(TOKEN_IDS)]
    completion = components["CompletionRequest"]
    completion["properties"]["prompt"] = {"anyOf": openai_prompt}
    completion["properties"]["suffix"] = _nullable({"type": "string", "maxLength": 0})
    completion["required"] = ["prompt"]
    chat = components["ChatCompletionRequest"]["properties"]
    chat["response_format"] = _nullable(_ref("ResponseFormat"))
    chat["tools"] = _nullable({"type": "array", "items": _ref("Tool")})
    chat["tool_choice"] = _nullable({"anyOf": [STRING, OBJECT]})
    for props in (chat, components["RenderChatRequest"]["properties"]):
        props["chat_template_kwargs"] = _nullable(_TEMPLATE_KWARGS)
    for props in (completion["properties"], chat):
        props["logit_bias"] = _nullable({"type": "object", "maxProperties": 0})
    json_schema = {
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
        "schema": OBJECT,
        "strict": _nullable(BOOL),
    }
    components["ResponseFormat"] = _object(
        {
            "type": {"enum": list(RESPONSE_FORMATS)},
            "json_schema": _object(json_schema, ["name", "schema"]),
        },
        ["type"],
    )
    function = {"name": STRING, "description": STRING, "parameters": OBJECT}
    components["Tool"] = _object(
        {"type": {"const": "function"}, "function": _object(function, ["name"])}
    )
    components["AbortRequest"] = _object({"rid": TEXT, "abort_all": BOOL}, [])
    return components


def _sampling_params(schema: dict[str, Any]) -> None:
    """SGLang's `sampling_params`: SamplingParams' fields, null meaning the default."""
    props = schema["properties"]
    props["stop"] = {"anyOf": [STRING, props["stop"]]}
    for name in CONSTRAINT_FIELDS:  # json_schema and structural_tag: JSON text or the JSON
        props[name] = {"anyOf": [STRING, OBJECT]} if name in _JSON_CONSTRAINTS else STRING
    props.update(_SGLANG_EXTRAS)
    for name, field in list(props.items()):
        field = {key: value for key, value in field.items() if key != "default"}
        props[name] = _nullable(_with_range(name, field))
    schema["additionalProperties"] = False  # an unknown key is a 400 naming it


def _generate_body(schema: dict[str, Any]) -> None:
    props = schema["properties"]
    for field in props.values():
        field.pop("default", None)  # null, and every field is nullable
    props["text"] = _nullable({"anyOf": [TEXT, _list_of(TEXT)]})
    props["input_ids"] = _nullable({"anyOf": [TOKEN_IDS, _list_of(TOKEN_IDS)]})
    props["sampling_params"] = _one_or_list(_ref("SamplingParams"))
    props["rid"] = _one_or_list(TEXT)
    props["return_logprob"] = _one_or_list(BOOL)
    props["logprob_start_len"] = _one_or_list(_with_range("logprob_start_len", INT))
    props["top_logprobs_num"] = _one_or_list(_with_range("top_logprobs_num", INT))
    props["cache_salt"] = _nullable(TEXT)
    for name in UNSUPPORTED_FIELDS:
        props[name] = _NOT_SUPPORTED_YET
    # exactly one of the two prompts (a 400 otherwise)
    schema["anyOf"] = [{"required": ["text"]}, {"required": ["input_ids"]}]


def _list_of(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": 1}


# ---- responses ------------------------------------------------------------------------------

_ERROR_BODY = _object(
    {"message": STRING, "type": STRING, "param": _nullable(STRING), "code": _nullable(STRING)}
)
ERROR = _object({"error": _ERROR_BODY})
_USAGE = _object({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT})
RESPONSE_SCHEMAS: dict[str, Any] = {
    "Error": ERROR,
    "GenerateOutput": _object(
        {
            "text": STRING,
            "reasoning_text": STRING,  # separate_reasoning: the thinking (text: the answer)
            "output_ids": {"type": "array", "items": INT},
            "meta_info": OBJECT,
        },
        ["text", "output_ids", "meta_info"],
    ),
    "Completion": _object(
        {
            "id": STRING,
            "object": {"enum": ["text_completion", "chat.completion"]},
            "created": INT,
            "model": STRING,
            "choices": {"type": "array", "items": OBJECT},
            "usage": _USAGE,
        }
    ),
    "Model": _object(
        {"id": STRING, "object": {"const": "model"}, "owned_by": STRING}, ["id", "object"]
    ),
    "ModelList": _object(
        {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}
    ),
}


# One event of a stream: a JSON chunk (an error object ends a failed stream), then "[DONE]".
_SSE_EVENT = _object({"data": STRING})


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": STRING}}}


def _error(description: str) -> dict[str, Any]:
    return _json(description, _ref("Error"))


def _json_or_stream(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    content = {
        "application/json": {"schema": schema},
        "text/event-stream": {"schema": _SSE_EVENT},  # "stream": true
    }
    return {"description": description, "content": content}


_INVALID = _error("invalid request: the error's `param` names the field")
_UNAVAILABLE = _error("the server cannot serve: a child process died, or it is stopping")
_NO_MODEL = _error("no such model (the `model` field)")
_TOO_LARGE = _error("the body is larger than --max-request-body-bytes")
_TIMED_OUT = _error("the request did not finish within --request-timeout")
_EMPTY_OK = {"description": "serving"}


@dataclasses.dataclass(frozen=True)
class Operation:
    body: str | None  # component name of the JSON body
    responses: dict[str, dict[str, Any]]
    body_required: bool = True
    open: bool = False  # served without the API key (probes, scrapers)
    admin: bool = False  # reaches every tenant: with tenants, the admin key only


_GENERATE = _json_or_stream(
    "one output, or a list for a batch or n > 1; a stream of SSE events with stream=true",
    {"anyOf": [_ref("GenerateOutput"), {"type": "array", "items": _ref("GenerateOutput")}]},
)
_COMPLETION = _json_or_stream("the completion; SSE chunks with stream=true", _ref("Completion"))

_FLUSH_CACHE = Operation(
    None,
    {"200": _text("flushed"), "400": _error("requests are running"), "503": _UNAVAILABLE},
    admin=True,
)

_GENERATION_ERRORS = {
    "400": _INVALID,
    "413": _TOO_LARGE,
    "503": _UNAVAILABLE,
    "504": _TIMED_OUT,
}
_SERVER_INFO = Operation(
    None, {"200": _json("config and state", OBJECT), "503": _UNAVAILABLE}, admin=True
)

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("get", "/health"): Operation(None, {"200": _EMPTY_OK, "503": _UNAVAILABLE}, open=True),
    ("get", "/health_generate"): Operation(
        None,
        {"200": _EMPTY_OK, "503": _error("no token came through the pipeline in time")},
        open=True,
    ),
    ("get", "/get_model_info"): Operation(None, {"200": _json("the model", OBJECT)}),
    ("get", "/model_info"): Operation(None, {"200": _json("the model", OBJECT)}),
    ("get", "/get_load"): Operation(
        None,
        {
            "200": _json(
                "the load, one entry per data-parallel rank (weft: one); what sglang-router's "
                "load-based policies read",
                {
                    "type": "array",
                    "items": _object(
                        {
                            "dp_rank": INT,
                            "num_reqs": INT,
                            "num_waiting_reqs": INT,
                            "num_tokens": INT,
                        }
                    ),
                },
            ),
            "503": _UNAVAILABLE,
        },
    ),
    ("get", "/get_server_info"): _SERVER_INFO,
    ("get", "/server_info"): _SERVER_INFO,
    ("get", "/flush_cache"): _FLUSH_CACHE,
    ("post", "/flush_cache"): _FLUSH_CACHE,
    ("get", "/metrics"): Operation(
        None,
        {
            "200": _text("Prometheus text format"),
            "404": _error("metrics are off"),
            "503": _UNAVAILABLE,
        },
        open=True,
    ),
    ("post", "/render_chat"): Operation(
        "RenderChatRequest",
        {
            "200": _json(
                "the prompt the chat template makes of the messages",
                _object({"text": STRING}),
            ),
            "400": _INVALID,
            "413": _TOO_LARGE,
        },
    ),
    ("post", "/generate"): Operation("GenerateReqInput", {"200": _GENERATE, **_GENERATION_ERRORS}),
    ("post", "/abort_request"): Operation(
        "AbortRequest",
        {
            "200": _json(
                "aborted (with tenants: a tenant's own requests; the admin key: anyone's)",
                _object({"success": BOOL}, []),
            ),
            "400": _INVALID,
            "404": _error("no running request has this rid"),
            "413": _TOO_LARGE,
        },
        body_required=False,
    ),
    ("get", "/v1/models"): Operation(None, {"200": _json("the served model", _ref("ModelList"))}),
    ("get", "/v1/models/{model}"): Operation(
        None, {"200": _json("the model", _ref("Model")), "404": _NO_MODEL}
    ),
    ("post", "/v1/completions"): Operation(
        "CompletionRequest", {"200": _COMPLETION, "404": _NO_MODEL, **_GENERATION_ERRORS}
    ),
    ("post", "/v1/chat/completions"): Operation(
        "ChatCompletionRequest", {"200": _COMPLETION, "404": _NO_MODEL, **_GENERATION_ERRORS}
    ),
}


def document(app: FastAPI, authenticated: bool, tenants: bool = False) -> dict[str, Any]:
    """FastAPI's document of the app's routes, with OPERATIONS' bodies and responses."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(_request_schemas())
    schemas.update(RESPONSE_SCHEMAS)
    if authenticated:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            described = OPERATIONS.get((method, path))
            if described is None:
                continue
            op["responses"] = copy.deepcopy(described.responses)
            if described.body is not None:
                op["requestBody"] = {
                    "required": described.body_required,
                    "content": {"application/json": {"schema": _ref(described.body)}},
                }
            if authenticated and not described.open:
                op["security"] = [{"apiKey": []}]
                op["responses"]["401"] = _error("invalid or missing API key")
            if tenants and described.admin:
                op["responses"]["403"] = _error("a tenant's key: this route takes the admin key")
    return doc


def install(app: FastAPI, authenticated: bool, tenants: bool = False) -> None:
    """Serve `document` at the app's openapi_url (built once, on the first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, authenticated, tenants)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
