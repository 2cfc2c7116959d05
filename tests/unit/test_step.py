"""train/trainer/advantages.py: every advantage estimator end to end (samples in, through the step
batch the trainer builds, per-token advantages out) against float64 numpy references written from the
papers' formulas; train/trainer/step.py: reward shaping, group selection, running reward statistics,
rollout metrics."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ROOT, run_config
from train.parallel.layout import layout_sizes
from train.parallel.step_batch import dispatch, exchange_index
from train.trainer import step as st
from train.trainer.advantages import compute_advantages
from train.workers.rollout import Sample

CTX = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)  # no process group: sums are local
ONE_RANK = SimpleNamespace(sizes=layout_sizes(1), dp_rank=0, is_data_leader=True)


def advantages(samples, G, c, ref=None, values=None, rewards=None, reward_scale=1.0, routes=None):
    """Advantages through the step batch, as the trainer computes them (one rank: the batch holds
    every sample, in order). Returns (advantages, returns or None, metrics)."""
    rewards = rewards or [s.reward for s in samples]
    index = exchange_index([len(s.ids) for s in samples], [i // G for i in range(len(samples))], rewards,
                           CTX.device, routes=routes)
    batch = dispatch(index, [s.ids for s in samples], [s.action_mask for s in samples],
                     [s.sampler_logprobs for s in samples], ONE_RANK, 1, CTX.device)
    assert batch.members == list(range(len(samples)))
    if ref is not None:
        batch.fields["ref_logp"] = [r.float() for r in ref]
    if values is not None:
        batch.fields["values"] = [v.float() for v in values]
    metrics = compute_advantages(batch, c.adv, c.actor.kl, CTX.device, reward_scale=reward_scale, distill=c.distill)
    return batch.fields["advantages"], batch.fields.get("returns"), metrics


def sequence_values(adv, samples):
    """The one value a sequence estimator puts on each action token (checked to be the same on all)."""
    out = []
    for a, s in zip(adv, samples):
        on = a[[t for t in positions(s)]]
        assert torch.allclose(on, on[0].expand_as(on)) and (a[[t for t in range(len(a)) if not s.action_mask[t + 1]]]
                                                               == 0).all()
        out.append(float(on[0]))
    return np.array(out)


def cfg(**overrides):
    """The run's typed config (config/grpo.yaml) with `overrides`, as the trainer's parts receive it."""
    return run_config(overrides)


def make_samples(rng, n_groups=3, G=4, binary=False):
    """Ragged multi-turn samples: prompt (0), response turns (1) with a tool span (0) between them."""
    out = []
    for g in range(n_groups):
        for _ in range(G):
            prompt = int(rng.integers(2, 6))
            turns = [int(rng.integers(1, 7)) for _ in range(int(rng.integers(1, 3)))]
            mask = [0] * prompt
            for k, t in enumerate(turns):
                mask += [1] * t + ([0] * 3 if k < len(turns) - 1 else [])
            ids = list(rng.integers(3, 100, size=len(mask)))
            logp = [float(-abs(x)) if m else 0.0 for x, m in zip(rng.normal(size=len(mask)), mask)]
            reward = float(rng.integers(0, 2)) if binary else float(rng.normal())
            out.append(Sample(g, [], None, ids, mask, logp, reward=reward))
    return out


def positions(s):
    """Per-token index t (token t+1) of each action token."""
    return [t for t, m in enumerate(s.action_mask[1:]) if m]


def ref_logps(rng, samples):
    return [torch.tensor(np.array(s.sampler_logprobs[1:]) + rng.normal(size=len(s.ids) - 1) * 0.3)
            for s in samples]


def as_np(adv, samples):
    """Per-token advantages (list of tensors) on action tokens only, flattened in sample order."""
    return np.concatenate([np.asarray(a, dtype=np.float64)[positions(s)] for a, s in zip(adv, samples)])


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["reinforce", "rloo"])
@pytest.mark.parametrize("norm_var,global_norm,batch_whiten", [(True, False, False), (False, False, False),
                                                               (True, True, False), (False, True, False),
                                                               (True, False, True), (False, False, True)])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_group_estimators(estimator, norm_var, global_norm, batch_whiten, kl_coef):
    rng = np.random.default_rng(1)
    G = 4
    samples = make_samples(rng, G=G)
    ref = ref_logps(rng, samples)
    c = cfg(**{"adv.estimator": estimator, "adv.norm_var": norm_var, "adv.global_norm": global_norm,
               "adv.batch_whiten": batch_whiten,
               "actor.kl.coef": kl_coef, "actor.kl.reward_estimator": "k1" if kl_coef else None})
    adv, returns, metrics = advantages(samples, G, c, ref if kl_coef else None)
    # reference: R_i = r_i - beta * sum_t (log pi - log ref) over action tokens
    R = np.array([s.reward - kl_coef * sum(s.sampler_logprobs[t + 1] - float(r[t]) for t in positions(s))
                  for s, r in zip(samples, ref)])
    A = np.zeros_like(R)
    N = len(R)
    if global_norm:  # one baseline for the batch (the guide's definition); Bessel-corrected std
        for i in range(N):
            if estimator == "rloo":
                A[i] = R[i] - (R.sum() - R[i]) / (N - 1)
            else:
                A[i] = R[i] - R.mean()
                if norm_var:
                    A[i] /= math.sqrt(((R - R.mean()) ** 2).sum() / (N - 1)) + 1e-6
    else:
        for g0 in range(0, N, G):
            grp = R[g0:g0 + G]
            for i in range(G):
                if estimator == "rloo":
                    A[g0 + i] = grp[i] - (grp.sum() - grp[i]) / (G - 1)
                else:
                    A[g0 + i] = grp[i] - grp.mean()
                    if norm_var:
                        A[g0 + i] /= math.sqrt(((grp - grp.mean()) ** 2).sum() / (G - 1)) + 1e-6
    if batch_whiten:
        A = (A - A.mean()) / (math.sqrt(((A - A.mean()) ** 2).sum() / (N - 1)) + 1e-6)
    np.testing.assert_allclose(sequence_values(adv, samples), A, rtol=1e-5, atol=1e-6)  # float32 per token
    assert returns is None
    if kl_coef:
        assert metrics["kl/reward_penalty"] == pytest.approx((np.array([s.reward for s in samples]) - R).mean()
                                                                 / kl_coef, rel=1e-6)


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("gamma,kl_coef", [(1.0, 0.0), (1.0, 0.05), (0.9, 0.05)])
def test_reinforce_pp(baseline, gamma, kl_coef):
    rng = np.random.default_rng(2)
    G = 4
    samples = make_samples(rng, G=G)
    ref = ref_logps(rng, samples)
    c = cfg(**{"adv.estimator": "reinforce_pp_baseline" if baseline else "reinforce_pp", "adv.gamma": gamma,
               "actor.kl.coef": kl_coef, "actor.kl.reward_estimator": "k1"})
    adv, _, _ = advantages(samples, G, c, ref)
    r = np.array([s.reward for s in samples])
    if baseline:
        r = r - np.repeat(r.reshape(-1, G).mean(1), G)
    returns = []
    for s, rl, outcome in zip(samples, ref, r):
        pos = positions(s)
        tok = [-kl_coef * (s.sampler_logprobs[t + 1] - float(rl[t])) for t in pos]
        tok[-1] += outcome
        returns.append([sum(gamma ** j * tok[k + j] for j in range(len(tok) - k)) for k in range(len(tok))])
    flat = np.concatenate(returns)
    expected = (flat - flat.mean()) / (flat.std(ddof=1) + 1e-6)  # Bessel-corrected
    np.testing.assert_allclose(as_np(adv, samples), expected, rtol=1e-5, atol=1e-6)
    for a, s in zip(adv, samples):  # exactly 0 off the action tokens
        off = [t for t in range(len(s.ids) - 1) if not s.action_mask[t + 1]]
        assert a.shape == (len(s.ids) - 1,) and (a[off] == 0).all()


@pytest.mark.parametrize("gamma,lam,whiten,scale,kl_coef", [(1.0, 1.0, False, 1.0, 0.0), (1.0, 0.95, True, 2.5, 0.0),
                                                            (0.99, 0.9, True, 1.0, 0.1)])
def test_gae_estimator(gamma, lam, whiten, scale, kl_coef):
    rng = np.random.default_rng(3)
    samples = make_samples(rng, G=2)
    values = [torch.tensor(rng.normal(size=len(s.ids) - 1)) for s in samples]
    ref = ref_logps(rng, samples)
    c = cfg(**{"adv.estimator": "gae", "adv.gamma": gamma, "adv.lamda": lam, "adv.whiten": whiten,
               "actor.kl.coef": kl_coef, "actor.kl.reward_estimator": "k1"})
    adv, returns, metrics = advantages(samples, 2, c, ref if kl_coef else None, values=values, reward_scale=scale)
    advs, rets, vals = [], [], []
    for s, v, rl in zip(samples, values, ref):
        pos = positions(s)
        tok = [-kl_coef * (s.sampler_logprobs[t + 1] - float(rl[t])) for t in pos]
        tok[-1] += s.reward
        tok = [x * scale for x in tok]
        V = [float(v[t]) for t in pos]
        a, last = [0.0] * len(pos), 0.0
        for k in reversed(range(len(pos))):
            v_next = V[k + 1] if k + 1 < len(pos) else 0.0
            last = tok[k] + gamma * v_next - V[k] + gamma * lam * last
            a[k] = last
        advs += a
        rets += [x + y for x, y in zip(a, V)]
        vals += V
    advs, rets, vals = map(np.array, (advs, rets, vals))
    np.testing.assert_allclose(as_np(returns, samples), rets, rtol=1e-5, atol=1e-5)
    expected = (advs - advs.mean()) / math.sqrt(advs.var(ddof=1) + 1e-8) if whiten else advs
    np.testing.assert_allclose(as_np(adv, samples), expected, rtol=1e-5, atol=1e-5)
    ev = 1 - np.var(rets - vals) / np.var(rets)
    assert metrics["critic/explained_variance"] == pytest.approx(ev, rel=1e-5, abs=1e-7)


def ref_distillation(samples, teacher, G, coef, reward_coef, taught=None):
    """Per action token, reward_coef * the GRPO advantage - coef * (log pi_student - log pi_teacher) (0 for a sample
    no teacher scored); and the reverse KLs of the tokens a teacher scored."""
    R = np.array([s.reward for s in samples])
    expected, rkl = [], []
    for i, (s, t) in enumerate(zip(samples, teacher)):
        grp = R[i - i % G: i - i % G + G]
        task = (R[i] - grp.mean()) / (math.sqrt(((grp - grp.mean()) ** 2).sum() / (G - 1)) + 1e-6)
        scored = taught is None or taught[i]
        for p in positions(s):
            d = s.sampler_logprobs[p + 1] - float(t[p]) if scored else 0.0
            expected.append(reward_coef * task - coef * d)
            rkl += [d] if scored else []
    return expected, rkl


@pytest.mark.parametrize("coef,reward_coef", [(1.0, 0.0), (0.5, 1.0)])
def test_distillation_advantage_is_the_negative_reverse_kl_to_the_teacher_per_token(coef, reward_coef):
    """distill.teacher: the reference slot's log-probs are the teacher's; each action token's advantage is
    reward_coef * (the GRPO advantage) - coef * (log pi_student - log pi_teacher) of that token."""
    rng = np.random.default_rng(5)
    G = 4
    samples = make_samples(rng, G=G)
    teacher = ref_logps(rng, samples)
    c = cfg(**{"distill.teacher": "stub/model", "distill.coef": coef, "distill.reward_coef": reward_coef})
    adv, _, metrics = advantages(samples, G, c, teacher)
    expected, rkl = ref_distillation(samples, teacher, G, coef, reward_coef)
    np.testing.assert_allclose(as_np(adv, samples), expected, rtol=1e-5, atol=1e-6)
    for a, s in zip(adv, samples):  # nothing off the action tokens
        assert (a[[t for t in range(len(a)) if not s.action_mask[t + 1]]] == 0).all()
    assert metrics["distill/reverse_kl"] == pytest.approx(np.mean(rkl), abs=1e-6)  # (teacher log-probs held in float32)


def test_samples_no_teacher_scores_keep_their_task_advantage():
    """distill.teachers routes by source; a sample routed to none (-1) has no reverse-KL term, whatever the
    reference slot holds for it, and the reverse-KL metric averages over the tokens a teacher scored."""
    from train.trainer.teachers import TeacherRoutes

    rng = np.random.default_rng(6)
    G = 4
    samples = make_samples(rng, G=G)
    teacher = ref_logps(rng, samples)
    routes = [-1 if i // G == 1 else i // G % 2 for i in range(len(samples))]  # group 1 untaught
    c = cfg(**{"distill.teachers": {"a": "stub/model"}, "distill.coef": 1.0, "distill.reward_coef": 1.0})
    adv, _, metrics = advantages(samples, G, c, teacher, routes=routes)
    expected, rkl = ref_distillation(samples, teacher, G, 1.0, 1.0, taught=[r >= 0 for r in routes])
    np.testing.assert_allclose(as_np(adv, samples), expected, rtol=1e-5, atol=1e-6)
    assert metrics["distill/reverse_kl"] == pytest.approx(np.mean(rkl), abs=1e-6)
    assert metrics["distill/taught_share"] == pytest.approx(len(rkl) / len(expected))

    # the routing table: a fallback teacher for sources not named, two sources sharing one model
    routes = TeacherRoutes.of("stub/model", {"code": "runs/coder", "math": "stub/model/", "chat": "runs/coder"})
    assert routes.folders == ("stub/model", "runs/coder")
    assert [routes.route(s) for s in ("math", "code", "chat", "other", None)] == [0, 1, 1, 0, 0]
    alone = TeacherRoutes.of(None, {"code": "runs/coder"})
    assert (alone.route("code"), alone.route("math"), alone.route(None)) == (0, -1, -1)


def test_kl_metric_in_the_loss_placement():
    """KL in the loss (no reward estimator): advantages untouched, the policy-vs-reference KL logged."""
    rng = np.random.default_rng(4)
    samples = make_samples(rng)
    ref = ref_logps(rng, samples)
    c = cfg(**{"actor.kl.coef": 0.1, "actor.kl.type": "k3"})
    with_ref, _, metrics = advantages(samples, 4, c, ref)
    without, _, _ = advantages(samples, 4, c, None)
    assert all(torch.equal(a, b) for a, b in zip(with_ref, without))
    d = np.concatenate([[np.float32(s.sampler_logprobs[t + 1]) - np.float32(r[t]) for t in positions(s)]
                        for s, r in zip(samples, ref)]).astype(np.float64)
    assert metrics["kl/k3"] == pytest.approx(np.mean(np.exp(-d) + d - 1), rel=1e-6)


# ----------------------------------------------------------------------------------------------
# shaping, selection, running moments


def test_overlong_shaping_and_group_selection():
    rng = np.random.default_rng(5)
    samples = make_samples(rng, n_groups=2, G=3)
    for s in samples:
        s.reward = 1.0  # every group is uninformative before shaping
    c = cfg(**{"rollout.train_sampling_params.max_new_tokens": 8, "rollout.overlong_buffer": 4,
               "rollout.overlong_penalty": 0.5})
    st.shape_rewards(samples, c.rollout)
    rewards = [s.shaped_reward for s in samples]
    for s in samples:
        L = s.n_action_tokens
        ref = 0.0 if L <= 4 else (-0.5 * (L - 4) / 4 if L <= 8 else -0.5)
        assert s.overlong_penalty == pytest.approx(ref) and s.shaped_reward == pytest.approx(1.0 + ref)
    kept = st.select_groups(samples, 3, dynamic_filtering=True)
    informative = [len(set(rewards[g * 3:(g + 1) * 3])) > 1 for g in range(2)]
    assert kept == [s for g, ok in enumerate(informative) if ok for s in samples[g * 3:(g + 1) * 3]]
    off = cfg(**{"rollout.overlong_buffer": None})
    st.shape_rewards(samples, off.rollout)
    assert [(s.shaped_reward, s.overlong_penalty) for s in samples] == [(1.0, 0.0)] * 6
    assert st.select_groups(samples, 3, True) == []  # unshaped: nothing kept
    frac = cfg(**{"rollout.train_sampling_params.max_new_tokens": 10, "rollout.overlong_buffer": 0.2})
    L = np.array([s.n_action_tokens for s in samples])
    st.shape_rewards(samples, frac.rollout)
    np.testing.assert_allclose([s.overlong_penalty for s in samples], -np.clip((L - 8) / 2, 0, 1))


def test_running_moments():
    rng = np.random.default_rng(6)
    m = st.RunningMoments()
    seen = []
    for _ in range(5):
        batch = list(rng.normal(loc=2.0, scale=3.0, size=int(rng.integers(1, 20))))
        m.update(batch)
        seen += batch
        assert m.count == len(seen)
        assert m.mean == pytest.approx(np.mean(seen), rel=1e-9) and m.std == pytest.approx(np.std(seen), rel=1e-9)
    again = st.RunningMoments()
    again.load_state_dict(m.state_dict())
    assert again == m


def test_mask_truncated_keeps_the_baseline_but_drops_the_tokens():
    rng = np.random.default_rng(7)
    samples = make_samples(rng, n_groups=2, G=4)
    samples[1].finish_reason = samples[6].finish_reason = "length"
    before = sequence_values(advantages(samples, 4, cfg())[0], samples)
    st.shape_rewards(samples, cfg().rollout)
    kept = st.select_groups(samples, 4, dynamic_filtering=False)
    st.mask_truncated(kept)
    assert kept == samples
    assert sum(samples[1].action_mask) == 0 and sum(samples[6].action_mask) == 0
    assert all(sum(s.action_mask) > 0 for i, s in enumerate(samples) if i not in (1, 6))
    after, _, _ = advantages(samples, 4, cfg())
    assert all((a == 0).all() for i, a in enumerate(after) if i in (1, 6))  # no token left to train
    kept_values = [float(a[positions(s)][0]) for i, (a, s) in enumerate(zip(after, samples)) if i not in (1, 6)]
    # the truncated rewards still shape their group's baseline
    np.testing.assert_allclose(kept_values, [v for i, v in enumerate(before) if i not in (1, 6)], rtol=1e-6)


def test_rollout_metrics_trajectory_and_turn_lengths():
    """trajectory_length = prompt + every turn + every tool message, in tokens; turn lengths per turn index."""
    def sample(prompt, turns, tool, reward):
        mask = [0] * prompt
        for k, t in enumerate(turns):
            mask += [1] * t + ([0] * tool if k < len(turns) - 1 else [])
        return Sample(0, [], None, list(range(len(mask))), mask, [0.0] * len(mask), reward=reward,
                      n_turns=len(turns), prompt_length=prompt, turn_lengths=list(turns))

    samples = [sample(10, [4, 2, 6], 3, 1.0), sample(10, [5], 0, 0.0), sample(12, [3, 7], 5, 1.0),
               sample(12, [2], 0, 1.0)]
    m = st.rollout_metrics(samples, 2, 2, cfg(**{"rollout.max_turns": 3}).rollout, CTX)
    lengths = [len(s.ids) for s in samples]
    assert lengths == [10 + 12 + 6, 15, 12 + 10 + 5, 14]
    assert m["trajectory_length/train"] == pytest.approx(np.mean(lengths))
    assert m["trajectory_length/train_max"] == max(lengths)
    assert m["prompt_length/train"] == pytest.approx(11.0)
    assert m["response_length/train"] == pytest.approx((12 + 5 + 10 + 2) / 4)
    assert m["turn_length/train"] == pytest.approx((12 + 5 + 10 + 2) / 7)  # per assistant turn
    assert m["turn_length/turn1"] == pytest.approx((4 + 5 + 3 + 2) / 4)
    assert m["turn_length/turn2"] == pytest.approx((2 + 7) / 2) and m["turn_length/turn3"] == 6
    assert m["dynamic_filtering_ratio"] == 0.5  # the second group is all 1.0


def test_rollout_metrics_count_tool_calls_and_errors():
    """tools/* count the environment's tool replies as the rollout records them (events of type
    "tool"), with `"error": true` replies counted apart; single-turn runs have no tools/* keys."""
    def sample(*turn_replies):
        events = [{"type": "tool", "turn": k, "messages": [{"role": "tool", "content": c, "error": e}
                                                           for c, e in replies]}
                  for k, replies in enumerate(turn_replies)]
        events.append({"type": "context_overflow", "turn": len(turn_replies), "env_tokens": 9, "room": 1})
        return Sample(0, [], None, [1, 2, 3], [0, 1, 1], [0.0] * 3, n_turns=len(turn_replies) + 1,
                      prompt_length=1, turn_lengths=[2], events=events)

    samples = [sample([("42", False)], [("Error: bad JSON", True), ("7", False)]), sample(),
               sample([("Error: unknown tool 'calc'", True)]), sample()]
    m = st.rollout_metrics(samples, 2, 2, cfg(**{"rollout.max_turns": 3}).rollout, CTX)
    assert m["tools/calls_per_sample"] == pytest.approx(4 / 4)
    assert m["tools/call_rate"] == pytest.approx(2 / 4)
    assert m["tools/errors"] == 2
    single = st.rollout_metrics(samples, 2, 2, cfg(**{"rollout.max_turns": 1}).rollout, CTX)
    assert not any(k.startswith("tools/") for k in single)


def documented_blocks(heading: str) -> list[str]:
    """The ```python blocks of one section of docs/design.md, as written."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [block.split("\n", 1)[1].split("\n```", 1)[0] for block in section.split("```python")[1:]]


def test_the_documented_estimator_runs_through_the_step(scoped_registries):
    """docs/design.md's "Add an estimator": its function and registry line, then its test, as
    written; then the new name through the trainer's path (compute_advantages on the step batch,
    KL in the reward) against a float64 reference written here."""
    from train.algorithms.advantages import ESTIMATORS
    estimator_block, test_block = documented_blocks("Add an estimator")
    exec(compile(estimator_block, "docs/design.md (estimator)", "exec"), {})
    assert "grpo_population_std" in ESTIMATORS.names()
    namespace: dict = {}
    exec(compile(test_block, "docs/design.md (test)", "exec"), namespace)
    namespace["test_grpo_population_std"]()

    rng = np.random.default_rng(5)
    G, kl_coef = 4, 0.1
    samples = make_samples(rng, G=G)
    ref = ref_logps(rng, samples)
    c = cfg(**{"adv.estimator": "grpo_population_std", "actor.kl.coef": kl_coef,
               "actor.kl.reward_estimator": "k1"})
    adv, returns, _ = advantages(samples, G, c, ref)
    R = np.array([s.reward - kl_coef * sum(s.sampler_logprobs[t + 1] - float(r[t]) for t in positions(s))
                  for s, r in zip(samples, ref)])
    A = np.zeros_like(R)
    for g0 in range(0, len(R), G):
        grp = R[g0:g0 + G]
        A[g0:g0 + G] = (grp - grp.mean()) / (math.sqrt(((grp - grp.mean()) ** 2).sum() / G) + 1e-6)
    np.testing.assert_allclose(sequence_values(adv, samples), A, rtol=1e-5, atol=1e-6)  # float32 per token
    assert returns is None
