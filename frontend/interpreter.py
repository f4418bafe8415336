"""The interpreter: runs the steps a program state queued, in order, against a backend.

`s += node` only queues the node (state.py); one drain task per state runs the queue, so a
program's Python body finishes (or reaches a value it reads) before anything is awaited, and
all states of a run — forks, batch members — progress together on one event loop.
Constant text is appended locally and sent with the next gen: text + gen is one request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from typing_extensions import assert_never

from weft.frontend.backend import Backend, ChatRenderer, GenResult, Message, TokenLogprobs
from weft.frontend.choices import ChoicesDecision, UncondEntries
from weft.frontend.ir import Gen, Leaf, RoleBegin, RoleEnd, Select, SeparateReasoning, Text
from weft.frontend.scoring import Tail, mean
from weft.runtime.server.reasoning import split_reasoning

if TYPE_CHECKING:
    from weft.frontend.state import ProgramState

T = TypeVar("T")
_SENTINEL = "\x00weft-role-content\x00"
# how many prefix tokens a choice request re-reads to find where the choice's tokens begin
_BOUNDARY_WINDOW = 8
REASONING_SUFFIX = "_reasoning_content"  # separate_reasoning: the thinking's variable
Prompt = str | list[Message]  # a text prompt, or a conversation for a chat endpoint


class ProgramError(RuntimeError):
    """A gen/select (or role) of a program failed; the message names it."""


@dataclass
class PlannedRequest:
    kind: str  # generate | stream | chat | warm | score
    label: str
    prompt: Prompt
    params: dict[str, Any]

    def __str__(self) -> str:
        return f"{self.kind:<8} {self.label:<24} prompt={self.prompt!r} params={self.params}"


@dataclass(eq=False)
class RunContext:
    """What the states of one program run share: backend, loop, defaults, request log."""

    backend: Backend
    _: KW_ONLY
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    defaults: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    semaphore: asyncio.Semaphore | None = None
    own_loop: bool = True  # False: a batch's programs share the loop
    tracing: bool = False  # Program.trace: selects pick their first choice
    renderer: ChatRenderer | None = field(default=None, init=False)  # resolved by the first role
    _renderer_resolved: bool = field(default=False, init=False)
    plan: list[PlannedRequest] = field(default_factory=list, init=False)
    runs: list[Interpreter] = field(default_factory=list, init=False)
    states: list[ProgramState] = field(default_factory=list, init=False)  # in creation order
    closed: bool = field(default=False, init=False)  # the program's Python body has returned

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
        for r in self.runs:
            r.wake.set()

    def cancel_all(self, error: BaseException) -> None:
        """Cancel what the states queued (the program's body raised `error`, which each state
        keeps). The tasks end when the loop next runs: at once on a run's own loop, with the
        rest of a batch on a shared one.
        NOTE: running a batch's shared loop here would start the other programs' requests
        before the batch does."""
        tasks = []
        for r in self.runs:
            if r.task is not None and not r.task.done():
                r.error = r.error or error
                r.task.cancel()
                tasks.append(r.task)
        if tasks and self.own_loop and not self.loop.is_running():
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    async def wait_all(self) -> None:
        """Until every state of the run (forks included) has drained; then the first error
        raises. NOTE: all settle first, so no state's task is left pending on the loop."""
        first: Exception | None = None
        for r in list(self.runs):
            try:
                await r.wait()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    async def request(
        self, kind: str, label: str, prompt: Prompt, params: dict[str, Any], aw: Awaitable[T]
    ) -> T:
        self.plan.append(PlannedRequest(kind, label, prompt, params))
        if self.semaphore is None:
            return await aw
        async with self.semaphore:
            return await aw


@dataclass(repr=False)
class ForkPoint:
    children: list[Interpreter]

    def __repr__(self) -> str:
        return f"Fork({len(self.children)})"


@dataclass(repr=False)
class JoinPoint:
    children: list[Interpreter]
    append: bool  # each fork's own text is appended to the parent

    def __repr__(self) -> str:
        return f"Join({len(self.children)})"


