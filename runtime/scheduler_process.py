"""The scheduler process: the model, the KV pool and the `Scheduler`, fed over ZMQ.

Loop: take every waiting message (block while idle, poll while busy), run one scheduler step,
send the step's new token ids to the detokenizer in one message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, assert_never

import torch
import zmq

from weft.runtime.core import Req, child_rid
from weft.runtime.ipc import (
    IpcNames,
    ParentWatch,
    exit_now,
    pull_socket,
    push_socket,
    setup_child,
)
from weft.runtime.loaders.source import ModelSource
from weft.runtime.messages import detokenizer_to_tokenizer as to_tm
from weft.runtime.messages import scheduler_to_detokenizer as to_detok
from weft.runtime.messages import tokenizer_to_scheduler as from_tm
from weft.runtime.messages.common import Fatal, Heartbeat, ModelInfo, Ready, Reply
from weft.runtime.scheduler import Scheduler, build_scheduler
from weft.runtime.server_config import ServerConfig

logger = logging.getLogger("weft")

IDLE_POLL_MS = 500  # while idle, wake up this often to check that the parent is alive
HEARTBEAT_S = 1.0  # how often the process tells the server it is alive (and its progress)
RANK_EXIT_GRACE_S = 1.0  # a failed step waits this long for the rank watch's reason


class _NoTextDecoder:
    """Stands in for the scheduler's incremental decoder when a request has no stop strings.

    The client-facing text is decoded once, in the detokenizer process; the scheduler only needs
    text to find stop strings. NOTE: relies on `OutputProcessor.start` keeping a decoder that is
    already set (tests compare the server's text with the in-process Engine's to catch a change).
    """

    text = ""

    def push(self, ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


_NO_TEXT = _NoTextDecoder()


@dataclass
class _Progress:
    ids_sent: int = 0
    logprobs_sent: int = 0
    started: bool = False  # the first update went out (it carries the prompt logprobs)


class SchedulerService:
    def __init__(
        self,
        config: ServerConfig,
        source: ModelSource,
        *,
        on_rank_exit: Callable[[str], None] | None = None,
    ) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.scheduler = build_scheduler(config.engine_config, source, on_rank_exit=on_rank_exit)
        self.runner = self.scheduler.runner
        self.has_tokenizer = self.scheduler.tokenizer is not None
        self.source = source
        self._progress: dict[str, _Progress] = {}
        self._starts: list[to_detok.DecodeStart] = []
        self._rejected: list[to_detok.TokenUpdate] = []
        self.num_requests = 0
        self.num_aborted = 0

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path=self.source.display_path,
            architecture=self.runner.model_config.architecture,
            vocab_size=self.runner.model_config.vocab_size,
            context_length=self.scheduler.max_seq_len,
            kv_pool_size=self.runner.kv_pool.size,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=str(self.runner.device),
        )

    # ---- the loop -------------------------------------------------------------------------

    def serve(self, inbox: zmq.Socket, outbox: zmq.Socket, watch: ParentWatch) -> None:
        while True:
            busy = self.has_work
            if inbox.poll(0 if busy else IDLE_POLL_MS):
                while True:
                    try:
                        raw = inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = self.handle(from_tm.decoder.decode(raw))
                    if reply is not None:
                        outbox.send(to_detok.encoder.encode(reply))
            if self.has_work:
                step = self.step()
                if step.updates or step.starts:
                    outbox.send(to_detok.encoder.encode(step))
            if (not busy or watch.due()) and not watch.parent_alive():
                logger.info("scheduler: the server process is gone; exiting")
                return

    def handle(self, msg: from_tm.ToScheduler) -> Reply | None:
        match msg:
            case from_tm.Generate(reqs=reqs):
                for r in reqs:
                    self._add(r)
            case from_tm.Abort(rids=rids):
                for rid in rids:
                    self.num_aborted += int(self.scheduler.abort(rid))
            case from_tm.GetServerInfo(query_id=qid):
                return Reply(qid, self.server_info())
            case from_tm.FlushCache(query_id=qid):
                return Reply(qid, {"flushed": self.scheduler.flush_cache()})
            case from_tm.GetMetrics(query_id=qid):
                return Reply(qid, self.metrics())
            case _:
                assert_never(msg)
        return None

    def _add(self, r: from_tm.GenerateRequest) -> None:
        req = Req.from_message(r)  # as the in-process Engine takes it
        if not r.params.stop:
            req.decoder = _NO_TEXT
        self.num_requests += 1
        hold = max((len(s) for s in r.params.stop), default=1) - 1
        try:
            children = self.scheduler.add(req)
        except Exception as exc:  # the server validated it: a bug, but only this request's
            logger.exception("scheduler: cannot add request %s", r.rid)
            self._reject(r, hold, f"the scheduler refused the request: {exc}")
            return
        for child in children:
            self._progress[child.rid] = _Progress()
            self._starts.append(
                to_detok.DecodeStart(
                    child.rid,
                    r.params.skip_special_tokens,
                    r.params.spaces_between_special_tokens,
                    hold,
                )
            )

    def _reject(self, r: from_tm.GenerateRequest, hold: int, message: str) -> None:
        reason = {"type": "abort", "message": message}
        for i in range(r.params.n):
            rid = child_rid(r.rid, i) if r.params.n > 1 else r.rid
            self._starts.append(to_detok.DecodeStart(rid, True, True, hold))
            finish = to_detok.Finish(reason, decode_last=True, text_len=-1)
            self._rejected.append(to_detok.TokenUpdate(rid, r.rid, i, [], 0, finish))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._rejected)

    def step(self) -> to_detok.Step:
        updates, self._rejected = self._rejected, []
        if self.scheduler.has_work:
            updates += [self._token_update(u) for u in self.scheduler.step()]
        starts, self._starts = self._starts, []
        return to_detok.Step(starts, updates)

    def _token_update(self, req: Req) -> to_detok.TokenUpdate:
        progress = self._progress[req.rid]
        new_ids = req.output_ids[progress.ids_sent :]
        progress.ids_sent = len(req.output_ids)
        out = to_detok.TokenUpdate(
            rid=req.rid,
            caller_rid=req.group_rid or req.rid,
            index=req.index,
            new_ids=new_ids,
            cached_tokens=req.cached_tokens,
            grammar=req.grammar_report(),
            spec=req.spec_report(),
        )
        if req.logprob is not None:
            out.output_logprobs = list(req.output_logprobs[progress.logprobs_sent :])
            progress.logprobs_sent = len(req.output_logprobs)
            if not progress.started and req.logprob.start_len >= 0:
                out.input_logprobs = list(req.input_logprobs)
        progress.started = True
        if req.finish is not None:
            matched = req.finish.matched
            stop_token = req.finish.type == "stop" and isinstance(matched, int)
            stop_string = req.finish.type == "stop" and isinstance(matched, str)
            out.finish = to_detok.Finish(
                reason=req.finish.to_dict(),
                decode_last=not stop_token,
                text_len=len(req.decoder.text) if stop_string else -1,
            )
            del self._progress[req.rid]
        return out

    # ---- queries --------------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        s = self.scheduler
        try:
            s.check_integrity()
            integrity_error = None
        except AssertionError as exc:
            integrity_error = str(exc)
        return {
            "kv_pool": s.memory_stats(),
            "kv_integrity_ok": integrity_error is None,
            "kv_integrity_error": integrity_error,
            "chunked_prefill_size": s.chunk_size,  # resolved (the config's may be unset)
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_steps": s.num_steps,
            "num_retractions": s.num_retractions,
            "peak_running": s.peak_running,
            "num_requests": self.num_requests,
            "num_aborted": self.num_aborted,
            "radix_cache": s.memory.cache.enabled,
            **({} if s.tp is None else {"tp_rank_pids": s.tp.ranks.pids}),
        }

    def metrics(self) -> dict[str, Any]:
        """Counters kept as the scheduler goes and gauges read now, all O(1): /metrics asks on
        every scrape."""
        s = self.scheduler
        memory = s.memory
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_grammar_waiting": len(s.grammar_wait),
            "kv_total": memory.kv_pool.size,
            "kv_used": memory.kv_pool.size - memory.available,  # not free, not evictable
            "kv_cached": memory.cache.total_size,
            "num_retractions": s.num_retractions,
            "num_aborted": self.num_aborted,
            "grammar_compile_s": s.grammar_compile_s.snapshot(),
            "grammar_mask_s": s.grammar_mask_s.snapshot(),
            "grammar_served_by": dict(s.constrained.served_by),
            "grammar_cache_hits": s.constrained.cache_hits,
            "spec_verify_ct": s.speculative.verify_ct,
            "spec_draft_tokens": s.speculative.draft_tokens,
            "spec_accepted_tokens": s.speculative.accepted_tokens,
        }


# the most the scheduler waits at start for the grammar backends (Scheduler.wait_for_grammars)
GRAMMAR_BUILD_WAIT_S = 60.0


class HeartbeatThread:
    """Sends the scheduler's progress to the tokenizer manager every HEARTBEAT_S, from a thread:
    the heartbeats go on during a long step and stop only when the process is frozen or gone.
    The manager's watchdog tells a live scheduler that cannot advance its requests from these.
    NOTE: the thread owns its socket (ZMQ sockets are not thread-safe); `stop` before the
    context terminates (ctx.term() waits for every socket)."""

    def __init__(self, ctx: zmq.Context, address: str, scheduler: Scheduler) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ctx, address, scheduler), name="weft-heartbeat", daemon=True
        )
        self._thread.start()

    def _run(self, ctx: zmq.Context, address: str, scheduler: Scheduler) -> None:
        sock = push_socket(ctx, address)
        try:
            while True:
                s = scheduler
                runnable = len(s.running) + len(s.waiting)
                beat = Heartbeat(s.num_steps, runnable, runnable + len(s.grammar_wait))
                sock.send(to_tm.encoder.encode(beat), zmq.NOBLOCK)
                if self._stopped.wait(HEARTBEAT_S):
                    return
        finally:
            sock.close()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def _rank_exit_report(ipc: IpcNames) -> Callable[[str], None]:
    """What the scheduler process does when a tensor-parallel rank exits: tell the server why
    (it fails every request and /health) and exit. Called from the rank watch's thread."""

    def report(why: str) -> None:
        # NOTE: the main thread may be blocked in a collective with the dead rank (NCCL waits
        # until its timeout): this thread ends the process, with its own socket
        ctx = zmq.Context()
        sock = push_socket(ctx, ipc.tokenizer)
        sock.send(to_tm.encoder.encode(Fatal("scheduler", why)))
        sock.close(linger=1000)
        ctx.term()  # (waits for the message to leave, up to the linger)
        exit_now(1)

    return report


