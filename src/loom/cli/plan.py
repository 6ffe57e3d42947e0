"""`loom plan`: does a model fit a GPU, and how much concurrency does it leave?

Only argparse and the flag helpers are imported at module level: the work is imported inside
the command, so `loom --help` stays fast and `loom plan` never needs torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from loom.cli.dataclass_flags import from_cli_args
from loom.cli.flags import add_command, opt, option
from loom.cli.main import help_of
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

    model: str | None = opt(None, "the model (see --model's choices); default: the bundled model")
    json: bool = opt(False, "print the rows as JSON (default: a table)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "plan", main, PlanOutput, PlanFlags, help=help_of("plan"),
                    description="Memory and roofline arithmetic for a model on GPUs you do not "
                                "have: weights, KV cache, overhead, max concurrency, "
                                "decode/prefill estimates and the serve flags.")
    option(p, "--model").help = model_help("the bundled model")


def main(args: argparse.Namespace) -> int:
    from loom.plan.catalogue import check_prices, parse_prices
    from loom.plan.models import resolve_model
    from loom.plan.planner import gpus_of, plan, settings
    from loom.plan.report import add_costs, print_plan

    asked, output = from_cli_args(PlanFlags, args), from_cli_args(PlanOutput, args)
    model, prices = resolve_model(output.model), parse_prices(asked.price)
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
