"""The FastAPI app: health and info routes here, the APIs in native_api / openai_api."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from weft.runtime.messages import tokenizer_to_scheduler as to_sched
from weft.runtime.sampling_params import RequestError, SamplingParams
from weft.runtime.server import native_api, openai_api, openapi
from weft.runtime.server.chat import ChatRenderer, check_template_kwargs
from weft.runtime.server.errors import ApiError, decode_body, error_kind
from weft.runtime.server.metrics import CONTENT_TYPE
from weft.runtime.server.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    load_api_keys,
    require_admin,
)
from weft.runtime.server.openai_protocol import RenderChatRequest
from weft.runtime.server.responses import json_response
from weft.runtime.server.tokenizer_manager import TokenizerManager
from weft.runtime.server.tool_calls import check_tools

logger = logging.getLogger("weft")

HEALTH_GENERATE_TIMEOUT_S = 20.0
VERSION = "0.1.0"


def build_app(tm: TokenizerManager, api_keys: Mapping[str, str] | None = None) -> FastAPI:
    """`api_keys`: key -> tenant (None: read from the config; empty: no authentication)."""
    config = tm.config
    chat = ChatRenderer(tm.tokenizer, config.chat_template)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        yield
        await tm.stop()

    app = FastAPI(
        title="weft",
        version=VERSION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )

    def count_error(status: int) -> None:
        # NOTE: a 499 (the client went away) is counted when its aborted request ends
        if tm.metrics is not None and status != 499:
            tm.metrics.error(error_kind(status))

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        count_error(exc.status)
        return json_response(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> Response:
        return await api_error(request, ApiError(exc.message, 400, param=exc.param, code=exc.code))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        count_error(exc.status_code)
        return json_response(ApiError(str(exc.detail), exc.status_code).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("request failed")
        count_error(500)
        error = ApiError(f"internal error: {type(exc).__name__}: {exc}", 500)
        return json_response(error.body(), 500)

    @app.get("/health")
    async def health() -> Response:
        tm.check_healthy()  # draining or stuck: load balancers must stop routing here
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """One token through the whole pipeline (scheduler, detokenizer, back)."""
        tm.check_alive()
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        req = tm.build_request([_probe_token(tm)], params, max_tokens_explicit=False)
        states = tm.submit([req], api="health")
        try:
            await asyncio.wait_for(tm.wait(states), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            tm.abort_unfinished(states)
            raise ApiError("the health check generation did not finish in time", 503) from None
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")  # (sglang-router asks this first)
    async def get_model_info() -> Response:
        return json_response(_model_info(tm, chat))

    @app.get("/get_load")
    async def get_load() -> Response:
        """SGLang's load report, one entry per data-parallel rank (weft: one): what a router's
        load-based policies (power_of_two) read."""
        tm.check_alive()
        info = await tm.query(to_sched.GetServerInfo)
        running, waiting = info["num_running"], info["num_waiting"]
        load = {
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": info["kv_pool"]["in_use"],
        }
        return json_response([load])

    @app.post("/render_chat")
    async def render_chat(request: Request) -> Response:
        req = decode_body(await request.body(), RenderChatRequest)
        tools = check_tools(req.tools) if req.tools else None
        kwargs = check_template_kwargs(req.chat_template_kwargs)
        text = chat.render(req.messages, tools, req.add_generation_prompt, kwargs)
        return json_response({"text": text})

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info(request: Request) -> Response:
        require_admin(request, config, "the server info")
        scheduler = await tm.query(to_sched.GetServerInfo)
        return json_response(
            {
                **config.to_dict(redact=True),
                "version": VERSION,
                "model_info": _model_info(tm, chat),
                "context_length": tm.info.context_length,
                "served_model_name": tm.served_model_name,
                "healthy": tm.healthy,
                **tm.stats(),
                **scheduler,
            }
        )

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        require_admin(request, config, "/flush_cache")
        reply = await tm.query(to_sched.FlushCache)
        if not reply["flushed"]:
            raise ApiError("cache not flushed: requests are running; retry when idle", 400)
        return Response("Cache flushed.\n", 200, media_type="text/plain")

    @app.get("/metrics")
    async def metrics() -> Response:
        if tm.metrics is None:
            raise ApiError("metrics are off: start the server with --enable-metrics", 404)
        # the scheduler's numbers are asked for per scrape; a dead scheduler's are left out
        scheduler = await tm.query(to_sched.GetMetrics) if tm.healthy else None
        return Response(tm.metrics.render(scheduler), 200, media_type=CONTENT_TYPE)

    native_api.register(app, tm)
    openai_api.register(app, tm, chat)
    # NOTE: the last added runs first: the key is checked before any of the body is read
    app.add_middleware(
        BodySizeLimitMiddleware,  # type: ignore[arg-type]
        max_bytes=config.max_request_body_bytes,
        on_error=count_error,
    )
    keys = load_api_keys(config) if api_keys is None else api_keys
    if keys:
        app.add_middleware(
            ApiKeyMiddleware,  # type: ignore[arg-type]
            keys=keys,
            admin_key=config.admin_api_key,
            on_error=count_error,
        )
    openapi.install(app, authenticated=bool(keys), tenants=config.api_keys_file is not None)
    return app


def _model_info(tm: TokenizerManager, chat: ChatRenderer) -> dict[str, Any]:
    source = tm.source
    return {
        "model_path": source.display_path,
        "tokenizer_path": str(source.tokenizer_folder) if source.tokenizer_folder else None,
        "is_generation": True,
        "served_model_name": tm.served_model_name,
        "architecture": tm.info.architecture,
        "context_length": tm.info.context_length,
        "vocab_size": tm.info.vocab_size,
        "dtype": tm.info.dtype,
        "device": tm.info.device,
        "kv_pool_size": tm.info.kv_pool_size,
        "preferred_sampling_params": None,
        "has_chat_template": chat.available,  # POST /render_chat renders it
    }


def _probe_token(tm: TokenizerManager) -> int:
    bos = getattr(tm.tokenizer, "bos_token_id", None)
    return int(bos) if bos is not None else 0
