"""`weft serve --dp-size 2`: two real replicas behind the real sglang-router, over HTTP."""

from __future__ import annotations

import re

import psutil
import pytest
import requests

from server_utils import ServerProcess, stories_args

pytest.importorskip("sglang_router")

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her friends. One day, she saw a big red ball under a tree. "
)
OTHER = (
    "Tom and his dog Max went to the beach. The sun was hot and the water was blue. Max ran "
    "into the waves and barked at the birds. Tom laughed and built a castle of sand. "
)


@pytest.fixture(scope="module")
def group(stories_dir):
    """One group for the module; its last test kills a replica (one start less: ~15 s)."""
    srv = ServerProcess(*stories_args(stories_dir, "--dp-size", "2"))
    yield srv
    if srv.proc.poll() is None:  # the dead-replica test did not run
        assert srv.stop() == 0


def _replicas(srv: ServerProcess) -> list[str]:
    line = next(line for line in srv.lines if "serving 2 replicas" in line)
    return re.findall(r"http://127\.0\.0\.1:\d+", line.split(" at ")[0])


def _generate(url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    reply = requests.post(url + "/generate", json=body, timeout=60)
    reply.raise_for_status()
    return reply.json()


def test_requests_that_share_a_prefix_go_where_it_is_cached(group):
    replicas = _replicas(group)
    assert len(replicas) == 2 and group.url not in replicas
    for prefix in (STORY, OTHER):
        first = _generate(group.url, prefix + "It was")
        assert first["meta_info"]["cached_tokens"] <= 1  # (the BOS token, at most)
        prompt = first["meta_info"]["prompt_tokens"]
        for suffix in ("She said", "Then the", "The end"):
            meta = _generate(group.url, prefix + suffix)["meta_info"]
            # all but the last prompt token or two (the suffixes differ) came from the cache
            assert meta["cached_tokens"] >= prompt - 4, meta
    # NOTE: which replica takes a prompt no cache holds is the router's choice (under no load,
    # its first); benchmarks/bench_dp_router.py compares the policies under load
    served = [requests.get(r + "/get_server_info", timeout=10).json() for r in replicas]
    assert sum(s["num_requests"] for s in served) == 8


def test_the_same_request_gives_the_same_answer_as_one_replica(group):
    direct = _generate(_replicas(group)[0], STORY + "The ball")
    routed = _generate(group.url, STORY + "The ball")
    assert routed["output_ids"] == direct["output_ids"]
    assert routed["text"] == direct["text"]


def test_a_replica_reports_its_load(group):
    for replica in _replicas(group):
        load = requests.get(replica + "/get_load", timeout=10).json()
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        info = requests.get(replica + "/model_info", timeout=10).json()
        assert info["model_path"].endswith("stories260K-hf")


def test_replicas_on_several_hosts_are_refused():
    from weft.runtime.server_config import ServerConfig

    with pytest.raises(ValueError, match="dp_size starts its replicas on this host"):
        ServerConfig(dp_size=2, tp_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500")
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        ServerConfig(dp_size=0)


def test_a_dead_replica_stops_the_group(group):
    """(Last: it ends the module's group.)"""
    srv = group
    replica = next(
        p
        for p in srv.ps.children()
        if "weft.launch_server" in " ".join(p.cmdline()) and "--dp-size" in p.cmdline()
    )
    replica.kill()
    assert srv.proc.wait(30) == 1
    assert "replica" in srv.output and "exited with status" in srv.output
    assert srv.stop() == 1  # (no process of the group is left: stop() checks)
    assert not psutil.pid_exists(replica.pid) or replica.status() == psutil.STATUS_ZOMBIE
