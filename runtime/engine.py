"""`weft.Engine`: the scheduler and model in-process, driven by one background thread.

Callers submit requests from any thread (or an asyncio loop); the engine thread runs scheduler
steps while there is work and hands results back (threading events for `generate`, the caller's
event loop for `async_generate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.core import LogprobRequest, Req, check_rid
from weft.runtime.loaders.source import resolve_source
from weft.runtime.results import request_output
from weft.runtime.sampling_params import (
    MAX_TOP_LOGPROBS_NUM,
    SamplingParams,
    output_room_error,
)
from weft.runtime.scheduler import build_scheduler
from weft.runtime.tokenizer import encode_prompt

logger = logging.getLogger("weft")

SamplingArg: TypeAlias = SamplingParams | dict[str, Any] | None


@dataclass
class _Pending:
    """A request as the caller sees it: one prompt, n samples."""

    n: int
    reqs: list[Req] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    # streaming: gets each chunk (built on the engine thread), then None at the end
    on_update: Callable[[dict[str, Any] | None], None] | None = None
    final_only: bool = False  # only the last chunk of each sample (async_generate)

    @property
    def finished(self) -> bool:
        return len(self.reqs) == self.n and all(r.finished for r in self.reqs)


class Engine:
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
        source = resolve_source(self.config)
        self.scheduler = build_scheduler(self.config, source)
        self.tokenizer, self.end_ids = self.scheduler.tokenizer, self.scheduler.end_ids
        self.runner = self.scheduler.runner
        self.model_config = self.runner.model_config
        self.source = source
        self._pending: dict[str, _Pending] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._step_lock = threading.Lock()  # one scheduler step at a time, whichever thread
        self._foreground = 0  # callers stepping the scheduler on their own thread (see _drive)
        self._stepper: int | None = None  # the thread inside _run_once (see _check_not_stepping)
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="weft-engine", daemon=True)
        self._thread.start()
        logger.info("engine ready in %.1f s", time.perf_counter() - started)

    # ---- public API ---------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.scheduler.max_seq_len

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: SamplingArg | list[SamplingArg] = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        rid: str | list[str] | None = None,
        namespace: str = "",
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Blocking generation. A single prompt gives a dict (a list of n dicts if n > 1); a
        batch gives a flat list in order, n entries per prompt.

        Not from the engine's own thread (inside a function given to `call`): that thread runs
        the steps this would wait for, so it raises RuntimeError at once."""
        self._check_not_stepping("generate")
        reqs, single = self._build(
            prompt,
            input_ids,
            sampling_params,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            namespace,
        )
        pendings = self._submit_all(reqs)
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
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        namespace: str = "",
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Awaitable generation of one prompt (a list of n dicts if n > 1). Like `generate`, not
        from a loop on the engine's own thread."""
        self._check_not_stepping("async_generate")
        outputs = [
            o
            async for o in self.generate_stream(
                prompt,
                sampling_params,
                input_ids,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                rid,
                namespace,
                final_only=True,
            )
        ]
        outputs.sort(key=lambda o: o["meta_info"]["index"])
        return outputs[0] if len(outputs) == 1 else outputs

    async def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingArg = None,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        namespace: str = "",
        final_only: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields chunks {text (cumulative), output_ids, meta_info, index}; the last chunk of each
        sample has meta_info.finish_reason set. Cancelling the iterator aborts the request.
        Like `generate`, not from a loop on the engine's own thread."""
        self._check_not_stepping("generate_stream")
        reqs, _ = self._build(
            prompt,
            input_ids,
            sampling_params,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            namespace,
        )
        if len(reqs) != 1:
            raise ValueError("generate_stream takes one prompt")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def on_update(chunk: dict[str, Any] | None) -> None:
            # NOTE: raises RuntimeError once the caller's loop is closed; _dispatch then aborts.
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        pending = self._submit(reqs[0], on_update, final_only)
        try:
            while True:
                chunk = await queue.get()
                if chunk is None:  # all samples finished, or the request/engine failed
                    if pending.error is not None:
                        raise _failure(pending.error)
                    return
                yield chunk
        finally:
            if not pending.finished and pending.error is None:
                with contextlib.suppress(RuntimeError):  # the engine may be gone already
                    self.abort(reqs[0].rid)

    def abort(self, rid: str) -> None:
        self._post("abort", rid)

    def check_integrity(self) -> None:
        """Audit free + cached + in-use == total (runs on the engine thread)."""
        self.call(self.scheduler.check_integrity)

    def memory_stats(self) -> dict[str, int]:
        return self.call(self.scheduler.memory_stats)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running."""
        return bool(self.call(self.scheduler.flush_cache))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the thread that steps the scheduler, between steps, and return its result.

        Called from that thread itself (inside a function given to `call`), fn runs at once,
        inline: it is between steps already, and posting fn would wait for itself forever."""
        if self._stepper == threading.get_ident():
            return fn()
        box: dict[str, Any] = {}
        done = threading.Event()
        self._post("call", (fn, box, done))
        while not done.wait(0.5):
            if not self._thread.is_alive():
                raise RuntimeError("the engine thread is not running")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- building requests ------------------------------------------------------------------

    def _build(
        self,
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: SamplingArg | list[SamplingArg],
        return_logprob: bool,
        logprob_start_len: int,
        top_logprobs_num: int,
        rid: str | list[str] | None,
        namespace: str,
    ) -> tuple[list[Req], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [self._tokenize(p) for p in prompts]
        else:
            assert input_ids is not None
            single = not input_ids or not isinstance(input_ids[0], list)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]  # type: ignore[arg-type]
        if not ids_list:
            raise ValueError("prompt batch is empty")
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, list)
            else [sampling_params] * len(ids_list)
        )
        if len(params_list) != len(ids_list):
            raise ValueError(
                f"sampling_params has {len(params_list)} entries for {len(ids_list)} prompts"
            )
        rids: list[str | None] = [None] * len(ids_list)
        if rid is not None:
            rids = [check_rid(r) for r in ([rid] if isinstance(rid, str) else rid)]
        if len(rids) != len(ids_list):
            raise ValueError(f"rid has {len(rids)} entries for {len(ids_list)} prompts")
        logprob = None
        if return_logprob:
            if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS_NUM:
                raise ValueError(
                    f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS_NUM}], got {top_logprobs_num}"
                )
            logprob = LogprobRequest(start_len=logprob_start_len, top_k=top_logprobs_num)
        reqs = []
        for ids, params, r in zip(ids_list, params_list, rids, strict=True):
            sp = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)
            sp.validate(self.model_config.vocab_size, self.config.request_limits)
            self._check_ids(ids)
            # (a max_new_tokens the caller set must fit; the default one is capped instead)
            if isinstance(params, dict) and "max_new_tokens" in params:
                error = output_room_error(len(ids), sp.max_new_tokens, self.context_length)
                if error is not None:
                    raise ValueError(error)
            if logprob is not None and logprob.start_len >= len(ids):
                raise ValueError(
                    f"logprob_start_len ({logprob.start_len}) must be below the prompt length "
                    f"({len(ids)})"
                )
            reqs.append(
                Req(
                    rid=r or uuid.uuid4().hex,
                    input_ids=ids,
                    params=sp,
                    logprob=logprob,
                    namespace=namespace,
                )
            )
        return reqs, single

    def _tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass input_ids instead of prompt")
        if not prompt:
            raise ValueError("prompt is empty")
        return encode_prompt(self.tokenizer, prompt)

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty (no input_ids)")
        vocab = self.model_config.vocab_size
        for tid in ids:
            if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab:
                raise ValueError(f"input_ids has {tid!r}, not a token id in [0, {vocab})")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"prompt is too long: {len(ids)} tokens, the context length is "
                f"{self.context_length} (prompt + at least one new token must fit)"
            )
        limit = self.config.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise ValueError(
                f"prompt is too long: {len(ids)} tokens, at most {limit} (max_prompt_tokens)"
            )

    # ---- the engine thread -------------------------------------------------------------------

    def _submit(
        self,
        req: Req,
        on_update: Callable[[dict[str, Any] | None], None] | None = None,
        final_only: bool = False,
    ) -> _Pending:
        pending = _Pending(n=req.params.n, on_update=on_update, final_only=final_only)
        self._post("add", [(req, pending)])
        return pending

    def _submit_all(self, reqs: list[Req]) -> list[_Pending]:
        """One message for the whole batch, so the scheduler sees it at once."""
        pendings = [_Pending(n=req.params.n) for req in reqs]
        self._post("add", list(zip(reqs, pendings, strict=True)))
        return pendings

    def _post(self, kind: str, payload: Any) -> None:
        with self._cv:
            if self._broken is not None:
                raise RuntimeError(f"the engine failed earlier: {self._broken}") from self._broken
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            self._inbox.append((kind, payload))
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (
                    self._foreground or (not self._inbox and not self.scheduler.has_work)
                ):
                    self._cv.wait()
                if self._stopped:
                    break
            if not self._run_once():
                return
        with self._step_lock:
            self._fail_all(RuntimeError("the engine was shut down"), [])

    def _run_once(self) -> bool:
        """Handle the inbox, then run one scheduler step; False once the engine has failed."""
        with self._step_lock:
            self._stepper = threading.get_ident()
            try:
                return self._step()
            finally:
                self._stepper = None

    def _step(self) -> bool:
        """The body of _run_once, under the step lock."""
        if self._broken is not None:
            return False
        with self._cv:
            inbox, self._inbox = self._inbox, []
        try:
            while inbox:
                kind, payload = inbox.pop(0)
                self._handle(kind, payload)
            if self.scheduler.has_work:
                self._dispatch(self.scheduler.step())
        except BaseException as exc:
            logger.exception("engine step failed")
            with self._cv:
                self._broken = exc
            self._fail_all(exc, inbox)
            return False
        return True

    def _check_not_stepping(self, name: str) -> None:
        """Refuse a blocking request from the thread that runs the steps it would wait for."""
        if self._stepper == threading.get_ident():
            raise RuntimeError(
                f"Engine.{name}() was called on the engine's own thread (inside a function "
                "given to Engine.call): it would wait for a step only this thread can run. "
                "Call it from another thread (e.g. a concurrent.futures.ThreadPoolExecutor), "
                "or, inside call(), use engine.scheduler directly"
            )

    def _drive(self, pendings: list[_Pending]) -> None:
        """Run the steps on this (the main) thread until these requests are done.

        NOTE: measured on a 2-core CPU, torch's OpenMP kernels run ~25 % slower when called from
        a thread other than the main one, so a blocking generate() on the main thread steps the
        scheduler itself; the engine thread sleeps meanwhile (`_foreground`).
        """
        with self._cv:
            self._foreground += 1
        try:
            while not all(p.done.is_set() for p in pendings):
                with self._cv:
                    idle = not self._inbox and not self.scheduler.has_work
                if self._stopped or idle or not self._run_once():
                    break
        finally:
            with self._cv:
                self._foreground -= 1
                self._cv.notify()

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            for req, pending in payload:
                if req.rid in self._pending:
                    self._reject(pending, ValueError(f"rid {req.rid!r} is already in use"))
                    continue
                try:
                    pending.reqs = self.scheduler.add(req)
                except Exception as exc:  # this request only; the others go on
                    self._reject(pending, exc)
                    continue
                self._pending[req.rid] = pending
        elif kind == "abort":
            self.scheduler.abort(payload)
        elif kind == "call":
            fn, box, done = payload
            try:
                box["value"] = fn()
            except Exception as exc:
                box["error"] = exc
            done.set()

    def _dispatch(self, reqs: list[Req]) -> None:
        """Hand a step's progress to the callers (on the engine thread, right after the step).

        NOTE: a request ends only after every update of the step went out: the samples of an
        n > 1 request that finish in the same step each send their last chunk first."""
        ended: dict[str, _Pending] = {}
        for req in reqs:
            key = req.group_rid or req.rid
            pending = self._pending.get(key)
            if pending is None:
                continue
            if pending.on_update is not None and (req.finished or not pending.final_only):
                chunk = request_output(req, key)
                if req.decoder is not None:  # without a held-back stop-string prefix
                    chunk["text"] = req.decoder.text[: req.sent_len]
                if not pending.final_only:  # a stream chunk, as the server's: which sample
                    chunk["index"] = req.index
                if not self._notify(pending, chunk):
                    # the caller went away (its event loop closed): stop generating for it
                    del self._pending[key]
                    ended.pop(key, None)
                    self.scheduler.abort(key)
                    continue
            if pending.finished:
                ended[key] = pending
        for key, pending in ended.items():
            del self._pending[key]
            self._notify(pending, None)
            pending.done.set()

    @staticmethod
    def _notify(pending: _Pending, chunk: dict[str, Any] | None) -> bool:
        if pending.on_update is None:
            return True
        try:
            pending.on_update(chunk)
        except RuntimeError:
            return False
        return True

    def _reject(self, pending: _Pending, exc: BaseException) -> None:
        pending.error = exc
        self._notify(pending, None)
        pending.done.set()

    def _fail_all(self, exc: BaseException, unhandled: list[tuple[str, Any]]) -> None:
        """Every waiter hears about it: running requests, and messages not handled yet."""
        for pending in self._pending.values():
            self._reject(pending, exc)
        self._pending.clear()
        with self._cv:
            unhandled = unhandled + self._inbox
            self._inbox = []
        stopped = RuntimeError(f"engine stopped: {exc}")
        for kind, payload in unhandled:
            if kind == "add":
                for _, pending in payload:
                    self._reject(pending, stopped)
            elif kind == "call":
                payload[1]["error"] = stopped
                payload[2].set()

    def _collect(self, pending: _Pending) -> list[dict[str, Any]]:
        if pending.error is not None:
            raise _failure(pending.error)
        for r in pending.reqs:
            if r.finish is not None and r.finish.status is not None:
                # a 4xx: the request's own fault (a bad grammar); a 5xx: a grammar backend failed
                error = ValueError if r.finish.status < 500 else RuntimeError
                raise error(r.finish.message)
        return [
            request_output(r, r.group_rid or r.rid)
            for r in sorted(pending.reqs, key=lambda r: r.index)
        ]


def _failure(error: BaseException) -> BaseException:
    """A request's own error (bad input) as itself; an engine failure wrapped."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"generation failed: {error}")


def _options_doc() -> str:
    """One line per Engine option, from EngineConfig's own help texts."""
    lines = ["\n    Options (default):"]
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model_path":
            continue
        default = f.default if f.default is not dataclasses.MISSING else "..."
        lines.append(f"        {f.name} ({default!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines) + "\n"


Engine.__doc__ = (Engine.__doc__ or "") + _options_doc()


def _setup_logging(level: str) -> None:
    log = logging.getLogger("weft")
    log.setLevel(level.upper())
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[weft %(asctime)s] %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
