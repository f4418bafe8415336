"""Scheduling: retraction under a tiny KV pool, request limits, admission order, aborts."""

from __future__ import annotations

import asyncio
import random

import pytest

from conftest import make_engine, require_default_model


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 24))] for _ in range(n)]


GREEDY = {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}


@pytest.fixture(scope="module")
def big(stories_dir):
    return make_engine(stories_dir, max_total_tokens=8192)


@pytest.mark.parametrize("radix", [True, False])
def test_tiny_pool_retracts_and_still_matches(stories_dir, big, radix):
    prompts = _prompts(8)
    expected = [o["output_ids"] for o in big.generate(input_ids=prompts, sampling_params=GREEDY)]
    # 8 requests need ~8 * 135 slots; 400 forces decode to run out and retract
    tiny = make_engine(stories_dir, max_total_tokens=400, disable_radix_cache=not radix)
    outs = tiny.generate(input_ids=prompts, sampling_params=GREEDY)
    assert tiny.scheduler.num_retractions > 0
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["finish_reason"] == {"type": "length"} for o in outs)
    tiny.check_integrity()
    tiny.shutdown()


def test_a_pool_of_a_few_tokens_starts_and_serves_what_fits(stories_dir):
    """The start's warm-up (a scratch prefill and decode) takes no more slots than the pool
    has; a request of 3 tokens and 2 new ones fits 5."""
    engine = make_engine(stories_dir, max_total_tokens=5)
    out = engine.generate(input_ids=[1, 5, 9], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2
    engine.shutdown()


def test_max_running_requests_is_respected(stories_dir):
    engine = make_engine(stories_dir, max_total_tokens=4096, max_running_requests=2)
    outs = engine.generate(input_ids=_prompts(6, seed=1), sampling_params=GREEDY)
    assert len(outs) == 6 and all(len(o["output_ids"]) == 120 for o in outs)
    assert engine.scheduler.peak_running == 2
    engine.shutdown()


def test_longest_prefix_first(stories_dir):
    engine = make_engine(stories_dir, max_total_tokens=4096, max_running_requests=1)
    warm = _prompts(1, seed=2)[0] * 3
    engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 0})
    cold = _prompts(1, seed=3)[0]
    # cold arrives first; with one running slot, lpm must admit the cached one first
    outs = engine.generate(input_ids=[cold, warm + [5]], sampling_params=GREEDY)
    assert outs[1]["meta_info"]["cached_tokens"] == len(warm)
    assert outs[1]["meta_info"]["e2e_latency"] < outs[0]["meta_info"]["e2e_latency"]
    engine.shutdown()


def test_fcfs_keeps_arrival_order(stories_dir):
    engine = make_engine(
        stories_dir, max_total_tokens=4096, max_running_requests=1, schedule_policy="fcfs"
    )
    warm = _prompts(1, seed=2)[0] * 3
    engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 0})
    cold = _prompts(1, seed=3)[0]
    outs = engine.generate(input_ids=[cold, warm + [5]], sampling_params=GREEDY)
    assert outs[0]["meta_info"]["e2e_latency"] < outs[1]["meta_info"]["e2e_latency"]
    engine.shutdown()


def test_chunked_prefill_mixed_with_decode(stories_dir, big):
    long_prompt = _prompts(1, seed=4)[0] * 10  # ~100+ tokens: several chunks of 16
    short = _prompts(3, seed=5)
    ref = [
        o["output_ids"]
        for o in big.generate(input_ids=short + [long_prompt], sampling_params=GREEDY)
    ]
    engine = make_engine(
        stories_dir, max_total_tokens=4096, chunked_prefill_size=16, disable_radix_cache=True
    )

    async def run():
        first = [
            asyncio.ensure_future(engine.async_generate(input_ids=p, sampling_params=GREEDY))
            for p in short
        ]
        await asyncio.sleep(0.05)  # the short ones are decoding when the long one arrives
        last = asyncio.ensure_future(
            engine.async_generate(input_ids=long_prompt, sampling_params=GREEDY)
        )
        return await asyncio.gather(*first, last)

    outs = asyncio.run(run())
    assert [o["output_ids"] for o in outs] == ref
    engine.shutdown()


def test_abort_mid_stream_frees_kv(big):
    async def run():
        chunks = 0
        stream = big.generate_stream(
            input_ids=_prompts(1, seed=6)[0], sampling_params={**GREEDY, "max_new_tokens": 400}
        )
        async for _ in stream:
            chunks += 1
            if chunks == 3:
                break
        await stream.aclose()
        return chunks

    assert asyncio.run(run()) == 3
    big.call(lambda: None)  # let the abort land
    assert big.memory_stats()["in_use"] == 0


def test_abort_by_rid(big):
    async def run():
        task = asyncio.ensure_future(
            big.async_generate(
                input_ids=_prompts(1, seed=7)[0],
                rid="victim",
                sampling_params={**GREEDY, "max_new_tokens": 480},
            )
        )
        await asyncio.sleep(0.05)
        big.abort("victim")
        return await task

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 480


def test_concurrent_requests_share_a_prefix_being_computed(stories_dir, big):
    system = _prompts(1, seed=8)[0] * 5  # a long shared prefix (> one chunk of 32)
    prompts = [system + q for q in _prompts(6, seed=9)]
    engine = make_engine(stories_dir, max_total_tokens=4096, chunked_prefill_size=32)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[0] == 0 and all(c >= len(system) - 1 for c in cached[1:]), cached
    ref = big.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    engine.shutdown()


def test_requests_arriving_together_compute_a_shared_prefix_once(stories_dir, big):
    """With room for all of them in one step, the first computes the shared prefix and the
    others wait one step, then take it from the cache."""
    system = _prompts(1, seed=10)[0] * 5
    prompts = [system + q for q in _prompts(6, seed=11)]
    engine = make_engine(stories_dir, max_total_tokens=4096, chunked_prefill_size=4096)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[0] == 0 and all(c >= len(system) for c in cached[1:]), cached
    ref = big.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
    engine.shutdown()


def test_chunked_prefill_size_defaults_by_device_memory(stories_dir):
    from weft.runtime.scheduler import chunk_size_for_memory

    assert chunk_size_for_memory(80 * 2**30) == 8192  # an H100
    assert chunk_size_for_memory(35 * 2**30) == 8192
    assert chunk_size_for_memory(24 * 2**30) == 2048  # a 4090
    engine = make_engine(stories_dir, device="cpu", max_total_tokens=1024)
    assert engine.scheduler.chunk_size == 2048
    engine.shutdown()
    engine = make_engine(stories_dir, device="cpu", max_total_tokens=1024, chunked_prefill_size=64)
    assert engine.scheduler.chunk_size == 64
    engine.shutdown()


def test_wait_for_grammars_returns_once_the_backends_are_built():
    """The server says it is ready only after this (scheduler_process): the build of the default
    model's 152k-token grammar vocabulary takes seconds, which the first request shared."""
    require_default_model()
    engine = make_engine(None, max_total_tokens=1024)
    engine.scheduler.wait_for_grammars(60)
    built = engine.scheduler._grammars_built
    assert built is not None and built.done() and built.exception() is None
    engine.shutdown()
