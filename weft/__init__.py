"""weft: a structured-generation LLM runtime with a Python program DSL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weft.frontend import (
        OpenAIBackend,
        RuntimeEndpoint,
        assistant,
        function,
        gen,
        select,
        system,
        user,
    )
    from weft.runtime.engine import Engine
    from weft.runtime.sampling_params import SamplingParams

_DSL = (
    "function",
    "gen",
    "select",
    "system",
    "user",
    "assistant",
    "RuntimeEndpoint",
    "OpenAIBackend",
)
__all__ = [
    "Engine",
    "OpenAIBackend",
    "RuntimeEndpoint",
    "SamplingParams",
    "assistant",
    "function",
    "gen",
    "select",
    "system",
    "user",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so that processes which never run a model (the HTTP server, the detokenizer)
    # do not pay for importing torch through `import weft`, nor httpx for the DSL.
    if name == "Engine":
        from weft.runtime.engine import Engine

        return Engine
    if name == "SamplingParams":
        from weft.runtime.sampling_params import SamplingParams

        return SamplingParams
    if name in _DSL:
        import weft.frontend

        return getattr(weft.frontend, name)
    raise AttributeError(f"module 'weft' has no attribute {name!r}")
