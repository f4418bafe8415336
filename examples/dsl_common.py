"""Shared by the DSL examples: pick the backend from the command line."""

from __future__ import annotations

import argparse
from typing import Any


def backend_from_args(description: str) -> tuple[Any, argparse.Namespace]:
    """`--url http://HOST:PORT` uses a running `weft serve`; otherwise the embedded default
    model runs in this process (weft.Engine())."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="a running weft server (default: weft.Engine() in-process)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    import weft

    if args.url:
        return weft.RuntimeEndpoint(args.url), args
    return weft.Engine(max_total_tokens=4096, show_progress=False, log_level="warning"), args


def close(backend: Any) -> None:
    if hasattr(backend, "shutdown"):
        backend.shutdown()
