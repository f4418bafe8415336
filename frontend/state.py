"""The program state: what a program's Python body touches.

`s += ...`, roles, `s[name] = v` and fork/join queue steps on the state's interpreter
(interpreter.py), which runs them on the run's event loop; reading a value (`s[name]`,
`text()`, `messages()`, ...) waits until what was queued before it has run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from weft.frontend.backend import Message
from weft.frontend.interpreter import Interpreter, JoinPoint, RunContext, SetVar
from weft.frontend.ir import RoleBegin, RoleEnd, flatten

JOIN_MODES = {"gather_variable": False, "concate_and_append": True}  # mode: append forks' text


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
        self.parent._run.push([JoinPoint([s._run for s in self], append=JOIN_MODES[mode])])


class ProgramState:
    """`s` in a program: what is added to it queues on its interpreter; reading waits for it."""

    def __init__(self, ctx: RunContext) -> None:
        self._ctx = ctx
        ctx.states.append(self)
        self._run = Interpreter(ctx)

    # ---- building the program ----------------------------------------------------------------

    def __iadd__(self, value: object) -> ProgramState:
        self._run.push(flatten(value))
        return self

    def system(self) -> AbstractContextManager[ProgramState]:
        return self._role("system")

    def user(self) -> AbstractContextManager[ProgramState]:
        return self._role("user")

    def assistant(self) -> AbstractContextManager[ProgramState]:
        return self._role("assistant")

    @contextmanager
    def _role(self, role: str) -> Iterator[ProgramState]:
        self._run.push([RoleBegin(role)])
        try:
            yield self
        finally:
            self._run.push([RoleEnd(role)])

    def fork(self, n: int = 1) -> ForkGroup:
        """n states that continue from this point; the shared prefix is sent once, then the
        branches run concurrently."""
        if n < 1:
            raise ValueError(f"fork(n) needs n >= 1, got {n}")
        children = [ProgramState(self._ctx) for _ in range(n)]
        self._run.fork([c._run for c in children])
        return ForkGroup(self, children)

    def copy(self) -> ProgramState:
        return self.fork(1)[0]

    # ---- reading results (blocks until this state's queue has run) -----------------------------

    def __setitem__(self, name: str, value: Any) -> None:
        """Set a variable, in program order (after what was added before it runs)."""
        self._run.push([SetVar(name, value)])

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def get_var(self, name: str) -> Any:
        return self[name]

    def __getitem__(self, name: str) -> Any:
        if name not in self:  # waits for the queue
            raise KeyError(f"no variable {name!r} in this program state")
        return self._run.vars[name]

    def __contains__(self, name: str) -> bool:
        self._sync()
        return name in self._run.vars

    def text(self) -> str:
        self._sync()
        return self._run.text

    def messages(self) -> list[Message]:
        """The conversation so far in OpenAI format (an open role as its partial message)."""
        self._sync()
        out = [dict(m) for m in self._run.messages]
        if (role := self._run.role) is not None:
            out.append({"role": role.role, "content": role.content})
        return out

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self._sync()
        return self._run.meta[name]

    @property
    def variables(self) -> dict[str, Any]:
        self._sync()
        return dict(self._run.vars)

    @property
    def error(self) -> BaseException | None:
        return self._run.error

    async def wait(self) -> None:
        """Until every queued node has run; raises the error that stopped the state."""
        await self._run.wait()

    def fail(self, error: BaseException) -> None:
        """Keep `error` as what stopped this state (its program's body raised it)."""
        self._run.error = error
        self._run.wake.set()

    def _sync(self) -> None:
        if self._run.busy:
            self._ctx.block(self.wait())
        if self._run.error is not None:
            raise self._run.error

    # ---- streaming -----------------------------------------------------------------------------

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Text as it is produced (of variable `name`, or all of it); for run(stream=True)."""
        i = 0
        while (event := self._ctx.block(self._run.next_event(i, name))) is not None:
            i, piece = event
            yield piece

    async def text_async_iter(self, name: str | None = None) -> AsyncIterator[str]:
        i = 0
        while (event := await self._run.next_event(i, name)) is not None:
            i, piece = event
            yield piece
