"""The `loom` command: the command table.

Commands are registered by name with the function that adds their parser, and only the one
being run is imported: `loom --help` and `loom bench` then start without torch, and each
command's flags are spelled once, where that command lives (a module of this package, each
`add_parser(sub)` + `main(args)`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass

from loom.log import LOG_FORMAT
from loom.torch_import import defer_unused_modules
from loom.version import __version__

DESCRIPTION = """\
loom: a continuous-batching LLM inference engine and OpenAI-compatible server.

  .venv/bin/loom generate "What is the capital of France?" --chat
  .venv/bin/loom serve                      # the bundled model on http://127.0.0.1:8000
  .venv/bin/loom bench run --base-url http://127.0.0.1:8000 --trace t.jsonl --rate 2

`loom COMMAND --help` lists a command's flags."""


@dataclass(frozen=True)
class Command:
    """A command: `adder` ("module:function") adds its parser to the sub-parsers action
    and sets `func`; it is imported only when this command runs."""

    name: str
    adder: str
    help: str

    def available(self) -> bool:
        """False while the module that defines it is not installed (or not written yet)."""
        try:
            return importlib.util.find_spec(self.adder.partition(":")[0]) is not None
        except ModuleNotFoundError:  # its package is missing too
            return False

    def add_parser(self, sub: argparse._SubParsersAction) -> None:
        module, _, function = self.adder.partition(":")
        getattr(importlib.import_module(module), function)(sub)


COMMANDS = (
    Command("generate", "loom.cli.generate:add_parser",
            "complete one prompt with the engine in this process"),
    Command("serve", "loom.cli.serve:add_parser",
            "serve a model over an OpenAI-compatible HTTP API"),
    Command("bench", "loom.cli.bench:add_parser",
            "replay realistic traffic against any OpenAI-compatible server"),
    Command("diagnose", "loom.cli.diagnose:add_parser",
            "explain a disappointing loom bench result"),
    Command("plan", "loom.cli.plan:add_parser",
            "size a deployment (memory, concurrency) before buying or starting it"),
    Command("simulate", "loom.cli.simulate:add_parser",
            "predict a configuration's latency and throughput without running the model"),
    Command("eval", "loom.cli.eval:add_parser",
            "measure a model's quality: perplexity, KL divergence from a reference"),
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_LOG_LEVEL = {"help": f"logging level: {', '.join(LOG_LEVELS)} (default: INFO)",
              "metavar": "LEVEL", "type": str.upper, "choices": LOG_LEVELS}


def help_of(name: str) -> str:
    """A command's one-line help, as the table gives it."""
    return next(c.help for c in COMMANDS if c.name == name)


def _chosen(argv: list[str]) -> str | None:
    """The command named on the command line, if any (the first word that is one)."""
    names = {c.name for c in COMMANDS}
    return next((a for a in argv if a in names), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `loom` parser. With `argv`, only the command it names gets its full parser
    (imported from its module); the others are listed by name and help alone."""
    parser = argparse.ArgumentParser(prog="loom", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"loom {__version__}")
    parser.add_argument("--log-level", default="INFO", **_LOG_LEVEL)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None if argv is None else _chosen(argv)
    for command in (c for c in COMMANDS if c.available()):
        if argv is None or command.name == chosen:
            command.add_parser(sub)
            _accept_log_level(sub.choices[command.name])
        else:
            sub.add_parser(command.name, help=command.help)
    return parser


def _accept_log_level(parser: argparse.ArgumentParser) -> None:
    """`--log-level` after the command too (`loom serve --log-level DEBUG`)."""
    if not any("--log-level" in a.option_strings for a in parser._actions):
        parser.add_argument("--log-level", default=argparse.SUPPRESS, **_LOG_LEVEL)
    for sub in _sub_actions(parser):
        for child in sub.choices.values():
            _accept_log_level(child)


def _sub_actions(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _innermost(parser: argparse.ArgumentParser,
               args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub-)command that was chosen, whose usage an error should show."""
    for sub in _sub_actions(parser):
        name = getattr(args, sub.dest, None)
        if name in sub.choices:
            return _innermost(sub.choices[name], args)
    return parser


def _compare_as_flag(argv: list[str]) -> list[str]:
    """`loom bench --compare ...` is `loom bench compare ...`."""
    if "bench" in argv:
        i = argv.index("bench") + 1
        if argv[i:i + 1] == ["--compare"]:
            return [*argv[:i], "compare", *argv[i + 1:]]
    return argv


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse `argv`; an unknown flag is reported with the usage of the command it was given
    to, not the top-level one."""
    argv = _compare_as_flag(argv)
    chosen = _chosen(argv)
    command = next((c for c in COMMANDS if c.name == chosen), None)
    if command is not None and not command.available():
        argparse.ArgumentParser(prog="loom").error(
            f"'loom {chosen}' is not part of this installation")
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    defer_unused_modules()  # this process is loom's own: it never runs torch's compilers
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        return args.func(args) or 0
    except (ValueError, OSError) as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2
