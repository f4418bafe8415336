"""`weft.Engine`: the scheduler and model in-process, driven by one background thread.

Callers submit requests from any thread (or an asyncio loop); the engine thread runs scheduler
steps while there is work and hands results back (threading events for `generate`, the caller's
event loop for `async_generate`). This module loads the model and reads the caller's arguments
into requests (through `weft.runtime.intake`, as the server does); `engine_thread` runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, TypeAlias, TypedDict, Unpack

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.engine_thread import EngineThread, failure
from weft.runtime.intake import Bounds, Intake, per_prompt
from weft.runtime.loaders.source import resolve_source
from weft.runtime.messages import tokenizer_to_scheduler as to_sched
from weft.runtime.messages.tokenizer_to_scheduler import GenerateRequest
from weft.runtime.sampling_params import RequestError, SamplingParams
from weft.runtime.scheduler import build_scheduler

logger = logging.getLogger("weft")

SamplingArg: TypeAlias = SamplingParams | dict[str, Any] | None


class RequestArgs(TypedDict, total=False):
    """`Engine.generate`'s keywords past the prompt and sampling_params (SGLang's names)."""

    input_ids: list[int] | list[list[int]] | None  # the prompt as token ids, instead of `prompt`
    return_logprob: bool
    logprob_start_len: int  # with return_logprob: the first prompt position scored; -1: none
    top_logprobs_num: int  # alternatives per position
    rid: str | list[str] | None  # the request's id (one per prompt of a batch)
    namespace: str  # prefix-cache namespace: no cache hit across namespaces
    # the output begins in the thinking, which ends with these tokens (the model's reasoning
    # end marker, e.g. Qwen3's </think> id): a constraint holds the answer after them, and
    # sampling_params thinking_budget bounds the thinking (weft.runtime.thinking)
    reasoning_end_ids: list[int] | None
    # with reasoning_end_ids: the output begins before the thinking and opens it by writing
    # these tokens first (a start marker); any other first token begins the answer
    reasoning_start_ids: list[int] | None


class Engine(EngineThread):
    """The model served in-process: `weft.Engine(model_path=None, **options)`.

    model_path: an HF model folder or a .gguf file; None is the embedded default model. Every
    option is a field of `weft.runtime.config.EngineConfig` (the same as `weft serve`'s flags,
    underscores for dashes); the list is below. Use it directly (`generate`, `async_generate`,
    `generate_stream`, with SGLang's sampling parameters) or as a program backend
    (`prog.run(backend=engine)`); `shutdown()` when done.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model_path=model_path, **kwargs)
        _setup_logging(self.config.log_level)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        started = time.perf_counter()
        self.source = resolve_source(self.config)
        self.scheduler = build_scheduler(self.config, self.source)
        self.tokenizer, self.end_ids = self.scheduler.tokenizer, self.scheduler.end_ids
        self.runner = self.scheduler.runner
        self.model_config = self.runner.model_config
        bounds = Bounds(
            vocab_size=self.model_config.vocab_size,
            context_length=self.scheduler.max_seq_len,
            max_prompt_tokens=self.config.max_prompt_tokens,
            limits=self.config.request_limits,
        )
        self.intake = Intake(self.tokenizer, bounds)
        self._start_thread()
        logger.info("engine ready in %.1f s", time.perf_counter() - started)

    # ---- public API ---------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.scheduler.max_seq_len

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: SamplingArg | list[SamplingArg] = None,
        **request: Unpack[RequestArgs],
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generation. A single prompt gives a dict (a list of n dicts if n > 1); a
        batch gives a flat list in order, n entries per prompt.

        Not from the engine's own thread (inside a function given to `call`): that thread runs
        the steps this would wait for, so it raises RuntimeError at once."""
        self._check_not_stepping("generate")
        reqs, single = self._build(prompt, sampling_params, request)
        pendings = self._submit(reqs)
        if threading.current_thread() is threading.main_thread():
            self._drive(pendings)
        for p in pendings:
            p.done.wait()
        outputs = [self._collect(p) for p in pendings]
        if single:
            return outputs[0][0] if len(outputs[0]) == 1 else outputs[0]
        return [o for group in outputs for o in group]

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingArg = None,
        **request: Unpack[RequestArgs],
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Awaitable generation of one prompt (a list of n dicts if n > 1). Like `generate`, not
        from a loop on the engine's own thread."""
        self._check_not_stepping("async_generate")
        stream = self.generate_stream(prompt, sampling_params, final_only=True, **request)
        outputs = [o async for o in stream]
        outputs.sort(key=lambda o: o["meta_info"]["index"])
        return outputs[0] if len(outputs) == 1 else outputs

    async def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingArg = None,
        *,
        final_only: bool = False,
        **request: Unpack[RequestArgs],
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields chunks {text (cumulative), output_ids, meta_info, index}; the last chunk of each
        sample has meta_info.finish_reason set. Cancelling the iterator aborts the request.
        Like `generate`, not from a loop on the engine's own thread."""
        self._check_not_stepping("generate_stream")
        reqs, _ = self._build(prompt, sampling_params, request)
        if len(reqs) != 1:
            raise ValueError("generate_stream takes one prompt")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def on_update(chunk: dict[str, Any] | None) -> None:
            # NOTE: raises RuntimeError once the caller's loop is closed; _dispatch then aborts.
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        [pending] = self._submit(reqs, on_update, final_only)
        try:
            while True:
                chunk = await queue.get()
                if chunk is None:  # all samples finished, or the request/engine failed
                    if pending.error is not None:
                        raise failure(pending.error)
                    return
                yield chunk
        finally:
            if not pending.finished and pending.error is None:
                with contextlib.suppress(RuntimeError):  # the engine may be gone already
                    self.abort(reqs[0].rid)

    def abort(self, rid: str) -> None:
        self._post(to_sched.Abort([rid]))

    def check_integrity(self) -> None:
        """Audit free + cached + in-use == total (runs on the engine thread)."""
        self.call(self.scheduler.check_integrity)

    def memory_stats(self) -> dict[str, int]:
        return self.call(self.scheduler.memory_stats)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running."""
        return bool(self.call(self.scheduler.flush_cache))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- building requests ------------------------------------------------------------------

    def _build(
        self,
        prompt: str | list[str] | None,
        sampling_params: SamplingArg | list[SamplingArg],
        request: RequestArgs,
    ) -> tuple[list[GenerateRequest], bool]:
        """The requests of a call (one per prompt) through the intake the server uses too, and
        whether the call gave a single prompt."""
        intake = self.intake
        ids_list, single = intake.prompts(prompt, request.get("input_ids"), text_param="prompt")
        count = len(ids_list)
        params_list = per_prompt(sampling_params, count, single, "sampling_params", list_of=dict)
        rids = per_prompt(request.get("rid"), count, single, "rid", list_of=str, broadcast=False)
        start = request.get("logprob_start_len", -1) if request.get("return_logprob") else None
        reqs = []
        for ids, params, rid in zip(ids_list, params_list, rids, strict=True):
            if isinstance(params, SamplingParams):
                sp, explicit = params, False
            else:
                sp = SamplingParams.from_dict(params)
                explicit = (params or {}).get("max_new_tokens") is not None
            cap = intake.bounds.limits.max_new_tokens
            if not explicit and cap is not None and sp.max_new_tokens > cap:
                sp = dataclasses.replace(sp, max_new_tokens=cap)  # as the server: not refused
            sp.validate(intake.bounds.vocab_size, intake.bounds.limits)
            end_ids = request.get("reasoning_end_ids")
            if end_ids is not None:
                end_ids = intake.check_ids(end_ids, "reasoning_end_ids")
            start_ids = request.get("reasoning_start_ids")
            if start_ids is not None:
                if not end_ids:
                    raise RequestError(
                        "reasoning_start_ids needs reasoning_end_ids", "reasoning_start_ids"
                    )
                start_ids = intake.check_ids(start_ids, "reasoning_start_ids")
            if sp.thinking_budget is not None and not end_ids:
                raise RequestError(
                    "thinking_budget needs reasoning_end_ids (the output's thinking)",
                    "thinking_budget",
                )
            reqs.append(
                intake.build(
                    ids,
                    sp,
                    max_tokens_explicit=explicit,
                    logprob_start_len=start,
                    top_logprobs_num=request.get("top_logprobs_num", 0),
                    rid=rid,
                    namespace=request.get("namespace", ""),
                    prompt_param="input_ids" if prompt is None else "prompt",
                    reasoning_end_ids=end_ids,
                    reasoning_start_ids=start_ids,
                )
            )
        return reqs, single


def _options_doc() -> str:
    """One line per Engine option, from EngineConfig's own help texts."""
    lines = [
        f"        {f.name} ({f.default!r}): {f.metadata['help']}"
        for f in dataclasses.fields(EngineConfig)
        if f.name != "model_path"
    ]
    return "\n    Options (default):\n" + "\n".join(lines) + "\n"


Engine.__doc__ = (Engine.__doc__ or "") + _options_doc()


def _setup_logging(level: str) -> None:
    log = logging.getLogger("weft")
    log.setLevel(level.upper())
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[weft %(asctime)s] %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