@dataclass
class SetVar:
    name: str
    value: Any


Step = Leaf | ForkPoint | JoinPoint | SetVar  # the IR's nodes, and steps only a state queues


@dataclass(eq=False)
class _OpenRole:
    role: str
    content: str
    suffix: str
    message: Message | None = None  # the message it became when it ended


@dataclass
class _Output:
    """Where a gen's (select's) output sits, so that separate_reasoning can rewrite it."""

    start: int  # in the state's text
    text: str  # as written there
    role: _OpenRole | None  # the role it was written in, and where in its content
    role_start: int = 0


class Interpreter:
    """Runs one state's queue on the run's loop, and holds what its steps made: the text, the
    variables and their meta info, the conversation. A fork starts from its parent's."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        ctx.runs.append(self)
        self.text = ""
        self.vars: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.messages: list[Message] = []
        self.role: _OpenRole | None = None
        self.outside_roles = False  # text was added outside any role
        self.forked_at = 0  # a fork's length of text inherited from its parent
        self.pending: deque[Step] = deque()
        self.task: asyncio.Task[None] | None = None
        self.ready: asyncio.Future[None] | None = None  # a fork's: set at its fork point
        self.error: BaseException | None = None
        self.events: list[tuple[str | None, str]] = []  # (variable, piece of text) as emitted
        self.outputs: dict[str, _Output] = {}  # each named gen's (select's) latest output
        self.wake = asyncio.Event()

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def push(self, steps: Sequence[Step]) -> None:
        if self.error is not None:
            raise self.error
        self.pending.extend(steps)
        if not self.busy:
            self.task = self.ctx.loop.create_task(self._drain())

    def fork(self, children: list[Interpreter]) -> None:
        for c in children:
            # each child drains from now on, waiting for the fork point first: reading a child
            # (even an empty one) waits for the fork, and a failed fork fails every child
            c.ready = self.ctx.loop.create_future()
            c.task = self.ctx.loop.create_task(c._drain())
        self.push([ForkPoint(children)])

    async def wait(self) -> None:
        """Until every queued step has run; raises the error that stopped the state."""
        while self.task is not None and not self.task.done():
            try:
                await asyncio.shield(self.task)
            except asyncio.CancelledError:
                if not self.task.cancelled():
                    raise  # the waiter itself was cancelled
                break  # the queue was cancelled (its program's body raised): error says why
        if self.error is not None:
            raise self.error

    async def next_event(self, i: int, name: str | None) -> tuple[int, str] | None:
        """(index after, piece) of the first event of `name` (None: any) from `i`; None at the end."""
        while True:
            while i < len(self.events):
                var, piece = self.events[i]
                i += 1
                if name is None or var == name:
                    return i, piece
            if self.error is not None:
                raise self.error
            if self.ctx.closed and not self.busy and not self.pending:
                return None
            self.wake.clear()
            await self.wake.wait()

    async def _drain(self) -> None:
        try:
            if self.ready is not None:
                await self.ready
            while self.pending:
                # NOTE: a step leaves the queue only once it has run: a fork point that fails is
                # still queued below, and its children must hear of it or they wait forever.
                await self._run(self.pending[0])
                self.pending.popleft()
        except BaseException as exc:  # kept on the state; readers raise it
            self.error = self.error or exc  # a failed body's error (fail) comes first
            for step in self.pending:
                if isinstance(step, ForkPoint):
                    for c in step.children:
                        if c.ready is not None and not c.ready.done():
                            c.ready.set_exception(exc)
            self.pending.clear()
            if not isinstance(exc, Exception):  # cancellation, KeyboardInterrupt: propagate
                raise
        finally:
            self.wake.set()

    async def _run(self, step: Step) -> None:
        match step:
            case Text():
                self._emit(step.value)
            case Gen():
                await self._gen(step)
            case Select():
                await self._select(step)
            case RoleBegin():
                await self._role_begin(step)
            case RoleEnd():
                self._role_end(step)
            case ForkPoint():
                await self._fork_point(step)
            case JoinPoint():
                await self._join_point(step)
            case SeparateReasoning():
                self._separate_reasoning(step)
            case SetVar():
                self.vars[step.name] = step.value
                self.meta.pop(step.name, None)  # a gen's meta info no longer describes the value
            case _:
                assert_never(step)

    def _emit(self, piece: str, var: str | None = None, content: bool = True) -> None:
        if not piece:
            return
        self.text += piece
        if content and self.role is not None:
            self.role.content += piece
        elif content:
            self.outside_roles = True
        self.events.append((var, piece))
        self.wake.set()

    async def _role_begin(self, node: RoleBegin) -> None:
        if self.role is not None:
            raise ProgramError(f"{node.role}(): the {self.role.role} role is still open")
        prefix = suffix = ""
        render = await self.ctx.get_renderer()
        if render is not None:
            before = await render(self.messages) if self.messages else ""
            probe = await render([*self.messages, {"role": node.role, "content": _SENTINEL}])
            cut = probe.index(_SENTINEL)
            if not probe[:cut].startswith(before):
                raise ProgramError(
                    f"{node.role}(): the chat template does not render the conversation "
                    "incrementally (an earlier message changes when one is added)"
                )
            prefix, suffix = probe[len(before) : cut], probe[cut + len(_SENTINEL) :]
        self._emit(prefix, content=False)
        self.role = _OpenRole(node.role, "", suffix)

    def _role_end(self, node: RoleEnd) -> None:
        role = self.role
        if role is None or role.role != node.role:
            raise ProgramError(f"{node.role}() ends, but the open role is {role and role.role}")
        self.role = None
        role.message = {"role": role.role, "content": role.content}
        self.messages.append(role.message)
        self._emit(role.suffix, content=False)

    def _chat_mode(self) -> bool:
        # NOTE: a role or a message means a role began, which resolved the renderer
        return self.ctx.renderer is None and (bool(self.messages) or self.role is not None)

    async def _gen(self, node: Gen) -> None:
        label, ctx = f"gen({node.name!r})", self.ctx
        params = {**ctx.defaults, **node.params}
        with _failing(label):
            # a backend without a chat template continues the conversation at its chat endpoint
            chat = self._chat_messages(label) if self._chat_mode() else None
            prompt = self.text if chat is None else chat
            if ctx.stream:
                ctx.plan.append(PlannedRequest("stream", label, prompt, params))
                pieces = (
                    ctx.backend.generate_stream(self.text, params, *_options(node))
                    if chat is None
                    else ctx.backend.chat_stream(chat, params)
                )
                result, seen = GenResult(""), ""
                async for result in pieces:  # cumulative text
                    self._emit(result.text[len(seen) :], node.name)
                    seen = result.text
            else:
                if chat is None:
                    aw = ctx.backend.generate(self.text, params, *_options(node))
                    result = await ctx.request("generate", label, prompt, params, aw)
                else:
                    aw = ctx.backend.chat(chat, params)
                    result = await ctx.request("chat", label, prompt, params, aw)
                self._emit(result.text, node.name)
        self._record_output(node.name, result.text)
        if node.name is not None:
            # a trace's placeholder reply reads as no value
            self.vars[node.name] = result.text if ctx.tracing else _value(label, node, result)
            self.meta[node.name] = result.meta

    def _record_output(self, name: str | None, text: str) -> None:
        """Just after `text`, a named output, was emitted."""
        if name is None:
            return
        role, start = self.role, len(self.text) - len(text)
        self.outputs[name] = _Output(
            start, text, role, len(role.content) - len(text) if role else 0
        )

    def _separate_reasoning(self, node: SeparateReasoning) -> None:
        """Each named output -> its answer (the variable, and in the text) and its thinking
        (the `_reasoning_content` variable); see api.separate_reasoning."""
        for name in node.names:
            label = f"separate_reasoning({name!r})"
            out = self.outputs.get(name)
            answer = self.vars.get(name)
            if out is None or not isinstance(answer, str):
                what = "no output" if out is None else f"{type(answer).__name__}, not text"
                raise ProgramError(f"{label}: the gen of that name left {what} to split")
            split_by_backend = (self.meta.get(name) or {}).get("reasoning_content")
            if split_by_backend is not None:  # the endpoint's parser split it already
                thinking = split_by_backend
            else:
                begins = node.format.starts_in_reasoning(self.text[: out.start])
                thinking, answer = split_reasoning(node.format, out.text, begins)
                self._rewrite(out, answer)
            self.vars[name] = answer
            self.vars[name + REASONING_SUFFIX] = thinking

    def _rewrite(self, out: _Output, answer: str) -> None:
        """The output's text, where it was written (the state's text, its role's content or
        message), becomes `answer`.
        NOTE: later outputs move with it; the stream's events keep what was sent."""
        end = out.start + len(out.text)
        if self.text[out.start : end] != out.text:
            raise ProgramError("separate_reasoning: the output is no longer where it was written")
        self.text = self.text[: out.start] + answer + self.text[end:]
        shift = len(answer) - len(out.text)
        for other in self.outputs.values():
            if other.start > out.start:
                other.start += shift
            if other.role is out.role and other.role_start > out.role_start:
                other.role_start += shift
        if out.role is not None:
            role, at = out.role, out.role_start
            content = role.content if role.message is None else role.message["content"]
            content = content[:at] + answer + content[at + len(out.text) :]
            if role.message is None:
                role.content = content
            else:
                role.message["content"] = content
        out.text = answer

    def _chat_messages(self, label: str) -> list[Message]:
        """The conversation a chat-endpoint gen continues; ProgramError where the gen does not
        start an assistant turn (no template to render anything else)."""
        role = self.role
        if role is None or role.role != "assistant" or role.content or self.outside_roles:
            raise ProgramError(
                f"{label}: {self.ctx.backend.name} has no chat template to render roles, so a "
                "gen in a role program must start an assistant turn, with no text outside roles "
                "(weft.Engine, or weft.RuntimeEndpoint on a weft server, render the model's "
                "template and run anything else)"
            )
        return [dict(m) for m in self.messages]

    async def _select(self, node: Select) -> None:
        label = f"select({node.name!r})"
        if self._chat_mode():
            raise ProgramError(
                f"{label}: {self.ctx.backend.name} has no chat template, so select cannot score "
                "choices inside a role program (use weft.Engine, or weft.RuntimeEndpoint on a "
                "weft server: both render the model's template)"
            )
        with _failing(label):
            choice, meta = await self._score(label, node)
        self._emit(choice, node.name)
        self._record_output(node.name, choice)
        if node.name is not None:
            self.vars[node.name] = choice
            self.meta[node.name] = meta

    async def _score(self, label: str, node: Select) -> tuple[str, dict[str, Any]]:
        prefix = self.text
        tail = await self._prefix_tail(label, prefix) if prefix else Tail(0, [])
        cond = await asyncio.gather(
            *(self._choice_logprobs(label, prefix, tail, c) for c in node.choices)
        )
        uncond: UncondEntries | None = None
        if node.method.requires_unconditional_logprobs:
            alone = await asyncio.gather(*(self._logprobs(label, c, 0) for c in node.choices))
            uncond = [[(lp, tid, None) for lp, tid in e] for e in alone]
        method = _first_choice if self.ctx.tracing else node.method
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
        return decision.decision, {
            "choice": decision.decision,
            "input_token_logprobs": [[e[0] for e in c] for c in cond],
            "unconditional_token_logprobs": uncond_values,
            **decision.meta_info,
        }

    async def _logprobs(self, label: str, prompt: str, start: int) -> TokenLogprobs:
        aw = self.ctx.backend.prompt_logprobs(prompt, start)
        params = {"max_new_tokens": 0, "logprob_start_len": start}
        return await self.ctx.request("score", label, prompt, params, aw)

    async def _prefix_tail(self, label: str, prefix: str) -> Tail:
        """Cache the prefix, then read the ids of its last few tokens.

        NOTE: the prefix is sent unscored first: a scored prompt position is always computed
        (its logits are needed), so scoring the whole prefix would prefill all of it again for
        every select, however much of it the radix cache holds. Only the last
        `_BOUNDARY_WINDOW` tokens are scored, to find where a choice's tokens begin.
        """
        result = await self._warm(label, prefix)
        length = result.meta.get("prompt_tokens")
        start = max(0, length - _BOUNDARY_WINDOW) if isinstance(length, int) else 0
        entries = await self._logprobs(label, prefix, start)
        return Tail(start, [tid for _, tid in entries])

    async def _choice_logprobs(
        self, label: str, prefix: str, tail: Tail, choice: str
    ) -> list[tuple[float, int, str | None]]:
        # NOTE: prefix + choice may tokenize differently at the seam (" yes" swallowing the
        # prefix's trailing space); the choice's tokens start where the ids first differ.
        entries = await self._logprobs(label, prefix + choice, tail.start)
        at = tail.seam([tid for _, tid in entries])
        if at is None:  # differs already at the window's start: read the whole prompts
            tail = Tail(0, [tid for _, tid in await self._logprobs(label, prefix, 0)])
            entries = await self._logprobs(label, prefix + choice, 0)
            at = tail.seam([tid for _, tid in entries])
            assert at is not None
        return [(lp, tid, None) for lp, tid in entries[at - tail.start :] if lp is not None]

    async def _warm(self, label: str, prefix: str) -> GenResult:
        """Prefill `prefix` into the backend's cache, generating nothing."""
        warm = {"max_new_tokens": 0}
        aw = self.ctx.backend.generate(prefix, warm)
        return await self.ctx.request("warm", label, prefix, warm, aw)

    async def _join_point(self, node: JoinPoint) -> None:
        for c in node.children:
            await c.wait()
        if node.append:
            for c in node.children:
                # a fork starts from the parent's text at the fork point: its own part follows
                self._emit(c.text[c.forked_at :])
        names = [n for n in node.children[0].vars if all(n in c.vars for c in node.children)]
        for n in names:
            if any(c.vars[n] is not self.vars.get(n) for c in node.children):
                self.vars[n] = [c.vars[n] for c in node.children]
                self.meta[n] = [c.meta.get(n) for c in node.children]

    async def _fork_point(self, node: ForkPoint) -> None:
        label = f"fork({len(node.children)})"
        if len(node.children) > 1 and self.text and not self._chat_mode():
            with _failing(label):
                await self._warm(label, self.text)
        for c in node.children:
            c.text, c.forked_at = self.text, len(self.text)
            c.vars, c.meta = dict(self.vars), dict(self.meta)
            c.messages = [dict(m) for m in self.messages]
            c.role = None if self.role is None else replace(self.role)
            c.outputs = {n: self._output_for(c, o) for n, o in self.outputs.items()}
            c.outside_roles = self.outside_roles
            assert c.ready is not None
            c.ready.set_result(None)

    def _output_for(self, child: Interpreter, out: _Output) -> _Output:
        """A fork's copy of an output: its role is the child's copy of the open role, or of
        the message that role became."""
        role = out.role
        if role is None:
            return replace(out)
        if role is self.role:
            return replace(out, role=child.role)
        at = next((i for i, m in enumerate(self.messages) if m is role.message), None)
        message = None if at is None else child.messages[at]
        return replace(out, role=replace(role, message=message))


@contextmanager
def _failing(label: str) -> Iterator[None]:
    """A backend's error, as the ProgramError that names the call it failed."""
    try:
        yield
    except ProgramError:
        raise
    except Exception as exc:
        raise ProgramError(f"{label} failed: {exc}") from exc


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
