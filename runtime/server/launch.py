"""`weft serve`: start the scheduler and detokenizer processes, then serve HTTP until a signal.

    launcher (this process: HTTP server + tokenizer manager)
      |-- scheduler process    (model, KV pool, Scheduler)
      `-- detokenizer process  (incremental detokenization)

Shutdown:
  SIGTERM drains: new requests and /health get 503 while the running ones finish, for up to
      --shutdown-grace-s; what is left then ends with a 503.
  SIGINT (Ctrl-C), or a second signal during a drain: pending requests end with a 503 at once.
Then uvicorn stops accepting, the children get SIGTERM (SIGKILL after a grace period) and the
ipc folder is removed. Children also exit by themselves when this process dies without
cleaning up (they watch their parent pid).
"""

from __future__ import annotations

import asyncio
import http
import logging
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
import zmq
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from weft.runtime.ipc import IpcNames, exit_status, pull_socket, remove_ipc_folder, setup_logging
from weft.runtime.loaders.source import ModelSource, resolve_source
from weft.runtime.messages import detokenizer_to_tokenizer as from_detok
from weft.runtime.messages.common import Fatal, ModelInfo, Ready
from weft.runtime.server.child_main import detokenizer_main, scheduler_main
from weft.runtime.server.middleware import load_api_keys
from weft.runtime.server_config import ServerConfig

# NOTE: this module is imported before the children start: torch, transformers and the HTTP
# stack are imported later, in launch_server once the children are loading (and by each child
# in its entry point, child_main). The launcher's imports (seconds) then overlap the
# children's instead of preceding them.
if TYPE_CHECKING:
    from weft.runtime.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("weft")

STARTUP_POLL_MS = 200
FATAL_GRACE_MS = 5000
CHILD_STOP_TIMEOUT_S = 5.0
OPENMP_SPIN_COUNT = 10_000  # GOMP_SPINCOUNT of the children: ~0.1 ms (ChildProcesses.start)
# uvicorn's own graceful shutdown, after weft's drain: only answers already decided (the last
# chunks of streams, 503s) are still being written then
GRACEFUL_SHUTDOWN_S = 5


class StartupError(RuntimeError):
    pass


class _Interrupted(Exception):
    """A signal arrived while loading (before uvicorn took over the signals)."""


class ChildProcesses:
    def __init__(self) -> None:
        self.procs: list[tuple[str, BaseProcess]] = []

    def start(self, config: ServerConfig, source: ModelSource, ipc: IpcNames) -> None:
        # NOTE: spawn, not fork: the parent may hold threads (tokenizers, torch) that fork
        # would copy in a locked state.
        ctx = multiprocessing.get_context("spawn")
        me = os.getpid()
        # NOTE: how long the scheduler's idle OpenMP threads spin before they sleep (read by
        # the children's OpenMP runtime at start, env inherited; unless the user set either).
        # libgomp's default (~300k spins, milliseconds) starved the other server processes on a
        # 2-core machine; passive waits (none) put a sleep and a wake-up into every torch op of
        # a step: single-stream decode 23-25 tok/s against 30-34 with OPENMP_SPIN_COUNT
        # (RESULTS.md, bench_serving), which spins through the gaps between a step's ops only.
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_COUNT))
        detokenizer_args = (source.tokenizer_folder, config.log_level, ipc, me)
        targets: list[tuple[str, Any, tuple[Any, ...]]] = [
            ("scheduler", scheduler_main, (config, source, ipc, me)),
            ("detokenizer", detokenizer_main, detokenizer_args),
        ]
        for name, target, args in targets:
            # NOTE: a daemon process may start no process: the scheduler of tensor-parallel
            # ranks starts them (and stops them, or they exit with it: tp_processes)
            daemon = name != "scheduler" or config.tp_size == 1
            proc = ctx.Process(target=target, args=args, name=f"weft-{name}", daemon=daemon)
            proc.start()
            self.procs.append((name, proc))

    def first_dead(self) -> tuple[str, BaseProcess] | None:
        return next(((n, p) for n, p in self.procs if not p.is_alive()), None)

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
        for name, proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                logger.warning("%s process did not stop; killing it", name)
                proc.kill()
                proc.join()
        self.procs.clear()


