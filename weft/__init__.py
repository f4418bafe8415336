"""weft: a structured-generation LLM runtime with a Python program DSL."""

from __future__ import annotations

from weft.runtime.engine import Engine
from weft.runtime.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams"]
__version__ = "0.1.0"
