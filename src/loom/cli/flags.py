"""Flags generated from dataclasses, for every command: `dataclass_flags.add_cli_args` turns a
field into a flag (its name, type, help and default); `add_flags` adds what a command line
needs besides: positional arguments, short options (`-n`), a second spelling of a flag, and
a parse function's error as argparse's usage error (a library raises ValueError, naming the
value; the user sees `argument -n/--num-requests: expected an integer >= 1, got '0'`).

Also here: the option types several commands share, and the checks that an output can be
written before minutes of work are spent on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
import tempfile
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.cli.dataclass_flags import add_cli_args
from loom.config import flag_field, flag_help
from loom.workload.load import parse_rate
from loom.workload.slo import Slo


def cli_flag(text: str, *, short: str | None = None, positional: bool = False,
             aliases: tuple[str, ...] = (), **more: Any) -> dict[str, Any]:
    """`flag_help` metadata plus what only a command line has: a short option, a positional
    argument (its field name is its metavar), other spellings of the flag."""
    meta = flag_help(text, **more)
    meta.update(short=short, positional=positional, aliases=aliases)
    return meta


def opt(default: Any, text: str, **meta: Any) -> Any:
    """A command line's own option: `loom.config.option` with `cli_flag(text, **meta)`'s
    metadata."""
    return flag_field(default, cli_flag(text, **meta))


def required(text: str, **meta: Any) -> Any:
    """A command line's own option that has no default: the command needs it."""
    return field(metadata=cli_flag(text, **meta))


def add_flags(parser: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None,
              short: Mapping[str, str] | None = None) -> None:
    """One flag per field of `cls` (or per field in `only`), as `add_cli_args` makes them;
    `short` gives fields of a library's dataclass a short option (`{"num_requests": "-n"}`)."""
    chosen = [f for f in dataclasses.fields(cls) if only is None or f.name in only]
    hints = typing.get_type_hints(cls)
    for f in chosen:
        if f.metadata.get("positional"):
            many = typing.get_origin(hints[f.name]) is list
            parser.add_argument(f.name, nargs="+" if many else None, help=f.metadata["help"],
                                type=_usage_error(f.metadata.get("parse", str)))
    add_cli_args(parser, cls, only=tuple(f.name for f in chosen
                                         if not f.metadata.get("positional")))
    for f in chosen:
        action = next((a for a in parser._actions if a.dest == f.name), None)
        if action is None or not action.option_strings:
            continue
        if "parse" in f.metadata:
            action.type = _usage_error(f.metadata["parse"])
        first = f.metadata.get("short") or (short or {}).get(f.name)
        action.option_strings[:0] = [first] if first else []  # "-n, --num-requests"
        action.option_strings += f.metadata.get("aliases", ())
        for spelling in action.option_strings:
            parser._option_string_actions[spelling] = action


# What a command's flags are made from: a dataclass (every field), a dataclass and the fields
# to take, or a function that adds flags itself (add_engine_args).
FlagSource = type | tuple[type, tuple[str, ...]] | Callable[[argparse.ArgumentParser], None]


def add_command(sub: argparse._SubParsersAction, name: str, run: Callable[..., int],
                *sources: FlagSource, short: Mapping[str, str] | None = None,
                **parser: Any) -> argparse.ArgumentParser:
    """Register a (sub-)command: its parser (`parser`: help, description, usage), its flags
    from `sources` in turn, and `run`, the function that runs it."""
    p = sub.add_parser(name, **parser)
    for source in sources:
        if isinstance(source, tuple):
            add_flags(p, source[0], source[1], short)
        elif dataclasses.is_dataclass(source):
            add_flags(p, source, None, short)
        else:
            source(p)
    p.set_defaults(func=run)
    return p


def _usage_error(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, its ValueError raised as argparse's own error, with its message."""
    if parse in (str, int, float):
        return parse

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    typed.__name__ = getattr(parse, "__name__", "value")
    return typed


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    """The action of `flag` (to say more in its help than its dataclass does)."""
    return parser._option_string_actions[flag]


# -- option types ----------------------------------------------------------------------------

def rates(text: str) -> tuple[float, ...]:
    """--rates: a list of req/s, each > 0 and finite, checked before any point runs."""
    try:
        values = [parse_rate(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(isinstance(r, str) or math.isinf(r) for r in values):
        raise ValueError(f"expected req/s > 0 separated by commas, e.g. 0.5,1,2; got {text!r}")
    return tuple(values)  # type: ignore[arg-type]  (no str, no inf: checked above)


def concurrencies(text: str) -> tuple[int, ...]:
    """--overlap: a list of users, each >= 1."""
    try:
        users = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        users = []
    if not users or min(users) < 1:
        raise ValueError(f"expected concurrencies >= 1 separated by commas, e.g. 1,2,4; got "
                         f"{text!r}")
    return tuple(users)


def overlap() -> Any:
    """--overlap, declared once for the commands that sweep a closed loop (`loom bench
    sweep | compare`, `loom simulate`)."""
    return opt(None, "closed loop at these concurrencies, e.g. 1,2,4,8; default: none",
               parse=concurrencies)


def price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise ValueError(f"expected a price >= 0, got {text!r}")
    return value


@dataclass(frozen=True)
class Report:
    """How results are judged and shown."""

    CLI_GROUP = "Report"

    slo: Slo | None = opt(None,
        "latency objective in seconds, e.g. ttft_p95=1.0,e2e_p95=10: goodput counts "
        "requests within every limit; default: none (no goodput)", parse=Slo.parse)
    gpu_cost_per_hour: float | None = opt(None,
        "price of the machine per hour: adds cost per accepted answer; default: no cost "
        "column", parse=price)
    wide: bool = opt(False,
        "print every scorecard column (default: the key ones, which fit an 80-column "
        "terminal)")


@dataclass(frozen=True)
class Tokenizer:
    """The served model's tokenizer (without its weights): trace lengths are its tokens."""

    CLI_GROUP = "Tokens"

    tokenizer: str | None = opt(None,
        "GGUF, tokenizer.json or HF folder of the served model, to count and synthesise "
        "prompt tokens (default: loom's bundled model)")


# -- outputs, checked before the work --------------------------------------------------------

def command_line() -> str:
    """This process's command line, which a result file records as what measured it (the
    libraries take it as an argument: the command line is the CLI's to read)."""
    return shlex.join(sys.argv)


def check_writable(path: str | Path, flag: str) -> None:
    """Fail now, naming the flag, if `path` cannot be written later (a directory, a read-only
    or pseudo file system): a result computed for minutes must not be lost at the end. Its
    missing parent folders are created, as writing would; the file itself is not."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with path.open("a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".loom-check-"):
                pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_folder_writable(path: str | Path, flag: str) -> None:
    """The folder results will be written into, made now: a bad path fails before work."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    check_writable(path / "compare.json", flag)
