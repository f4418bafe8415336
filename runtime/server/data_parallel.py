"""`weft serve --dp-size N`: N weft servers behind sglang-router, started by one command.

    this process (waits, forwards signals)
      |-- weft serve (replica 0, 127.0.0.1, any free port)   each its own scheduler, KV cache
      |-- ...
      `-- sglang-router (--host / --port: the address clients use), cache-aware by default

The router (the Rust one on PyPI, `pip install sglang-router`) speaks SGLang's native API, which
weft serves: it registers each replica through /model_info and /health, reads its load from
/get_load (power_of_two) and sends each request to the replica whose radix cache holds the
longest prefix of it (cache_aware), unless the replicas' loads drift too far apart. On CUDA each
replica gets its own GPUs (tp_size of them) through CUDA_VISIBLE_DEVICES.

Any process that exits ends the others (a supervisor restarts the whole group): SIGTERM drains
the replicas as it drains a single server.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace

from weft.runtime.cli_args import config_flags
from weft.runtime.server_config import ServerConfig

READY = re.compile(r"weft: ready, serving .* at (http://[^ ]+) ")
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.2


class _Group:
    """The replicas and the router, started and stopped together."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # NOTE: a Ctrl-C reaches this process only: it stops them
        )
        self.procs.append((name, proc))

    def first_exited(self) -> tuple[str, int] | None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def stop(self) -> None:
        # the router first: no request goes to a replica that is draining
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _relay(name: str, proc: subprocess.Popen[str], ready: re.Pattern[str] | None) -> list[str]:
    """Echo a child's output with its name; returns the list its ready URL lands in."""
    found: list[str] = []

    def run() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = ready.search(line) if ready is not None else None
            if match:
                found.append(match.group(1))
                # NOTE: not as it is: the group's own ready line must be the only one (scripts
                # wait for it)
                line = f"up at {match.group(1)}\n"
            print(f"[{name}] {line}", end="", flush=True)

    threading.Thread(target=run, daemon=True).start()
    return found


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _replica_env(config: ServerConfig, rank: int) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of replica `rank` (tp_size GPUs each), on CUDA only."""
    if config.device == "cpu":
        return {}
    import torch

    if not torch.cuda.is_available():
        return {}
    tp = config.tp_size
    count = torch.cuda.device_count()
    if count < config.dp_size * tp:
        raise ValueError(
            f"dp_size {config.dp_size} x tp_size {tp} needs {config.dp_size * tp} GPUs, "
            f"{count} visible"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(rank * tp + i) for i in range(tp))}


def _router_command(config: ServerConfig, urls: list[str], port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *urls,
        "--policy",
        config.router_policy,
        "--host",
        config.host,
        "--port",
        str(port),
        # NOTE: its metrics exporter binds a fixed port (29000) by default: two groups on one
        # host would collide
        "--prometheus-port",
        str(_free_port(config.host)),
        "--log-level",
        "warn" if config.log_level.lower() == "warning" else config.log_level.lower(),
    ]


def _router_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def launch_data_parallel(config: ServerConfig) -> int:
    """Serve `config` as dp_size replicas behind sglang-router until a signal or until any of
    them exits. Returns the exit code."""
    if importlib.util.find_spec("sglang_router") is None:
        print(
            "weft: cannot start: --dp-size needs sglang-router (pip install 'weft[router]')",
            file=sys.stderr,
            flush=True,
        )
        return 1
    group = _Group()
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        replica = replace(config, dp_size=1, host="127.0.0.1", port=0)
        flags = config_flags(ServerConfig, replica.to_dict())
        ready: list[list[str]] = []
        for rank in range(config.dp_size):
            cmd = [sys.executable, "-m", "weft.launch_server", *flags]
            group.start(f"replica {rank}", cmd, _replica_env(config, rank))
            ready.append(_relay(f"replica {rank}", group.procs[-1][1], READY))
        print(f"weft: starting {config.dp_size} replicas", flush=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(ready):
            if stop.is_set() or group.first_exited() or time.monotonic() > deadline:
                return _ended(group, stop, "while the replicas started")
            time.sleep(POLL_S)
        urls = [found[0] for found in ready]
        port = config.port or _free_port(config.host)
        group.start("router", _router_command(config, urls, port))
        _relay("router", group.procs[-1][1], None)
        url = f"http://{config.host}:{port}"
        while not _router_up(url):
            if stop.is_set() or group.first_exited() or time.monotonic() > deadline:
                return _ended(group, stop, "while the router started")
            time.sleep(POLL_S)
        print(
            f"weft: ready, serving {config.dp_size} replicas ({', '.join(urls)}) at {url} "
            f"through sglang-router ({config.router_policy})",
            flush=True,
        )
        while not stop.wait(POLL_S):
            if group.first_exited():
                return _ended(group, stop, "while serving")
        return _ended(group, stop, "while serving")
    finally:
        group.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _ended(group: _Group, stop: threading.Event, when: str) -> int:
    exited = group.first_exited()
    if exited is None:
        print("weft: stopping" if stop.is_set() else f"weft: timed out {when}", flush=True)
        return 0 if stop.is_set() else 1
    name, code = exited
    print(f"weft: {name} exited with status {code} {when}; stopping the others", flush=True)
    return 1
