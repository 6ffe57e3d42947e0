"""`loom plan`: does a model fit a GPU, and how much concurrency does it leave?

Only argparse and the flag helpers are imported at module level: the work is imported inside
the command, so `loom --help` stays fast and `loom plan` never needs torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from loom.cli.flags import add_flags, option
from loom.cli.main import help_of
from loom.config import flag_help, from_cli_args
from loom.plan.planner import PlanFlags


def model_help(default: str) -> str:
    """--model's help, naming the shapes shipped in models.json (read, not imported: this
    module stays light)."""
    from loom.plan.models import known_models

    return (f"{', '.join(sorted(known_models()))} (shapes shipped with loom), or a GGUF / HF "
            f"folder / config.json (no weights needed); default: {default}")


@dataclass(frozen=True)
class PlanOutput:
    """What `loom plan` plans for and how it answers."""

    CLI_GROUP = "Plan"

    model: str | None = field(default=None, metadata=flag_help(
        "the model (see --model's choices); default: the bundled model"))
    json: bool = field(default=False, metadata=flag_help(
        "print the rows as JSON (default: a table)"))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help=help_of("plan"),
                       description="Memory and roofline arithmetic for a model on GPUs you do "
                                   "not have: weights, KV cache, overhead, max concurrency, "
                                   "decode/prefill estimates and the serve flags.")
    add_flags(p, PlanOutput, only=("model",))
    option(p, "--model").help = model_help("the bundled model")
    add_flags(p, PlanFlags)
    add_flags(p, PlanOutput, only=("json",))
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from loom.plan.catalogue import check_prices, parse_prices
    from loom.plan.models import resolve_model
    from loom.plan.planner import gpus_of, plan, settings
    from loom.plan.report import add_costs, print_plan

    asked, output = from_cli_args(PlanFlags, args), from_cli_args(PlanOutput, args)
    prices = parse_prices(asked.price)
    model = resolve_model(output.model)
    planned = settings(model, asked)
    gpus = gpus_of(asked)
    check_prices(prices, [g.key for g in gpus])
    rows = plan(model, gpus, planned)
    add_costs(rows, prices)
    if output.json:
        print(json.dumps(rows, indent=1))
    else:
        print_plan(rows, model, planned)
    return 0
