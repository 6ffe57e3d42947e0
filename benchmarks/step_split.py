"""Where the mixed workload's time goes, per kind of step: decode-only steps vs steps that
carry prefill chunks, for continuous and static batching at max_num_seqs 16 (fp32). Prints
wall time and, per kind, (steps, seconds, mean decodes per step). Run from the repository root:

    python benchmarks/step_split.py
"""

from __future__ import annotations

import collections
import sys
import time

sys.path.insert(0, "benchmarks")
from workload import bundled_tokenizer, mixed_workload  # noqa: E402

from loom import LLM, SamplingParams  # noqa: E402


def main() -> None:
    items = mixed_workload(bundled_tokenizer())
    for scheduler in ("continuous", "static"):
        engine = LLM(scheduler=scheduler, max_num_seqs=16, kv_cache_memory="1536MiB").engine
        for i, item in enumerate(items):
            engine.add_request(f"r{i}", item.prompt_token_ids, SamplingParams(
                max_tokens=item.max_tokens, temperature=0, ignore_eos=True))
        stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
        execute = engine.runner.execute

        def timed(batch, execute=execute, stats=stats):
            start = time.perf_counter()
            out = execute(batch)
            decodes = sum(1 for s in batch.scheduled if len(s.token_ids) == 1)
            kind = "decode-only" if batch.num_scheduled_tokens == decodes else "with prefill"
            entry = stats[kind]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            entry[2] += decodes
            return out

        engine.runner.execute = timed
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        summary = {k: (int(v[0]), round(v[1], 1), round(v[2] / max(v[0], 1), 1))
                   for k, v in stats.items()}
        print(scheduler, f"wall {time.perf_counter() - start:.1f}", summary, flush=True)


if __name__ == "__main__":
    main()
