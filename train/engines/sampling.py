"""The `hf` engine's sampler: one token per row from its logits, and the penalties applied before.

Per-row settings (temperature, top-p, top-k, min-p, penalties) in one batch, with every row's token a function
of its own logits and uniform alone (not of the rows beside it), and its log-prob the float32
`log_softmax(logits / T)` a trainer recomputes. Written for the decode step's hot path: the passes over
[rows, vocab] that no row needs are skipped (the flags `sample_tokens` takes), and the inverse CDF runs in two
levels (benchmarks/sampler.py).
"""
from __future__ import annotations

import torch

from train.engines.base import SamplingParams


class Penalties:
    """Repetition, presence and frequency penalties of a batch of rows (vLLM / SGLang semantics):
    repetition divides a positive logit (multiplies a negative one) of every token seen in the
    prompt or the response; presence subtracts its value once from every token already in the
    response, frequency once per occurrence. Rows can be dropped as they finish (`select`)."""

    def __init__(self, prompts: list[list[int]], params: list[SamplingParams], vocab: int,
                 device: torch.device) -> None:
        n = len(prompts)
        as_t = lambda xs: torch.tensor(xs, device=device, dtype=torch.float32)[:, None]  # noqa: E731
        self.repetition = as_t([sp.repetition_penalty for sp in params])
        self.presence = as_t([sp.presence_penalty for sp in params])
        self.frequency = as_t([sp.frequency_penalty for sp in params])
        self.counts = torch.zeros(n, vocab, device=device)  # occurrences in the response so far
        self.seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)  # prompt or response
        for row, prompt in enumerate(prompts):
            ids = torch.tensor([t for t in prompt if t < vocab], dtype=torch.long, device=device)
            self.seen[row, ids] = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        rep = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, rep, logits)
        return logits - self.frequency * self.counts - self.presence * (self.counts > 0)

    def record(self, tokens: torch.Tensor) -> None:
        rows = torch.arange(tokens.numel(), device=tokens.device)
        self.counts[rows, tokens] += 1
        self.seen[rows, tokens] = True

    def select(self, idx: torch.Tensor) -> None:
        for name in ("repetition", "presence", "frequency", "counts", "seen"):
            setattr(self, name, getattr(self, name)[idx])


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
    min_p: torch.Tensor | None = None,
    *,
    any_sampled: bool | None = None,
    filtered: torch.Tensor | None = None,
    unit_temperature: bool | None = None,
    any_greedy: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, log-probs of those tokens).

    Per-row `temperature` (0 = greedy), `top_p` (1 = off), `top_k` (<= 0 = off), `min_p` (0 or
    None = off: keep tokens with p >= min_p * p_max), `uniforms` in (0, 1]. The log-prob is taken
    from the full distribution at the row's temperature (T = 1 for greedy rows), which is what a
    trainer recomputes from `log_softmax(logits / T)`; truncation (top-p, top-k, min-p) is not
    renormalised into it. Penalties, when used, are already applied to `logits`.

    What the caller knows from the rows' parameters spares the device-to-host reads that would otherwise
    decide it (each one waits for the GPU): `any_sampled` (some row has temperature > 0), `filtered` (a
    device index of the rows with top-p < 1 or 0 < top-k < vocab; empty = none). Only those rows are sorted:
    a temperature-only row needs no sort, and gets the same values either way. `unit_temperature` (every
    row's temperature is 0 or 1, as in most RL): the division by the temperature is skipped, one pass over
    [rows, vocab] less. `any_greedy` False (no row at temperature 0): no argmax pass. A `min_p` given is
    applied to its rows with min_p > 0 (pass None when none asks).
    """
    logits = logits.float()
    greedy = temperature <= 0
    if unit_temperature:  # x / 1 is x exactly: the same log-probs without the pass
        logp = torch.log_softmax(logits, dim=-1)
    else:
        scale = torch.where(greedy, torch.ones_like(temperature), temperature)
        logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    chosen = None if any_greedy is False else logits.argmax(dim=-1)
    if any_sampled if any_sampled is not None else not bool(greedy.all()):
        probs = logp.exp()
        vocab = probs.shape[-1]
        if min_p is not None:
            floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            truncated = torch.where(probs >= floor, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))
            # Renormalised (top-p then sees the truncated distribution), on the rows that asked only:
            # the others keep their values bit for bit, so their samples do not depend on the batch.
            probs = torch.where(min_p[:, None] > 0, truncated / truncated.sum(dim=-1, keepdim=True), probs)
        if filtered is None:
            filtered = ((top_p < 1) | ((top_k > 0) & (top_k < vocab))).nonzero().squeeze(1)
        if filtered.numel():
            every = filtered.numel() == probs.shape[0]
            rows = probs if every else probs[filtered]
            row_p, row_k = (top_p, top_k) if every else (top_p[filtered], top_k[filtered])
            ranked, order = rows.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=probs.device)
            mass_before = ranked.cumsum(-1) - ranked
            keep = (mass_before < row_p[:, None]) | (row_p[:, None] >= 1)
            keep &= (row_k[:, None] <= 0) | (rank < row_k[:, None])
            keep[:, 0] = True  # the most likely token always survives
            # Back in vocabulary order, so every row samples by inverting the CDF of its probabilities in
            # the same order: a row's token does not depend on whether another row of its batch filters.
            rows = torch.zeros_like(rows).scatter_(1, order, ranked * keep)
            probs = rows if every else probs.index_copy(0, filtered, rows)
        sampled = inverse_cdf(probs, uniforms)
        chosen = sampled if any_greedy is False else torch.where(greedy, chosen, sampled)
    return chosen, logp.gather(1, chosen[:, None]).squeeze(1)


CDF_BLOCK = 1024  # the most tokens in one block of inverse_cdf's two levels


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [rows, vocab] (not necessarily summing to 1), the first token whose cumulative
    probability reaches uniform x the row's total; a token of probability 0 is never chosen.

    In two levels where the vocabulary splits into blocks (the largest divisor of it up to CDF_BLOCK, at least
    64 tokens): each block's mass (one read of [rows, vocab]), their running sum, then the running sum inside
    each row's chosen block only. A running sum over the whole vocabulary would read and write it all again
    (on an H100, the cumsum over a 152k vocabulary at batch 256 was 5% of a decode step's GPU time)."""
    rows, vocab = probs.shape
    block = next((b for b in range(min(CDF_BLOCK, vocab), 63, -1) if vocab % b == 0), vocab)
    if block == vocab:
        cdf = probs.cumsum(-1)
        target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
        return torch.searchsorted(cdf, target).clamp(max=vocab - 1).squeeze(1)
    blocks = probs.view(rows, vocab // block, block)
    reach = blocks.sum(-1).cumsum(-1)  # [rows, blocks]: the mass up to the end of each block
    target = uniforms.to(reach.dtype)[:, None] * reach[:, -1:]  # <= the total: u <= 1
    chosen = torch.searchsorted(reach, target)  # [rows, 1]: the first block reaching it (so it has mass)
    before = torch.where(chosen > 0, reach.gather(1, (chosen - 1).clamp(min=0)), 0.0)  # < target
    inside = blocks.gather(1, chosen[:, :, None].expand(-1, 1, block)).squeeze(1).cumsum(-1)
    # In (0, the block's mass], so the first entry reaching it is a token of nonzero probability.
    within = (target - before).clamp(max=inside[:, -1:])
    return (chosen * block + torch.searchsorted(inside, within).clamp(max=block - 1)).squeeze(1)
