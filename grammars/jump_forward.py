"""Which tokens of the text a grammar forces may be appended without asking the model.

Jump-forward must not change the answer. Two hazards, both seen on real models:
- Rewriting the model's own token: re-tokenizing the sampled `{` with the forced `"name` gives
  `{"` + `name`, tokens the model did not choose, and the model continues from context it never
  produced. The sampled token stays as it is; only the forced text is tokenized.
- Imposing a token boundary the model would not: the forced ` [` appended as a token leaves the
  model to continue with `"` where it would have emitted ` ["` as one token, and from that
  unnatural split it wrote ".NET" for "NET". A forced tail that some vocabulary token extends
  (the model's next token could cover it and go on) is left for the model to emit, under the
  grammar's mask, as it would without jump-forward.

The tail test is by the vocabulary alone (not the grammar), so it leaves a little more to the
model than needed; that costs steps, never the answer.
"""

from __future__ import annotations

import bisect

from weft.grammars.vocab import TokenVocab


def extends(vocab: TokenVocab, tail: bytes) -> bool:
    """Whether some token's text starts with `tail` and goes on past it."""
    texts = vocab.sorted_texts
    # the first text > tail: a longer text starting with tail sorts right after tail itself
    at = bisect.bisect_right(texts, tail)
    return at < len(texts) and texts[at].startswith(tail)


def settled_tokens(vocab: TokenVocab, forced: bytes) -> list[int]:
    """The canonical tokens of `forced` up to its first token boundary from which the rest of
    the forced text could still merge with the text after it ([] when none is settled, or the
    tokenizer does not spell `forced` back exactly)."""
    if vocab.tokenizer is None:
        return []
    try:
        text = forced.decode("utf-8")
    except UnicodeDecodeError:
        return []  # the forced text ends inside a character: next time
    ids = list(vocab.tokenizer.encode(text, add_special_tokens=False))
    if vocab.text_bytes(ids) != forced:
        return []  # e.g. a SentencePiece tokenizer that prefixes a space
    start = 0
    for k, tid in enumerate(ids):
        if extends(vocab, forced[start:]):
            return ids[:k]
        start += len(vocab.token_bytes[tid] or b"")
    return ids
