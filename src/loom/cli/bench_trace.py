"""`loom bench trace`: generate a trace from a class mix, or import one (ShareGPT, a request
log), optionally anonymized."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from loom.bench.importers import DEFAULT_RULES, MOONCAKE_BLOCK_SIZE
from loom.cli.dataclass_flags import from_cli_args
from loom.cli.flags import Tokenizer, add_command, check_writable, opt, required
from loom.workload.load import Load, parse_count
from loom.workload.mix import ArrivalSpec, CancelSpec

MIX = "chat=0.6,long=0.15,rag=0.25"
DEFAULT_TRACE_SIZE = 500


@dataclass(frozen=True)
class TraceFlags:
    """Where the trace comes from (a mix, or one of two imports: at most one) and where it
    goes."""

    CLI_GROUP = "Trace"

    output: str = required("trace file to write (JSONL)", short="-o")
    mix: str | None = opt(None,
        f"class weights (default {MIX}); classes: chat, long, rag, session")
    from_sharegpt: str | None = opt(None,
        "import ShareGPT-style conversations (JSON list or JSONL); default: generate "
        "requests from --mix")
    from_log: str | None = opt(None,
        "import a request log, keeping its arrival times (see --format); default: generate "
        "requests from --mix")
    format: Literal["openai", "azure", "mooncake"] = opt("openai",
        "--from-log's format: openai (JSONL of logged requests), azure (the Azure LLM "
        "inference trace CSV), mooncake (Mooncake JSONL with hash_ids)")
    time_scale: float = opt(1.0,
        "--from-log: multiply the logged inter-arrival times (0.5: twice as fast)")
    classify: str = opt(DEFAULT_RULES,
        "--from-log: class rules CLASS:COND[&COND],..., first match wins; COND compares "
        "prompt_len, output_len, prefix_len or tenant")
    hash_block_size: int = opt(MOONCAKE_BLOCK_SIZE, "--format mooncake: tokens per hash_ids block")
    anonymize: bool = opt(False,
        "replace every text by synthetic tokens of the same lengths and prefix sharing, and "
        "rename ids, tenants and sessions: a trace to share")
    num_requests: int | None = opt(None,
        f"requests to generate (default {DEFAULT_TRACE_SIZE}), or at most N to import "
        "(default: all)", short="-n", parse=parse_count)

    def __post_init__(self) -> None:
        sources = [flag for flag, value in (("--mix", self.mix),
                                            ("--from-sharegpt", self.from_sharegpt),
                                            ("--from-log", self.from_log)) if value]
        if len(sources) > 1:
            raise ValueError(f"give one of {' and '.join(sources)}: a trace has one source")


def add_parser(commands: argparse._SubParsersAction) -> None:
    add_command(commands, "trace", main, TraceFlags, (Load, ("seed",)), Tokenizer,
                ArrivalSpec, CancelSpec,
                help="generate or import a trace")


def main(args: argparse.Namespace) -> int:
    from loom.bench import importers
    from loom.workload.mix import generate_mix, parse_mix
    from loom.workload.tokens import PromptSynth, load_tokenizer, tokenizer_path
    from loom.workload.trace import write_trace

    flags = from_cli_args(TraceFlags, args)
    arrivals, cancels = from_cli_args(ArrivalSpec, args), from_cli_args(CancelSpec, args)
    check_writable(flags.output, "-o")
    path = tokenizer_path(from_cli_args(Tokenizer, args).tokenizer)
    seed = from_cli_args(Load, args).seed
    synth, tokenizer_name = PromptSynth(load_tokenizer(path)), path.name
    if flags.from_log:
        trace = importers.import_log(flags.from_log, flags.format, synth,
                                     importers.Classifier(flags.classify), flags.time_scale,
                                     flags.num_requests, seed, flags.hash_block_size,
                                     tokenizer_name)
    elif flags.from_sharegpt:
        trace = importers.import_sharegpt(flags.from_sharegpt, flags.num_requests, seed,
                                          synth, arrivals, cancels, tokenizer_name)
    else:
        trace = generate_mix(parse_mix(flags.mix or MIX),
                             flags.num_requests or DEFAULT_TRACE_SIZE, seed, synth,
                             arrivals, cancels, tokenizer_name)
    if flags.anonymize:
        from loom.bench.anonymize import anonymize

        trace = anonymize(trace, synth, seed)
    sha = write_trace(trace, flags.output)
    counts: dict[str, int] = {}
    for r in trace.requests:
        counts[r.cls] = counts.get(r.cls, 0) + 1
    print(f"wrote {len(trace.requests)} requests {counts} to {flags.output} (sha256 {sha})")
    return 0
