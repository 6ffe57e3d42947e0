"""The sampler: a step's logits in, its tokens out (`Sampler.sample`), in one call from the
runner. It owns what sampling keeps per request (seeded generators, the tokens penalties
count) and does every part of choosing a token: penalties and logit bias, a grammar's mask,
draft verification (speculative decoding), and logprobs, the model's own before any mask."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.core.batch import GrammarBitmask, ScheduledRequest
from loom.model.logits import (
    adjust_logits,
    apply_token_bitmask,
    apply_top_k_top_p,
    has_limits,
    inverse_cdf,
    keep_top_k_top_p,
    row_argmax,
)
from loom.model.spec_verify import verify_drafts
from loom.outputs import TokenLogprob
from loom.sampling import SamplingParams

# what tests and benchmarks read from here: the logit operations the sampler applies
__all__ = ["LogitRows", "SampledTokens", "Sampler", "adjust_logits", "apply_token_bitmask",
           "apply_top_k_top_p", "generator_seed", "row_argmax"]

_LOW_32_BITS = 2**32 - 1
_BITS_64 = 2**64 - 1


def generator_seed(seed: int) -> int:
    """What a request's seed seeds its `torch.Generator` with. torch's CPU generator (an
    mt19937) keeps only a seed's low 32 bits, so seeds that differ only above them (1 and
    2**32 + 1, or -1 and 2**32 - 1) drew the same numbers. Seeds of up to 32 bits are taken as
    they are; wider ones, negative ones as their 64-bit two's complement, go through
    splitmix64's mixer first, whose low 32 bits differ for two such seeds but with chance
    2^-32 (a 32-bit generator cannot keep 64 bits apart)."""
    z = seed & _BITS_64
    if z <= _LOW_32_BITS:
        return z
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _BITS_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _BITS_64
    return (z ^ (z >> 31)) & _LOW_32_BITS


@dataclass(frozen=True)
class LogitRows:
    """Which rows of a step's logits are whose: the hidden rows (positions in the flat batch)
    that need logits, each sampling request's first row among them, and each prompt-scoring
    request's (first row, count). A request samples at its last position, and at each draft
    before it."""

    items: list[ScheduledRequest]  # in the flat batch's order
    rows: list[int]
    sample_rows: dict[str, int]
    prompt_rows: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, items: list[ScheduledRequest]) -> LogitRows:
        offset, rows = 0, []
        sample_rows: dict[str, int] = {}
        prompt_rows: dict[str, tuple[int, int]] = {}
        for item in items:
            n = len(item.token_ids)
            if item.sampling_params.prompt_logprobs is not None and \
                    item.start_position + 1 < item.num_prompt_tokens:
                # logits at position p score prompt token p + 1
                last = min(item.start_position + n, item.num_prompt_tokens - 1)
                count = last - item.start_position
                prompt_rows[item.request_id] = (len(rows), count)
                rows.extend(range(offset, offset + count))
            if item.sample:
                sample_rows[item.request_id] = len(rows)
                rows.extend(range(offset + n - 1 - item.num_draft_tokens, offset + n))
            offset += n
        return cls(items, rows, sample_rows, prompt_rows)


@dataclass
class SampledTokens:
    """A step's choices, by request id: the token sampled, the drafts kept before it, its
    logprob entry, and (first position, entries) of the prompt tokens scored."""

    token_ids: dict[str, int] = field(default_factory=dict)
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


class Sampler:
    """Samples a step's tokens from its logits, keeping each request's sampling state.

    Called directly, samples one token per row of a logits matrix, each row with its own
    parameters. Random rows use inverse-CDF sampling: one uniform draw per row, located in the row's
    cumulative distribution. A per-request `torch.Generator` therefore produces one number per
    step, whatever else shares the batch: a seeded request's draws are its own. Its text is
    reproducible as far as its logits are; those can move in their last bits with the batch's
    size (the native matmul's int8 and fp32 paths, linear.py), which turns a draw that lands
    near the boundary between two tokens. (The
    exponential-race trick needs a random number per vocabulary entry; torch's CPU
    `exponential_` made that 25 ms for 32 rows of a 49k vocabulary, against 1.5 ms here:
    benchmarks/kernels/op_costs.py.)
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.generators: dict[str, torch.Generator] = {}
        # the tokens sampled for each request with penalties (adjust_logits)
        self.outputs_so_far: dict[str, list[int]] = {}

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        logits = logits.float()
        greedy_ids = row_argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return greedy_ids
        device = logits.device
        uniform = torch.empty(len(logits), 1, device=device)
        uniform[random_rows] = torch.rand(len(random_rows), 1, device=device)
        for i in random_rows:
            if generators[i] is not None:
                uniform[i] = torch.rand(1, device=device, generator=generators[i])
        limited = [i for i in random_rows if has_limits(params[i].top_k, params[i].top_p)]
        unlimited = [i for i in random_rows if i not in limited]
        if unlimited:
            greedy_ids[unlimited] = inverse_cdf(
                self._scaled(logits, unlimited, params).softmax(dim=-1), uniform[unlimited])
        if limited:
            kept = keep_top_k_top_p(self._scaled(logits, limited, params),
                                    [params[i].top_k for i in limited],
                                    [params[i].top_p for i in limited])
            greedy_ids[limited] = kept.draw(uniform[limited])
        return greedy_ids

    @staticmethod
    def _scaled(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]
                ) -> torch.Tensor:
        """The rows' logits divided by their temperatures."""
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        return logits[rows] / temps.unsqueeze(1)

    def forget(self, request_ids: list[str]) -> None:
        """Drop finished requests' state (the runner calls this in order with the steps)."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
            self.outputs_so_far.pop(request_id, None)

    def sample(self, logits: torch.Tensor, rows: LogitRows,
               bitmask: GrammarBitmask | None) -> SampledTokens:
        """One token per sampling request, in one batched call; requests with drafts verify
        them first (their rows start at rows.sample_rows[id], one per draft, then one more).
        Logprobs are the model's own, before any grammar's mask."""
        out = SampledTokens()
        items, sample_rows = rows.items, rows.sample_rows
        mask_rows = bitmask.first_rows() if bitmask is not None else {}
        plain = [s for s in items if s.sample and not s.num_draft_tokens]
        if plain:
            picked = take_rows(logits, [sample_rows[s.request_id] for s in plain])
            params = [s.sampling_params for s in plain]
            picked = adjust_logits(picked, params,
                                   [self.outputs_so_far.get(s.request_id, []) for s in plain],
                                   [s.prompt_token_ids for s in plain],
                                   [s.banned_token_ids for s in plain])
            token_ids = self(self._constrain(picked, plain, bitmask, mask_rows),
                             params, [self._generator(s) for s in plain]).tolist()
            for s, token_id in zip(plain, token_ids):
                out.token_ids[s.request_id] = token_id
                if s.sampling_params.penalized:
                    self.outputs_so_far.setdefault(s.request_id, []).append(token_id)
                if s.sampling_params.logprobs is not None:
                    row = sample_rows[s.request_id]
                    out.logprobs[s.request_id] = token_logprobs(
                        logits[row:row + 1], [token_id], s.sampling_params.logprobs)[0]
        for s in items:
            if s.sample and s.num_draft_tokens:
                self._verify(logits, s, sample_rows[s.request_id], bitmask, mask_rows, out)
        self._score_prompts(logits, rows, out)
        return out

    def _verify(self, logits: torch.Tensor, s: ScheduledRequest, first: int,
                bitmask: GrammarBitmask | None, mask_rows: dict[str, int],
                out: SampledTokens) -> None:
        count = s.num_draft_tokens + 1
        # drafts skip penalized requests (Scheduler._drafts): a logit bias at most
        positions = adjust_logits(logits[first:first + count], [s.sampling_params] * count,
                                  [[]] * count, [[]] * count, [()] * count)
        if bitmask is not None and s.request_id in mask_rows:
            mask_first = mask_rows[s.request_id]
            positions = apply_token_bitmask(positions,
                                            bitmask.bitmask[mask_first:mask_first + count])
        accepted, token_id = verify_drafts(positions, s.token_ids[-s.num_draft_tokens:],
                                           s.sampling_params, self._generator(s))
        out.accepted_draft_ids[s.request_id] = accepted
        out.token_ids[s.request_id] = token_id

    def _constrain(self, logits: torch.Tensor, plain: list[ScheduledRequest],
                   bitmask: GrammarBitmask | None, mask_rows: dict[str, int]) -> torch.Tensor:
        """Mask the rows of constrained requests (structured outputs) in a copy (`logits` may
        be a view of the model's, which logprobs read); the others, and batches with none,
        pass untouched."""
        if bitmask is None:
            return logits
        rows = [j for j, s in enumerate(plain) if s.request_id in mask_rows]
        if rows:
            masks = bitmask.bitmask[[mask_rows[plain[j].request_id] for j in rows]]
            index = torch.tensor(rows, device=logits.device)
            logits = logits.index_put((index,), apply_token_bitmask(logits[index], masks))
        return logits

    @staticmethod
    def _score_prompts(logits: torch.Tensor, rows: LogitRows, out: SampledTokens) -> None:
        for item in rows.items:
            if item.request_id in rows.prompt_rows:
                first, count = rows.prompt_rows[item.request_id]
                start = item.start_position + 1
                targets = item.prompt_token_ids[start:start + count]
                out.prompt_logprobs[item.request_id] = (start, token_logprobs(
                    logits[first:first + count], targets, item.sampling_params.prompt_logprobs))

    def _generator(self, item: ScheduledRequest) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None:
            return None
        if item.request_id not in self.generators:
            self.generators[item.request_id] = torch.Generator(self.device).manual_seed(
                generator_seed(seed))
        return self.generators[item.request_id]


def take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows]: a view where the rows are consecutive, as in a decode-only step, where
    the copy (32 rows of a 49k vocabulary) cost as much as the sampling."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return tensor[rows[0]:rows[0] + len(rows)]
    return tensor[torch.tensor(rows, device=tensor.device)]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int
                   ) -> list[TokenLogprob]:
    """Log-probability of each chosen token and the top-n alternatives, per logits row."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1))
    chosen_list = chosen.squeeze(1).tolist()
    if top_n:
        top_values, top_ids = logprobs.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen_list, tops)]
