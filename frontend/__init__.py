"""The weft program DSL: `@weft.function`, gen, select, roles, and the backends."""

from __future__ import annotations

from weft.frontend.api import assistant, gen, select, system, user
from weft.frontend.backend import Backend, BackendError
from weft.frontend.openai_backend import OpenAIBackend
from weft.frontend.program import Plan, Program, function
from weft.frontend.runtime_endpoint import RuntimeEndpoint
from weft.frontend.state import ForkGroup, ProgramError, ProgramState

__all__ = [
    "Backend",
    "BackendError",
    "ForkGroup",
    "OpenAIBackend",
    "Plan",
    "Program",
    "ProgramError",
    "ProgramState",
    "RuntimeEndpoint",
    "assistant",
    "function",
    "gen",
    "select",
    "system",
    "user",
]
