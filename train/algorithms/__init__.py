"""RL algorithm pieces as pure tensor functions: no distributed calls, no global state beyond the
registries that map config names to implementations (registry.py). Where a quantity must be global
(normalisers, advantage statistics), the caller computes it (e.g. with an all-reduce) and passes it in.

Conventions
- Token-level tensors are [B, T] (padded). `mask` [B, T] (bool or float) is 1 on action tokens, the
  tokens the policy sampled, and 0 on prompt/template/tool/padding tokens.
- Sequence-level tensors are [B]. Samples of one prompt group share a group id.
- Token-level outputs are exactly 0 on non-action tokens.
- Statistics returned in `stats` dicts are detached 0-dim tensors (no host sync is forced here).

Modules by job: masks (masked sums, sequence <-> token placement), moments (counts, sums and the
statistics built from them), returns (token rewards, GAE, returns-to-go), advantages (the estimators,
registry `ESTIMATORS`), kl (registry `KL_ESTIMATORS`), policy_loss (registry `POLICY_LOSSES`),
aggregation (registry `AGG_MODES`), ratios (log-ratio clamp), value_loss, logits (log-probs, entropy), mismatch (TIS, sampler
diagnostics), shaping (overlong penalty), schedules, dynamic_sampling.
"""
