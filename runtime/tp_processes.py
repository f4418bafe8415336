"""Tensor-parallel processes: rank 0 (the scheduler's process) starts its host's other ranks,
they meet through torch.distributed's TCP store, and rank 0 watches them.

    host 0: scheduler process = rank 0 --spawns--> ranks 1 .. k-1      (k = tp_size / nnodes)
    host h: `weft serve --node-rank h`  --spawns--> ranks h k .. h k + k - 1   (no HTTP server)

Rank 0 hosts the store (at --dist-init-addr, or a free local port on one host); every rank joins
the model's group (NCCL on CUDA, one GPU per rank: cuda:(rank % k); gloo on the CPU) and a gloo
control group (tp_driver), builds its ModelRunner, and follows rank 0's steps until told to stop.
A rank whose parent is gone exits by itself.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from weft.runtime.config import EngineConfig
from weft.runtime.ipc import PARENT_CHECK_S, exit_now, exit_status, setup_logging
from weft.runtime.loaders.source import ModelSource
from weft.runtime.model_config import ModelConfig
from weft.runtime.model_runner import ModelRunner, resolve_device
from weft.runtime.parallel import TPGroup, destroy_tp_group, init_tp_group
from weft.runtime.tp_driver import TPDriver, TPLink, follow

logger = logging.getLogger("weft")

# NOTE: how long a rank waits in a collective of a step (or of the model's start) for the
# others: a rank on another host that hangs fails rank 0 after this (a local rank that dies is
# seen at once, by its sentinel). The control group waits without bound: it is where the ranks
# wait for rank 0's next step, however long the server stays idle.
TP_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=600)
IDLE_WAIT = datetime.timedelta(days=3650)  # a rank learns that rank 0 died from its socket
RANK_STOP_TIMEOUT_S = 10.0  # a rank told to stop exits within this, else it is killed


def check_tp(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse, before any rank starts, what tensor parallelism cannot run (the layers refuse the
    rest as they are built)."""
    tp = TPGroup(0, config.tp_size)
    tp.split(model.num_heads, what="num_attention_heads")
    tp.split_kv_heads(model.num_kv_heads)
    if resolve_device(config).type == "cuda":
        gpus = torch.cuda.device_count()
        if config.ranks_per_node > gpus:
            raise ValueError(
                f"{config.ranks_per_node} tensor-parallel ranks on this host need as many GPUs; "
                f"it has {gpus}"
            )


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    if resolve_device(config).type == "cuda":
        return torch.device("cuda", rank % config.ranks_per_node)
    return torch.device("cpu")


def store_address(config: EngineConfig) -> tuple[str, int]:
    """Where rank 0 hosts the store: --dist-init-addr, or any free port of this host (0)."""
    if config.dist_init_addr is None:
        return "127.0.0.1", 0
    host, _, port = config.dist_init_addr.rpartition(":")
    return host, int(port)


def join(config: EngineConfig, rank: int, store: dist.Store) -> TPLink:
    tp = init_tp_group(
        rank,
        config.tp_size,
        rank_device(config, rank),
        store=store,
        timeout=TP_COLLECTIVE_TIMEOUT,
    )
    return TPLink(tp, dist.new_group(backend="gloo", timeout=IDLE_WAIT))


def leave(link: TPLink) -> None:
    destroy_tp_group(link.tp)


