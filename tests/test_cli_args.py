"""Config flags both ways: `config_flags` writes what `add_config_flags` reads back."""

from __future__ import annotations

import argparse

import pytest

from weft.runtime.cli_args import add_config_flags, config_flags, config_from_args
from weft.runtime.server_config import ServerConfig


def test_flags_read_back_as_the_values_they_were_written_from():
    values = {
        "model_path": "/models/m",
        "show_progress": False,  # defaults on: --no-show-progress
        "enable_jump_forward": True,  # defaults off: the bare switch
        "max_total_tokens": 4096,
        "mem_fraction_static": 0.5,
        "host": "127.0.0.1",
        "port": 0,
        "tokenizer_path": None,  # the default
    }
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ServerConfig)
    config = config_from_args(ServerConfig, parser.parse_args(config_flags(ServerConfig, values)))
    for name, value in values.items():
        assert getattr(config, name) == value, name


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match="unknown option 'max_tokens_total'"):
        config_flags(ServerConfig, {"max_tokens_total": 1})


def test_reasoning_parser_flags():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ServerConfig)
    args = parser.parse_args(["--reasoning-parser", "generic", "--reasoning-end", "</r>"])
    config = config_from_args(ServerConfig, args)
    assert (config.reasoning_parser, config.reasoning_start, config.reasoning_end) == (
        "generic",
        None,
        "</r>",
    )
    assert config.reasoning_format is not None and config.reasoning_format.forced
    assert config_from_args(ServerConfig, parser.parse_args([])).reasoning_format is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "qwen4"])
    with pytest.raises(ValueError, match="reasoning_end"):
        config_from_args(ServerConfig, parser.parse_args(["--reasoning-parser", "generic"]))
    with pytest.raises(ValueError, match="for reasoning_parser generic"):
        ServerConfig(reasoning_parser="qwen3", reasoning_end="x")
