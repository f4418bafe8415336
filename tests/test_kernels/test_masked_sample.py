"""masked_sample (Triton) and its torch twin vs the definitions: exact token ids.

The oracle (`_oracle_kept`) applies the definitions of the module docstring in float64, token by
token. Each case places every decision far from its boundary (`_make_case`): top_p between two
levels of "mass above", min_p between two probability levels, and uniform at the middle of the
chosen token's CDF interval; so the float32 kernel, the float32 twin and the float64 oracle
must agree exactly. Logits are rounded to multiples of `quantum`: ties everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from weft.grammars.bitmask import allowed_tokens
from weft.kernels.masked_sample import HAS_TRITON, masked_sample
from weft.kernels.masked_sample_ref import masked_sample_reference, max_and_argmax

from .kernel_utils import SMALL_DEVICE, generator

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
NEG_INF = float("-inf")
FLOAT32_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 < 1

# row kinds: (temperature, top_k, top_p wanted, min_p wanted); top_p/min_p get snapped to safe
# values, 1 / 0 stay off
KINDS = {
    "greedy": (0.0, 0, 1.0, 0.0),
    "greedy_k1": (0.8, 1, 0.9, 0.1),
    "plain": (1.0, 0, 1.0, 0.0),
    "hot": (2.5, 0, 1.0, 0.0),
    "top_k": (0.7, 5, 1.0, 0.0),
    "top_p": (1.0, 0, 0.8, 0.0),
    "min_p": (1.3, 0, 1.0, 0.2),
    "k_p": (0.9, 12, 0.6, 0.0),
    "k_p_min": (1.0, 40, 0.95, 0.05),
    "p_min": (0.6, 0, 0.5, 0.02),
    "cold_k": (0.05, 40, 1.0, 0.0),  # top-k far below the max in probability halvings
}


def _oracle_kept(
    logits: torch.Tensor,
    allowed: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kept [B, V], e [B, V], mass above [B, V]) in float64, from the definitions."""
    vocab = logits.shape[1]
    lm = logits.double().masked_fill(~allowed, NEG_INF)
    row_max = lm.amax(-1, keepdim=True)
    e = torch.exp((lm - row_max) / temperature.double()[:, None])
    z = e.sum(-1, keepdim=True)
    desc = lm.sort(-1, descending=True).values
    # top-k: at least the k-th largest allowed logit
    k = top_k.long()[:, None]
    use_k = (k > 0) & (k < allowed.sum(-1, keepdim=True))
    kth = desc.gather(1, (k.clamp(1, vocab) - 1))
    # top-p: the mass of the tokens with a strictly larger logit than token i
    before = torch.cat(
        [
            torch.zeros_like(z),
            torch.exp((desc - row_max) / temperature.double()[:, None]).cumsum(-1),
        ],
        -1,
    )
    num_larger = torch.searchsorted(-desc, -lm)  # count of desc > l_i
    above = before.gather(1, num_larger)
    kept = allowed.clone()
    kept &= ~use_k | (lm >= kth)
    kept &= (top_p.double()[:, None] >= 1) | (above < top_p.double()[:, None] * z)
    kept &= e >= min_p.double()[:, None]
    return kept, e, above


