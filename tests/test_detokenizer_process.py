"""The detokenizer's text rules, without processes: whole characters only, the scheduler's
end-token and stop-string decisions, and the stop-string hold-back."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from weft.runtime.detokenizer_process import Detokenizer
from weft.runtime.messages import detokenizer_to_tokenizer as to_tm
from weft.runtime.messages import scheduler_to_detokenizer as msg
from weft.runtime.messages.common import GrammarReport
from weft.runtime.server.sglang_params import parse_sampling_params

from conftest import fixture_path


@pytest.fixture(scope="module")
def tokenizer():
    # Llama-2's SentencePiece vocabulary: an emoji is four byte tokens, each alone invalid UTF-8
    return AutoTokenizer.from_pretrained(str(fixture_path("tokenizers", "llama2")))


def _run(tokenizer, ids, finish=None, stop_hold=0, skip_special=True):
    detok = Detokenizer(tokenizer)
    start = msg.DecodeStart("r", skip_special, True, stop_hold)
    deltas = []
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        update = msg.TokenUpdate("r", "r", 0, [tid], 0, finish if last else None)
        out = detok.step(msg.Step([start] if i == 0 else [], [update]))
        deltas.append(out.updates[0].text)
    assert not detok.samples, "a finished sample must be forgotten"
    return deltas


LENGTH = msg.Finish({"type": "length"}, decode_last=True, text_len=-1)


def test_never_half_a_character(tokenizer):
    text = "Hé 🦙 日本語 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert sum(1 for i in ids if tokenizer.decode([i]) == "\ufffd") >= 4  # byte tokens
    deltas = _run(tokenizer, ids, LENGTH)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "" in deltas  # the emoji's first bytes were held back


def test_an_end_token_is_not_decoded(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False) + [2]
    stop = msg.Finish({"type": "stop", "matched": 2}, decode_last=False, text_len=-1)
    assert "".join(_run(tokenizer, ids, stop, skip_special=False)) == "Hello world"


def test_a_stop_string_cut_and_hold_back(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    full = tokenizer.decode(ids)
    cut = full.index(" three")
    stop = msg.Finish({"type": "stop", "matched": " three"}, decode_last=True, text_len=cut)
    ids = ids[: len(tokenizer.encode("one two three", add_special_tokens=False))]
    deltas = _run(tokenizer, ids, stop, stop_hold=len(" three") - 1)
    assert "".join(deltas) == "one two"
    # while running, the last len(stop) - 1 characters were never sent
    assert len("".join(deltas[:-1])) <= len(tokenizer.decode(ids[:-1])) - (len(" three") - 1)


def test_what_meta_info_reports_passes_through(tokenizer):
    """Counts, finish reason and grammar report reach the tokenizer manager as the scheduler
    sent them (the server builds meta_info from these), msgpack round trip included."""
    report = GrammarReport("xgrammar", 3)
    logprobs = [(-0.5, 100, [(-0.5, 100), (-1.5, 7)])]
    update = msg.TokenUpdate("r", "caller", 1, [100], 5, LENGTH, logprobs, None, report)
    step = Detokenizer(tokenizer).step(msg.Step([msg.DecodeStart("r", True, True, 0)], [update]))
    out = to_tm.decoder.decode(to_tm.encoder.encode(step)).updates[0]
    assert (out.rid, out.index, out.new_ids, out.cached_tokens) == ("caller", 1, [100], 5)
    assert out.finish_reason == {"type": "length"} and out.grammar == report
    assert out.output_logprobs == logprobs and out.input_logprobs is None


def test_sglang_nulls_and_spellings():
    params, explicit = parse_sampling_params(
        {
            "regex": None,
            "json_schema": "",
            "top_k": 1 << 30,
            "sampling_seed": 3,
            "stop": "x",
            "stop_regex": [],
            "logit_bias": {},
            "stream_interval": 4,
            "max_new_tokens": None,
        },
        vocab_size=100,
    )
    assert params.seed == 3 and params.stop == ["x"] and params.max_new_tokens == 128
    assert not explicit
