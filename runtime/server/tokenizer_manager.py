"""The tokenizer manager: the HTTP process's side of the pipeline.

It tokenizes and validates requests, sends them to the scheduler, and keeps `rid -> ReqState`
that the detokenizer's text updates fill in; handlers wait on a state's `listener` event. It
also watches the child processes: when one dies, every pending request ends with an error and
/health fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from weft.runtime.messages import detokenizer_to_tokenizer as from_detok
from weft.runtime.messages import tokenizer_to_scheduler as to_sched
from weft.runtime.messages.common import Fatal, LogprobEntry, ModelInfo, Ready, Reply
from weft.runtime.model_runner import ModelSource
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server.errors import ApiError, bad_request
from weft.runtime.server.metrics import ServerMetrics
from weft.runtime.server_config import ServerConfig

logger = logging.getLogger("weft")

QUERY_TIMEOUT_S = 30.0


@dataclass
class Sample:
    """One of a request's n samples, as received so far."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    output_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_logprobs: list[LogprobEntry] | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    # what the consumer has not seen yet (a stream sends one chunk per wake-up, not per token)
    dirty: bool = False
    new_logprobs_from: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    samples: list[Sample]
    listener: asyncio.Event  # set on every update; may be shared by a batch's states
    created: float = field(default_factory=time.perf_counter)
    error: ApiError | None = None
    want_logprobs: bool = False
    stream: bool = False  # wake the listener on every update (else on finish only)

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.samples)

    @property
    def e2e_latency(self) -> float | None:
        ends = [s.finished_at for s in self.samples]
        if any(e is None for e in ends):
            return None
        return max(e for e in ends if e is not None) - self.created


