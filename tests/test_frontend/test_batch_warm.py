"""A batch whose programs share a prefix sends it once first; the engine's cache serves it."""

from __future__ import annotations

import weft

from conftest import fixture_path, make_engine

SYSTEM = "Once upon a time, there was a little girl named Lily. She loved to play outside. "


@weft.function
def story(s, hero):
    s += SYSTEM + hero + " said" + weft.gen("rest", max_tokens=6, temperature=0)


def test_batch_programs_hit_the_warmed_prefix():
    engine = make_engine(fixture_path("models", "stories260K-hf"), max_total_tokens=4096)
    heroes = ["Tom", "Sue", "Max", "Ann"]
    states = story.run_batch([{"hero": h} for h in heroes], backend=engine)
    prefix_tokens = len(engine.tokenizer.encode(SYSTEM))
    for s in states:
        assert s.get_meta_info("rest")["cached_tokens"] >= prefix_tokens - 2
    engine.shutdown()
