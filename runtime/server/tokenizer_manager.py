"""The tokenizer manager: the HTTP process's side of the pipeline.

It tokenizes and validates requests, sends them to the scheduler, and keeps `rid -> ReqState`
that the detokenizer's text updates fill in; handlers wait on a state's `listener` event. It
also watches the child processes: when one dies, every pending request ends with an error,
/health fails and the server exits non-zero (for a supervisor to restart it). The scheduler's
heartbeats tell a frozen scheduler (no heartbeat) and a stuck one (requests pending, no step):
/health fails while either lasts, and past --watchdog-timeout the server gives up as if the
scheduler had died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, assert_never

import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from weft.runtime.detokenize import TokenTexts
from weft.runtime.intake import Bounds, Intake
from weft.runtime.ipc import exit_status
from weft.runtime.loaders.source import ModelSource
from weft.runtime.messages import detokenizer_to_tokenizer as from_detok
from weft.runtime.messages import tokenizer_to_scheduler as to_sched
from weft.runtime.messages.common import Fatal, Heartbeat, ModelInfo, Ready, Reply
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server.errors import ApiError, bad_request
from weft.runtime.server.liveness import HEARTBEAT_TIMEOUT_S, SchedulerClock
from weft.runtime.server.metrics import ServerMetrics
from weft.runtime.server.middleware import cache_namespace
from weft.runtime.server.reasoning import marker_ids
from weft.runtime.server.request_log import RequestLog, request_record
from weft.runtime.server.request_state import ReqState, Sample, Totals
from weft.runtime.server_config import ServerConfig

logger = logging.getLogger("weft")

QUERY_TIMEOUT_S = 30.0
WATCHDOG_CHECK_S = 1.0
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait


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
        if self.metrics is not None:  # gauges read at scrape time
            self.metrics.pending.set_function(lambda: len(self.states))
            self.metrics.cache_hit_rate.set_function(lambda: self.totals.cache_hit_rate)
        self.request_log = (
            RequestLog(config.request_log, config.log_prompts) if config.request_log else None
        )
        self._to_scheduler = push_socket(ctx, scheduler_address)
        self._inbox_sync = inbox
        self._inbox: zmq.asyncio.Socket | None = None
        self.states: dict[str, ReqState] = {}  # by sched_rid
        self._by_caller: dict[tuple[str | None, str], ReqState] = {}  # (tenant, rid)
        self._queries: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._query_ids = itertools.count(1)
        self.token_text = TokenTexts(tokenizer)  # a token's text, for logprobs
        # the reasoning markers' ids, which a thinking request carries to the scheduler
        self.reasoning_ids = marker_ids(tokenizer, config.reasoning_format)
        self._recv_task: asyncio.Task[None] | None = None
        bounds = Bounds(
            vocab_size=info.vocab_size,
            context_length=info.context_length,
            max_prompt_tokens=config.max_prompt_tokens,
            limits=config.request_limits,
        )
        self.intake = Intake(tokenizer, bounds)
        self.dead: str | None = None  # why the server cannot serve any more
        # the scheduler's liveness, from its heartbeats (monotonic times)
        self._clock = SchedulerClock()
        self._watchdog_task: asyncio.Task[None] | None = None
        # NOTE: set by the launcher's SIGTERM handler: refuse new requests while running ones
        # finish (a plain flag: a signal handler must not touch the states)
        self.draining = False
        self.started_at = time.time()
        self.totals = Totals()  # over finished requests (the server's cache hit rate)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._inbox = zmq.asyncio.Socket.from_socket(self._inbox_sync)
        self._recv_task = loop.create_task(self._recv_loop())
        self._clock.restart()
        self._watchdog_task = loop.create_task(self._watchdog())
        for name, proc in self.children:
            loop.add_reader(proc.sentinel, self._child_exited, name, proc)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for _, proc in self.children:
            loop.remove_reader(proc.sentinel)
        self.fail_all("the server is shutting down", 503)
        for task in (self._recv_task, self._watchdog_task):
            if task is not None:
                task.cancel()
        if self.request_log is not None:
            self.request_log.close()
            self.request_log = None

    def _child_exited(self, name: str, proc: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        # NOTE: the sentinel closes as the process exits, a moment before it can be reaped:
        # join(0) saw no exit code yet ("code None")
        proc.join(1.0)
        self._mark_dead(f"the {name} process exited ({exit_status(proc.exitcode)})")

    def _mark_dead(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            logger.error("server unhealthy: %s", why)
        self.fail_all(f"request failed: {why}", 503)

    @property
    def healthy(self) -> bool:
        return self.dead is None

    def _liveness(self) -> tuple[str | None, float]:
        return self._clock.liveness(len(self.states), self.config.watchdog_timeout)

    def check_healthy(self) -> None:
        """/health: alive, admitting, and the scheduler answers and advances its requests."""
        self.check_admitting()
        why, _ = self._liveness()
        if why is not None:
            raise ApiError(f"the server is unhealthy: {why}", 503)

    async def _watchdog(self) -> None:
        """Log a stall once; past --watchdog-timeout, give up on the scheduler: fail every
        pending request and stop the server (it exits non-zero)."""
        logged = False
        while self.dead is None:
            await asyncio.sleep(WATCHDOG_CHECK_S)
            why, stalled = self._liveness()
            if why is not None and not logged:
                logger.warning("server unhealthy: %s", why)
            logged = why is not None
            limit = self.config.watchdog_timeout
            if why is not None and limit and stalled > limit:
                self._mark_dead(f"watchdog: {why} (--watchdog-timeout {limit:g})")

    def check_alive(self) -> None:
        if self.dead is not None:
            raise ApiError(f"the server cannot serve requests: {self.dead}", 503)

    def check_admitting(self) -> None:
        """New requests (and /health): refused when the server is dead or draining."""
        self.check_alive()
        if self.draining:
            raise ApiError("the server is shutting down: it accepts no new requests", 503)

    # ---- tokens and requests (the checks: `weft.runtime.intake`, shared with the Engine) ----

    def tokenize(self, text: str, param: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.intake.encode(text, param, add_special_tokens=add_special_tokens)

    def build_request(
        self,
        ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: object = None,
        tenant: str | None = None,
        **fields: Any,
    ) -> to_sched.GenerateRequest:
        """The intake's request (`fields`: `Intake.build`'s), in the caller's prefix-cache
        namespace."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        # NOTE: the prefix cache only matches within a namespace: requests of another tenant,
        # or with another salt, never reuse this one's KV (nor it theirs)
        namespace = cache_namespace(tenant, cache_salt)
        return self.intake.build(ids, params, namespace=namespace, **fields)

    # ---- requests ---------------------------------------------------------------------------

    def submit(
        self,
        reqs: list[to_sched.GenerateRequest],
        *,
        stream: bool = False,
        api: str = "native",
        tenant: str | None = None,
    ) -> list[ReqState]:
        """Send a batch in one message; one state per prompt (n samples each), sharing one
        listener. A stream's listener wakes on every update, otherwise on finish only. `api`
        names the route in the request log.

        With --max-queued-requests N, a batch is refused (503, nothing sent) while N samples
        wait for their first token; it is admitted whole otherwise."""
        self.check_admitting()
        self._check_queue()
        if not self.states:  # the stall clock counts from the first pending request
            self._clock.restart()
        rids = [r.rid for r in reqs]  # (checked by the intake)
        if len(set(rids)) != len(rids) or any((tenant, rid) in self._by_caller for rid in rids):
            raise bad_request("rid is already in use by a running request", "rid")
        listener = asyncio.Event()
        states = []
        for r in reqs:
            caller_rid, r.rid = r.rid, uuid.uuid4().hex
            state = ReqState(
                rid=caller_rid,
                sched_rid=r.rid,
                prompt_tokens=len(r.input_ids),
                samples=[Sample() for _ in range(r.params.n)],
                listener=listener,
                want_logprobs=r.logprob_start_len is not None,
                stream=stream,
                api=api,
                tenant=tenant,
                prompt_ids=r.input_ids if self.config.log_prompts else None,
            )
            self.states[r.rid] = state
            self._by_caller[(tenant, caller_rid)] = state
            states.append(state)
        self._send(to_sched.Generate(reqs))
        timeout = self.config.request_timeout
        if timeout is not None:
            loop = asyncio.get_running_loop()
            for state in states:
                state.deadline = loop.call_later(timeout, self._time_out, state)
        return states

    @property
    def num_queued(self) -> int:
        """Samples with no token yet: waiting in the scheduler, for a grammar, or prefilling."""
        return sum(
            1
            for state in self.states.values()
            if state.error is None
            for s in state.samples
            if s.first_token_at is None and not s.finished
        )

    def _check_queue(self) -> None:
        limit = self.config.max_queued_requests
        if limit is None:
            return
        queued = self.num_queued
        if queued >= limit:
            raise ApiError(
                f"the server is busy: {queued} requests wait to start (at most {limit}, each of "
                "n samples counted; --max-queued-requests); retry later",
                503,
                code="server_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def _time_out(self, state: ReqState) -> None:
        """--request-timeout: the client gets a 504 now; the scheduler aborts the request (its
        KV goes back to the pool) and its abort finish removes the state as usual."""
        if self.states.get(state.sched_rid) is not state or state.finished:
            return
        state.error = ApiError(
            f"the request did not finish within {self.config.request_timeout:g} s "
            "(--request-timeout)",
            504,
            code="request_timeout",
        )
        if self.dead is None:
            self._send(to_sched.Abort([state.sched_rid]))
        state.listener.set()

    def abort(self, rid: str, tenant: str | None = None, any_tenant: bool = False) -> bool:
        """Stop a running request by the caller's rid; its KV goes back to the pool (the
        scheduler frees it). A tenant only finds its own requests; the admin (any_tenant)
        aborts the requests of that rid of every tenant."""
        if any_tenant:
            hit = [s for s in self.states.values() if s.rid == rid]
        else:
            hit = [s for s in [self._by_caller.get((tenant, rid))] if s is not None]
        self.abort_unfinished(hit)
        return bool(hit)

    def abort_all(self, tenant: str | None = None, any_tenant: bool = False) -> None:
        """Every running request of the tenant (of all tenants: any_tenant)."""
        mine = [s for s in self.states.values() if any_tenant or s.tenant == tenant]
        self.abort_unfinished(mine)

    def abort_unfinished(self, states: list[ReqState]) -> None:
        rids = [s.sched_rid for s in states if not s.finished and s.sched_rid in self.states]
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
        self, msg_type: type[to_sched.GetServerInfo | to_sched.FlushCache | to_sched.GetMetrics]
    ) -> dict[str, Any]:
        self.check_alive()
        if self._clock.silent_s > HEARTBEAT_TIMEOUT_S:
            why, _ = self._liveness()
            raise ApiError(f"the scheduler cannot answer: {why}", 503)
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
            if state.deadline is not None:
                state.deadline.cancel()
            state.error = error
            state.listener.set()
            self._record(state)
        self.states.clear()
        self._by_caller.clear()
        for future in self._queries.values():
            if not future.done():
                future.set_exception(ApiError(message, status))

    # ---- receiving ----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._inbox is not None
        while True:
            raw = await self._inbox.recv()
            try:
                self._handle(from_detok.decoder.decode(raw))
            except Exception:  # one bad message must not stop the server
                logger.exception("tokenizer manager: cannot handle a message")

    def _handle(self, msg: from_detok.ToTokenizer) -> None:
        match msg:
            case from_detok.TextStep(updates=updates):
                self._on_text(updates)
            case Reply(query_id=qid, body=body):
                future = self._queries.get(qid)
                if future is not None and not future.done():
                    future.set_result(body)
            case Heartbeat():
                self._clock.on_heartbeat(msg, len(self.states))
            case Fatal(process=process, message=message):
                self._mark_dead(f"the {process} process failed: {message}")
            case Ready():
                pass  # handled by the launcher before serving
            case _:
                assert_never(msg)

    def _on_text(self, updates: list[from_detok.TextUpdate]) -> None:
        now = time.perf_counter()
        for u in updates:
            state = self.states.get(u.rid)
            if state is None:
                continue  # failed or aborted meanwhile
            sample = state.samples[u.index]
            if u.new_ids:
                self._tokens_arrived(state, sample, len(u.new_ids), now)
            sample.apply(u, now)
            if u.finish_reason is not None:
                if state.finished:
                    self._finished(state)
                state.listener.set()
            elif state.stream:
                state.listener.set()

    def _tokens_arrived(self, state: ReqState, sample: Sample, count: int, now: float) -> None:
        """TTFT at a sample's first token; one ITL gap per later token: a chunk of k tokens
        after a wait w counts k gaps of w / k, tokens that came with the first one gaps of 0."""
        previous, sample.last_token_at = sample.last_token_at, now
        if sample.first_token_at is None:
            sample.first_token_at = now
            if self.metrics is not None:
                self.metrics.ttft.observe(now - state.created)
                self.metrics.tokens_arrived(count - 1, 0.0)
        elif self.metrics is not None and previous is not None:
            self.metrics.tokens_arrived(count, now - previous)

    def _finished(self, state: ReqState) -> None:
        del self.states[state.sched_rid]
        del self._by_caller[(state.tenant, state.rid)]
        if state.deadline is not None:
            state.deadline.cancel()
        completion, cached = state.completion_tokens, state.cached_tokens
        self.totals.add(state.prompt_tokens, cached, completion)
        if self.metrics is not None:
            reason = (state.samples[0].finish_reason or {}).get("type", "")
            latency = state.e2e_latency or 0.0
            self.metrics.request_done(state.prompt_tokens, completion, cached, latency, reason)
        self._record(state)

    def _record(self, state: ReqState) -> None:
        """A request ended (finished, or failed by `fail_all`): its error count and log line."""
        kind, _ = state.outcome()
        # NOTE: an error answered as an HTTP error is counted by the app's error handler; a
        # stream's error goes out as an event instead (its 200 is sent already)
        if self.metrics is not None and (kind == "aborted" or (kind != "ok" and state.stream)):
            self.metrics.error(kind)
        if self.request_log is not None:
            prompt = None
            if self.request_log.with_texts:
                ids = state.prompt_ids or []
                prompt = str(self.tokenizer.decode(ids)) if self.tokenizer is not None else ""
            self.request_log.write(request_record(state, prompt))

    def stats(self) -> dict[str, Any]:
        return {
            "num_pending": len(self.states),
            "num_queued": self.num_queued,
            **dataclasses.asdict(self.totals),
            "cache_hit_rate": self.totals.cache_hit_rate,
        }
