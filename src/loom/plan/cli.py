"""`loom plan`: does a model fit a GPU, and how much concurrency does it leave?

Only argparse is imported at module level: the work is imported inside the command, so
`loom --help` stays fast and `loom plan` never needs torch.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def model_help(default: str) -> str:
    """--model's help, naming the shapes shipped in models.json (read, not imported: this
    module stays light)."""
    from loom.plan.models import known_models

    return (f"{', '.join(sorted(known_models()))} (shapes shipped with loom), or a GGUF / HF "
            f"folder / config.json (no weights needed); default: {default}")


def csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def csv_names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_model_args(p: argparse.ArgumentParser, gpus_help: str) -> None:
    """Flags `loom plan` and `loom simulate --gpus` share, spelled once."""
    p.add_argument("--gpus", type=csv_names, default=None, help=gpus_help)
    p.add_argument("--tensor-parallel-size", type=csv_ints, default=[1],
                   help="GPUs per replica, one value or a list, e.g. 1,2,4 (default: 1)")
    p.add_argument("--weight-dtype", default="auto",
                   choices=["auto", "float32", "bf16", "fp16", "fp8", "int8", "int4", "gguf"],
                   help="weight storage (int4: weight-only, AWQ/GPTQ-style, computing in "
                        "16-bit); default: auto = the GGUF's own for a .gguf, else bf16")
    p.add_argument("--kv-dtype", default="bf16", choices=["float32", "bf16", "fp16", "fp8"],
                   help="KV cache dtype (default: %(default)s)")
    p.add_argument("--safety-margin", type=float, default=0.10,
                   help="share of GPU memory kept free (default: %(default).2f)")
    p.add_argument("--runtime-overhead", default="1GiB",
                   help="fixed framework memory per GPU (CUDA context, workspaces, allocator; "
                        "default: %(default)s)")
    p.add_argument("--efficiency", default=None,
                   help="roofline factors, e.g. bandwidth=0.8,compute=0.6,interconnect=0.7,"
                        "step_overhead_s=0.002,seq_overhead_s=2e-5,allreduce_latency_s=1e-5; "
                        "default: those values")
    p.add_argument("--gpu-spec", action="append", default=None, metavar="FILE",
                   help='extra GPUs: JSON {"gpus": {"name": {"memory_gb": .., '
                        '"memory_bandwidth_gbs": .., "bf16_tflops": .., ...}}} (repeatable); '
                        "default: the catalogue only")
    p.add_argument("--price", default=None,
                   help="$ per GPU-hour as you were quoted, e.g. h100-sxm=2.4,h200=3.1, for "
                        "GPUs in --gpus (loom ships no prices); default: no costs")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="will a model fit a GPU, at what concurrency and speed",
                       description="Memory and roofline arithmetic for a model on GPUs you do "
                                   "not have: weights, KV cache, overhead, max concurrency, "
                                   "decode/prefill estimates and the serve flags.")
    p.add_argument("--model", default=None, help=model_help("the bundled model"))
    add_model_args(p, "GPUs from the catalogue, 'this' (measured) or --gpu-spec; default: "
                      "every catalogued GPU")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per sequence; default: the model's context")
    p.add_argument("--concurrency", type=csv_ints, default=[1],
                   help="concurrent sequences of max_model_len, one value or a list "
                        "(default: 1)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step (sizes the activations; default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="sequences per step (sizes the logits; default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print the rows as JSON (default: a table)")
    p.set_defaults(func=run_plan)


def settings_from_args(args: argparse.Namespace, model: Any, concurrencies: list[int]) -> Any:
    """PlanSettings from the shared flags (also used by `loom simulate --gpus`)."""
    from loom.config import parse_size
    from loom.plan.planner import PlanSettings
    from loom.plan.roofline import Efficiency

    weight_dtype = args.weight_dtype
    if weight_dtype == "auto":
        weight_dtype = "gguf" if model.gguf_weight_bytes is not None else "bf16"
    max_model_len = args.max_model_len  # 0 is refused by PlanSettings, not the default
    return PlanSettings(
        max_model_len=model.arch.max_position_embeddings if max_model_len is None
        else max_model_len,
        concurrencies=tuple(dict.fromkeys(concurrencies)),
        tensor_parallel_sizes=tuple(dict.fromkeys(args.tensor_parallel_size)),
        weight_dtype=weight_dtype,
        kv_dtype=args.kv_dtype, block_size=args.block_size, safety_margin=args.safety_margin,
        framework_bytes=parse_size(args.runtime_overhead),
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        efficiency=Efficiency.parse(args.efficiency))


def resolve_gpu_args(args: argparse.Namespace) -> list[Any]:
    from loom.plan.catalogue import load_catalogue, resolve_gpus

    catalogue = load_catalogue(args.gpu_spec)
    names = dict.fromkeys(n.lower() for n in args.gpus) if args.gpus else sorted(catalogue)
    return resolve_gpus(list(names), catalogue)  # each GPU once, however often named


def run_plan(args: argparse.Namespace) -> int:
    from loom.plan.catalogue import check_prices, parse_prices
    from loom.plan.models import resolve_model
    from loom.plan.planner import plan
    from loom.plan.report import add_costs, print_plan

    prices = parse_prices(args.price)
    model = resolve_model(args.model)
    settings = settings_from_args(args, model, args.concurrency)
    gpus = resolve_gpu_args(args)
    check_prices(prices, [g.key for g in gpus])
    rows = plan(model, gpus, settings)
    add_costs(rows, prices)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_plan(rows, model, settings)
    return 0
