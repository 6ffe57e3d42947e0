"""`loom generate PROMPT`: one completion with the engine in this process."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from loom.cli.flags import add_flags, cli_flag
from loom.cli.main import help_of
from loom.config import EngineConfig, check_device, flag_help, from_cli_args


@dataclass(frozen=True)
class GenerateConfig:
    """What `loom generate` asks of the sampler (greedy by default, unlike SamplingParams:
    a command line that prints a different answer each time is a poor first impression)."""

    CLI_GROUP = "Sampling"

    prompt: str = field(default="", metadata=cli_flag("the prompt text", positional=True))
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help=help_of("generate"),
                       description="Complete one prompt with the engine in this process.")
    add_flags(p, GenerateConfig)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from loom.sampling import SamplingParams

    options = from_cli_args(GenerateConfig, args)
    sampling = {k: v for k, v in dataclasses.asdict(options).items()
                if k not in ("chat", "prompt")}
    params = SamplingParams(**sampling)  # bad values fail here, before the model loads
    config = EngineConfig.from_cli_args(args)
    check_device(config.model.device)

    from loom.entrypoints.llm import LLM

    llm = LLM.from_config(config)
    if options.chat:
        output = llm.chat([{"role": "user", "content": options.prompt}], params)[0]
    else:
        output = llm.generate(options.prompt, params)[0]
    print(output.outputs[0].text)
    return 0
