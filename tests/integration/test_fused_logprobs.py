"""actor.use_liger_kernel: the fused (chunked) log-prob/entropy head against the plain path.

On CPU the plain-torch fused implementation is compared with full-logits log_softmax/entropy
(values and gradients), through a Hugging Face model, and through the FSDP2 actor under torchrun.
The real liger-kernel comparison needs CUDA + triton and is skipped here with the reason."""
from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import ROOT, run_torchrun
from train.algorithms.logits import entropy_from_logits, logprobs_from_logits
from train.parallel.fused_logprobs import FusedLogprobHead, check_supported, fused_logprobs_entropy, liger_available
from train.utils.live_bytes import LiveBytes


def plain(hidden, weight, labels, temperature):
    logits = (hidden @ weight.t()).float()
    return (logprobs_from_logits(logits, labels, temperature=temperature),
            entropy_from_logits(logits / temperature))


def float64_reference(hidden, weight, labels, temperature):
    """log softmax(h W^T / T)[y] and the entropy, in float64, written out."""
    z = (hidden.double() @ weight.double().t()) / temperature
    logp = z - z.logsumexp(-1, keepdim=True)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 3), (1.3, 1000)])
def test_values_and_gradients_match_the_plain_path(temperature: float, chunk: int) -> None:
    """Against a float64 reference, the fused head's values and gradients are as close as the plain path's (float32
    on both, summed in other orders: ~1e-6 relative for the values, ~1e-5 absolute for the gradients)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g).requires_grad_()
    weight = torch.randn(50, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 50, (3, 11), generator=g)
    a, b = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    lp, ent = float64_reference(h64, w64, labels, temperature)
    want = [lp, ent, *torch.autograd.grad((a.double() * lp + b.double() * ent).sum(), (h64, w64))]
    lp0, ent0 = plain(hidden, weight, labels, temperature)
    plain_path = [lp0, ent0, *torch.autograd.grad((a * lp0 + b * ent0).sum(), (hidden, weight))]
    lp1, ent1 = fused_logprobs_entropy(hidden, weight, labels, temperature, chunk_tokens=chunk)
    fused = [lp1, ent1, *torch.autograd.grad((a * lp1 + b * ent1).sum(), (hidden, weight))]
    for name, got, other, exact in zip(("logp", "entropy", "grad hidden", "grad weight"), fused, plain_path, want):
        err, plain_err = (got.double() - exact).abs().max(), (other.double() - exact).abs().max()
        assert err <= 2 * plain_err + 1e-6 and err < 3e-5, (name, float(err), float(plain_err))
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)


def test_an_unused_entropy_adds_no_term_to_the_backward(monkeypatch) -> None:
    """The actor computes the entropy for its metric and detaches it at actor.entropy.coef 0: the head's backward
    then gets None for it (not a tensor of zeros), skips its term, and gives the gradients of a head that
    computed no entropy, bit for bit."""
    from train.parallel import fused_logprobs

    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(13, 16, generator=g).requires_grad_()
    weight = torch.randn(50, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 50, (13,), generator=g)
    seen = []
    backward = fused_logprobs._ChunkedLogprobEntropy.backward

    def recording(ctx, g_logp, g_ent):
        seen.append(g_ent)
        return backward(ctx, g_logp, g_ent)

    monkeypatch.setattr(fused_logprobs._ChunkedLogprobEntropy, "backward", staticmethod(recording))
    lp, ent = fused_logprobs_entropy(hidden, weight, labels, 0.7, chunk_tokens=4)
    got = torch.autograd.grad((lp * 2.0).sum() + 0 * ent.detach().sum(), (hidden, weight))
    assert seen == [None]
    lp, _ = fused_logprobs_entropy(hidden, weight, labels, 0.7, chunk_tokens=4, with_entropy=False)
    want = torch.autograd.grad((lp * 2.0).sum(), (hidden, weight))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("trained,bonus,temperature,hidden_size", [
    (False, False, 1.0, 64), (True, False, 0.7, 64), (True, True, 0.7, 64), (True, False, 1.0, 1024)],
    ids=["lora-head", "trained-head", "entropy-bonus", "wide-trained-head"])
def test_the_backward_holds_what_the_memory_plan_counts(trained: bool, bonus: bool, temperature: float,
                                                        hidden_size: int, monkeypatch) -> None:
    """The memory plan counts the fused head's peak (`memory_plan.head_bytes`): one chunk's logits cast to float32 and
    their gradient (6 bytes per chunk token and vocabulary entry, 8 with the entropy's term), a trained head's
    float32 gradient and the hidden states' gradient. Measured here as the bytes the head's ops hold at once from
    its forward through its backward, called as the actor calls it (the entropy always computed, detached without a
    bonus) in bf16."""
    from types import SimpleNamespace

    from train.models.memory_plan import head_bytes

    from train.parallel import fused_logprobs

    # the wide head: its gradient's [vocab, hidden] float32 sum outweighs the chunk's logits, and its product is
    # made a slice of 1024 vocabulary rows at a time (16384 for a real vocabulary)
    monkeypatch.setattr(fused_logprobs, "WEIGHT_GRAD_ROWS", 1024)
    monkeypatch.setattr("train.models.memory_plan.WEIGHT_GRAD_ROWS", 1024)
    vocab, tokens, chunk = 4096, 1024, 256
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(tokens, hidden_size, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / 8).bfloat16().requires_grad_(trained)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with LiveBytes() as held:
        lp, ent = fused_logprobs_entropy(hidden, weight, labels, temperature, chunk_tokens=chunk)
        loss = lp.sum() + (0.01 * ent.sum() if bonus else 0 * ent.detach().sum())
        loss.backward()
    planned = head_bytes(SimpleNamespace(vocab_size=vocab, hidden_size=hidden_size), tokens, fused=True,
                         trained=trained, entropy=bonus, chunk=chunk)
    assert 0.95 * planned <= held.peak <= 1.01 * planned, (held.peak / (chunk * vocab), planned / (chunk * vocab))


@pytest.mark.parametrize("bonus,temperature", [(False, 1.0), (False, 0.7), (True, 0.7)])
def test_the_plain_head_holds_what_the_memory_plan_counts(bonus: bool, temperature: float) -> None:
    """The actor's plain head (head_logprobs_entropy on the lm_head's bf16 logits) from its forward through its
    backward: at most memory_plan.head_bytes (16 bytes per token and vocabulary entry, 21 with the entropy's graph),
    and within 10% of it."""
    from types import SimpleNamespace

    from train.algorithms.logits import head_logprobs_entropy
    from train.models.memory_plan import head_bytes

    vocab, hidden_size, tokens = 4096, 64, 1024
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(tokens, hidden_size, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / 8).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with LiveBytes() as held:
        lp, ent = head_logprobs_entropy(hidden @ weight.t(), labels, temperature, entropy_grad=bonus)
        loss = lp.sum() + (0.01 * ent.sum() if bonus else 0 * ent.detach().sum())
        loss.backward()
    planned = head_bytes(SimpleNamespace(vocab_size=vocab, hidden_size=hidden_size), tokens, fused=False,
                         trained=True, entropy=bonus)
    assert 0.9 * planned <= held.peak <= planned, (held.peak / (tokens * vocab), planned / (tokens * vocab))


def test_logprob_only_and_bfloat16() -> None:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 32, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(64, 32, generator=g).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 64, (2, 9), generator=g)
    lp0, _ = plain(hidden, weight, labels, 1.0)
    gh0, gw0 = torch.autograd.grad(lp0.sum(), (hidden, weight))
    lp1, ent = fused_logprobs_entropy(hidden, weight, labels, with_entropy=False, chunk_tokens=4)
    assert ent is None
    gh1, gw1 = torch.autograd.grad(lp1.sum(), (hidden, weight))
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)  # same bf16 matmul, float32 after
    assert gh1.dtype == torch.bfloat16 and gw1.dtype == torch.bfloat16
    torch.testing.assert_close(gh1.float(), gh0.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw1.float(), gw0.float(), rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        lp2, _ = fused_logprobs_entropy(hidden, weight, labels, with_entropy=False)
    torch.testing.assert_close(lp2, lp0.detach(), rtol=0, atol=1e-5)


def tiny_llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_head_through_a_hugging_face_model(tie: bool) -> None:
    model = tiny_llama(tie)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 80, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding on one row
    labels = ids[:, 1:]
    T = 0.8

    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    lp0 = logprobs_from_logits(logits, labels, temperature=T)
    ent0 = entropy_from_logits(logits / T)
    (lp0.sum() + 0.1 * ent0.sum()).backward()
    grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    head = FusedLogprobHead(model, chunk_tokens=5)
    inputs = dict(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=torch.arange(ids.shape[1] - 1))
    lp1, ent1 = head(model, labels, T, True, **inputs)
    (lp1.sum() + 0.1 * ent1.sum()).backward()
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=2e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads0[n], rtol=1e-4, atol=1e-5, msg=n)
    assert "forward" not in model.lm_head.__dict__  # the swap is undone
    lp2, none = head(model, labels, T, False, **inputs)
    assert none is None and torch.allclose(lp2, lp1)


def test_models_that_post_process_logits_are_refused() -> None:
    model = tiny_llama(False)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_supported(model)


def test_fsdp_actor_fused_matches_plain(tmp_path) -> None:
    """Two ranks, FSDP2 over the stub model: log-probs, entropy and gradients of the update agree."""
    out = tmp_path / "liger.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           str(ROOT / "tests" / "liger_dist_check.py"), "--out", str(out)]
    proc = run_torchrun(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    res = torch.load(out)
    plain_, fused = res["plain"], res["fused"]
    assert plain_["logp"].keys() == fused["logp"].keys() and plain_["logp"]
    for i, a in plain_["logp"].items():
        torch.testing.assert_close(fused["logp"][i], a, rtol=0, atol=1e-5)
    assert fused["entropy"] == pytest.approx(plain_["entropy"], rel=1e-5)
    assert fused["loss"] == pytest.approx(plain_["loss"], rel=1e-5, abs=1e-7)
    for name, g in plain_["grads"].items():
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(fused["grads"][name], g, rtol=0, atol=1e-5 * scale, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not liger_available(),
                    reason="liger-kernel's Triton kernels need a CUDA GPU and liger-kernel installed "
                           "(pip install -r requirements-gpu.txt); not available on this machine")
def test_real_liger_kernel_matches_the_fused_torch_path() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(300, 64, generator=g).cuda().to(torch.bfloat16)
    weight = torch.randn(1000, 64, generator=g).cuda().to(torch.bfloat16)
    labels = torch.randint(0, 1000, (300,), generator=g).cuda()
    with torch.no_grad():
        ours, _ = fused_logprobs_entropy(hidden, weight, labels, 0.7, with_entropy=False, use_liger=False)
        got, _ = fused_logprobs_entropy(hidden, weight, labels, 0.7, with_entropy=False, use_liger=True)
    # Both paths round the logits to bfloat16 (liger also rounds h / T first), so each is within a few
    # bfloat16 steps of the exact value; a step is 2^-7 of the magnitude (0.25 at the logits of 32 to 64
    # seen here, so the two paths differ by up to ~0.25 on the H100). A wrong label, temperature or
    # sign is off by the logits' spread (~10 here) instead.
    z = (hidden.double() @ weight.double().t()) / 0.7
    exact = torch.log_softmax(z, dim=-1).gather(1, labels[:, None]).squeeze(1)
    step = 2.0 ** -7 * float(z.abs().max())
    for name, value in (("liger", got), ("torch", ours)):
        err = (value.double() - exact).abs()
        assert float(err.max()) <= 4 * step, f"{name}: {float(err.max())} > 4 bf16 steps ({4 * step})"
        assert float(err.mean()) <= step, f"{name}: mean error {float(err.mean())} > one bf16 step ({step})"


@pytest.mark.slow
def test_trainer_runs_with_the_fused_head(tmp_path) -> None:
    """Two ranks, two steps, KL on (the reference actor uses the head too): the sampler's log-probs
    (hf engine, plain float32 logits) and the fused trainer's agree to float rounding."""
    from conftest import read_jsonl, run_trainer

    run_trainer([f"trainer.save_dir={tmp_path}", "trainer.total_steps=2", "actor.use_liger_kernel=true",
                 "actor.kl.coef=0.01", "trainer.test_freq=null"], nproc=2)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert abs(r["actor/sampler_kl"]) < 1e-6 and r["actor/entropy"] > 0
