"""The `weft` command: `weft generate ...` (in-process) and `weft serve ...` (the HTTP server)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from weft.runtime.cli_args import add_config_flags, config_from_args
from weft.runtime.config import EngineConfig
from weft.runtime.server_config import ServerConfig


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt with the in-process engine")
    add_config_flags(p, EngineConfig)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from weft.runtime.engine import Engine

    config = config_from_args(EngineConfig, args)
    engine = Engine(**vars(config))
    try:
        prompt = args.prompt
        if args.chat:
            if engine.tokenizer is None or not engine.tokenizer.chat_template:
                raise SystemExit("error: this model has no chat template")
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        params = {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "seed": args.seed,
        }
        out = engine.generate(prompt, params)
        assert isinstance(out, dict)
        print(json.dumps(out, indent=2) if args.json else out["text"])
    finally:
        engine.shutdown()
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the model over HTTP (SGLang-style native API and OpenAI API)"
    )
    add_config_flags(p, ServerConfig)
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from weft.runtime.ipc import exit_now
    from weft.runtime.server.launch import launch_server

    # NOTE: `serve` is the process's whole life: once the server has stopped (children joined,
    # ipc folder removed), the process ends without the interpreter's teardown (see exit_now)
    exit_now(launch_server(config_from_args(ServerConfig, args)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