class TokenizerManager:
    def __init__(
        self,
        config: ServerConfig,
        source: ModelSource,
        tokenizer: PreTrainedTokenizerBase | None,
        info: ModelInfo,
        ctx: zmq.Context,
        inbox: zmq.Socket,
        scheduler_address: str,
        children: Sequence[tuple[str, BaseProcess]],
    ) -> None:
        from weft.runtime.ipc import push_socket

        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.info = info
        self.served_model_name = config.served_model_name or source.display_path
        self.children = list(children)
        self.metrics = ServerMetrics() if config.enable_metrics else None
        self._to_scheduler = push_socket(ctx, scheduler_address)
        self._inbox_sync = inbox
        self._inbox: zmq.asyncio.Socket | None = None
        self.states: dict[str, ReqState] = {}
        self._queries: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._query_ids = itertools.count(1)
        self._token_texts: dict[int, str] = {}
        self._anchor: int | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self.dead: str | None = None  # why the server cannot serve any more
        self.started_at = time.time()
        # totals over finished requests (the server's cache hit rate)
        self.num_finished = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.completion_tokens_total = 0

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._inbox = zmq.asyncio.Socket.from_socket(self._inbox_sync)
        self._recv_task = loop.create_task(self._recv_loop())
        for name, proc in self.children:
            loop.add_reader(proc.sentinel, self._child_exited, name, proc)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for _, proc in self.children:
            loop.remove_reader(proc.sentinel)
        self.fail_all("the server is shutting down", 503)
        if self._recv_task is not None:
            self._recv_task.cancel()

    def _child_exited(self, name: str, proc: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(0)
        self._mark_dead(f"the {name} process exited (code {proc.exitcode})")

    def _mark_dead(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            logger.error("server unhealthy: %s", why)
        self.fail_all(f"request failed: {why}", 503)

    @property
    def healthy(self) -> bool:
        return self.dead is None

    def check_alive(self) -> None:
        if self.dead is not None:
            raise ApiError(f"the server cannot serve requests: {self.dead}", 503)

    # ---- tokens -----------------------------------------------------------------------------

    def tokenize(
        self, text: str, param: str = "text", add_special_tokens: bool = True
    ) -> list[int]:
        """Special-token strings in the text (a rendered chat template) become special tokens."""
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send input_ids instead of text", param)
        if not text:
            raise bad_request(f"{param} is empty", param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_text(self, tid: int) -> str:
        """The text a token adds after other text (for logprobs).

        NOTE: decoding a lone token drops a SentencePiece token's leading space ("▁upon" ->
        "upon"); decoding it after an anchor token and cutting the anchor's text keeps it.
        """
        text = self._token_texts.get(tid)
        if text is None:
            text = ""
            if self.tokenizer is not None:
                if self._anchor is None:
                    self._anchor = _anchor_token(self.tokenizer)
                anchor_text = str(self.tokenizer.decode([self._anchor]))
                both = str(self.tokenizer.decode([self._anchor, tid]))
                if both.startswith(anchor_text):
                    text = both[len(anchor_text) :]
                else:
                    text = str(self.tokenizer.decode([tid]))
            self._token_texts[tid] = text
        return text

    def check_ids(self, ids: Any, param: str) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise bad_request(f"{param} must be a non-empty list of token ids", param)
        vocab = self.info.vocab_size
        for tid in ids:
            if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab:
                raise bad_request(f"{param} has {tid!r}, not a token id in [0, {vocab})", param)
        return ids

    def build_request(
        self,
        ids: list[int],
        params: SamplingParams,
        max_tokens_explicit: bool,
        logprob_start_len: int | None = None,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        param: str = "text",
        max_tokens_param: str = "max_new_tokens",
        cache_salt: str | None = None,
    ) -> to_sched.GenerateRequest:
        """Checks that need the model: prompt and output length against the context."""
        context = self.info.context_length
        if len(ids) >= context:
            raise ApiError(
                f"the prompt is too long: {len(ids)} tokens, the context length is {context} "
                "(the prompt and at least one new token must fit)",
                400,
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens_explicit and len(ids) + params.max_new_tokens > context:
            raise ApiError(
                f"{max_tokens_param} is too large: the prompt has {len(ids)} tokens and "
                f"{max_tokens_param} is {params.max_new_tokens}, but the context length is "
                f"{context}",
                400,
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        if logprob_start_len is not None:
            if not isinstance(logprob_start_len, int) or isinstance(logprob_start_len, bool):
                raise bad_request("logprob_start_len must be an integer", "logprob_start_len")
            if not -1 <= logprob_start_len < len(ids):
                raise bad_request(
                    f"logprob_start_len ({logprob_start_len}) must be -1 or below the prompt "
                    f"length ({len(ids)})",
                    "logprob_start_len",
                )
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= 1024:
            raise bad_request(
                "top_logprobs_num must be an integer in [0, 1024]", "top_logprobs_num"
            )
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise bad_request("rid must be a non-empty string", "rid")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        return to_sched.GenerateRequest(
            rid=rid or uuid.uuid4().hex,
            input_ids=ids,
            params=params,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            # NOTE: the prefix cache only matches within a namespace: requests with another salt
            # never reuse this one's KV (nor it theirs)
            namespace="" if cache_salt is None else "salt:" + cache_salt,
        )

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, reqs: list[to_sched.GenerateRequest], stream: bool = False) -> list[ReqState]:
        """Send a batch in one message; one state per prompt (n samples each), sharing one
        listener. A stream's listener wakes on every update, otherwise on finish only."""
        self.check_alive()
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids) or any(rid in self.states for rid in rids):
            raise bad_request("rid is already in use by a running request", "rid")
        listener = asyncio.Event()
        states = []
        for r in reqs:
            state = ReqState(
                rid=r.rid,
                prompt_tokens=len(r.input_ids),
                samples=[Sample() for _ in range(r.params.n)],
                listener=listener,
                want_logprobs=r.logprob_start_len is not None,
                stream=stream,
            )
            self.states[r.rid] = state
            states.append(state)
        self._send(to_sched.Generate(reqs))
        if self.metrics is not None:
            self.metrics.running.set(len(self.states))
        return states

    def abort(self, rid: str) -> bool:
        """Stop a running request; its KV goes back to the pool (the scheduler frees it)."""
        if rid not in self.states:
            return False
        self._send(to_sched.Abort([rid]))
        return True

    def abort_unfinished(self, states: list[ReqState]) -> None:
        rids = [s.rid for s in states if not s.finished and s.rid in self.states]
        if rids and self.dead is None:
            self._send(to_sched.Abort(rids))

    async def wait(
        self, states: list[ReqState], client_gone: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Until every state finished (the states must not stream: they wake on finish only).
        `client_gone` returns when the client disconnects: its requests are aborted then (and
        it gets a 499 it will never read)."""
        listener = states[0].listener
        gone = asyncio.ensure_future(client_gone()) if client_gone is not None else None
        try:
            while not all(s.finished for s in states):
                if gone is None:
                    await listener.wait()
                else:
                    waiter = asyncio.ensure_future(listener.wait())
                    await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if gone.done():
                        waiter.cancel()
                        self.abort_unfinished(states)
                        raise ApiError("the client disconnected", 499)
                listener.clear()
        finally:
            if gone is not None:
                gone.cancel()
        for state in states:
            if state.error is not None:
                raise state.error

    async def query(
        self, msg_type: type[to_sched.GetServerInfo] | type[to_sched.FlushCache]
    ) -> dict[str, Any]:
        self.check_alive()
        qid = next(self._query_ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._queries[qid] = future
        self._send(msg_type(qid))
        try:
            return await asyncio.wait_for(future, QUERY_TIMEOUT_S)
        except TimeoutError:
            raise ApiError("the scheduler did not answer in time", 503) from None
        finally:
            self._queries.pop(qid, None)

    def _send(self, msg: to_sched.ToScheduler) -> None:
        # NOTE: a PUSH socket without a high-water mark: never blocks the event loop.
        self._to_scheduler.send(to_sched.encoder.encode(msg), zmq.NOBLOCK)

    def fail_all(self, message: str, status: int) -> None:
        error = ApiError(message, status)
        for state in self.states.values():
            state.error = error
            state.listener.set()
        self.states.clear()
        for future in self._queries.values():
            if not future.done():
                future.set_exception(ApiError(message, status))

    # ---- receiving ----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._inbox is not None
        while True:
            raw = await self._inbox.recv()
            try:
                msg = from_detok.decoder.decode(raw)
                if isinstance(msg, from_detok.TextStep):
                    self._on_text(msg.updates)
                elif isinstance(msg, Reply):
                    future = self._queries.get(msg.query_id)
                    if future is not None and not future.done():
                        future.set_result(msg.body)
                elif isinstance(msg, Fatal):
                    self._mark_dead(f"the {msg.process} process failed: {msg.message}")
                elif isinstance(msg, Ready):
                    pass  # handled by the launcher before serving
            except Exception:  # one bad message must not stop the server
                logger.exception("tokenizer manager: cannot handle a message")

    def _on_text(self, updates: list[from_detok.TextUpdate]) -> None:
        now = time.perf_counter()
        for u in updates:
            state = self.states.get(u.rid)
            if state is None:
                continue  # failed or aborted meanwhile
            sample = state.samples[u.index]
            if u.new_ids and sample.first_token_at is None:
                sample.first_token_at = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - state.created)
            sample.text += u.text
            sample.output_ids.extend(u.new_ids)
            sample.cached_tokens = u.cached_tokens
            if u.output_logprobs:
                sample.output_logprobs.extend(u.output_logprobs)
            if u.input_logprobs is not None:
                sample.input_logprobs = u.input_logprobs
            sample.dirty = True
            if u.finish_reason is not None:
                sample.finish_reason = u.finish_reason
                sample.finished_at = now
                if state.finished:
                    self._finished(state)
                state.listener.set()
            elif state.stream:
                state.listener.set()

    def _finished(self, state: ReqState) -> None:
        del self.states[state.rid]
        completion = sum(len(s.output_ids) for s in state.samples)
        cached = min(s.cached_tokens for s in state.samples)
        self.num_finished += 1
        self.prompt_tokens_total += state.prompt_tokens
        self.cached_tokens_total += cached
        self.completion_tokens_total += completion
        if self.metrics is not None:
            latency = state.e2e_latency
            reason = state.samples[0].finish_reason or {}
            self.metrics.request_done(
                state.prompt_tokens, completion, cached, latency or 0.0, reason.get("type", "")
            )
            self.metrics.running.set(len(self.states))

    def stats(self) -> dict[str, Any]:
        prompt = self.prompt_tokens_total
        return {
            "num_pending": len(self.states),
            "num_finished": self.num_finished,
            "prompt_tokens_total": prompt,
            "cached_tokens_total": self.cached_tokens_total,
            "completion_tokens_total": self.completion_tokens_total,
            "cache_hit_rate": self.cached_tokens_total / prompt if prompt else 0.0,
        }


def _anchor_token(tokenizer: PreTrainedTokenizerBase) -> int:
    ids = tokenizer.encode("a", add_special_tokens=False)
    return int(ids[-1]) if ids else 0
