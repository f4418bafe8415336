"""Server configuration: the engine's fields plus what only the HTTP server needs.

`weft serve` flags are generated from these fields (engine fields included), so the defaults live
here and in `EngineConfig` only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from weft.runtime.config import EngineConfig, option
from weft.runtime.server.reasoning import REASONING_PARSERS, ReasoningFormat, reasoning_format

DEFAULT_PORT = 30000
# sglang-router's policies (--router-policy)
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True)
class ServerConfig(EngineConfig):
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(DEFAULT_PORT, "port to listen on (0 = any free port)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every API route")
    api_keys_file: str | None = option(
        None,
        'JSON file {"KEY": "TENANT", ...}: each key is accepted, and tenants never share '
        "prefix-cache entries (--api-key's tenant is 'default')",
    )
    admin_api_key: str | None = option(
        None,
        "with --api-keys-file, the only key that may call /flush_cache, /get_server_info and "
        "abort other tenants' requests; accepted on every route (its tenant is 'admin')",
    )
    max_queued_requests: int | None = option(
        None,
        "refuse requests with a 503 while this many samples wait for their first token "
        "(default: unbounded)",
    )
    request_timeout: float | None = option(
        None, "seconds after which an unfinished request is aborted (default: never)"
    )
    max_request_body_bytes: int = option(
        32 * 1024 * 1024, "refuse larger request bodies with a 413"
    )
    header_timeout_s: float = option(
        10.0,
        "seconds a request's headers may take to arrive (from the connection's start, or the "
        "request's first byte); a later one gets a 408 and the connection is closed",
    )
    served_model_name: str | None = option(
        None, "model name in the OpenAI API (default: the model path)"
    )
    chat_template: str | None = option(
        None, "chat template file or Jinja string (default: the tokenizer's own)"
    )
    trust_request_chat_template: bool = option(
        False,
        "accept a chat request's own chat_template (vLLM's field; its Jinja runs in "
        "transformers' sandbox; off: such a request is a 400)",
    )
    reasoning_parser: str | None = option(
        None,
        "split the thinking from the answer: qwen3 and deepseek-r1 (<think>...</think>), or "
        "generic (--reasoning-start / --reasoning-end); chat returns it as reasoning_content, "
        "/generate as reasoning_text with separate_reasoning",
        choices=REASONING_PARSERS,
    )
    reasoning_start: str | None = option(
        None,
        "generic reasoning parser: the start marker, which an output may write to open its "
        "thinking (omitted: the output begins thinking)",
    )
    reasoning_end: str | None = option(None, "generic reasoning parser: the end marker")
    enable_metrics: bool = option(False, "serve Prometheus /metrics")
    request_log: str | None = option(
        None, "append one JSON line per finished request to this file ('-' = stderr)"
    )
    log_prompts: bool = option(
        False, "put the prompt and output texts in the request log (off: counts only)"
    )
    # NOTE: as vLLM's --shutdown-timeout. Kubernetes kills a pod terminationGracePeriodSeconds
    # (30 by default) after its SIGTERM: raise that above this grace, or the drain is cut short.
    shutdown_grace_s: float = option(
        30.0, "on SIGTERM, seconds running requests get to finish before they fail (0 = at once)"
    )

    dp_size: int = option(
        1,
        "data parallelism: this many replicas of the server behind sglang-router (pip install "
        "'weft[router]'), which listens on --host / --port; on CUDA each replica takes its own "
        "GPUs",
    )
    router_policy: str = option(
        "cache_aware",
        "with --dp-size: how sglang-router picks a replica (cache_aware: the one whose prefix "
        "cache holds most of the prompt, unless loads drift apart)",
        choices=ROUTER_POLICIES,
    )

    watchdog_timeout: float = option(
        300.0,
        "seconds the scheduler may hold requests without a step before the server fails "
        "them and exits non-zero, for a supervisor to restart it (0 = never; /health "
        "reports the stall sooner)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (omit it to turn authentication off)")
        if self.api_keys_file == "":
            raise ValueError("api_keys_file must not be empty (omit it to turn tenants off)")
        if self.admin_api_key == "":
            raise ValueError("admin_api_key must not be empty (omit it to have no admin key)")
        for name in ("max_queued_requests", "max_request_body_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if not self.watchdog_timeout >= 0:
            raise ValueError(f"watchdog_timeout must be >= 0, got {self.watchdog_timeout}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if self.request_log == "":
            raise ValueError("request_log must not be empty (omit it to turn the log off)")
        if self.log_prompts and self.request_log is None:
            raise ValueError("log_prompts needs request_log (the file the texts go to)")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError(
                "dp_size starts its replicas on this host; for replicas on several hosts, "
                "start weft serve on each and sglang-router in front of them (README)"
            )
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        given = self.reasoning_start is not None or self.reasoning_end is not None
        if given and self.reasoning_parser != "generic":
            raise ValueError("reasoning_start and reasoning_end are for reasoning_parser generic")
        if self.reasoning_parser is not None:
            self.reasoning_format  # noqa: B018 - raises ValueError on bad markers

    @property
    def reasoning_format(self) -> ReasoningFormat | None:
        """--reasoning-parser's markers, None without one."""
        if self.reasoning_parser is None:
            return None
        return reasoning_format(self.reasoning_parser, self.reasoning_start, self.reasoning_end)

    @property
    def engine_config(self) -> EngineConfig:
        """The engine part alone (what the scheduler process builds its model from)."""
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{k: v for k, v in self.to_dict().items() if k in names})

    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        if redact:
            for name in ("api_key", "api_keys_file", "admin_api_key"):
                if values[name] is not None:
                    values[name] = "<set>"
        return values
