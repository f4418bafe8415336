"""What the server's processes share: per-instance ZMQ `ipc://` names and child-process hygiene.

Every channel is a PUSH -> PULL pipe: the receiver binds, the sender connects.

    tokenizer manager --(scheduler)--> scheduler --(detokenizer)--> detokenizer
          ^                                                             |
          +------------------------------(tokenizer)-------------------+
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

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
    whole process group) and stops children with SIGTERM, which exits through SystemExit so that
    the process's finalizers run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    setup_logging(log_level, name)


def _exit_on_sigterm(sig: int, frame: object) -> None:
    raise SystemExit(0)


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
