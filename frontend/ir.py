"""IR of a weft program: the nodes `s += ...` appends to a state, in order.

Each node is small and prints as the DSL call that made it, so a trace reads like the program.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weft.frontend.choices import ChoicesSamplingMethod, token_length_normalized
from weft.runtime.server.reasoning import ReasoningFormat


class Node:
    """Base class of IR nodes; `+` builds a sequence (`user("a") + gen("x")`). A node prints as
    its class called with its fields, positionally."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, vars(self).values()))})"

    def __add__(self, other: object) -> Seq:
        return Seq([*flatten(self), *flatten(other)])

    def __radd__(self, other: object) -> Seq:
        return Seq([*flatten(other), *flatten(self)])


@dataclass(repr=False)
class Text(Node):
    value: str


@dataclass(frozen=True, repr=False)
class DType:
    """gen(dtype=...): the regex the output is held to, and how the variable is read from it."""

    name: str  # int | float | bool | str
    regex: str
    convert: Callable[[str], Any]  # text that matches the regex, stripped -> the value
    keyword = "dtype"  # the gen() argument it came from

    def __repr__(self) -> str:
        return self.name

    def value(self, text: str) -> Any:
        """The value an output spells (surrounding whitespace aside); ValueError if the output
        does not match the regex (cut off by max_tokens, or a backend that ignored the regex)."""
        body = text.strip()
        if re.fullmatch(self.regex, body) is None:
            raise ValueError(
                f"the output {text!r} does not match the {self.name} regex {self.regex!r}"
            )
        return self.convert(body)


@dataclass(frozen=True, repr=False)
class ModelType:
    """gen(json_schema=SomePydanticModel): the variable holds the validated instance."""

    cls: Any  # a pydantic BaseModel subclass
    keyword = "json_schema"  # the gen() argument it came from

    def __repr__(self) -> str:
        return str(self.cls.__name__)

    def value(self, text: str) -> Any:
        """The instance; pydantic's ValidationError (a ValueError) when the output is not one
        (cut off by max_tokens, say)."""
        return self.cls.model_validate_json(text)


@dataclass(repr=False)
class Gen(Node):
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)
    # what the variable holds instead of the text: a dtype's value, a pydantic instance
    reader: DType | ModelType | None = None
    # request options beside the sampling parameters (return_logprob, top_logprobs_num, ...)
    options: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        args = [repr(self.name)] + [f"{k}={v!r}" for k, v in self.params.items()]
        args += [f"{k}={v!r}" for k, v in self.options.items()]
        if self.reader is not None:
            args.append(f"{self.reader.keyword}={self.reader!r}")
        return f"Gen({', '.join(args)})"


@dataclass(repr=False)
class Select(Node):
    name: str | None
    choices: list[str]
    method: ChoicesSamplingMethod = token_length_normalized

    def __repr__(self) -> str:
        return f"Select({self.name!r}, {self.choices!r}, method={self.method!r})"


@dataclass(repr=False)
class RoleBegin(Node):
    role: str


@dataclass(repr=False)
class RoleEnd(Node):
    role: str


@dataclass(repr=False)
class SeparateReasoning(Node):
    """separate_reasoning(...): the named gens' (selects') outputs split into the thinking and
    the answer, after they ran."""

    names: list[str]
    format: ReasoningFormat  # the markers (runtime/server/reasoning.py, as the server's)

    def __repr__(self) -> str:
        return f"SeparateReasoning({self.names!r}, model_type={self.format.name!r})"


# the nodes a state queues: every node but Seq, which `s += ...` flattens
Leaf = Text | Gen | Select | RoleBegin | RoleEnd | SeparateReasoning


@dataclass(repr=False)
class Seq(Node):
    nodes: list[Leaf]

    def __repr__(self) -> str:
        return " + ".join(repr(n) for n in self.nodes) or "Seq([])"


def flatten(value: object) -> list[Leaf]:
    """The flat node list for `s += value`."""
    if isinstance(value, Seq):
        return list(value.nodes)
    if isinstance(value, Leaf):
        return [value]
    if isinstance(value, str):
        return [Text(value)] if value else []
    raise TypeError(f"cannot add {type(value).__name__} to a weft program (str or a weft node)")
