"""The request log (--request-log): one JSON object per finished request, one line each.

    {"time", "rid", "tenant", "api", "prompt_tokens", "completion_tokens", "cached_tokens",
     "ttft_s", "e2e_s", "finish_reason", "status", "error"}
    plus "prompt" and "output" (one text per sample) with --log-prompts only.

`status` is "ok", "aborted" or an error kind (`errors.ERROR_KINDS`), `error` the message (else
null); `time` is when the request ended (UTC). A line is one `os.write` from the event loop (no
buffer, so nothing to flush): microseconds on a local disk. NOTE: a log on a slow network
filesystem would stall the server's event loop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from weft.runtime.server.request_state import ReqState

logger = logging.getLogger("weft")


class RequestLog:
    def __init__(self, path: str, with_texts: bool) -> None:
        self.path = path
        self.with_texts = with_texts
        self._failed = False
        self._owned = path != "-"
        if not self._owned:
            self._fd = sys.stderr.fileno()
            return
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ValueError(f"cannot open the request log {path}: {exc.strerror}") from None

    def write(self, record: dict[str, Any]) -> None:
        """Append one line; a failing disk costs the log, never the request (reported once)."""
        view = memoryview(msgspec.json.encode(record) + b"\n")
        try:
            while view:  # one write, unless a pipe takes only part of a long line
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            if not self._failed:
                self._failed = True
                logger.error("cannot write the request log %s: %s", self.path, exc)

    def close(self) -> None:
        if self._owned and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def request_record(state: ReqState, prompt: str | None = None) -> dict[str, Any]:
    """The log line of a finished (or failed) request; `prompt` given: the texts too."""
    status, error = state.outcome()
    firsts = [s.first_token_at for s in state.samples if s.first_token_at is not None]
    e2e = state.e2e_latency
    reason = state.samples[0].finish_reason
    now = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    record: dict[str, Any] = {
        "time": now.replace("+00:00", "Z"),
        "rid": state.rid,
        "tenant": state.tenant,
        "api": state.api,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.completion_tokens,
        "cached_tokens": state.cached_tokens,
        "ttft_s": round(min(firsts) - state.created, 6) if firsts else None,
        "e2e_s": round(e2e if e2e is not None else time.perf_counter() - state.created, 6),
        "finish_reason": reason["type"] if reason else None,
        "status": status,
        "error": error,
    }
    if prompt is not None:
        record["prompt"] = prompt
        record["output"] = [s.text for s in state.samples]
    return record
