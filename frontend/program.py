"""`@weft.function`: a program is a Python function of a state; run, run_batch and trace."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from tqdm import tqdm

from weft.frontend.api import SAMPLING_NAMES
from weft.frontend.backend import Backend, ChatRenderer, GenResult, Message, as_backend
from weft.frontend.interpreter import PlannedRequest, RunContext
from weft.frontend.state import ProgramState

WARM_MIN_CHARS = 32  # a shared batch prefix shorter than this is not sent ahead
# programs traced to find a batch's shared prefix (a trace may render roles on the server)
WARM_SAMPLE = 16
_default_backend: Backend | None = None


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when `run`, `run_batch` or a call names none."""
    global _default_backend
    _default_backend = None if backend is None else as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default_backend


def flush_cache(backend: Any = None) -> bool:
    """Empty the backend's prefix cache (default: the default backend); False while requests
    are running."""
    return _backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    """The backend's configuration and state (default: the default backend)."""
    return _backend(backend).get_server_info()


def _backend(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise ValueError("no backend: pass backend=... or call weft.set_default_backend(...) first")
    return _default_backend


def _defaults(sampling: dict[str, Any]) -> dict[str, Any]:
    """Run-wide sampling defaults, by gen()'s names or SGLang's."""
    out = {}
    for key, value in sampling.items():
        name = SAMPLING_NAMES.get(key, key)
        if name not in SAMPLING_NAMES.values():
            raise TypeError(f"unknown run() argument {key!r}")
        if value is not None:
            out[name] = value
    return out


class Program:
    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@weft.function {func.__name__}: the first argument is the state")
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def __repr__(self) -> str:
        return f"<weft program {self.func.__name__}>"

    def _start(
        self,
        ctx: RunContext,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        keep_error: bool = False,
    ) -> ProgramState:
        """Run the program's body, which queues its steps. A body that raises has what it queued
        cancelled; the error propagates, or with `keep_error` (a batch member) stays on the
        state, whose reading raises it, and the batch goes on."""
        state = ProgramState(ctx)
        try:
            self.func(state, *args, **kwargs)
        except BaseException as exc:
            ctx.close()
            ctx.cancel_all(exc)
            if not (keep_error and isinstance(exc, Exception)):
                raise
            state.fail(exc)
        ctx.close()
        return state

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        """`prog(...)` is `prog.run(...)` (as in SGLang)."""
        return self.run(*args, **kwargs)

    def run(
        self, *args: Any, backend: Any = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run once, on `backend` (an Engine, RuntimeEndpoint or OpenAIBackend; default: the
        one given to weft.set_default_backend). Keyword arguments the function takes go to it;
        the rest are sampling defaults (max_new_tokens, temperature, ...). With stream=True the
        state comes back at once: read it with state.text_iter(name)."""
        fn_kwargs, sampling = self._split(kwargs)
        ctx = RunContext(_backend(backend), defaults=_defaults(sampling), stream=stream)
        state = self._start(ctx, args, fn_kwargs)
        if not stream:
            ctx.block(ctx.wait_all())
        return state

    async def run_async(
        self, *args: Any, backend: Any = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run on the caller's event loop. The function must not read a variable before the end
        (nothing can block there); with stream=True use `async for x in state.text_async_iter()`."""
        fn_kwargs, sampling = self._split(kwargs)
        loop = asyncio.get_running_loop()
        ctx = RunContext(_backend(backend), loop=loop, defaults=_defaults(sampling), stream=stream)
        state = self._start(ctx, args, fn_kwargs)
        if not stream:
            await ctx.wait_all()
        return state

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Any = None,
        progress_bar: bool = False,
        max_concurrency: int | None = None,
        num_threads: int | str = "auto",
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run once per kwargs dict, all on one event loop, at most `max_concurrency` requests
        in flight. A failed program keeps its error: reading its state raises it.

        `num_threads` (SGLang's name): an int caps the requests in flight like
        `max_concurrency` (weft runs a batch's programs as tasks on one loop, not threads);
        "auto" leaves them uncapped."""
        if num_threads != "auto":
            if not isinstance(num_threads, int) or num_threads < 1:
                raise ValueError(f"num_threads must be 'auto' or an int >= 1, got {num_threads!r}")
            max_concurrency = min(max_concurrency or num_threads, num_threads)
        be = _backend(backend)
        defaults = _defaults(sampling)
        loop = asyncio.new_event_loop()
        prefix = self._shared_prefix(be, batch_kwargs, sampling)
        if prefix:  # computed once, so the radix cache serves it to every program
            loop.run_until_complete(_warm(be, prefix))
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        contexts = []
        states = []
        for kwargs in batch_kwargs:
            ctx = RunContext(be, loop=loop, defaults=defaults, semaphore=sem, own_loop=False)
            contexts.append(ctx)
            states.append(self._start(ctx, (), kwargs, keep_error=True))

        async def finish() -> None:
            with tqdm(total=len(contexts), disable=not progress_bar, desc=self.__name__) as bar:
                for done in asyncio.as_completed([_settle(c) for c in contexts]):
                    await done
                    bar.update(1)

        loop.run_until_complete(finish())
        return states

    def _shared_prefix(
        self, be: Backend, batch_kwargs: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> str:
        """The text prompt that the first requests of the first WARM_SAMPLE programs start
        with, if long enough to be worth sending first ('' otherwise): a program beyond the
        sample that does not share it only had one prefill sent early."""
        if len(batch_kwargs) < 2:
            return ""
        prompts = []
        for kwargs in batch_kwargs[:WARM_SAMPLE]:
            try:
                plan = self.trace(backend=be, **{**sampling, **kwargs})
            except Exception:  # the real run reports it, on that program's state
                return ""
            if not plan or not isinstance(plan[0].prompt, str) or plan[0].kind == "chat":
                return ""
            prompts.append(plan[0].prompt)
        common = os.path.commonprefix(prompts)  # noqa: RUF071 - characters are what we want
        return common if len(common) >= WARM_MIN_CHARS else ""

    def trace(self, *args: Any, backend: Any = None, **kwargs: Any) -> Plan:
        """The requests a run would send, without a model: gens answer with a placeholder,
        selects pick the first choice. Pass `backend` to render roles with its chat template
        (without one, roles render as `<|role|>` lines)."""
        fn_kwargs, sampling = self._split(kwargs)
        source = as_backend(backend) if backend is not None else None
        ctx = RunContext(_TraceBackend(source), defaults=_defaults(sampling), tracing=True)
        self._start(ctx, args, fn_kwargs)
        ctx.block(ctx.wait_all())
        return Plan(ctx.plan)

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        sig = inspect.signature(self.func)
        takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        fn = {k: v for k, v in kwargs.items() if takes_any or k in sig.parameters}
        return fn, {k: v for k, v in kwargs.items() if k not in fn}


async def _warm(be: Backend, prefix: str) -> None:
    with contextlib.suppress(Exception):  # only an optimisation: the programs still run
        await be.generate(prefix, {"max_new_tokens": 0})


async def _settle(ctx: RunContext) -> None:
    with contextlib.suppress(Exception):  # kept on the state: reading it raises
        await ctx.wait_all()


def function(func: Callable[..., Any]) -> Program:
    """Decorator: `@weft.function def prog(s, question): s += ...`."""
    return Program(func)


class Plan(list[PlannedRequest]):
    """The requests of a traced run, in the order they were issued."""

    def __str__(self) -> str:
        return "\n".join(f"{i + 1:>3}. {r}" for i, r in enumerate(self))


async def _placeholder(messages: list[Message]) -> str:
    """A stand-in chat template for traces without a backend."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


class _TraceBackend(Backend):
    name = "trace"

    def __init__(self, source: Backend | None) -> None:
        self._source = source  # whose chat template renders roles (None: a placeholder)

    async def generate(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> GenResult:
        # one token per character, as in prompt_logprobs below
        meta = {"prompt_tokens": len(prompt)}
        return GenResult("" if params.get("max_new_tokens") == 0 else "<gen>", meta)

    async def generate_stream(
        self, prompt: str, params: dict[str, Any], options: dict[str, Any] | None = None
    ) -> AsyncIterator[GenResult]:
        yield GenResult("<gen>")

    async def prompt_logprobs(self, prompt: str, start: int) -> list[tuple[float | None, int]]:
        return [(0.0, i) for i in range(start, len(prompt))]

    async def chat_renderer_async(self) -> ChatRenderer | None:
        if self._source is None:
            return _placeholder
        return await self._source.chat_renderer_async()

    async def chat(self, messages: list[Message], params: dict[str, Any]) -> GenResult:
        return GenResult("<gen>")
