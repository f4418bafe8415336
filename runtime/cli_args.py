"""argparse flags generated from a config dataclass (one source of truth for the defaults)."""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, Union, get_args, get_origin, get_type_hints


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """--field-name flags for every field of the dataclass `cls` (bools become switches)."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help", None)
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = _base_type(hints[f.name])
        if kind is bool:
            if default:
                parser.add_argument(
                    "--no-" + f.name.replace("_", "-"),
                    dest=f.name,
                    action="store_false",
                    help=f"turn off: {help_text}",
                )
            else:
                parser.add_argument(flag, dest=f.name, action="store_true", help=help_text)
            parser.set_defaults(**{f.name: default})
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=kind,
            default=default,
            help=f"{help_text} (default: {default})",
            **meta,
        )


def config_flags(cls: type, values: dict[str, Any]) -> list[str]:
    """The flags `add_config_flags(parser, cls)` reads back as `values` (field name -> value):
    the inverse, for starting a process from Python. A bool that differs from its default is
    its switch (`--no-...` for one that defaults on); None leaves the default."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    flags: list[str] = []
    for name, value in values.items():
        f = fields.get(name)
        if f is None:
            raise TypeError(f"unknown option {name!r} (not a field of {cls.__name__})")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value != f.default:
                flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)


def _base_type(hint: Any) -> Any:
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0]
    return hint
