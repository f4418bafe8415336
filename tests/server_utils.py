"""Run the real server as a subprocess on 127.0.0.1 with a free port, for tests.

The server is started with --port 0 and reports the port it bound in its ready line, so no port
is ever guessed. Teardown sends SIGTERM and checks that no child process is left behind.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import requests

READY = re.compile(r"weft: ready, serving .* at (http://[^ ]+) ")
STARTUP_TIMEOUT_S = 180.0


def stories_args(stories_dir: Any, *extra: str) -> list[str]:
    """The test servers' common start: stories260K with a 4096-token KV pool, then `extra`."""
    return ["--model-path", str(stories_dir), "--max-total-tokens", "4096", *extra]


def schedule_args(schedule: str) -> list[str]:
    """Serve flags for a schedule ("plain" or "overlap"), on any device."""
    return {"plain": ["--disable-overlap-schedule"], "overlap": ["--enable-overlap-schedule"]}[
        schedule
    ]


@functools.cache
def checkout_path() -> str:
    """A folder that holds only `weft`, linked to this checkout's: on a server's PYTHONPATH, its
    processes import the weft under test (not an installed one), and the checkout's root, which
    weft takes off sys.path (weft._unshadow), is not needed there."""
    folder = Path(tempfile.mkdtemp(prefix="weft-path-"))
    (folder / "weft").symlink_to(Path(__file__).resolve().parents[1] / "weft")
    return str(folder)


def checkout_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that must run this checkout's weft (`checkout_path`)."""
    merged = {**os.environ, **(env or {})}
    paths = [checkout_path(), *filter(None, merged.get("PYTHONPATH", "").split(os.pathsep))]
    return {**merged, "PYTHONPATH": os.pathsep.join(paths)}


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [
            sys.executable,
            "-m",
            "weft.launch_server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-show-progress",
            "--log-level",
            "warning",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=checkout_env(env),
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait_ready()
        self.children_pids = [c.pid for c in self.ps.children(recursive=True)]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = READY.search(line)
            if match:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # the process ended

    def _wait_ready(self) -> None:
        if not self._ready.wait(STARTUP_TIMEOUT_S) or not self.url:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + self.output)
        requests.get(self.url + "/health", timeout=10).raise_for_status()

    @property
    def ps(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def child(self, name: str) -> psutil.Process:
        """The scheduler or detokenizer process (by start order: scheduler first)."""
        spawned = sorted(
            (c for c in self.ps.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())),
            key=lambda c: c.pid,
        )
        return spawned[{"scheduler": 0, "detokenizer": 1}[name]]

    @contextmanager
    def scheduler_paused(self) -> Iterator[None]:
        """SIGSTOP the scheduler (no running request can finish by itself), SIGCONT at exit.
        NOTE: /get_server_info asks the scheduler: it hangs while paused."""
        scheduler = self.child("scheduler")
        scheduler.suspend()
        try:
            yield
        finally:
            scheduler.resume()

    def wait_health(self, status: int, timeout: float = 10.0) -> None:
        """Until /health answers `status` (a signal is handled a moment after it is sent)."""
        deadline = time.monotonic() + timeout
        while (got := self.get("/health").status_code) != status:
            assert time.monotonic() < deadline, f"/health is still {got}, not {status}"
            time.sleep(0.01)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then check that the server and all its children are gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        if code != 0:  # the teardown's error report shows why the server ended
            print(f"the server exited {code}:\n{self.output}", file=sys.stderr)
        deadline = time.monotonic() + 10
        left = self.leftover_children()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.leftover_children()
        assert not left, f"child processes left behind: {left}\n{self.output}"
        return code

    def leftover_children(self) -> list[int]:
        alive = []
        for pid in self.children_pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    # ---- HTTP helpers ---------------------------------------------------------------------

    def post(self, path: str, body: Any = None, **kwargs: Any) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=60, **kwargs)

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return requests.get(self.url + path, timeout=60, **kwargs)

    def generate(self, body: dict[str, Any]) -> Any:
        r = self.post("/generate", body)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[Any]:
        """The parsed `data:` events of an SSE response, "[DONE]" included as a string."""
        with requests.post(self.url + path, json=body, stream=True, timeout=60) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    data = line[6:]
                    yield "[DONE]" if data == b"[DONE]" else json.loads(data)

    def server_info(self) -> dict[str, Any]:
        r = self.get("/get_server_info")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Server info once nothing is pending or running (aborts are asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info()
            idle = (
                info["num_pending"] == 0 and info["num_running"] == 0 and info["num_waiting"] == 0
            )
            if idle or time.monotonic() > deadline:
                return info
            time.sleep(0.05)

    def assert_kv_intact(self) -> dict[str, Any]:
        info = self.wait_idle()
        assert info["num_running"] == 0 and info["num_pending"] == 0, info
        assert info["kv_integrity_ok"], info["kv_integrity_error"]
        assert info["kv_pool"]["in_use"] == 0, info["kv_pool"]
        assert info["kv_pool"].get("draft_in_use", 0) == 0, info["kv_pool"]
        return info
