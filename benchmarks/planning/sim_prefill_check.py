"""Single prefills timed on the engine against a step profile's prediction: where a calibrated
profile leans (BENCHMARKS.md, "Simulation speed and accuracy").

    python benchmarks/planning/sim_prefill_check.py --profile p.json --lengths 256,512,1024,2000
"""

from __future__ import annotations

import argparse
import random
import time

from loom import host
from loom.entrypoints.llm import LLM
from loom.plan.roofline import StepWork
from loom.sampling import SamplingParams
from loom.sim.profile import Profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--lengths", default="256,512,1024,2000")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    profile = Profile.load(args.profile)
    llm = LLM(max_model_len=args.max_model_len, kv_cache_memory="512MiB",
              enable_prefix_caching=False)  # a cached prompt would not be prefilled
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([[rng.randrange(100, 40000) for _ in range(64)]], params)  # warm-up
    print(f"# {host.describe()}; profile {args.profile}")
    for n in (int(x) for x in args.lengths.split(",")):
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        measured = time.perf_counter() - start
        predicted = profile.step_model.time(StepWork.of([(n, 0, True)]))
        print(f"prefill {n}: measured {measured * 1e3:.0f} ms, profile {predicted * 1e3:.0f} ms, "
              f"ratio {measured / predicted:.2f}")


if __name__ == "__main__":
    main()