def _allowed_plain(bitmask: torch.Tensor, constrained: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V]: token t of a constrained row is allowed iff t < 32 W and bit t % 32 of word t // 32
    is set (the definition, token by token; independent of the module's `allowed_tokens`)."""
    num_words = bitmask.shape[1]
    tok = torch.arange(vocab)
    word = bitmask[:, (tok // 32).clamp(max=num_words - 1)]  # [B, V]
    bit = ((word >> (tok % 32)) & 1).bool() & (tok < 32 * num_words)
    return bit | ~constrained[:, None]


def _pick_between(
    levels: torch.Tensor, want: float, min_gap: float, geometric: bool
) -> float | None:
    """A value between two consecutive distinct `levels` (ascending, float64), the pair nearest
    `want` among those at least `min_gap` apart (relative, or in log for `geometric`)."""
    lo, hi = levels[:-1], levels[1:]
    if geometric:
        mid = (lo * hi).sqrt()
        wide = hi / lo >= 1 + min_gap
    else:
        mid = (lo + hi) / 2
        wide = hi - lo >= min_gap
    if not bool(wide.any()):
        return None
    dist = (mid - want).abs().masked_fill(~wide, math.inf)
    return float(mid[int(dist.argmin())])


def _make_case(
    name: str,
    device: torch.device,
    kinds: list[str],
    vocab: int,
    words: int | None = None,
    *,
    constrained: list[bool] | None = None,
    quantum: float = 0.5,
    scale: float = 3.0,
    density: float = 0.5,
) -> dict:
    """Inputs with every decision far from its boundary, and the oracle's token ids."""
    g = generator(name, torch.device("cpu"))
    batch = len(kinds)
    words = words if words is not None else -(-vocab // 32)
    logits = torch.randn((batch, vocab), generator=g) * scale
    if quantum:
        logits = (logits / quantum).round() * quantum
    bits = torch.rand((batch, words, 32), generator=g) < density
    bitmask = (bits.int() << torch.arange(32, dtype=torch.int32)).sum(-1, dtype=torch.int32)
    cons = torch.tensor(
        constrained if constrained is not None else [i % 2 == 0 for i in range(batch)]
    )
    temperature = torch.tensor([KINDS[k][0] for k in kinds], dtype=torch.float32)
    top_k = torch.tensor([KINDS[k][1] for k in kinds], dtype=torch.int32)
    top_p = torch.tensor([KINDS[k][2] for k in kinds], dtype=torch.float32)
    min_p = torch.tensor([KINDS[k][3] for k in kinds], dtype=torch.float32)
    allowed = _allowed_plain(bitmask, cons, vocab)
    assert torch.equal(allowed_tokens(bitmask, cons, vocab), allowed)

    # snap top_p and min_p between the levels their decisions compare against
    # greedy rows: any temperature will do (their settings are never read)
    temp_for_oracle = torch.where(temperature < 1e-5, 1.0, temperature)
    _, e, above = _oracle_kept(
        logits, allowed, temp_for_oracle, top_k, top_p.clamp(max=1), min_p * 0
    )
    z = e.sum(-1)
    for b in range(batch):
        if top_p[b] < 1:
            levels = torch.unique(above[b][allowed[b]] / z[b])
            p = _pick_between(levels, float(top_p[b]), 1e-3, geometric=False)
            top_p[b] = p if p is not None and p < 1 else 1.0
        if min_p[b] > 0:
            levels = torch.unique(e[b][allowed[b] & (e[b] > 0)])
            m = _pick_between(levels, float(min_p[b]), 1e-2, geometric=True)
            min_p[b] = m if m is not None else 0.0

    kept, e, _ = _oracle_kept(logits, allowed, temp_for_oracle, top_k, top_p, min_p)
    mass = torch.where(kept, e, 0.0)
    total = mass.sum(-1)
    before = mass.cumsum(-1) - mass
    uniform = torch.empty(batch, dtype=torch.float32)
    expected = torch.empty(batch, dtype=torch.int64)
    lm = logits.double().masked_fill(~allowed, NEG_INF)
    for b in range(batch):
        if not bool(allowed[b].any()):
            uniform[b], expected[b] = 0.5, -1
        elif temperature[b] < 1e-5 or top_k[b] == 1:
            uniform[b] = float(torch.rand((), generator=g))
            expected[b] = int((lm[b] == lm[b].max()).nonzero()[0])  # the first of the largest
        else:
            share = mass[b] / total[b]
            choices = (share >= 1e-3).nonzero()[:, 0]
            tok = int(choices[torch.randint(len(choices), (), generator=g)])
            uniform[b] = float((before[b, tok] + mass[b, tok] / 2) / total[b])
            expected[b] = tok
    inputs = dict(
        logits=logits,
        bitmask=bitmask,
        constrained=cons,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        uniform=uniform,
    )
    case = {k: v.to(device) for k, v in inputs.items()}
    case["expected"] = expected.to(device)
    case["allowed"] = allowed.to(device)
    return case


def _call(fn, case: dict, **kw):
    args = [case[k] for k in ("logits", "bitmask", "constrained", "temperature", "top_k")]
    args += [case[k] for k in ("top_p", "min_p", "uniform")]
    return fn(*args, **kw)


def _kernel(case: dict, **kw):
    """The kernel on SMALL_DEVICE (the interpreter on CPUs), its results on the case's device."""
    kw.setdefault("capacity", 64)  # the interpreter sorts a 2048-token buffer slowly
    dev = case["logits"].device
    on_small = {k: v.to(SMALL_DEVICE) if v is not None else None for k, v in case.items()}
    ids, logprobs = _call(masked_sample, on_small, **kw)
    return ids.to(dev), logprobs.to(dev) if logprobs is not None else None


def _reference(case: dict, **kw):
    return _call(masked_sample_reference, case, **kw)


def _assert_ids_and_logprobs(case: dict, ids: torch.Tensor, logprobs: torch.Tensor | None) -> None:
    assert ids.dtype == torch.int64
    assert ids.tolist() == case["expected"].tolist()
    assert logprobs is not None and logprobs.dtype == torch.float32
    raw = torch.log_softmax(case["logits"].double(), -1)
    want = raw.gather(1, ids.clamp_min(0)[:, None])[:, 0].float()
    want = want.masked_fill(ids < 0, float("nan"))
    torch.testing.assert_close(logprobs, want, rtol=1e-5, atol=1e-5, equal_nan=True)


MIXED = [
    "greedy",
    "plain",
    "top_k",
    "top_p",
    "min_p",
    "k_p",
    "k_p_min",
    "p_min",
    "hot",
    "greedy_k1",
    "cold_k",
]
SHAPES = [(200, None), (97, 4), (256, 12), (33, 1)]  # (V, W): W = ceil(V / 32) unless given


@pytest.mark.parametrize(("vocab", "words"), SHAPES)
def test_reference_matches_definition(request, vocab, words):
    case = _make_case(request.node.nodeid, torch.device("cpu"), MIXED, vocab, words)
    _assert_ids_and_logprobs(case, *_reference(case, want_logprobs=True))


@pytest.mark.parametrize(("vocab", "words"), SHAPES)
@pytest.mark.parametrize("density", [1.0, 0.5, 0.02])
def test_reference_all_greedy_matches_definition(request, monkeypatch, vocab, words, density):
    """A batch of greedy rows only takes a one-pass path where every row's largest logit is
    allowed, the full path otherwise: the oracle's tokens either way."""
    from weft.kernels import masked_sample_ref

    taken = []
    fast = masked_sample_ref._greedy_allowed
    monkeypatch.setattr(
        masked_sample_ref, "_greedy_allowed", lambda *a: taken.append(fast(*a)) or taken[-1]
    )
    kinds = ["greedy", "greedy_k1"] * 3
    case = _make_case(
        request.node.nodeid, torch.device("cpu"), kinds, vocab, words, density=density
    )
    _assert_ids_and_logprobs(case, *_reference(case, want_logprobs=True))
    largest_allowed = case["allowed"].gather(1, case["logits"].argmax(-1)[:, None])
    assert (taken[0] is not None) == bool(largest_allowed.all())
    if density == 1.0 and words is None:
        assert taken[0] is not None
    if density == 0.02:  # some constrained row's maximum is masked
        assert taken[0] is None


@pytest.mark.parametrize("vocab", [128 * 37, 128 * 37 + 5])  # by blocks; argmax itself
def test_max_and_argmax_is_argmax(request, vocab):
    """Ties (the first wins), NaN (the first NaN wins), rows all -inf, both signs of zero."""
    g = generator(request.node.nodeid, torch.device("cpu"))
    x = torch.randn((7, vocab), generator=g)
    x[1, 3::5] = x[1].max() + 1  # tied maxima in many blocks
    x[2, [600, 200, 4000]] = float("nan")
    x[3] = NEG_INF
    x[4, [130, 131]] = float("inf")
    x[5] = torch.where(torch.arange(vocab) % 2 == 0, -0.0, -1.0)
    x[5, 900] = 0.0
    x[6, -1] = 50.0  # the last token
    top, ids = max_and_argmax(x)
    want = x.argmax(-1)
    assert ids.tolist() == want.tolist()
    torch.testing.assert_close(
        top, x.gather(1, want[:, None])[:, 0], rtol=0, atol=0, equal_nan=True
    )
    assert ids.tolist()[1:5] == [3, 200, 0, 130]


@needs_triton
@pytest.mark.parametrize(("vocab", "words"), SHAPES)
@pytest.mark.parametrize(
    "launch",
    [
        dict(chunks=2, num_candidates=8, capacity=16),  # searches; buffer or chunk draw
        dict(chunks=1, num_candidates=2, capacity=16),
        dict(chunks=4, num_candidates=4, capacity=256),  # A fits: buffer, no search pass
        dict(num_candidates=16, capacity=32),
    ],
    ids=["c2-n8-cap16", "c1-n2-cap16", "c4-n4-cap256", "default-n16-cap32"],
)
def test_kernel_matches_definition(request, vocab, words, launch):
    case = _make_case(request.node.nodeid, SMALL_DEVICE, MIXED, vocab, words)
    _assert_ids_and_logprobs(case, *_kernel(case, want_logprobs=True, **launch))


@needs_triton
def test_kernel_distinct_logits_and_flat_mask(request):
    """No ties, a sparse mask (~10% allowed) and no unconstrained row."""
    kinds = ["top_p", "k_p", "min_p", "plain", "k_p_min", "p_min"]
    case = _make_case(
        request.node.nodeid,
        SMALL_DEVICE,
        kinds,
        300,
        constrained=[True] * len(kinds),
        quantum=0.0,
        density=0.1,
    )
    wide_k = dict(case, top_k=case["top_k"].long())  # top_k may be int64
    _assert_ids_and_logprobs(case, *_kernel(wide_k, want_logprobs=True, chunks=2))
    _assert_ids_and_logprobs(case, *_reference(wide_k, want_logprobs=True))


def _single_row(logits: list[float], **kw) -> dict:
    """One row, unconstrained unless `allowed_ids`; sampling settings by keyword."""
    vocab = len(logits)
    allowed_ids = kw.pop("allowed_ids", None)
    words = kw.pop("words", -(-vocab // 32))
    bitmask = None
    constrained = None
    if allowed_ids is not None:
        bitmask = torch.zeros((1, words), dtype=torch.int32)
        for t in allowed_ids:
            word = int(bitmask[0, t // 32]) | (1 << (t % 32))
            bitmask[0, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
        constrained = torch.tensor([True])
    return dict(
        logits=torch.tensor([logits], dtype=torch.float32),
        bitmask=bitmask,
        constrained=constrained,
        temperature=torch.tensor([kw.get("temperature", 1.0)]),
        top_k=torch.tensor([kw.get("top_k", 0)], dtype=torch.int32),
        top_p=torch.tensor([kw.get("top_p", 1.0)]),
        min_p=torch.tensor([kw.get("min_p", 0.0)]),
        uniform=torch.tensor([kw.get("uniform", 0.5)]),
    )


def _both(case: dict) -> list[int]:
    """Token id of row 0 by the twin and, where Triton is installed, by the kernel."""
    got = [int(_reference(case)[0][0])]
    if HAS_TRITON:
        got.append(int(_kernel(case, chunks=1)[0][0]))
    return got


def test_greedy_takes_the_first_allowed_maximum():
    logits = [1.0, 5.0, 2.0, 5.0, 5.0, -1.0] + [0.0] * 30 + [5.0]
    assert set(_both(_single_row(logits, temperature=0.0))) == {1}
    assert set(_both(_single_row(logits, temperature=0.0, allowed_ids=[0, 2, 3, 36]))) == {3}
    assert set(_both(_single_row(logits, top_k=1, allowed_ids=[36, 4]))) == {4}
    assert set(_both(_single_row(logits, top_k=1, allowed_ids=[0, 5]))) == {0}


def test_top_k_keeps_every_tie_of_the_kth():
    """top_k=2 over [3, 2, 2, 2, 1]: the threshold is 2, tokens 0-3 are kept (four of them)."""
    logits = [3.0, 2.0, 2.0, 2.0, 1.0]
    e = [math.exp(x - 3.0) for x in logits[:4]]
    # the middle of token 3's interval; without the ties past the k-th it would be token 0..1
    u = (sum(e[:3]) + e[3] / 2) / sum(e)
    assert set(_both(_single_row(logits, top_k=2, uniform=u))) == {3}
    # token 4 is never kept: a uniform just below 1 lands on the last kept token
    assert set(_both(_single_row(logits, top_k=2, uniform=FLOAT32_BELOW_ONE))) == {3}
    assert set(_both(_single_row(logits, top_k=0, uniform=FLOAT32_BELOW_ONE))) == {4}


def test_signed_zeros_tie():
    """-0.0 == +0.0: with the 2nd largest logit 0, both zeros are kept."""
    logits = [1.0, 0.0, -0.0, -1.0]
    e = [math.exp(x - 1.0) for x in logits[:3]]
    u = (sum(e[:2]) + e[2] / 2) / sum(e)
    assert set(_both(_single_row(logits, top_k=2, uniform=u))) == {2}
    # top-p: the mass above token 2 (-0.0) is e0 only (token 1 ties with it): kept, as token 1
    p = (e[0] + 1e-3) / sum(math.exp(x - 1.0) for x in logits)
    assert set(_both(_single_row(logits, top_p=p, uniform=u))) == {2}


def test_top_p_keeps_the_token_that_crosses():
    """p = [0.5, 0.3, 0.2] (logits log p): top_p=0.6 keeps tokens 0 and 1 (0.5 < 0.6 before 1)."""
    logits = [math.log(0.2), math.log(0.5), math.log(0.3)]
    # kept {1, 2} in id order: token 1 holds [0, 0.625), token 2 [0.625, 1) of the kept mass
    assert set(_both(_single_row(logits, top_p=0.6, uniform=0.6))) == {1}
    assert set(_both(_single_row(logits, top_p=0.6, uniform=0.65))) == {2}
    assert set(_both(_single_row(logits, top_p=0.45, uniform=0.99))) == {1}  # only the top one
    # min_p 0.5: keeps p >= 0.25 (tokens 1, 2); token 0 (0.2) goes
    assert set(_both(_single_row(logits, min_p=0.5, uniform=0.1))) == {1}
    assert set(_both(_single_row(logits, min_p=0.3, uniform=0.1))) == {0}


def test_tie_group_larger_than_the_buffer():
    """theta_k = 1 sits in a tie group of 50 tokens and the kernel's buffer holds 16: the search
    pins theta by key and the draw runs over the row; both sides of the tie group are kept."""
    g = generator("tie-group", torch.device("cpu"))
    values = torch.tensor([2.0] * 50 + [1.0] * 50 + [0.0] * 100)
    logits = values[torch.randperm(200, generator=g)]
    mass = torch.exp(logits.double() - 2.0) * (logits >= 1)
    before = mass.cumsum(0) - mass
    for tok in (int((logits == 1).nonzero()[-1]), int((logits == 2).nonzero()[3])):
        u = float((before[tok] + mass[tok] / 2) / mass.sum())
        case = _single_row(logits.tolist(), top_k=60, uniform=u, temperature=1.0)
        assert int(_reference(case)[0][0]) == tok
        if HAS_TRITON:
            for capacity in (16, 256):  # pinned by key; everything in the buffer
                assert int(_kernel(case, chunks=2, capacity=capacity)[0][0]) == tok


def test_nothing_allowed_is_minus_one():
    logits = [0.5] * 40
    cases = [
        _single_row(logits, allowed_ids=[]),
        _single_row(logits, allowed_ids=[], temperature=0.0),
        _single_row(logits, allowed_ids=[40, 63], words=2),  # only bits past V
        _single_row(logits, allowed_ids=[70, 95], words=3),  # only words past V
    ]
    for case in cases:
        assert set(_both(case)) == {-1}
        ids, logprobs = _reference(case, want_logprobs=True)
        assert ids.tolist() == [-1] and logprobs is not None and math.isnan(float(logprobs[0]))
        if HAS_TRITON:
            ids, logprobs = _kernel(case, want_logprobs=True, chunks=1)
            assert ids.tolist() == [-1] and logprobs is not None and math.isnan(float(logprobs[0]))


def test_bits_past_the_vocabulary_are_ignored():
    logits = [float(i % 7) for i in range(40)]
    # 6 is the largest allowed (logit 6 at id 6, 13, ...); bits 40..63 allowed too: ignored
    case = _single_row(logits, temperature=0.0, allowed_ids=[3, 6, 13, *range(40, 64)], words=2)
    assert set(_both(case)) == {6}
    case = _single_row(logits, top_k=2, uniform=0.99, allowed_ids=[3, 6, 13, 45], words=4)
    assert set(_both(case)) == {13}


def test_short_bitmask_disallows_the_rest():
    """W < ceil(V / 32): the tokens at or past 32 * W are not allowed."""
    logits = [0.0] * 70
    logits[69] = 9.0  # not allowed: past 32 * 2
    logits[33] = 3.0
    case = _single_row(logits, temperature=0.0, allowed_ids=[1, 33], words=2)
    assert set(_both(case)) == {33}
    case = _single_row(logits, uniform=FLOAT32_BELOW_ONE, allowed_ids=[1, 33, 63], words=2)
    assert set(_both(case)) == {63}


def test_all_minus_inf_row_is_greedy():
    logits = [NEG_INF] * 10 + [4.0]
    case = _single_row(logits, allowed_ids=[2, 5, 7], top_p=0.5, min_p=0.1)
    assert set(_both(case)) == {2}
    # -inf tokens have no mass: never drawn, not even at the ends of the uniform range
    for u in (0.0, FLOAT32_BELOW_ONE):
        case = _single_row([NEG_INF, 1.0, NEG_INF, 1.0, NEG_INF], top_k=4, uniform=u)
        assert set(_both(case)) == {1 if u == 0.0 else 3}


def test_no_kept_mass_and_nan_stay_in_range():
    """Out-of-range settings and NaN logits give a defined or at least an allowed token: min_p > 1
    keeps nothing (the greedy token); NaN logits: some allowed token (unspecified)."""
    logits = [0.5, 3.0, 1.0, 3.0, -2.0]
    assert set(_both(_single_row(logits, min_p=1.5, uniform=0.3))) == {1}
    assert set(_both(_single_row(logits, min_p=1.5, top_p=0.9, uniform=0.3))) == {1}
    # top_p = 0 (out of range) keeps the tokens tied at the max: 1 and 3
    assert set(_both(_single_row(logits, top_p=0.0, uniform=0.7))) == {3}
    nan_row = [0.5, float("nan"), 1.0, 3.0, -2.0] * 8
    allowed = [0, 1, 3, 6, 17, 33]  # 1 and 6: NaN
    for kw in ({"temperature": 0.0}, {"top_p": 0.9}, {"top_k": 3}, {}):
        for got in _both(_single_row(nan_row, allowed_ids=allowed, **kw)):
            assert got in allowed
    # both read NaN as -inf (one semantics on every device): greedy takes the first 3.0
    assert set(_both(_single_row(nan_row, allowed_ids=allowed, temperature=0.0))) == {3}


def test_constrained_none_means_every_row():
    case = _make_case("constrained-none", torch.device("cpu"), MIXED, 150)
    all_rows = dict(case, constrained=torch.ones(len(MIXED), dtype=torch.bool))
    no_flags = dict(case, constrained=None)
    want = _reference(all_rows)[0]
    assert torch.equal(_reference(no_flags)[0], want)
    assert bool(case["allowed"].logical_not().any())  # the mask does exclude tokens
    if HAS_TRITON:
        assert torch.equal(_kernel(no_flags, chunks=2)[0], want)
    # no bitmask: nothing constrained
    free = dict(case, bitmask=None, constrained=None)
    ids = _reference(free)[0]
    assert (ids >= 0).all()
    if HAS_TRITON:
        assert torch.equal(_kernel(free, chunks=2)[0], ids)


def _random_uniform_case(name: str, device: torch.device, vocab: int) -> dict:
    """Unsnapped settings and uniforms: decisions may sit on boundaries (invariants only)."""
    case = _make_case(name, device, MIXED * 2, vocab)
    g = generator(name + "/u", torch.device("cpu"))
    batch = len(MIXED) * 2
    case["uniform"] = torch.rand(batch, generator=g).to(device)
    case["top_p"] = torch.rand(batch, generator=g).clamp_min(0.05).to(device)
    case["top_k"] = torch.randint(0, 20, (batch,), generator=g, dtype=torch.int32).to(device)
    return case


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_invariants_on_random_uniforms(request, impl):
    """Any uniform: the token is allowed, and within the top k (by value, ties included)."""
    if impl == "kernel" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    case = _random_uniform_case(request.node.nodeid, SMALL_DEVICE, 120)
    ids = (_reference(case) if impl == "reference" else _kernel(case, chunks=1))[0]
    allowed = case["allowed"]
    assert (ids >= 0).all()  # every row allows something here
    assert allowed.gather(1, ids[:, None]).all()
    lm = case["logits"].masked_fill(~allowed, NEG_INF)
    k = case["top_k"].long()
    use = k > 0
    kth = lm.sort(-1, descending=True).values.gather(1, (k.clamp_min(1) - 1)[:, None])[:, 0]
    chosen = lm.gather(1, ids[:, None])[:, 0]
    assert (chosen[use] >= kth[use]).all()
    assert use.sum() >= 5  # the assertion above covers enough rows


def _grid_counts(impl, logits: list[float], n: int, **kw) -> tuple[list[int], list[int], int]:
    """Counts per token over uniforms (j + 0.5) / n and the exact ones; grid points within
    1e-5 of a CDF boundary (float64) may land on either side: their count."""
    vocab = len(logits)
    row = _single_row(logits, **kw)
    case = {
        k: v.expand(n, *v.shape[1:]).contiguous() if v is not None else None for k, v in row.items()
    }
    grid = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()
    case["uniform"] = grid
    ids = impl(case)
    got = torch.bincount(ids, minlength=vocab).tolist()
    # exact: the filtered softmax in float64
    allowed = torch.ones((1, vocab), dtype=torch.bool)
    kept, e, _ = _oracle_kept(
        row["logits"], allowed, row["temperature"], row["top_k"], row["top_p"], row["min_p"]
    )
    cdf = torch.where(kept, e, 0.0)[0].cumsum(0)
    cdf = cdf / cdf[-1]
    want_ids = torch.searchsorted(cdf, grid.double(), right=True)
    ambiguous = ((grid.double()[:, None] - cdf[None, :]).abs() < 1e-5).any(-1)
    same = ids == want_ids
    assert same[~ambiguous].all()
    want = torch.bincount(want_ids, minlength=vocab).tolist()
    return got, want, int(ambiguous.sum())


def test_reference_frequencies_match_the_filtered_softmax():
    logits = [0.3, 2.0, -1.0, 1.5, 1.5, 0.0, -3.0, 2.2]
    for kw in ({}, {"temperature": 0.5}, {"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.3}):
        got, want, ambiguous = _grid_counts(masked_sample_reference_ids, logits, 4096, **kw)
        assert ambiguous == 0
        assert got == want
        assert sum(got) == 4096


@needs_triton
def test_kernel_frequencies_match_the_filtered_softmax():
    logits = [0.3, 2.0, -1.0, 1.5, 1.5, 0.0, -3.0, 2.2]
    for kw in ({"temperature": 0.7}, {"top_k": 3, "top_p": 0.9}):
        got, want, ambiguous = _grid_counts(kernel_ids, logits, 40, **kw)
        assert ambiguous == 0
        assert got == want


def masked_sample_reference_ids(case: dict) -> torch.Tensor:
    return _reference(case)[0]


def kernel_ids(case: dict) -> torch.Tensor:
    return _kernel(case, chunks=1)[0]


def test_logits_are_not_modified():
    case = _make_case("not-modified", SMALL_DEVICE, MIXED, 100)
    before = case["logits"].clone()
    _reference(case, want_logprobs=True)
    if HAS_TRITON:
        _kernel(case, want_logprobs=True, chunks=1)
    assert torch.equal(case["logits"], before)


def test_checks():
    case = _make_case("checks", torch.device("cpu"), ["plain", "top_k"], 64)
    fns = [masked_sample_reference] + ([masked_sample] if HAS_TRITON else [])
    bad = [
        (dict(logits=case["logits"].half()), "logits"),
        (dict(logits=case["logits"][:, ::2]), "logits"),
        (dict(bitmask=case["bitmask"].long()), "bitmask"),
        (dict(bitmask=case["bitmask"][:1]), "bitmask"),
        (dict(constrained=case["constrained"].int()), "constrained"),
        (dict(bitmask=None), "constrained"),
        (dict(top_k=case["top_k"].float()), "top_k"),
        (dict(uniform=case["uniform"][:1]), "uniform"),
        (dict(temperature=case["temperature"].double()), "temperature"),
    ]
    for fn in fns:
        for change, match in bad:
            with pytest.raises(ValueError, match=match):
                _call(fn, dict(case, **change))
    if HAS_TRITON:
        with pytest.raises(ValueError, match="chunks"):
            _kernel(case, chunks=3)
        with pytest.raises(ValueError, match="capacity"):
            _kernel(case, capacity=8)
        with pytest.raises(ValueError, match="num_candidates"):
            _kernel(case, num_candidates=3)
        ids, logprobs = _kernel({k: v[:0] for k, v in case.items()}, want_logprobs=True)
        assert ids.shape == (0,) and logprobs is not None and logprobs.shape == (0,)


@pytest.mark.cuda
def test_real_shapes_cuda(request):
    """B=64 at Qwen2's vocabulary (151936), half the rows constrained: kernel, twin, oracle."""
    kinds = [list(KINDS)[i % len(KINDS)] for i in range(64)]
    case = _make_case(
        request.node.nodeid, torch.device("cuda"), kinds, 151936, quantum=1 / 64, scale=4.0
    )
    # the production buffer (2048) and a small one (more search passes, the chunk draw)
    _assert_ids_and_logprobs(case, *_kernel(case, want_logprobs=True, capacity=2048))
    _assert_ids_and_logprobs(case, *_kernel(case, want_logprobs=True, capacity=64))
    _assert_ids_and_logprobs(case, *_reference(case, want_logprobs=True))
