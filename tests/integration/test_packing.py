"""Packed micro-batches: budgets, balance across dp groups, boundaries (positions restart, no
attention across sequences), and the same log-probs and gradients as running each sequence alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ROOT, STUB_MODEL, ranks_cmd, run_torchrun
from train.parallel.packing import balance, build_packed as build_packed_tensors, plan_packs
from train.parallel.seq_parallel import install_packed_attention


def build_packed(index, seqs, masks, *args, **kwargs):
    """build_packed from plain lists: token ids, and raw action masks (one entry per token) shifted
    the way the step batch stores them (entry t for token t + 1)."""
    return build_packed_tensors(index, [torch.tensor(s) for s in seqs],
                                [torch.tensor(m[1:], dtype=torch.float32) for m in masks], *args, **kwargs)


def ragged(n: int = 9, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(n):
        length = int(torch.randint(3, 30, (1,), generator=g))
        ids.append(torch.randint(3, 500, (length,), generator=g).tolist())
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        masks.append([0] * prompt + [1] * (length - prompt))
    return ids, masks


def test_plan_packs_respects_the_budget_and_places_every_sample_once():
    lengths = [30, 5, 17, 64, 8, 8, 22, 3, 40]
    packs = plan_packs(lengths, 48)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    for p in packs:
        assert sum(lengths[i] for i in p) <= 48 or len(p) == 1  # only an over-long sample stands alone
    assert [3] in packs  # 64 > 48: its own pack
    assert len(packs) <= 5  # first-fit decreasing fills packs (205 tokens: 5 packs of 48 at most)
    assert plan_packs(lengths, 48) == packs  # deterministic: every rank plans the same


def test_balance_spreads_tokens_evenly_over_groups():
    lengths = [100, 90, 80, 10, 10, 10, 5, 5, 60, 40]
    bins = balance(lengths, 3)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(lengths)  # the greedy bound
    assert max(loads) - min(loads) <= 20  # and close in practice: 410 tokens -> 140 / 135 / 135
    assert balance(lengths, 1) == [list(range(len(lengths)))]


def test_packed_boundaries():
    seqs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    masks = [[0, 1, 1], [0, 1], [0, 0, 1, 1]]
    mb = build_packed([0, 1, 2], seqs, masks, pad_id=0, device=torch.device("cpu"), multiple=4)
    assert mb.total_len == 12  # 9 tokens padded to a multiple of 4
    assert mb.input_ids[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 0, 0]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]  # restart per sequence
    # the label of a sequence's last token is not the next sequence's first token
    assert mb.labels.tolist() == [6, 7, 0, 9, 0, 11, 12, 13, 0, 0, 0, 0]
    assert mb.loss_positions.tolist() == [True, True, False, True, False, False, True, True, False, False, False,
                                          False]
    # attention runs per segment: each sequence, then the end padding as a segment of its own
    assert mb.segments == [3, 2, 4, 3]
    rows = mb.rows(torch.arange(12, dtype=torch.float32))
    assert rows.tolist() == [[0, 1, 0], [3, 0, 0], [5, 6, 7]]  # entry t of sample i sits at its offset + t
    assert mb.action_mask.tolist() == [[1, 1, 0], [1, 0, 0], [0, 1, 1]]


def test_sequence_parallel_chunks_cover_the_row():
    seqs, masks = ragged(4)
    chunks = [build_packed([0, 1, 2, 3], seqs, masks, 0, torch.device("cpu"), sp_rank=r, sp_size=2, multiple=2)
              for r in range(2)]
    whole = build_packed([0, 1, 2, 3], seqs, masks, 0, torch.device("cpu"))
    assert torch.equal(torch.cat([c.input_ids for c in chunks], 1)[:, : whole.total_len], whole.input_ids)
    assert torch.equal(torch.cat([c.labels for c in chunks])[: whole.total_len], whole.labels)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(STUB_MODEL, dtype=torch.float32)
    install_packed_attention(m)
    return m


@pytest.fixture(scope="module")
def plain_model():
    return AutoModelForCausalLM.from_pretrained(STUB_MODEL, dtype=torch.float32)


def _unpacked_logprobs(model, seq: list[int]) -> torch.Tensor:  # the stock attention, one sequence
    logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)


def _packed_logprobs(model, mb) -> torch.Tensor:
    logits = model(**mb.model_inputs(), use_cache=False).logits[0].double()
    flat = torch.log_softmax(logits, -1).gather(-1, mb.labels[:, None]).squeeze(-1)
    return mb.rows(flat)


def test_packed_forward_gives_the_unpacked_logprobs_and_gradients(model, plain_model):
    seqs, masks = ragged()
    mb = build_packed(list(range(len(seqs))), seqs, masks, 0, torch.device("cpu"), multiple=8)
    packed = _packed_logprobs(model, mb)
    loss_packed = (packed * mb.action_mask).sum()
    loss_packed.backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss_ref = 0.0
    for row, (seq, mask) in enumerate(zip(seqs, masks)):
        ref = _unpacked_logprobs(plain_model, seq)
        torch.testing.assert_close(packed[row, : len(seq) - 1], ref, rtol=0, atol=1e-5)
        loss_ref = loss_ref + (ref * torch.tensor(mask[1:], dtype=torch.float64)).sum()
    loss_ref.backward()
    for n, p in plain_model.named_parameters():  # float32 sums in another order: ~1e-7 of each tensor's scale
        torch.testing.assert_close(g_packed[n], p.grad, rtol=0, atol=1e-5 * float(p.grad.abs().max()), msg=n)
    plain_model.zero_grad()


def test_no_attention_across_sequences(model):
    """Changing one sequence leaves the log-probs of its pack neighbours bit-for-bit unchanged."""
    seqs, masks = ragged(5)
    with torch.no_grad():
        before = _packed_logprobs(model, build_packed([0, 1, 2, 3, 4], seqs, masks, 0, torch.device("cpu")))
        seqs[2] = [t + 1 for t in seqs[2]]
        after = _packed_logprobs(model, build_packed([0, 1, 2, 3, 4], seqs, masks, 0, torch.device("cpu")))
    for row in (0, 1, 3, 4):
        assert torch.equal(before[row], after[row]), row
    assert not torch.equal(before[2], after[2])


def test_actor_packed_update_matches_an_unpacked_reference(tmp_path):
    """The actor (several packs, FSDP2, 1 process) against a plain per-sequence float64 reference:
    log-probs on action tokens and the gradient of the policy loss."""
    out = tmp_path / "packing.pt"
    cmd = ranks_cmd(1, str(ROOT / "tests" / "dist_checks.py"), "packing", "--out", str(out))
    proc = run_torchrun(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = torch.load(out)
    assert result["packs"] >= 3  # the budget really split the batch
    assert result["logp_err"] < 1e-5
    for name, (got, ref) in result["grads"].items():
        scale = float(ref.abs().max())
        assert scale > 0
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * scale, msg=name)


def grouped(seed: int = 3):
    """Three groups sharing a prompt each; in group 0 one reply repeats another's first tokens and
    one sample is an exact copy; multi-turn style masks (a tool reply inside a response)."""
    g = torch.Generator().manual_seed(seed)
    ids, masks, groups = [], [], []
    for grp in range(3):
        prompt = torch.randint(3, 500, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g)
        for k in range(4):
            reply = torch.randint(3, 500, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
            if grp == 0 and k == 1:
                reply = torch.cat([ids[0][len(prompt):len(prompt) + 2], reply])
            mask = torch.cat([torch.zeros(len(prompt) - 1), torch.ones(len(reply))])
            if len(reply) > 6:
                mask[len(prompt) + 2:len(prompt) + 4] = 0
            ids.append(torch.cat([prompt, reply]))
            masks.append(mask)
            groups.append(grp)
    ids.append(ids[0].clone())
    masks.append(masks[0].clone())
    groups.append(0)
    return ids, masks, groups


@pytest.mark.parametrize("budget", [10_000, 40])
def test_a_shared_prompt_gives_the_unshared_logprobs_and_gradients(model, budget):
    """actor.share_prompt's packing: each group's common prefix once, every response attending to it
    with positions continuing from it; the same log-probs (every entry) and gradients as unshared."""
    from train.parallel.packing import prompt_units, unit_length

    ids, masks, groups = grouped()
    units = prompt_units(list(range(len(ids))), ids, groups, budget)
    assert sorted(i for u in units for i in u.members) == list(range(len(ids)))
    for u in units:
        assert unit_length([len(ids[i]) for i in u.members], u.shared) <= budget or len(u.members) == 1
    order = [i for u in units for i in u.members]
    shared = build_packed_tensors(order, ids, masks, 0, torch.device("cpu"), multiple=8, units=units)
    plain = build_packed_tensors(order, ids, masks, 0, torch.device("cpu"), multiple=8)
    assert shared.index == plain.index and shared.represented == plain.laid_out == sum(len(s) for s in ids)
    assert shared.laid_out < 0.75 * shared.represented  # prompts really laid out once
    if budget > 1000:  # one unit per group: the prompt of group 1 appears once, its responses' positions follow it
        first = next(u for u in units if 4 in u.members)
        start = sum(unit_length([len(ids[i]) for i in u.members], u.shared) for u in units[:units.index(first)])
        row = shared.input_ids[0].tolist()
        assert row[start:start + first.shared] == ids[4][:first.shared].tolist()
        assert shared.position_ids[0, start + first.shared].item() == first.shared  # continues the prompt
    weights = torch.randn(plain.action_mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(mb):
        model.zero_grad()
        logp = _packed_logprobs(model, mb)
        (logp * mb.action_mask * weights).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (a, grads_a), (b, grads_b) = run(shared), run(plain)
    model.zero_grad()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for name, g in grads_b.items():
        torch.testing.assert_close(grads_a[name], g, rtol=0, atol=1e-5 * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("family,path", [("gemma3", "math"), ("gemma3", "sdpa"), ("gemma3", "shared"),
                                         ("mistral", "math")])
def test_sliding_window_attention_is_the_stock_one_when_packed(tmp_path, monkeypatch, family, path):
    """Gemma 3's local layers and Mistral attend only to the last `sliding_window` keys: packed attention keeps the
    window (sequences up to 3x longer than it), on CPU's matmul path, SDPA's, and with shared prompts, giving the
    log-probs of the stock attention run on each sequence alone."""
    from model_families import FAMILIES, build
    from train.parallel import seq_parallel
    from train.parallel.packing import prompt_units

    model_type, overrides, _ = FAMILIES[family]
    FAMILIES_WINDOW = {**FAMILIES, family: (model_type, {**overrides, "sliding_window": 8}, "")}
    monkeypatch.setattr("model_families.FAMILIES", FAMILIES_WINDOW)
    folder = build(family, tmp_path / family)
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    packed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    install_packed_attention(packed)
    if path == "sdpa":
        monkeypatch.setattr(seq_parallel, "MATH_ATTENTION_MAX_LEN", 0)
    g = torch.Generator().manual_seed(3)
    if path == "shared":  # two groups of three responses after a 12-token prompt
        ids, masks, groups = [], [], []
        for group in range(2):
            prompt = torch.randint(3, 500, (12,), generator=g).tolist()
            for _ in range(3):
                reply = torch.randint(3, 500, (int(torch.randint(5, 14, (1,), generator=g)),), generator=g).tolist()
                ids.append(prompt + reply)
                masks.append([0] * 12 + [1] * len(reply))
                groups.append(group)
        tensors = [torch.tensor(s) for s in ids]
        units = prompt_units(list(range(len(ids))), tensors, groups, 10_000)
        order = [i for u in units for i in u.members]
        mb = build_packed_tensors(order, tensors, [torch.tensor(m[1:], dtype=torch.float32) for m in masks], 0,
                                  torch.device("cpu"), multiple=8, units=units)
        assert mb.laid_out < mb.represented  # the prompts really are shared
    else:
        ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (24, 9, 17, 6)]
        masks = [[0] * 3 + [1] * (len(s) - 3) for s in ids]
        mb = build_packed(list(range(len(ids))), ids, masks, 0, torch.device("cpu"), multiple=8)
    with torch.no_grad():
        got = _packed_logprobs(packed, mb)
        for row, i in enumerate(mb.index):
            ref = _unpacked_logprobs(plain, ids[i])
            torch.testing.assert_close(got[row, : len(ids[i]) - 1], ref, rtol=0, atol=1e-5)
        # and the window matters: packed attention told no window differs on the longest sequence
        packed.config.sliding_window = None  # Mistral reads it from the config at each call, Gemma from the layer
        for layer in packed.model.layers:
            layer.self_attn.sliding_window = None
        unwindowed = _packed_logprobs(packed, mb)
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        row = mb.index.index(longest)
        assert not torch.allclose(got[row], unwindowed[row], atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_segments_read_each_key_value_head_as_it_is(dtype):
    """Past the CPU's matmul length, packed attention in fp32 hands SDPA the key/value heads as they are
    (enable_gqa, as on a GPU in bf16): the output equals the one with a copy of each key/value head per query
    head, bit for bit, and against a float64 attention computed segment by segment the gradients of q, k and v
    are at the same rounding as with the copies (within twice their error: the kernel sums a key/value head's
    gradient over its query heads in its own order). In bf16 the CPU's grouped backward rounds those gradients
    about twice as much (measured: 1.5% of the largest entry against 0.7%), so there the copies stay: the same
    gradients bit for bit."""
    from train.parallel.packing import segment_slots
    from train.parallel.seq_parallel import MATH_ATTENTION_MAX_LEN, _segment_attention

    lengths = [MATH_ATTENTION_MAX_LEN + 40, 70, MATH_ATTENTION_MAX_LEN + 5]  # the longest takes SDPA's path
    g = torch.Generator().manual_seed(0)
    total, heads, kv, dim = sum(lengths), 14, 2, 16
    rep = heads // kv
    q, k, v = (torch.randn(1, n, total, dim, generator=g).to(dtype) for n in (heads, kv, kv))
    segments = segment_slots(lengths, torch.device("cpu"))
    up = torch.randn(1, heads, total, dim, generator=g)

    def run(grouped: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        a, b, c = leaves
        if not grouped:  # copies made here: the path taken then has nothing to group
            b, c = b.repeat_interleave(rep, 1), c.repeat_interleave(rep, 1)
        out = _segment_attention(a, b, c, segments, None, 0.0)
        (out.float() * up).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    def reference():  # each segment alone, causal, float64
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        outs, start = [], 0
        for n in lengths:
            qs, ks, vs = (t[0, :, start:start + n] for t in leaves)
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            scores = ((qs @ ks.transpose(-1, -2)) / dim ** 0.5).masked_fill(
                torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            outs.append(torch.softmax(scores, -1) @ vs)
            start += n
        out = torch.cat(outs, dim=1)[None]
        (out * up.double()).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    (out, grads), (copied, copied_grads), (exact, exact_grads) = run(True), run(False), reference()
    assert torch.equal(out, copied)
    if dtype == torch.bfloat16:
        assert all(torch.equal(a, b) for a, b in zip(grads, copied_grads))
    for got, before, ref in zip([out, *grads], [copied, *copied_grads], [exact, *exact_grads]):
        err, err_before = ((t.double() - ref).abs().max().item() for t in (got, before))
        assert err <= 2 * err_before + 1e-12 and err <= 0.02 * ref.abs().max().item(), (err, err_before)
    assert not torch.equal(grads[1], copied_grads[1]) or dtype == torch.bfloat16  # fp32: the grouped kernel ran
