"""The embedding table and the lm_head, split over tensor-parallel ranks by vocabulary rows.

Rank r of `size` holds rows [r V', (r + 1) V') of the vocabulary, V' = ceil(vocab / size); rows
past the vocabulary (the last rank's, where size does not divide it) are padding, zero after
loading. The embedding looks up the ids in its rows (zeros for the others) and sums over the
ranks; the head computes the logits of its rows and gathers them, the padding trimmed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft.runtime.models.fp8 import FP8Weight
from weft.runtime.models.layers import (
    QuantLoading,
    QuantWeight,
    SlicedLoading,
    linear,
    load_plain,
)
from weft.runtime.parallel import SINGLE, RankSlice, TPGroup


def vocab_rows(vocab_size: int, tp: TPGroup) -> tuple[RankSlice, int]:
    """The vocabulary ids this rank holds, and its table's rows (the same on every rank)."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return RankSlice(vocab_size, start, min(rows, vocab_size - start)), rows


def _load_rows(weight: torch.Tensor, ids: RankSlice, tensor: torch.Tensor, name: str) -> None:
    """The rows of `ids` from the full table `tensor` [vocab, H]; padding rows zero."""
    load_plain(weight[: ids.size], ids.take(tensor, 0, name), name)
    weight.data[ids.size :].zero_()


def _vocab_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor | QuantWeight | FP8Weight,
    tp: TPGroup,
    vocab_size: int,
) -> torch.Tensor:
    """hidden [K, H] -> logits [K, vocab] in hidden's dtype, every rank's rows."""
    logits = tp.all_gather(linear(hidden, weight))  # [K, size * V']
    if logits.shape[-1] == vocab_size:
        return logits
    return logits[:, :vocab_size].contiguous()  # NOTE: the samplers take dense rows


class VocabEmbedding(SlicedLoading, nn.Module):
    """The token embeddings (`embed_tokens`); a tied model's logits come from them too."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.ids, rows = vocab_rows(vocab_size, tp)
        # NOTE: no random init (a normal_ over Qwen's 151936 x 896 table takes 1-2 s of every
        # load on a small CPU): every weight is loaded, or drawn by init_dummy
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)

    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        _load_rows(self.weight, self.ids, tensor, name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, H]."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.ids.start
        outside = (local < 0) | (local >= self.ids.size)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill_(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _vocab_logits(hidden, self.weight, self.tp, self.vocab_size)


class LMHead(QuantLoading, SlicedLoading, nn.Module):
    """An untied lm_head. Its weight may arrive GGUF-quantized (on one rank only); quantization
    'fp8' leaves it dense."""

    def __init__(self, hidden: int, vocab_size: int, dtype: torch.dtype, *, tp: TPGroup = SINGLE):
        super().__init__()
        self.quantize = False
        self.tp = tp
        self.vocab_size = vocab_size
        self.ids, rows = vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)

    def load_param(self, leaf: str, tensor: torch.Tensor, name: str) -> None:
        weight = self.weight
        if not isinstance(weight, nn.Parameter):  # quantized from the GGUF already
            raise ValueError(f"unexpected {name!r} for an lm_head without a dense weight")
        _load_rows(weight, self.ids, tensor, name)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _vocab_logits(hidden, self.weight, self.tp, self.vocab_size)
