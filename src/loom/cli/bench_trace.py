"""`loom bench trace`: generate a trace from a class mix, or import one (ShareGPT, a request
log), optionally anonymized."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

from loom.bench.importers import DEFAULT_RULES, MOONCAKE_BLOCK_SIZE
from loom.cli.flags import add_flags, check_writable, cli_flag
from loom.config import flag_help, from_cli_args
from loom.workload.load import parse_count
from loom.workload.mix import ArrivalSpec, CancelSpec

MIX = "chat=0.6,long=0.15,rag=0.25"
DEFAULT_TRACE_SIZE = 500


@dataclass(frozen=True)
class TraceFlags:
    """Where the trace comes from (a mix, or one of two imports: at most one) and where it
    goes."""

    CLI_GROUP = "Trace"

    output: str = field(metadata=cli_flag("trace file to write (JSONL)", short="-o"))
    mix: str | None = field(default=None, metadata=flag_help(
        f"class weights (default {MIX}); classes: chat, long, rag, session"))
    from_sharegpt: str | None = field(default=None, metadata=flag_help(
        "import ShareGPT-style conversations (JSON list or JSONL); default: generate "
        "requests from --mix"))
    from_log: str | None = field(default=None, metadata=flag_help(
        "import a request log, keeping its arrival times (see --format); default: generate "
        "requests from --mix"))
    format: Literal["openai", "azure", "mooncake"] = field(default="openai", metadata=flag_help(
        "--from-log's format: openai (JSONL of logged requests), azure (the Azure LLM "
        "inference trace CSV), mooncake (Mooncake JSONL with hash_ids)"))
    time_scale: float = field(default=1.0, metadata=flag_help(
        "--from-log: multiply the logged inter-arrival times (0.5: twice as fast)"))
    classify: str = field(default=DEFAULT_RULES, metadata=flag_help(
        "--from-log: class rules CLASS:COND[&COND],..., first match wins; COND compares "
        "prompt_len, output_len, prefix_len or tenant"))
    hash_block_size: int = field(default=MOONCAKE_BLOCK_SIZE, metadata=flag_help(
        "--format mooncake: tokens per hash_ids block"))
    anonymize: bool = field(default=False, metadata=flag_help(
        "replace every text by synthetic tokens of the same lengths and prefix sharing, and "
        "rename ids, tenants and sessions: a trace to share"))
    num_requests: int | None = field(default=None, metadata=cli_flag(
        f"requests to generate (default {DEFAULT_TRACE_SIZE}), or at most N to import "
        "(default: all)", short="-n", parse=parse_count))
    seed: int = field(default=0, metadata=flag_help(
        "seed of everything random: lengths, arrivals, synthetic prompts"))
    tokenizer: str | None = field(default=None, metadata=flag_help(
        "GGUF, tokenizer.json or HF folder of the served model, to count and synthesise "
        "prompt tokens (default: loom's bundled model)"))

    def __post_init__(self) -> None:
        sources = [flag for flag, value in (("--mix", self.mix),
                                            ("--from-sharegpt", self.from_sharegpt),
                                            ("--from-log", self.from_log)) if value]
        if len(sources) > 1:
            raise ValueError(f"give one of {' and '.join(sources)}: a trace has one source")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("trace", help="generate or import a trace")
    add_flags(p, TraceFlags)
    add_flags(p, ArrivalSpec)
    add_flags(p, CancelSpec)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from loom.bench import importers
    from loom.workload.mix import generate_mix, parse_mix
    from loom.workload.tokens import PromptSynth, load_tokenizer, tokenizer_path
    from loom.workload.trace import write_trace

    flags = from_cli_args(TraceFlags, args)
    arrivals, cancels = from_cli_args(ArrivalSpec, args), from_cli_args(CancelSpec, args)
    check_writable(flags.output, "-o")
    path = tokenizer_path(flags.tokenizer)
    synth, tokenizer_name = PromptSynth(load_tokenizer(path)), path.name
    if flags.from_log:
        trace = importers.import_log(flags.from_log, flags.format, synth,
                                     importers.Classifier(flags.classify), flags.time_scale,
                                     flags.num_requests, flags.seed, flags.hash_block_size,
                                     tokenizer_name)
    elif flags.from_sharegpt:
        trace = importers.import_sharegpt(flags.from_sharegpt, flags.num_requests, flags.seed,
                                          synth, arrivals, cancels, tokenizer_name)
    else:
        trace = generate_mix(parse_mix(flags.mix or MIX),
                             flags.num_requests or DEFAULT_TRACE_SIZE, flags.seed, synth,
                             arrivals, cancels, tokenizer_name)
    if flags.anonymize:
        from loom.bench.anonymize import anonymize

        trace = anonymize(trace, synth, flags.seed)
    sha = write_trace(trace, flags.output)
    counts: dict[str, int] = {}
    for r in trace.requests:
        counts[r.cls] = counts.get(r.cls, 0) + 1
    print(f"wrote {len(trace.requests)} requests {counts} to {flags.output} (sha256 {sha})")
    return 0
