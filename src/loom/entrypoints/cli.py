"""The `loom` command.

Sub-commands are registered by name with the function that adds their parser, and only the
one being run is imported: `loom --help` and `loom bench` then start without torch, and each
sub-command's flags are spelled once, where that sub-command lives.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass, field

import loom
from loom.config import EngineConfig, add_cli_args, check_device, flag_help, from_cli_args
from loom.torch_import import defer_unused_modules

DESCRIPTION = """\
loom: a continuous-batching LLM inference engine and OpenAI-compatible server.

  .venv/bin/loom generate "What is the capital of France?" --chat
  .venv/bin/loom serve                      # the bundled model on http://127.0.0.1:8000
  .venv/bin/loom bench run --base-url http://127.0.0.1:8000 --trace t.jsonl --rate 2

`loom COMMAND --help` lists a command's flags."""


@dataclass(frozen=True)
class Command:
    """A sub-command: `adder` ("module:function") adds its parser to the sub-parsers action
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
    Command("generate", "loom.entrypoints.cli:add_generate_parser",
            "complete one prompt with the engine in this process"),
    Command("serve", "loom.entrypoints.cli:add_serve_parser",
            "serve a model over an OpenAI-compatible HTTP API"),
    Command("bench", "loom.bench.cli:add_bench_parser",
            "replay realistic traffic against any OpenAI-compatible server"),
    Command("diagnose", "loom.bench.cli:add_diagnose_parser",
            "explain a disappointing loom bench result"),
    Command("plan", "loom.plan.cli:add_parser",
            "size a deployment (memory, concurrency) before buying or starting it"),
    Command("simulate", "loom.sim.cli:add_parser",
            "predict a configuration's latency and throughput without running the model"),
)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the engine process's too
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_LOG_LEVEL = {"help": f"logging level: {', '.join(LOG_LEVELS)} (default: INFO)",
              "metavar": "LEVEL", "type": str.upper, "choices": LOG_LEVELS}


# -- loom generate ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GenerateConfig:
    """What `loom generate` asks of the sampler (greedy by default, unlike SamplingParams:
    a command line that prints a different answer each time is a poor first impression)."""

    CLI_GROUP = "Sampling"

    max_tokens: int = field(default=128, metadata=flag_help("tokens to generate at most"))
    temperature: float = field(default=0.0, metadata=flag_help("0 = greedy"))
    top_p: float = field(default=1.0, metadata=flag_help("nucleus sampling: keep this share"))
    top_k: int = field(default=-1, metadata=flag_help("keep the k likeliest tokens; -1 = all"))
    seed: int | None = field(default=None, metadata=flag_help(
        "sampling seed, for reproducible text at temperature > 0; default: unseeded"))
    ignore_eos: bool = field(default=False, metadata=flag_help(
        "keep generating past the end-of-sequence token"))
    stop: list[str] = field(default_factory=list, metadata=flag_help(
        "stop at this string (repeatable); default: none"))
    chat: bool = field(default=False, metadata=flag_help(
        "wrap the prompt in the model's chat template"))


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help=_help("generate"),
                       description="Complete one prompt with the engine in this process.")
    p.add_argument("prompt", help="the prompt text")
    add_cli_args(p, GenerateConfig)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from loom.sampling import SamplingParams

    options = from_cli_args(GenerateConfig, args)
    sampling = {k: v for k, v in dataclasses.asdict(options).items() if k != "chat"}
    params = SamplingParams(**sampling)  # bad values fail here, before the model loads
    config = EngineConfig.from_cli_args(args)
    check_device(config.model.device)

    from loom.entrypoints.llm import LLM

    llm = LLM.from_config(config)
    if options.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0


# -- loom serve ------------------------------------------------------------------------------

def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from loom.entrypoints.openai.launch import add_serve_args, run_server

    p = sub.add_parser("serve", help=_help("serve"),
                       description="Serve a model over OpenAI's HTTP API (no arguments: the "
                                   "bundled model on http://127.0.0.1:8000).")
    add_serve_args(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=run_server)


# -- the parser ------------------------------------------------------------------------------

def _help(name: str) -> str:
    return next(c.help for c in COMMANDS if c.name == name)


def _chosen(argv: list[str]) -> str | None:
    """The sub-command named on the command line, if any (the first word that is one)."""
    names = {c.name for c in COMMANDS}
    return next((a for a in argv if a in names), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `loom` parser. With `argv`, only the sub-command it names gets its full parser
    (imported from its module); the others are listed by name and help alone."""
    parser = argparse.ArgumentParser(prog="loom", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"loom {loom.__version__}")
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
    """`--log-level` after the sub-command too (`loom serve --log-level DEBUG`)."""
    if not any("--log-level" in a.option_strings for a in parser._actions):
        parser.add_argument("--log-level", default=argparse.SUPPRESS, **_LOG_LEVEL)
    for sub in _sub_actions(parser):
        for child in sub.choices.values():
            _accept_log_level(child)


def _sub_actions(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _innermost(parser: argparse.ArgumentParser,
               args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub-)sub-command that was chosen, whose usage an error should show."""
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
    """Parse `argv`; an unknown flag is reported with the usage of the sub-command it was
    given to, not the top-level one."""
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


if __name__ == "__main__":
    sys.exit(main())
