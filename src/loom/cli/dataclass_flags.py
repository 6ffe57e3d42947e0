"""The flag generator: a dataclass's fields as argparse flags (`max_num_seqs` ->
`--max-num-seqs`, booleans as `--x/--no-x`), grouped in `--help` by what a user tunes (the
`CLI_GROUP` of the class that declares a field, or the field's own `group`), each stating its
default, and the parsed flags back into the dataclass. The fields' names, help and parse
functions are the libraries' (`loom.config.flag_help`); only the command line knows argparse.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

from loom.config import EngineConfig, field_type, flag_name, flag_type

T = TypeVar("T")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags: every section of EngineConfig (model, cache, scheduler)."""
    for name in EngineConfig.SECTIONS:
        add_cli_args(parser, field_type(EngineConfig, name))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: from_cli_args(field_type(EngineConfig, name), args)
                           for name in EngineConfig.SECTIONS})


def help_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's `--help` section called `title`, made on first use, so that flags of
    several dataclasses (or one field filed elsewhere) share one heading."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def group_title(cls: type, name: str) -> str:
    """The `--help` heading of field `name`: the `CLI_GROUP` the dataclass that declares it
    sets, else that class's name less "Config" (AdmissionConfig: Admission). The declaring
    class, not `cls`: a class built on another (ServerConfig on AdmissionConfig) lists the
    base's fields under the base's heading."""
    declaring = next(c for c in reversed(cls.__mro__)
                     if name in getattr(c, "__dataclass_fields__", {}))
    return vars(declaring).get("CLI_GROUP", declaring.__name__.removesuffix("Config"))


def default_text(value: Any) -> str:
    """A default as `--help` states it: on/off for switches, LOW-HIGH for a range, the value
    otherwise."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return "-".join(str(v) for v in value)
    return str(value).replace("%", "%%")


def add_cli_args(parser: argparse.ArgumentParser, cls: type,
                 only: tuple[str, ...] | None = None) -> None:
    """One flag per dataclass field (or per field named in `only`), named after it, with the
    field's help and its default; a field without a default is a required flag.

    Flags default to argparse.SUPPRESS, so `from_cli_args` sees only those a user gave and
    the dataclass keeps the one copy of each default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        group = help_group(parser, f.metadata.get("group") or group_title(cls, f.name))
        help_text = f.metadata.get("help", "")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.default is not None and not required and f.default is not dataclasses.MISSING:
            help_text += f" (default: {default_text(f.default)})"
        hint = hints[f.name]
        if hint is bool:
            group.add_argument(flag_name(f), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        arg_type, choices = flag_type(hint)
        extra: dict[str, Any] = {"required": True} if required else {"default": argparse.SUPPRESS}
        if typing.get_origin(arg_type) is list:  # a repeatable flag: --stop a --stop b
            (arg_type,) = typing.get_args(arg_type)
            extra["action"] = "append"
        group.add_argument(flag_name(f), dest=f.name, type=f.metadata.get("parse", arg_type),
                           choices=choices, help=help_text,
                           metavar=None if choices else flag_name(f)[2:].upper().replace("-", "_"),
                           **extra)


def from_cli_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build `cls` from the flags that were given; the rest keep the dataclass defaults."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
             if hasattr(args, f.name)}
    return cls(**given)
