"""How select (and gen(choices=)) picks a choice from its token logprobs: SGLang's
`choices_method` objects, subclassable with the same call signature.

Token logprob entries are `(logprob, token_id, text)` tuples (text None), one list per choice,
as SGLang passes them; a choice's entries are its own tokens after the prompt. Unconditional
entries (a choice scored alone) have logprob None for the first token, which had no context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weft.frontend.scoring import choose

Entries = list[list[tuple[float, int, str | None]]]
UncondEntries = list[list[tuple[float | None, int, str | None]]]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesSamplingMethod:
    """Subclass and implement `__call__`; set `requires_unconditional_logprobs` to be given
    each choice's logprobs scored alone (no prompt)."""

    requires_unconditional_logprobs = False

    def __repr__(self) -> str:
        return type(self).__name__

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: Entries,
        output_token_logprobs: Entries,
        unconditional_token_logprobs: UncondEntries | None = None,
    ) -> ChoicesDecision:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")


class _Builtin(ChoicesSamplingMethod):
    name = ""

    def __repr__(self) -> str:
        return self.name

    def __call__(  # the same keywords; those unused in **_
        self,
        *,
        choices: list[str],
        input_token_logprobs: Entries,
        unconditional_token_logprobs: UncondEntries | None = None,
        **_: Any,
    ) -> ChoicesDecision:
        cond = [[e[0] for e in entries] for entries in input_token_logprobs]
        uncond = None
        if unconditional_token_logprobs is not None:
            uncond = [[e[0] for e in entries] for entries in unconditional_token_logprobs]
        index, scores = choose(self.name, cond, uncond)
        return ChoicesDecision(choices[index], {"scores": scores})


class TokenLengthNormalized(_Builtin):
    """The highest mean token logprob."""

    name = "token_length_normalized"


class GreedyTokenSelection(_Builtin):
    """The best first token wins; ties look at the next token."""

    name = "greedy"


class UnconditionalLikelihoodNormalized(_Builtin):
    """Mean token logprob after the prompt minus that of the choice alone."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
_BY_NAME: dict[str, ChoicesSamplingMethod] = {
    "token_length_normalized": token_length_normalized,
    "greedy": greedy_token_selection,
    "greedy_token_selection": greedy_token_selection,
    "unconditional_likelihood_normalized": unconditional_likelihood_normalized,
}


def choices_method_named(label: str, method: str | ChoicesSamplingMethod) -> ChoicesSamplingMethod:
    """The method object for a name or an object; ValueError naming the call otherwise."""
    if isinstance(method, ChoicesSamplingMethod):
        return method
    if isinstance(method, str) and method in _BY_NAME:
        return _BY_NAME[method]
    raise ValueError(
        f"{label}: unknown choices_method {method!r}; one of {', '.join(_BY_NAME)}, "
        "or a weft.ChoicesSamplingMethod instance"
    )
