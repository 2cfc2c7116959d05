"""On-policy distillation (Qwen3; Thinking Machines, 2025): the student samples, a teacher scores each
sampled token, and the per-token reverse KL log pi_student - log pi_teacher, negated, is a dense
advantage: a token the teacher finds likely is pushed up, one it finds unlikely is pushed down, at the
cost of one forward pass of the teacher (the reference's slot) per step."""
from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.masks import bool_mask


def distill_advantages(task_advantages: Tensor, student_logp: Tensor, teacher_logp: Tensor, mask: Tensor,
                       coef: float, reward_coef: float) -> Tensor:
    """A_t = reward_coef * A_task_t - coef * (log pi_student(o_t) - log pi_teacher(o_t)) on action tokens.

    All [n, T]; `student_logp` are the log-probs the samples were drawn with (or recomputed at the same
    weights), so the second term is a one-sample estimate of the reverse KL(student || teacher) at each
    position, used with discount 0 (each token answers for itself, as in the recipe). 0 off the mask."""
    m = bool_mask(mask)
    reverse_kl = (student_logp - teacher_logp).to(task_advantages.dtype)
    out = reward_coef * task_advantages - coef * reverse_kl
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))
