"""`loom eval perplexity` and `loom eval kld`: a model's quality on a text, as llama-perplexity
measures it (loom.eval says how), offline with any engine flags or on a server (--base-url)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from loom.cli.dataclass_flags import add_engine_args, engine_config, from_cli_args
from loom.cli.flags import add_command, check_writable, opt
from loom.cli.main import help_of
from loom.config import EngineConfig, base_url_field, check_device
from loom.eval.config import ScoringConfig

if TYPE_CHECKING:
    from loom.eval.scores import ChunkScores


@dataclass(frozen=True)
class EvalOptions:
    """What to score and where the results go."""

    CLI_GROUP = "Eval"

    text: str | None = opt(None, "UTF-8 text file to score; default: the bundled KJV "
                                 "Genesis-Exodus (public domain, ~90k tokens)")
    json: bool = opt(False, "print the result as JSON")
    save_logits: str | None = opt(None,
        "write the scored distributions to this .npz (a later --reference)")
    base_url: str | None = base_url_field(None,
        ": score there (/v1/completions with echo and logprobs) instead of in this process; "
        "--model then names its tokenizer")
    api_key: str | None = opt(None, "the server's API key, with --base-url")


@dataclass(frozen=True)
class KldOptions(EvalOptions):
    """kld's options: eval's and what it compares against, one of the two required (listed
    under their own heading: the class that declares a field names its group)."""

    CLI_GROUP = "Reference"

    reference: str | None = opt(None,
        "the reference: a .npz from --save-logits, or another model file of the same "
        "vocabulary, run with the same engine flags; default: --model")
    reference_dtype: Literal["float32"] | None = opt(None,
        "float32: run the reference with float32 activations, --batched-matmul native and a "
        "float32 KV cache (loom's most exact); default: the tested flags")

    def __post_init__(self) -> None:
        if self.reference is None and self.reference_dtype is None:
            raise ValueError("kld needs a reference: --reference (a model or a --save-logits "
                             ".npz) or --reference-dtype float32")


Options = TypeVar("Options", bound=EvalOptions)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("eval", help=help_of("eval"),
                            description="Measure a model's quality on a text: perplexity, "
                                        "and KL divergence from a reference.")
    commands = parser.add_subparsers(dest="eval_command", required=True, metavar="COMMAND")
    add_command(commands, "perplexity", perplexity, EvalOptions, ScoringConfig,
                add_engine_args, help="perplexity over a text",
                description="Perplexity over a text file, chunk by chunk and in total, as "
                            "llama-perplexity computes it.")
    add_command(commands, "kld", kld, KldOptions, ScoringConfig,
                add_engine_args,
                help="KL divergence and top-1 agreement against a reference",
                description="KL divergence of the model's predictions from a reference's, "
                            "top-1 agreement and the change in perplexity, as "
                            "llama-perplexity --kl-divergence reports them.")


def perplexity(args: argparse.Namespace) -> int:
    from loom.eval import metrics
    from loom.eval.run import score_text

    options, scoring, config = _read(args, EvalOptions)
    run = score_text(options.text, scoring, config, options.base_url, options.api_key)
    _print(metrics.perplexity(_saved(options, scoring, config, run.scored), scoring.context),
           options.json)
    return 0


def kld(args: argparse.Namespace) -> int:
    from loom.eval import logits_file, metrics
    from loom.eval.offline import float32_reference
    from loom.eval.run import score_text

    options, scoring, config = _read(args, KldOptions)
    if options.reference is not None and logits_file.is_logits_file(options.reference):
        saved = logits_file.load(options.reference)
        meta = saved.meta
        if (meta.context, meta.stride) != (scoring.context, scoring.stride or scoring.context):
            raise ValueError(f"--reference {options.reference} was scored with --context "
                             f"{meta.context} --stride {meta.stride}; give the same")
        reference, vocab = iter(saved), saved.vocab_size
    else:
        ref_config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, model=options.reference or config.model.model))
        if options.reference_dtype == "float32":
            ref_config = float32_reference(ref_config)
        scored = score_text(options.text, scoring, ref_config)
        reference, vocab = scored.scored, scored.vocab_size
    # both engines are loaded now and take turns, `--batch-size` chunks each
    run = score_text(options.text, scoring, config, options.base_url, options.api_key,
                     expect_vocab=vocab)
    tested = _saved(options, scoring, config, run.scored)
    _print(metrics.kl_divergence(reference, tested), options.json)
    return 0


def _read(args: argparse.Namespace, options_class: type[Options]
          ) -> tuple[Options, ScoringConfig, EngineConfig]:
    options = from_cli_args(options_class, args)
    scoring = from_cli_args(ScoringConfig, args)
    config = engine_config(args)
    check_device(config.model.device)
    if options.save_logits is not None:
        check_writable(options.save_logits, "--save-logits")
    return options, scoring, config


def _saved(options: EvalOptions, scoring: ScoringConfig, config: EngineConfig,
           scored: Iterator[ChunkScores]) -> Iterator[ChunkScores]:
    """`scored`, written to --save-logits as it passes, if given."""
    if options.save_logits is None:
        return scored
    from loom.eval import logits_file

    meta = logits_file.LogitsMeta(scoring.context, scoring.stride or scoring.context, 0,
                                  str(config.model.model or "bundled"))
    return logits_file.saving(options.save_logits, meta, scored)


def _print(result: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
        return
    for f in dataclasses.fields(result):
        value = getattr(result, f.name)
        if f.name == "chunks":
            print("chunks: " + " ".join(f"[{c.index + 1}]{c.perplexity:.4f}" for c in value))
        else:
            print(f"{f.name}: {value:.6g}" if isinstance(value, float) else
                  f"{f.name}: {value}")
