"""What the server's processes share: per-instance ZMQ `ipc://` names and child-process hygiene.

Every channel is a PUSH -> PULL pipe: the receiver binds, the sender connects.

    tokenizer manager --(scheduler)--> scheduler --(detokenizer)--> detokenizer
          ^                                                             |
          +------------------------------(tokenizer)-------------------+
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import zmq

PARENT_CHECK_S = 1.0  # how often a child checks that the server process is still there


@dataclass(frozen=True)
class IpcNames:
    folder: str  # a fresh private folder; removed by the launcher at shutdown
    scheduler: str  # the scheduler's inbox
    detokenizer: str  # the detokenizer's inbox
    tokenizer: str  # the tokenizer manager's inbox

    @classmethod
    def create(cls) -> IpcNames:
        # NOTE: unix socket paths are limited to ~100 bytes, so keep the folder short.
        folder = tempfile.mkdtemp(prefix="weft-")
        return cls(
            folder=folder,
            scheduler=f"ipc://{folder}/scheduler",
            detokenizer=f"ipc://{folder}/detokenizer",
            tokenizer=f"ipc://{folder}/tokenizer",
        )


def pull_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    return sock


def push_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A sender that never blocks: no high-water mark (bounded by the request count instead) and
    no linger, so that a process can exit even when its peer is gone."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


class ParentWatch:
    """Tells a child process that its parent is gone (re-parented), without prctl: portable."""

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid
        self._checked = time.monotonic()

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def due(self) -> bool:
        """True at most once per PARENT_CHECK_S (cheap enough to call every step)."""
        now = time.monotonic()
        if now - self._checked < PARENT_CHECK_S:
            return False
        self._checked = now
        return True


def exit_status(code: int | None) -> str:
    """A child process's exit code as words: "code 1", "killed by SIGKILL"."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


def setup_child(name: str, log_level: str) -> None:
    """Common start of a child process: the parent owns Ctrl-C (the terminal sends SIGINT to the
    whole process group) and stops children with SIGTERM, which raises SystemExit so that the
    process's `finally` blocks run and its loop can close its sockets (then `exit_now`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    setup_logging(log_level, name)


def _exit_on_sigterm(sig: int, frame: object) -> None:
    raise SystemExit(0)


def exit_now(code: int) -> NoReturn:
    """End this process once it has released what it owns (sockets closed, threads stopped): its
    atexit handlers run (multiprocessing's finalizers, which unlink its semaphores, among them),
    the interpreter's teardown does not.

    NOTE: with torch and transformers loaded, that teardown's garbage-collection passes over every
    module take 1-2 s of CPU (measured on a 2-core machine), and a server's stop waits for them in
    each of its processes; what they would free goes with the process anyway. Non-daemon threads
    (a grammar compile in flight) are not waited for: the process was told to stop."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def setup_logging(level: str, name: str = "server") -> None:
    log = logging.getLogger("weft")
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(f"[weft {name} %(asctime)s] %(levelname)s %(message)s", "%H:%M:%S")
        )
        log.addHandler(handler)
        log.propagate = False


def remove_ipc_folder(names: IpcNames) -> None:
    folder = Path(names.folder)
    for path in folder.glob("*"):
        path.unlink(missing_ok=True)
    folder.rmdir()
