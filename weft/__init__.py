"""weft: a structured-generation LLM runtime with a Python program DSL (SGLang's, so that
`import weft as sgl` runs SGLang programs).

Programs (docs/dsl.md):
    @weft.function            a program: a Python function of a state `s`
    s += text, gen(...), select(...), system/user/assistant(...), s.fork(n) / .join()
    separate_reasoning(gen("x"), model_type="qwen3")   s["x"], s["x_reasoning_content"]
    prog.run(..., backend=...), prog(...), prog.run_batch([...]), prog.trace(...)
    gen_int, gen_string, *_begin / *_end role markers, ChoicesSamplingMethod and the three
    choices methods, set_default_backend
Backends:
    Engine(model_path=None, **options)   the model in-process (None: the embedded default model)
    RuntimeEndpoint(url)                 a running `weft serve` (or SGLang) server
    Runtime(model_path=None, **options)  a server started from Python (SGLang's sgl.Runtime)
    OpenAIBackend(base_url, model)       any OpenAI-compatible server
    SamplingParams                       SGLang's sampling parameters
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any


def _unshadow() -> None:
    """Take the checkout's root off sys.path (`python -m ...` run from it puts it there).
    HAZARD: weft's subpackages live in the root's folders (kernels/, runtime/, grammars/, linked
    into weft/), so from the root they are also importable by their bare names and shadow the
    packages of those names: transformers 5 imports the `kernels` package (a dependency of it)
    whenever it is installed, and got ours, failing every tokenizer load."""
    here = os.path.dirname(os.path.realpath(__file__))
    if not os.path.islink(os.path.join(here, "kernels")):
        return  # an installed copy (its folder is site-packages, which must stay)
    root = os.path.dirname(here)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]


_unshadow()

if TYPE_CHECKING:
    from weft.frontend import (
        Backend,
        BackendError,
        ChoicesDecision,
        ChoicesSamplingMethod,
        OpenAIBackend,
        ProgramError,
        ProgramState,
        Runtime,
        RuntimeEndpoint,
        assistant,
        assistant_begin,
        assistant_end,
        flush_cache,
        function,
        gen,
        gen_int,
        gen_string,
        get_default_backend,
        get_server_info,
        greedy_token_selection,
        select,
        separate_reasoning,
        set_default_backend,
        system,
        system_begin,
        system_end,
        token_length_normalized,
        unconditional_likelihood_normalized,
        user,
        user_begin,
        user_end,
    )
    from weft.runtime.engine import Engine
    from weft.runtime.sampling_params import SamplingParams

__all__ = [
    "Backend",
    "BackendError",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Engine",
    "OpenAIBackend",
    "ProgramError",
    "ProgramState",
    "Runtime",
    "RuntimeEndpoint",
    "SamplingParams",
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
    if name in __all__:  # the DSL's names (Engine and SamplingParams are above)
        import weft.frontend

        return getattr(weft.frontend, name)
    raise AttributeError(f"module 'weft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
