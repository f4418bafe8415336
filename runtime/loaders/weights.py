"""Reading weights: safetensors files (single or sharded) and dummy initialisation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def iter_safetensors(
    files: list[Path], device: torch.device, show_progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) over all files, with one progress bar over the tensors."""
    handles = []
    for path in files:
        try:
            handles.append(safe_open(str(path), framework="pt", device="cpu"))
        except Exception as exc:  # safetensors raises its own error type for corrupt headers
            raise ValueError(f"cannot read weights file {path}: {exc}") from None
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for path, handle in zip(files, handles, strict=True):
            for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise ValueError(f"corrupt tensor {name!r} in {path}: {exc}") from None
                yield name, tensor.to(device)
                bar.update(1)


def init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights in real shapes (benchmarks: decode speed does not depend on values).

    Drawn on the parameters' own device, so values differ between CPU and GPU for one seed.
    NOTE: tensor-parallel ranks draw the same values in the same order (their parameters have
    the same shapes), so the replicated ones (norms, a MoE router) agree across ranks; the split
    ones are not slices of one model, which a benchmark does not mind.
    """
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        param.data.normal_(0.0, 0.02, generator=gen)
