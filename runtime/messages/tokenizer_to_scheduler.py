"""Channel tokenizer manager -> scheduler: new requests, aborts and queries."""

from __future__ import annotations

import msgspec

from weft.runtime.sampling_params import SamplingParams


class GenerateRequest(msgspec.Struct, array_like=True):
    """One tokenized, validated prompt (n > 1 samples are split by the scheduler)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    logprob_start_len: int | None = None  # None: no logprobs; -1: output tokens only
    top_logprobs_num: int = 0
    namespace: str = ""
    # the output begins in the thinking, which ends with these tokens (the reasoning end
    # marker): the constraint holds the answer after them, params.thinking_budget counts the
    # tokens before them (weft.runtime.thinking). None: no thinking phase.
    reasoning_end_ids: list[int] | None = None
    # with reasoning_end_ids: the output begins before the thinking, and opens it if it writes
    # these tokens (the reasoning start marker) first. None: it begins in the thinking.
    reasoning_start_ids: list[int] | None = None


class Generate(msgspec.Struct, tag="generate"):
    reqs: list[GenerateRequest]  # a batch arrives as one message so it is scheduled together


class Abort(msgspec.Struct, tag="abort"):
    rids: list[str]  # caller rids (an n > 1 rid aborts all its samples)


class GetServerInfo(msgspec.Struct, tag="server_info"):
    query_id: int


class FlushCache(msgspec.Struct, tag="flush_cache"):
    query_id: int


class GetMetrics(msgspec.Struct, tag="metrics"):
    """Counters and gauges for /metrics: cheap to answer (no integrity audit)."""

    query_id: int


ToScheduler = Generate | Abort | GetServerInfo | FlushCache | GetMetrics

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ToScheduler)
