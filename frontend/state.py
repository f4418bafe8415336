"""Program state and the interpreter that runs its IR on an asyncio loop.

`s += node` only queues the node; one drain task per state runs the queue in order, so a
program's Python body finishes (or reaches a value it reads) before anything is awaited, and
all states of a run — forks, batch members — progress together on one event loop.
Constant text is appended locally and sent with the next gen: text + gen is one request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from weft.frontend.backend import Backend, ChatRenderer, GenResult, Message, TokenLogprobs
from weft.frontend.choices import ChoicesDecision, UncondEntries
from weft.frontend.ir import Gen, Node, RoleBegin, RoleEnd, Select, Text, flatten
from weft.frontend.scoring import mean

T = TypeVar("T")
_SENTINEL = "\x00weft-role-content\x00"
# how many prefix tokens a choice request re-reads to find where the choice's tokens begin
_BOUNDARY_WINDOW = 8


class ProgramError(RuntimeError):
    """A gen/select (or role) of a program failed; the message names it."""


@dataclass
class PlannedRequest:
    kind: str  # generate | stream | chat | warm | score
    label: str
    prompt: str | list[Message]
    params: dict[str, Any]

    def __str__(self) -> str:
        return f"{self.kind:<8} {self.label:<24} prompt={self.prompt!r} params={self.params}"


class RunContext:
    """What the states of one program run share: backend, loop, defaults, request log."""

    def __init__(
        self,
        backend: Backend,
        loop: asyncio.AbstractEventLoop,
        defaults: dict[str, Any],
        stream: bool = False,
        semaphore: asyncio.Semaphore | None = None,
        own_loop: bool = True,
    ) -> None:
        self.backend = backend
        self.loop = loop
        self.own_loop = own_loop  # False: a batch's programs share the loop
        self.defaults = defaults
        self.stream = stream
        self.semaphore = semaphore
        self.renderer: ChatRenderer | None = None  # resolved by the first role (get_renderer)
        self._renderer_resolved = False
        self.plan: list[PlannedRequest] = []
        self.states: list[ProgramState] = []
        self.closed = False  # the program's Python body has returned
        self.tracing = False  # Program.trace: selects pick their first choice

    def block(self, aw: Awaitable[T]) -> T:
        """Run the loop until `aw` is done; only from sync code (no loop running)."""
        if self.loop.is_running():
            if asyncio.iscoroutine(aw):
                aw.close()
            raise RuntimeError(
                "this value is not ready and the event loop is running: "
                "`await state.wait()` first (or read it after the run)"
            )
        return self.loop.run_until_complete(aw)

    async def get_renderer(self) -> ChatRenderer | None:
        if not self._renderer_resolved:
            self.renderer = await self.backend.chat_renderer_async()
            self._renderer_resolved = True
        return self.renderer

    def close(self) -> None:
        self.closed = True
        for s in self.states:
            s._wake.set()

    def cancel_all(self, error: BaseException) -> None:
        """Cancel what the states queued (the program's body raised `error`, which each state
        keeps). The tasks end when the loop next runs: at once on a run's own loop, with the
        rest of a batch on a shared one.
        NOTE: running a batch's shared loop here would start the other programs' requests
        before the batch does."""
        tasks = []
        for s in self.states:
            if s._task is not None and not s._task.done():
                s._error = s._error or error
                s._task.cancel()
                tasks.append(s._task)
        if tasks and self.own_loop and not self.loop.is_running():
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    async def wait_all(self) -> None:
        """Until every state of the run (forks included) has drained; then the first error
        raises. NOTE: all settle first, so no state's task is left pending on the loop."""
        first: Exception | None = None
        for s in list(self.states):
            try:
                await s.wait()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    async def request(
        self, kind: str, label: str, prompt: str | list[Message], params: dict[str, Any], aw: Any
    ) -> Any:
        self.plan.append(PlannedRequest(kind, label, prompt, params))
        if self.semaphore is None:
            return await aw
        async with self.semaphore:
            return await aw


@dataclass
class _OpenRole:
    role: str
    content: str
    suffix: str


class _ForkPoint:
    def __init__(self, children: list[ProgramState]) -> None:
        self.children = children

    def __repr__(self) -> str:
        return f"Fork({len(self.children)})"


JOIN_MODES = ("gather_variable", "concate_and_append")


class _JoinPoint:
    def __init__(self, children: list[ProgramState], append: bool = False) -> None:
        self.children = children
        self.append = append

    def __repr__(self) -> str:
        return f"Join({len(self.children)})"


