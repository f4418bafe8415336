"""Server configuration: the engine's fields plus what only the HTTP server needs.

`weft serve` flags are generated from these fields (engine fields included), so the defaults live
here and in `EngineConfig` only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from weft.runtime.config import EngineConfig, _help

DEFAULT_PORT = 30000


@dataclass(frozen=True)
class ServerConfig(EngineConfig):
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=DEFAULT_PORT, metadata=_help("port to listen on (0 = any free port)"))
    api_key: str | None = field(
        default=None, metadata=_help("require 'Authorization: Bearer KEY' on every API route")
    )
    served_model_name: str | None = field(
        default=None, metadata=_help("model name in the OpenAI API (default: the model path)")
    )
    chat_template: str | None = field(
        default=None,
        metadata=_help("chat template file or Jinja string (default: the tokenizer's own)"),
    )
    enable_metrics: bool = field(default=False, metadata=_help("serve Prometheus /metrics"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (omit it to turn authentication off)")

    @property
    def engine_config(self) -> EngineConfig:
        """The engine part alone (what the scheduler process builds its model from)."""
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{k: v for k, v in self.to_dict().items() if k in names})

    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        if redact and values["api_key"] is not None:
            values["api_key"] = "<set>"
        return values