class RankProcesses:
    """The ranks this process started, and a thread that watches them: a rank that exits before
    `stop` makes the thread call `on_exit(why)`."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        ranks: range,
        address: tuple[str, int],
        on_exit: Callable[[str], None] | None,
    ) -> None:
        from weft.runtime.server.child_main import rank_main

        # NOTE: spawn, not fork, as the server's own children (launch.ChildProcesses)
        ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, BaseProcess] = {}
        for rank in ranks:
            args = (config, source, rank, address, os.getpid())
            proc = ctx.Process(target=rank_main, args=args, name=f"weft-rank{rank}", daemon=True)
            proc.start()
            self.procs[rank] = proc
        self.exited: str | None = None  # why a rank is gone, once one is
        self._on_exit = on_exit
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="weft-rank-watch", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> dict[int, int | None]:
        return {rank: proc.pid for rank, proc in self.procs.items()}

    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in self.procs.items()}
        ready = wait([*sentinels, self._wake_r])
        if self._stopping:
            return
        rank = next(sentinels[s] for s in ready if s in sentinels)  # type: ignore[index]
        proc = self.procs[rank]
        proc.join(1.0)  # (the sentinel closes a moment before the exit code can be read)
        self.exited = f"tensor-parallel rank {rank} exited ({exit_status(proc.exitcode)})"
        logger.log(logging.ERROR if proc.exitcode else logging.INFO, "%s", self.exited)
        if self._on_exit is not None:
            self._on_exit(self.exited)

    def expect_exit(self) -> None:
        """The ranks are about to exit (told to stop): no longer a failure to report."""
        if not self._stopping:
            self._stopping = True
            os.write(self._wake_w, b"x")

    def stop(self, *, terminate: bool = False) -> None:
        """Join the ranks (told to stop already, failed, or terminated here: SIGTERM ends a rank
        at once); kill those that do not exit."""
        self.expect_exit()
        if terminate:
            for proc in self.procs.values():
                proc.terminate()
        deadline = time.monotonic() + RANK_STOP_TIMEOUT_S
        for rank, proc in self.procs.items():
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                logger.warning("tensor-parallel rank %d did not stop; killing it", rank)
                proc.kill()
                proc.join()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)


class Rank0:
    """Rank 0's side of the group: the store the ranks meet at, this host's other rank
    processes, and rank 0's model behind the driver the scheduler runs its steps through."""

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        on_exit: Callable[[str], None] | None = None,
    ) -> None:
        host, port = store_address(config)
        store = dist.TCPStore(
            host,
            port,
            config.tp_size,
            is_master=True,
            timeout=TP_COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )
        ranks = range(1, config.ranks_per_node)
        self.ranks = RankProcesses(config, source, ranks, (host, store.port), on_exit)
        self._closed = False
        try:
            self.link = join(config, 0, store)
            try:
                # (the other ranks build theirs meanwhile)
                self.driver = TPDriver(ModelRunner(config, source, tp=self.link.tp), self.link)
            except BaseException:
                leave(self.link)
                raise
        except BaseException:
            self.ranks.stop(terminate=True)
            raise

    def close(self) -> None:
        """Stop the ranks (they leave their loop and exit) and leave the group; once."""
        if self._closed:
            return
        self._closed = True
        self.ranks.expect_exit()
        if self.ranks.exited is None:
            try:
                self.driver.stop()
            except RuntimeError as exc:  # a rank of another host is gone (its socket closed)
                logger.warning("cannot tell every tensor-parallel rank to stop: %s", exc)
        self.ranks.stop()
        leave(self.link)


def run_rank(
    config: EngineConfig,
    source: ModelSource,
    rank: int,
    address: tuple[str, int],
    parent_pid: int,
) -> None:
    """A rank process (ranks > 0): build this rank's model, follow rank 0, exit."""
    # NOTE: no SIGTERM handler (a Python handler would wait for the collective the rank is
    # blocked in, possibly forever): SIGTERM ends the process at once. Ctrl-C is the parent's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(config.log_level, f"rank {rank}")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        host, port = address
        store = dist.TCPStore(
            host, port, config.tp_size, is_master=False, timeout=TP_COLLECTIVE_TIMEOUT
        )
        link = join(config, rank, store)
        follow(ModelRunner(config, source, tp=link.tp), link)
        leave(link)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        exit_now(1)
    exit_now(0)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    logger.info("the process that started this rank is gone; exiting")
    os._exit(0)


def serve_node(config: EngineConfig, source: ModelSource) -> int:
    """`weft serve --node-rank h` (h > 0): run this host's ranks until one exits (rank 0 told
    them to stop, or something failed); SIGTERM or Ctrl-C stops them. Returns the exit code."""
    first = config.node_rank * config.ranks_per_node
    ranks = range(first, first + config.ranks_per_node)
    done = threading.Event()
    procs = RankProcesses(config, source, ranks, store_address(config), lambda why: done.set())
    print(f"weft: node {config.node_rank} runs tensor-parallel ranks {list(ranks)}", flush=True)
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(PARENT_CHECK_S):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        procs.stop(terminate=procs.exited is None)  # (a signal: the ranks were not told to stop)
    codes = [proc.exitcode for proc in procs.procs.values()]
    return 0 if all(code in (0, -signal.SIGTERM) for code in codes) else 1
