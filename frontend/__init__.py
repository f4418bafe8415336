"""The weft program DSL: `@weft.function`, gen, select, roles, and the backends."""

from __future__ import annotations

from weft.frontend.api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from weft.frontend.backend import Backend, BackendError
from weft.frontend.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from weft.frontend.interpreter import ProgramError
from weft.frontend.openai_backend import OpenAIBackend
from weft.frontend.program import (
    Plan,
    Program,
    flush_cache,
    function,
    get_default_backend,
    get_server_info,
    set_default_backend,
)
from weft.frontend.runtime import Runtime
from weft.frontend.runtime_endpoint import RuntimeEndpoint
from weft.frontend.state import ForkGroup, ProgramState

__all__ = [
    "Backend",
    "BackendError",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "ForkGroup",
    "OpenAIBackend",
    "Plan",
    "Program",
    "ProgramError",
    "ProgramState",
    "Runtime",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "greedy_token_selection",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