@dataclass
class _SetVar:
    name: str
    value: Any


class _RoleBlock:
    def __init__(self, state: ProgramState, role: str) -> None:
        self.state = state
        self.role = role

    def __enter__(self) -> ProgramState:
        self.state._push([RoleBegin(self.role)])
        return self.state

    def __exit__(self, *exc: object) -> None:
        self.state._push([RoleEnd(self.role)])


class ForkGroup(list["ProgramState"]):
    """The states of `s.fork(n)`; `join()` gathers each variable the forks all set (and its
    meta info) into a list on the parent."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]) -> None:
        super().__init__(states)
        self.parent = parent

    def join(self, mode: str = "gather_variable") -> None:
        """Queued on the parent like any other step, so the program's body goes on (the other
        programs of a batch keep running on the loop); reading the parent waits for it.

        mode "gather_variable": each variable the forks all set becomes a list on the parent.
        mode "concate_and_append" (SGLang's spelling): the text each fork added is appended to
        the parent, fork after fork, and the variables are gathered as well.
        NOTE: joining here by blocking would run a batch's programs one at a time."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {', '.join(JOIN_MODES)}; got {mode!r}")
        self.parent._push([_JoinPoint(list(self), append=mode == "concate_and_append")])


class ProgramState:
    def __init__(self, ctx: RunContext) -> None:
        self._ctx = ctx
        ctx.states.append(self)
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, Any] = {}
        self._messages: list[Message] = []
        self._role: _OpenRole | None = None
        self._outside_roles = False  # text was added outside any role
        self._forked_at = 0  # a fork's length of text inherited from its parent
        self._pending: deque[Node | _ForkPoint | _JoinPoint | _SetVar] = deque()
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._events: list[tuple[str | None, str]] = []
        self._wake = asyncio.Event()

    # ---- building the program ----------------------------------------------------------------

    def __iadd__(self, value: object) -> ProgramState:
        self._push(flatten(value))
        return self

    def system(self) -> _RoleBlock:
        return _RoleBlock(self, "system")

    def user(self) -> _RoleBlock:
        return _RoleBlock(self, "user")

    def assistant(self) -> _RoleBlock:
        return _RoleBlock(self, "assistant")

    def fork(self, n: int = 1) -> ForkGroup:
        """n states that continue from this point; the shared prefix is sent once, then the
        branches run concurrently."""
        if n < 1:
            raise ValueError(f"fork(n) needs n >= 1, got {n}")
        children = [ProgramState(self._ctx) for _ in range(n)]
        for c in children:
            # each child drains from now on: it waits for the fork point, then runs what was
            # added to it, so reading a child (even an empty one) waits for the fork, and a
            # failed fork fails every child
            c._ready = self._ctx.loop.create_future()
            c._task = self._ctx.loop.create_task(c._drain())
        self._push([_ForkPoint(children)])
        return ForkGroup(self, children)

    def copy(self) -> ProgramState:
        return self.fork(1)[0]

    # ---- reading results (blocks until this state's queue has run) -----------------------------

    def __setitem__(self, name: str, value: Any) -> None:
        """Set a variable, in program order (after what was added before it runs)."""
        self._push([_SetVar(name, value)])

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def get_var(self, name: str) -> Any:
        return self[name]

    def __getitem__(self, name: str) -> Any:
        self._sync()
        if name not in self._vars:
            raise KeyError(f"no variable {name!r} in this program state")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self._sync()
        return name in self._vars

    def text(self) -> str:
        self._sync()
        return self._text

    def messages(self) -> list[Message]:
        """The conversation so far in OpenAI format (an open role as its partial message)."""
        self._sync()
        out = [dict(m) for m in self._messages]
        if self._role is not None:
            out.append({"role": self._role.role, "content": self._role.content})
        return out

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self._sync()
        return self._meta[name]

    @property
    def variables(self) -> dict[str, Any]:
        self._sync()
        return dict(self._vars)

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def wait(self) -> None:
        """Until every queued node has run; raises the error that stopped the state."""
        while self._task is not None and not self._task.done():
            try:
                await asyncio.shield(self._task)
            except asyncio.CancelledError:
                if not self._task.cancelled():
                    raise  # the waiter itself was cancelled
                break  # the queue was cancelled (its program's body raised): _error says why
        if self._error is not None:
            raise self._error

    def fail(self, error: BaseException) -> None:
        """Keep `error` as what stopped this state (its program's body raised it)."""
        self._error = error
        self._wake.set()

    def _sync(self) -> None:
        if self._task is not None and not self._task.done():
            self._ctx.block(self.wait())
        if self._error is not None:
            raise self._error

    # ---- streaming -----------------------------------------------------------------------------

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Text as it is produced (of variable `name`, or all of it); for run(stream=True)."""
        i = 0
        while True:
            event = self._ctx.block(self._next_event(i, name))
            if event is None:
                return
            i, piece = event
            yield piece

    async def text_async_iter(self, name: str | None = None) -> AsyncIterator[str]:
        i = 0
        while True:
            event = await self._next_event(i, name)
            if event is None:
                return
            i, piece = event
            yield piece

    async def _next_event(self, i: int, name: str | None) -> tuple[int, str] | None:
        while True:
            while i < len(self._events):
                var, piece = self._events[i]
                i += 1
                if name is None or var == name:
                    return i, piece
            if self._error is not None:
                raise self._error
            idle = self._task is None or self._task.done()
            if self._ctx.closed and idle and not self._pending:
                return None
            self._wake.clear()
            await self._wake.wait()

    # ---- the interpreter -------------------------------------------------------------------------

    def _push(self, nodes: Sequence[Node | _ForkPoint | _JoinPoint | _SetVar]) -> None:
        if self._error is not None:
            raise self._error
        self._pending.extend(nodes)
        if self._task is None or self._task.done():
            self._task = self._ctx.loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            if self._ready is not None:
                await self._ready
            while self._pending:
                # NOTE: a node leaves the queue only once it has run: a fork point that fails is
                # still queued below, and its children must hear of it or they wait forever.
                node = self._pending[0]
                await getattr(self, "_run_" + type(node).__name__.lstrip("_"))(node)
                self._pending.popleft()
        except BaseException as exc:  # kept on the state; readers raise it
            self._error = self._error or exc  # a failed body's error (fail) comes first
            for node in self._pending:
                if isinstance(node, _ForkPoint):
                    for c in node.children:
                        if c._ready is not None and not c._ready.done():
                            c._ready.set_exception(exc)
            self._pending.clear()
            if not isinstance(exc, Exception):  # cancellation, KeyboardInterrupt: propagate
                raise
        finally:
            self._wake.set()

    def _emit(self, piece: str, var: str | None = None, content: bool = True) -> None:
        if not piece:
            return
        self._text += piece
        if content:
            if self._role is not None:
                self._role.content += piece
            else:
                self._outside_roles = True
        self._events.append((var, piece))
        self._wake.set()

    async def _run_SetVar(self, node: _SetVar) -> None:
        self._vars[node.name] = node.value
        self._meta.pop(node.name, None)  # a gen's meta info no longer describes the value

    async def _run_Text(self, node: Text) -> None:
        self._emit(node.value)

    async def _run_RoleBegin(self, node: RoleBegin) -> None:
        if self._role is not None:
            raise ProgramError(f"{node.role}(): the {self._role.role} role is still open")
        prefix = suffix = ""
        render = await self._ctx.get_renderer()
        if render is not None:
            before = await render(self._messages) if self._messages else ""
            probe = await render([*self._messages, {"role": node.role, "content": _SENTINEL}])
            cut = probe.index(_SENTINEL)
            if not probe[:cut].startswith(before):
                raise ProgramError(
                    f"{node.role}(): the chat template does not render the conversation "
                    "incrementally (an earlier message changes when one is added)"
                )
            prefix, suffix = probe[len(before) : cut], probe[cut + len(_SENTINEL) :]
        self._emit(prefix, content=False)
        self._role = _OpenRole(node.role, "", suffix)

    async def _run_RoleEnd(self, node: RoleEnd) -> None:
        role = self._role
        if role is None or role.role != node.role:
            raise ProgramError(f"{node.role}() ends, but the open role is {role and role.role}")
        self._role = None
        self._messages.append({"role": role.role, "content": role.content})
        self._emit(role.suffix, content=False)

    def _chat_mode(self) -> bool:
        # NOTE: a role or a message means a role began, which resolved the renderer
        return self._ctx.renderer is None and (bool(self._messages) or self._role is not None)

    async def _run_Gen(self, node: Gen) -> None:
        label = f"gen({node.name!r})"
        ctx = self._ctx
        params = {**ctx.defaults, **node.params}
        try:
            # a backend without a chat template continues the conversation at its chat endpoint
            messages = self._chat_messages(label) if self._chat_mode() else None
            prompt = self._text if messages is None else messages
            if ctx.stream:
                pieces = (
                    ctx.backend.generate_stream(self._text, params, *_options(node))
                    if messages is None
                    else ctx.backend.chat_stream(messages, params)
                )
                await ctx.request("stream", label, prompt, params, _none())
                result, seen = GenResult(""), ""
                async for result in pieces:  # cumulative text
                    self._emit(result.text[len(seen) :], node.name)
                    seen = result.text
            else:
                aw = (
                    ctx.backend.generate(self._text, params, *_options(node))
                    if messages is None
                    else ctx.backend.chat(messages, params)
                )
                kind = "generate" if messages is None else "chat"
                result = await ctx.request(kind, label, prompt, params, aw)
                self._emit(result.text, node.name)
        except ProgramError:
            raise
        except Exception as exc:
            raise ProgramError(f"{label} failed: {exc}") from exc
        if node.name is not None:
            traced = self._ctx.tracing  # the placeholder reply reads as no value
            self._vars[node.name] = result.text if traced else _value(label, node, result)
            self._meta[node.name] = result.meta

    def _chat_messages(self, label: str) -> list[Message]:
        """The conversation a chat-endpoint gen continues; ProgramError where the gen does not
        start an assistant turn (no template to render anything else)."""
        name = self._ctx.backend.name
        role = self._role
        if role is None or role.role != "assistant" or role.content or self._outside_roles:
            raise ProgramError(
                f"{label}: {name} has no chat template to render roles, so a gen in a role "
                "program must start an assistant turn, with no text outside roles "
                "(weft.Engine, or weft.RuntimeEndpoint on a weft server, render the model's "
                "template and run anything else)"
            )
        return [dict(m) for m in self._messages]

    async def _run_Select(self, node: Select) -> None:
        label = f"select({node.name!r})"
        if self._chat_mode():
            raise ProgramError(
                f"{label}: {self._ctx.backend.name} has no chat template, so select cannot score "
                "choices inside a role program (use weft.Engine, or weft.RuntimeEndpoint on a "
                "weft server: both render the model's template)"
            )
        try:
            index, meta = await self._score(label, node)
        except ProgramError:
            raise
        except Exception as exc:
            raise ProgramError(f"{label} failed: {exc}") from exc
        choice = node.choices[index]
        self._emit(choice, node.name)
        if node.name is not None:
            self._vars[node.name] = choice
            self._meta[node.name] = meta

    async def _score(self, label: str, node: Select) -> tuple[int, dict[str, Any]]:
        prefix = self._text
        tail = _Tail(0, [])
        if prefix:
            tail = await self._prefix_tail(label, prefix)
        cond = await asyncio.gather(
            *(self._choice_logprobs(label, prefix, tail, c) for c in node.choices)
        )
        uncond: UncondEntries | None = None
        if node.method.requires_unconditional_logprobs:
            alone = await asyncio.gather(*(self._logprobs(label, c, 0) for c in node.choices))
            uncond = [[(lp, tid, None) for lp, tid in e] for e in alone]
        method = _first_choice if self._ctx.tracing else node.method
        decision = method(
            choices=list(node.choices),
            normalized_prompt_logprobs=[mean([e[0] for e in c]) for c in cond],
            input_token_logprobs=list(cond),
            output_token_logprobs=[[] for _ in node.choices],
            unconditional_token_logprobs=uncond,
        )
        if decision.decision not in node.choices:
            raise ProgramError(f"{label}: {node.method!r} chose {decision.decision!r}, no choice")
        uncond_values = None if uncond is None else [[e[0] for e in u] for u in uncond]
        meta = {
            "choice": decision.decision,
            "input_token_logprobs": [[e[0] for e in c] for c in cond],
            "unconditional_token_logprobs": uncond_values,
            **decision.meta_info,
        }
        return node.choices.index(decision.decision), meta

    async def _logprobs(self, label: str, prompt: str, start: int) -> TokenLogprobs:
        aw = self._ctx.backend.prompt_logprobs(prompt, start)
        params = {"max_new_tokens": 0, "logprob_start_len": start}
        result: TokenLogprobs = await self._ctx.request("score", label, prompt, params, aw)
        return result

    async def _prefix_tail(self, label: str, prefix: str) -> _Tail:
        """Cache the prefix, then read the ids of its last few tokens.

        NOTE: the prefix is sent unscored first: a scored prompt position is always computed
        (its logits are needed), so scoring the whole prefix would prefill all of it again for
        every select, however much of it the radix cache holds. Only the last
        `_BOUNDARY_WINDOW` tokens are scored, to find where a choice's tokens begin.
        """
        warm = {"max_new_tokens": 0}
        result = await self._ctx.request(
            "warm", label, prefix, warm, self._ctx.backend.generate(prefix, warm)
        )
        length = result.meta.get("prompt_tokens")
        start = max(0, length - _BOUNDARY_WINDOW) if isinstance(length, int) else 0
        entries = await self._logprobs(label, prefix, start)
        return _Tail(start, [tid for _, tid in entries])

    async def _choice_logprobs(
        self, label: str, prefix: str, tail: _Tail, choice: str
    ) -> list[tuple[float, int, str | None]]:
        # NOTE: prefix + choice may tokenize differently at the seam (" yes" swallowing the
        # prefix's trailing space); the choice's tokens start where the ids first differ.
        entries = await self._logprobs(label, prefix + choice, tail.start)
        at = tail.seam([tid for _, tid in entries])
        if at is None:  # differs already at the window's start: read the whole prompts
            tail = _Tail(0, [tid for _, tid in await self._logprobs(label, prefix, 0)])
            entries = await self._logprobs(label, prefix + choice, 0)
            at = tail.seam([tid for _, tid in entries])
            assert at is not None
        return [(lp, tid, None) for lp, tid in entries[at - tail.start :] if lp is not None]

    async def _run_JoinPoint(self, node: _JoinPoint) -> None:
        for s in node.children:
            await s.wait()
        if node.append:
            for s in node.children:
                # a fork starts from the parent's text at the fork point: its own part follows
                self._emit(s._text[s._forked_at :])
        names = [n for n in node.children[0]._vars if all(n in s._vars for s in node.children)]
        for n in names:
            if any(s._vars[n] is not self._vars.get(n) for s in node.children):
                self._vars[n] = [s._vars[n] for s in node.children]
                self._meta[n] = [s._meta.get(n) for s in node.children]

    async def _run_ForkPoint(self, node: _ForkPoint) -> None:
        if len(node.children) > 1 and self._text and not self._chat_mode():
            warm = {"max_new_tokens": 0}
            aw = self._ctx.backend.generate(self._text, warm)
            try:
                await self._ctx.request("warm", f"fork({len(node.children)})", self._text, warm, aw)
            except Exception as exc:
                raise ProgramError(f"fork({len(node.children)}) failed: {exc}") from exc
        for c in node.children:
            c._text = self._text
            c._forked_at = len(self._text)
            c._vars = dict(self._vars)
            c._meta = dict(self._meta)
            c._messages = [dict(m) for m in self._messages]
            if self._role is not None:
                c._role = _OpenRole(self._role.role, self._role.content, self._role.suffix)
            c._outside_roles = self._outside_roles
            assert c._ready is not None
            c._ready.set_result(None)


@dataclass(frozen=True)
class _Tail:
    """The token ids of a prefix from position `start` to its end."""

    start: int
    ids: list[int]

    def seam(self, ids: list[int]) -> int | None:
        """Position of the choice's first token in prefix + choice, whose ids from `start` on
        are `ids`; None when they differ already at `start` (> 0): the window was too short."""
        n = 0
        while n < len(self.ids) and n < len(ids) and ids[n] == self.ids[n]:
            n += 1
        if n == 0 and self.start > 0:
            return None
        return self.start + n


def _value(label: str, node: Gen, result: GenResult) -> Any:
    """What a gen's variable holds: its text, or the value it spells for gen(dtype=...)."""
    if node.reader is None:
        return result.text
    try:
        return node.reader.value(result.text)
    except ValueError as exc:
        finish = result.meta.get("finish_reason")
        raise ProgramError(
            f"{label} with {node.reader.keyword}={node.reader!r}: {exc}; finish_reason {finish}"
        ) from exc


def _first_choice(*, choices: list[str], **_: Any) -> ChoicesDecision:
    return ChoicesDecision(choices[0], {"scores": [0.0] * len(choices)})


def _options(node: Gen) -> tuple[dict[str, Any], ...]:
    """The gen's request options as an extra argument, only where it has any (a Backend
    written before options takes two arguments)."""
    return (dict(node.options),) if node.options else ()


async def _none() -> None:
    return None
