"""`loom diagnose RESULT`: findings, the numbers behind them and one setting to try."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from loom.cli.dataclass_flags import from_cli_args
from loom.cli.flags import Report, add_command, opt
from loom.cli.main import help_of


@dataclass(frozen=True)
class DiagnoseFlags:
    CLI_GROUP = "Diagnose"

    result: str = opt("", "run or sweep JSON, or a compare directory", positional=True)
    json: bool = opt(False, "print the findings as JSON")


def add_parser(sub: argparse._SubParsersAction) -> None:

    add_command(sub, "diagnose", main, DiagnoseFlags, (Report, ("slo",)),
                help=help_of("diagnose"),
                description="Explain a disappointing loom bench result: findings, the numbers "
                            "behind them and one setting to try; when no rule fires, what "
                            "bounds each run.")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from loom.bench.diagnose import diagnose, what_bounds
    from loom.cli.bench import read_result

    flags = from_cli_args(DiagnoseFlags, args)
    result = read_result(flags.result)
    findings = diagnose(result, from_cli_args(Report, args).slo)
    if flags.json:  # what bounds each run is part of the answer, findings or not
        print(json.dumps({"findings": [asdict(f) for f in findings],
                          "what_bounds": what_bounds(result)}, indent=1))
        return 0
    console = Console()
    for f in findings:
        console.print(f"[bold]{f.title}[/bold] ({f.run})\n  {f.message}\n"
                      f"  [bold]Try:[/bold] {f.setting}\n", highlight=False)
    if not findings:
        console.print("No rule fired: no sign of a scheduling, admission, memory or "
                      "client-side constraint in these figures. What bounds each run:\n",
                      highlight=False)
        for line in what_bounds(result):
            console.print(f"  {line}", highlight=False)
    return 0
