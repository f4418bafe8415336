"""weft: a structured-generation LLM runtime with a Python program DSL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weft.runtime.engine import Engine
    from weft.runtime.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so that processes which never run a model (the HTTP server, the detokenizer)
    # do not pay for importing torch through `import weft`.
    if name == "Engine":
        from weft.runtime.engine import Engine

        return Engine
    if name == "SamplingParams":
        from weft.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'weft' has no attribute {name!r}")
