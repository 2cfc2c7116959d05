"""Loss aggregation: one micro-batch's share of the batch loss, registered by mode (`actor.agg_mode`).

Every mode divides by GLOBAL normalisers that count the whole mini-batch (all micro-batches, all
data-parallel ranks), so the parts summed over micro-batches and ranks give the full-batch loss
whatever the layout. A normaliser of 0 is treated as 1 (the numerator is then 0 as well).
"""
from __future__ import annotations

from typing import Protocol

from torch import Tensor

from train.algorithms.masks import float_mask, masked_sum
from train.algorithms.registry import Registry


class Aggregation(Protocol):
    def __call__(self, per_seq: Tensor, token_loss: Tensor, mask: Tensor, n_tokens_global: float | Tensor,
                 n_seqs_global: float | Tensor, max_len_norm: float | None) -> Tensor: ...


AGG_MODES: Registry[Aggregation] = Registry("loss aggregation mode", "actor.agg_mode")


def _at_least_one(n: float | Tensor) -> float | Tensor:
    """max(n, 1) for a python number or a tensor."""
    return n.clamp_min(1.0) if isinstance(n, Tensor) else max(float(n), 1.0)


@AGG_MODES.register("all_token_mean")
def all_token_mean(per_seq: Tensor, token_loss: Tensor, mask: Tensor, n_tokens_global: float | Tensor,
                   n_seqs_global: float | Tensor, max_len_norm: float | None) -> Tensor:
    """sum_{i,t} m*l / n_tokens_global"""
    return per_seq.sum() / _at_least_one(n_tokens_global)


@AGG_MODES.register("seq_mean_token_mean")
def seq_mean_token_mean(per_seq: Tensor, token_loss: Tensor, mask: Tensor, n_tokens_global: float | Tensor,
                        n_seqs_global: float | Tensor, max_len_norm: float | None) -> Tensor:
    """sum_i [sum_t m*l / max(1, n_i)] / n_seqs_global"""
    n = float_mask(mask, token_loss).sum(dim=1).clamp_min(1.0)
    return (per_seq / n).sum() / _at_least_one(n_seqs_global)


@AGG_MODES.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(per_seq: Tensor, token_loss: Tensor, mask: Tensor, n_tokens_global: float | Tensor,
                            n_seqs_global: float | Tensor, max_len_norm: float | None) -> Tensor:
    """sum_i [sum_t m*l / max_len_norm] / n_seqs_global   (Dr. GRPO)"""
    if max_len_norm is None or max_len_norm <= 0:
        raise ValueError("mode 'seq_mean_token_sum_norm' needs max_len_norm > 0 (e.g. the max response length)")
    return (per_seq / max_len_norm).sum() / _at_least_one(n_seqs_global)


@AGG_MODES.register("seq_mean_token_sum")
def seq_mean_token_sum(per_seq: Tensor, token_loss: Tensor, mask: Tensor, n_tokens_global: float | Tensor,
                       n_seqs_global: float | Tensor, max_len_norm: float | None) -> Tensor:
    """sum_i sum_t m*l / n_seqs_global"""
    return per_seq.sum() / _at_least_one(n_seqs_global)


def aggregate_loss(
    token_loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    n_tokens_global: float | Tensor,
    n_seqs_global: float | Tensor,
    max_len_norm: float | None = None,
) -> Tensor:
    """This micro-batch's share of the batch loss: sum over its rows / GLOBAL normaliser (the mode's)."""
    aggregate = AGG_MODES.get(mode)
    per_seq = masked_sum(token_loss, mask, dim=1)
    return aggregate(per_seq, token_loss, mask, n_tokens_global, n_seqs_global, max_len_norm)
