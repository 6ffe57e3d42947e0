"""`loom generate PROMPT`: one completion with the engine in this process."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from loom.cli.dataclass_flags import add_engine_args, engine_config, from_cli_args
from loom.cli.flags import add_command, opt
from loom.cli.main import help_of
from loom.config import check_device


@dataclass(frozen=True)
class GenerateConfig:
    """What `loom generate` asks of the sampler (greedy by default, unlike SamplingParams:
    a command line that prints a different answer each time is a poor first impression)."""

    CLI_GROUP = "Sampling"

    prompt: str = opt("", "the prompt text", positional=True)
    max_tokens: int = opt(128, "tokens to generate at most")
    temperature: float = opt(0.0, "0 = greedy")
    top_p: float = opt(1.0, "nucleus sampling: keep this share")
    top_k: int = opt(-1, "keep the k likeliest tokens; -1 = all")
    seed: int | None = opt(None,
        "sampling seed, for reproducible text at temperature > 0; default: unseeded")
    ignore_eos: bool = opt(False, "keep generating past the end-of-sequence token")
    stop: list[str] = opt(list, "stop at this string (repeatable); default: none")
    chat: bool = opt(False, "wrap the prompt in the model's chat template")


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "generate", main, GenerateConfig, add_engine_args,
                help=help_of("generate"),
                description="Complete one prompt with the engine in this process.")


def main(args: argparse.Namespace) -> int:
    from loom.sampling import SamplingParams

    options = from_cli_args(GenerateConfig, args)
    sampling = {k: v for k, v in dataclasses.asdict(options).items()
                if k not in ("chat", "prompt")}
    params = SamplingParams(**sampling)  # bad values fail here, before the model loads
    config = engine_config(args)
    check_device(config.model.device)

    from loom.entrypoints.llm import LLM

    llm = LLM.from_config(config)
    if options.chat:
        output = llm.chat([{"role": "user", "content": options.prompt}], params)[0]
    else:
        output = llm.generate(options.prompt, params)[0]
    print(output.outputs[0].text)
    return 0