def _wait_ready(inbox: zmq.Socket, children: ChildProcesses) -> ModelInfo:
    """Until the scheduler (model loaded) and the detokenizer (tokenizer loaded) are ready."""
    while True:
        if inbox.poll(STARTUP_POLL_MS):
            msg = from_detok.decoder.decode(inbox.recv())
            if isinstance(msg, Ready):
                return msg.info
            if isinstance(msg, Fatal):
                raise StartupError(f"the {msg.process} process failed: {msg.message}")
            continue
        dead = children.first_dead()
        if dead is not None:
            name, proc = dead
            # its reason may still be on the way (through the detokenizer)
            if inbox.poll(FATAL_GRACE_MS):
                msg = from_detok.decoder.decode(inbox.recv())
                if isinstance(msg, Fatal):
                    raise StartupError(f"the {msg.process} process failed: {msg.message}")
            raise StartupError(
                f"the {name} process exited during startup ({exit_status(proc.exitcode)})"
            )


class _Server(uvicorn.Server):
    """uvicorn, plus: a ready line with the real port, and weft's shutdown. uvicorn's
    `should_exit` is only set once the drain is over, and then nothing is left pending: its
    graceful shutdown does not hold on to running requests."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, grace_s: float) -> None:
        super().__init__(config)
        self.tm = tm
        self.grace_s = grace_s
        self._drain_deadline: float | None = None
        self._drain_announced = False
        self._failed_pending = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: a signal handler runs between any two bytecodes of the event loop: it only sets
        # flags; on_tick acts on them.
        draining = self._drain_deadline is not None
        if sig == signal.SIGTERM and self.grace_s > 0 and not draining and not self.should_exit:
            self._drain_deadline = time.monotonic() + self.grace_s
            self.tm.draining = True
            return
        super().handle_exit(sig, frame)  # SIGINT, a second signal, or no grace: stop now

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(
                f"weft: ready, serving {self.tm.served_model_name} at http://{shown}:{port} "
                "(native API: /generate, OpenAI API: /v1)",
                flush=True,
            )

    async def on_tick(self, counter: int) -> bool:
        # NOTE: done here, on the event loop, not in the signal handler: a handler interrupts
        # the loop at an arbitrary bytecode, in the middle of the manager's own bookkeeping.
        if self._drain_deadline is not None and not self.should_exit:
            if not self.tm.states or time.monotonic() >= self._drain_deadline:
                self.should_exit = True
            elif not self._drain_announced:
                self._drain_announced = True
                print(
                    f"weft: draining {len(self.tm.states)} pending request(s) for at most "
                    f"{self.grace_s:g} s (a second signal stops at once)",
                    flush=True,
                )
        if self.tm.dead is not None and not self.should_exit:
            # NOTE: a child died or the watchdog gave up: the pending requests have failed;
            # exit non-zero, for a supervisor to restart the server
            print(f"weft: stopping: {self.tm.dead}", file=sys.stderr, flush=True)
            self.should_exit = True
        if self.should_exit and not self._failed_pending:
            self._failed_pending = True
            self.tm.fail_all("the server is shutting down", 503)
        return await super().on_tick(counter)


def launch_server(config: ServerConfig) -> int:
    """Serve until SIGINT / SIGTERM. Returns the process exit code."""
    if config.dp_size > 1:
        from weft.runtime.server.data_parallel import launch_data_parallel

        return launch_data_parallel(config)
    setup_logging(config.log_level)
    signals = _SignalGate()
    children = ChildProcesses()
    ipc: IpcNames | None = None
    ctx = zmq.Context()
    model = config.model_path or "the embedded default model"
    if config.node_rank == 0:
        print(
            f"weft: loading {model}; will listen on http://{config.host}:{config.port}", flush=True
        )
    try:
        api_keys = load_api_keys(config)  # a bad keys file fails before the model loads
        source = resolve_source(config.engine_config)
        if config.node_rank > 0:
            from weft.runtime.tp_processes import serve_node

            signals.serving = True  # serve_node handles SIGINT / SIGTERM
            return serve_node(config.engine_config, source)
        ipc = IpcNames.create()
        inbox = pull_socket(ctx, ipc.tokenizer)
        children.start(config, source, ipc)
        # while the children load the model
        from weft.runtime.server.http_server import build_app
        from weft.runtime.server.tokenizer_manager import TokenizerManager
        from weft.runtime.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(source.tokenizer_folder) if source.tokenizer_folder else None
        info = _wait_ready(inbox, children)
        tm = TokenizerManager(
            config, source, tokenizer, info, ctx, inbox, ipc.scheduler, children.procs
        )
        app = build_app(tm, api_keys)
        server = _Server(_uvicorn_config(app, config), tm, config.shutdown_grace_s)
        signals.serving = True  # uvicorn owns SIGINT/SIGTERM from here on
        server.run()
        print("weft: stopped", flush=True)
        return 0 if tm.dead is None else 1
    except _Interrupted:
        print("weft: interrupted while starting", flush=True)
        return 0
    except (StartupError, ValueError, FileNotFoundError) as exc:
        print(f"weft: cannot start: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signals.serving = True  # a second signal must not cut the cleanup short
        children.stop()
        ctx.destroy(linger=0)
        if ipc is not None:
            remove_ipc_folder(ipc)
        signals.restore()


def _uvicorn_config(app: Any, config: ServerConfig) -> uvicorn.Config:
    level = config.log_level.lower()
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        log_level=level,
        access_log=level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=5,
        http=_bounded_headers(config.header_timeout_s),
    )


# A request's headers must arrive within --header-timeout-s (from the connection's start for its
# first request, from a request's first bytes for later ones) and within MAX_HEADER_BYTES:
# otherwise a client that sends them slowly, or without end, holds a connection and its memory
# for as long as it likes (3,000 slow-header connections were held once). uvicorn has neither
# bound; it only closes a connection idle between requests (timeout_keep_alive).
MAX_HEADER_BYTES = 64 * 1024  # the request line and all headers; nginx allows 32 KiB


class _BoundedHeadersProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the two bounds above: a 408 or a 431, and the
    connection closed. A body that arrives slowly is not bounded here (the handlers read it).

    NOTE: relies on HttpToolsProtocol's callbacks (as of uvicorn 0.54): connection_made,
    data_received, on_message_begin, on_headers_complete, on_message_complete,
    connection_lost; and on its `cycle`, `transport`, `loop` and `server_state`."""

    header_timeout_s: float  # set per server by `_bounded_headers`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "idle": no request begun (bytes may still come: CRLFs begin no request),
        # "headers": a request's line and headers are arriving, "body": its body is
        self._reading: Literal["idle", "headers", "body"] = "idle"
        self._header_bytes = 0  # bytes received since the last request's headers ended
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._reading != "body":
            self._arm()
            self._header_bytes += len(data)
        super().data_received(data)
        # NOTE: counts a whole chunk, though a body may follow the headers in it; the count
        # restarts where they end, so only a request whose headers did not end is refused
        if self._reading != "body" and self._header_bytes > MAX_HEADER_BYTES:
            self._refuse(431, "the request headers are too large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = "headers"
        self._arm()

    def on_headers_complete(self) -> None:
        self._reading = "body"
        self._header_bytes = 0
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading = "idle"
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:  # a deadline is never pushed back
            self._deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        self._refuse(408, "the request headers did not arrive in time")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` to the request whose headers are arriving, and close (a connection
        where no request began just ends, as an idle one does)."""
        self._disarm()
        if self.transport.is_closing():
            return
        # NOTE: a response on its way (the headers are a pipelined request's) is cut short: a
        # client that pipelines a request does not send it slowly unless it is broken or hostile
        responding = self.cycle is not None and not self.cycle.response_complete
        if self._reading == "headers" and not responding:
            who = f"{self.client[0]}:{self.client[1]}" if self.client else "an unknown client"
            logger.info("%s from %s (%d): connection closed", message, who, status)
            body = message.encode()
            head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()]
            head += [
                name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers
            ]
            head.append(
                b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n" % len(body)
            )
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def _bounded_headers(timeout_s: float) -> type[_BoundedHeadersProtocol]:
    """The protocol class with this server's header timeout (uvicorn makes one instance per
    connection from the class it is given)."""

    class BoundedHeaders(_BoundedHeadersProtocol):
        header_timeout_s = timeout_s

    return BoundedHeaders


class _SignalGate:
    """SIGINT / SIGTERM while loading abort the start; uvicorn handles them while serving (and
    re-raises them once it has stopped, when they must do nothing more)."""

    def __init__(self) -> None:
        self.serving = False
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        if not self.serving:
            raise _Interrupted(signal.Signals(sig).name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
