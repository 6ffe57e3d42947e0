"""`loom` command line: generate | serve. Engine flags are generated from the config
dataclasses (see loom.config), so each option is spelled once."""

from __future__ import annotations

import argparse
import logging
import sys

from loom.bench.cli import add_bench_parsers
from loom.config import EngineConfig


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt with the engine in this process")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from loom.entrypoints.llm import LLM
    from loom.sampling import SamplingParams

    llm = LLM.from_config(EngineConfig.from_cli_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from loom.entrypoints.openai.server import add_serve_args, run_server

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(p)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=run_server)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    add_bench_parsers(sub)
    return parser


def _compare_as_flag(argv: list[str]) -> list[str]:
    """`loom bench --compare ...` (the spelling in DESIGN.md) is `loom bench compare ...`."""
    if "bench" in argv:
        i = argv.index("bench") + 1
        if argv[i:i + 1] == ["--compare"]:
            return [*argv[:i], "compare", *argv[i + 1:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_compare_as_flag(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (ValueError, OSError) as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
