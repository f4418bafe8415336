"""tests/test_models_vs_hf.py's checks with TritonAttention (on the CPU: the interpreter) for the
configs whose attention is not plain causal (sliding windows, Gemma 3's scale): logprobs, a greedy
batch, prefix-cache hits and chunked prefill (16) across the window's boundary.

The engine picks TritonAttention on CUDA itself; on the CPU it picks TorchAttention, so there the
pair below puts TritonAttention in by hand (as test_triton_attention.py does).
"""

from __future__ import annotations

import pytest
from test_models_vs_hf import (  # noqa: F401  (collected here again, with the pair below)
    test_greedy_batch_matches_hf,
    test_prefix_cache_hits_give_same_outputs,
    test_prompt_logprobs_match_hf,
)

from weft.runtime.triton_attention import TritonAttention

from .kernel_utils import HAS_CUDA, INTERPRETED
from conftest import make_engine
from hf_models import CONFIGS, save_random_model

# NOTE: one Gemma 3 config is enough here: the other one runs the same kernels with the same
# options (window, scale) at another window. It is slow (~40 s): the interpreter runs its six
# fused norms a layer and the GELU kernel too
# ... and under the interpreter (~25 s a config) one Mistral window is enough as well; on CUDA
# both run
_SAME_KERNEL_PATHS = {"gemma3-gqa-window8-tied"}
if INTERPRETED or not HAS_CUDA:
    _SAME_KERNEL_PATHS.add("mistral-gqa-window24-tied")
WINDOWED = [
    pytest.param(name, marks=pytest.mark.slow) if spec["arch"] == "gemma3" else name
    for name, spec in sorted(CONFIGS.items())
    if spec.get("sliding_window") and name not in _SAME_KERNEL_PATHS
]


@pytest.fixture(scope="module", params=WINDOWED)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(request.param, folder)
    device = "cpu" if INTERPRETED or not HAS_CUDA else "cuda"
    engine = make_engine(
        folder, dtype="float32", max_total_tokens=2048, chunked_prefill_size=16, device=device
    )
    runner = engine.runner
    runner.attention = TritonAttention(runner.kv_pool, runner.req_to_token)
    return hf, engine


def test_windowed_configs_exist():
    assert WINDOWED, "hf_models.CONFIGS lost its sliding-window configs"