def run_scheduler_process(
    config: ServerConfig, source: ModelSource, ipc: IpcNames, parent_pid: int
) -> None:
    """Entry point of the child process (multiprocessing spawn); ends the process."""
    setup_child("scheduler", config.log_level)
    ctx = zmq.Context()
    inbox = pull_socket(ctx, ipc.scheduler)
    outbox = push_socket(ctx, ipc.detokenizer)
    service: SchedulerService | None = None
    try:
        started = time.perf_counter()
        service = SchedulerService(config, source, on_rank_exit=_rank_exit_report(ipc))
        service.scheduler.wait_for_grammars(GRAMMAR_BUILD_WAIT_S)
        outbox.send(to_detok.encoder.encode(Ready(service.model_info())))
        logger.info("scheduler ready in %.1f s", time.perf_counter() - started)
        heartbeat = HeartbeatThread(ctx, ipc.tokenizer, service.scheduler)
        try:
            service.serve(inbox, outbox, ParentWatch(parent_pid))
        finally:
            heartbeat.stop()
            service.scheduler.close()
    except SystemExit:  # SIGTERM: the server is stopping
        pass
    except Exception as exc:  # reported to the server, then the process exits
        logger.exception("scheduler failed")
        if service is not None and service.scheduler.tp is not None:
            # NOTE: a collective fails when a rank dies: the rank watch reports that, the
            # clearer reason, and ends this process within this grace
            time.sleep(RANK_EXIT_GRACE_S)
        outbox.send(to_detok.encoder.encode(Fatal("scheduler", f"{type(exc).__name__}: {exc}")))
        outbox.close(linger=1000)  # let the message leave before the process ends
        exit_now(1)
    inbox.close()
    outbox.close()
    ctx.term()
    exit_now(0)
