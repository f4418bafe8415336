"""`weft.Runtime`: SGLang's `sgl.Runtime`, a server started from Python and used as a backend.

It runs `weft serve` as a child process on 127.0.0.1 with a free port, waits for its ready line,
and is then a RuntimeEndpoint on it; `shutdown()` (or leaving a `with` block) stops it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from typing import Any

from weft.frontend.backend import BackendError
from weft.frontend.runtime_endpoint import RuntimeEndpoint

_READY = re.compile(r"weft: ready, serving .* at (http://\S+) ")
STARTUP_TIMEOUT_S = 600.0  # loading a large model from disk
_KEEP_LINES = 200  # the last lines of the server's output, shown when it fails to start


class Runtime(RuntimeEndpoint):
    """`weft.Runtime(model_path=None, **server_options)`: start a server (the options are
    `weft serve`'s flags, underscores for dashes; None: the embedded default model) and use it
    as a backend. Its output goes to this process's stderr after startup."""

    def __init__(self, model_path: str | None = None, **server_options: Any) -> None:
        from weft.runtime.cli_args import config_flags
        from weft.runtime.server_config import ServerConfig

        options = {"model_path": model_path, **server_options, "host": "127.0.0.1", "port": 0}
        flags = config_flags(ServerConfig, options)  # TypeError naming an unknown option
        cmd = [sys.executable, "-m", "weft.launch_server", *flags]
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._lines: list[str] = []
        url = self._wait_ready()
        super().__init__(url, server_options.get("api_key"))

    def _wait_ready(self) -> str:
        found: dict[str, str] = {}
        ready = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                if ready.is_set():
                    sys.stderr.write(line)
                    continue
                self._lines = [*self._lines[-_KEEP_LINES:], line]
                match = _READY.search(line)
                if match:
                    found["url"] = match.group(1)
                    ready.set()
            ready.set()  # the process ended

        threading.Thread(target=read, name="weft-runtime-output", daemon=True).start()
        if not ready.wait(STARTUP_TIMEOUT_S) or "url" not in found:
            self.process.kill()
            raise BackendError("weft.Runtime: the server did not start:\n" + "".join(self._lines))
        return found["url"]

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the server (SIGTERM: running requests finish first), then wait for it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
