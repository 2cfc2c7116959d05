"""Tests of the `hf` rollout engine on tiny random Llama models (no downloads, a few seconds)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from train.engines import make_engine
from train.engines.base import Generation, SamplingParams
from train.engines.hf import HFEngine

VOCAB = 100


def tiny_model(seed: int = 0, max_positions: int = 128, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config).eval()
    # Random init is nearly uniform; sharper logits make greedy ties and "always length" unlikely.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


class WordTokenizer:
    """Each id decodes to a short word, so a stop string may span several tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"w{i} " for i in ids)


def prompts(lengths: tuple[int, ...] = (3, 11, 6, 1), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run_all(engine: HFEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
    async def main() -> list[Generation]:
        return await asyncio.gather(*(engine.generate(p, sp) for p, sp in requests))

    return asyncio.run(main())


def reference_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forward passes, no cache, no batching."""
    ids = list(prompt)
    out, lps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            tok = int(logits.argmax())
            out.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return out, lps


def trainer_logprobs(model: LlamaForCausalLM, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """What the trainer computes: log_softmax(model(full_sequence).logits / T) at response positions."""
    full = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=full).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pos, torch.tensor(response)]


def test_logprobs_match_full_forward_batched_ragged() -> None:
    model = tiny_model()
    engine = HFEngine(model, eos_token_ids=[], seed=3)
    ps = prompts((2, 13, 7, 1, 9))
    for temperature, top_p, top_k in [(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 20)]:
        sp = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k)
        gens = run_all(engine, [(p, sp) for p in ps])
        for p, g in zip(ps, gens):
            assert len(g.token_ids) == len(g.logprobs) == 12
            ref = trainer_logprobs(model, p, g.token_ids, temperature)
            assert (ref - torch.tensor(g.logprobs)).abs().max().item() < 1e-4


def test_greedy_matches_reference_loop_and_batch_invariance() -> None:
    model = tiny_model()
    engine = HFEngine(model, eos_token_ids=[])
    ps = prompts((5, 1, 12, 8))
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    batched = run_all(engine, [(p, sp) for p in ps])
    for p, g in zip(ps, batched):
        ref_tokens, ref_lps = reference_greedy(model, p, 10)
        assert g.token_ids == ref_tokens
        assert g.finish_reason == "length"
        # greedy log-probs are taken at temperature 1
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref_lps)) < 1e-4
        alone = run_all(engine, [(p, sp)])[0]
        assert alone.token_ids == g.token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, g.logprobs)) < 1e-4


def test_eos_stops_and_is_included() -> None:
    model = tiny_model()
    prompt = prompts((6,))[0]
    ref, _ = reference_greedy(model, prompt, 8)
    eos = ref[3]
    cut = ref.index(eos) + 1
    engine = HFEngine(model, eos_token_ids=[eos])
    other = prompts((4,), seed=7)[0]  # a batch mate that keeps going
    g = run_all(engine, [(prompt, SamplingParams(max_new_tokens=8, temperature=0.0)),
                         (other, SamplingParams(max_new_tokens=8, temperature=0.0))])[0]
    assert g.finish_reason == "stop"
    assert g.token_ids == ref[:cut] and g.token_ids[-1] == eos
    assert len(g.logprobs) == cut


def test_max_new_tokens_gives_length() -> None:
    engine = HFEngine(tiny_model(), eos_token_ids=[])
    ps = prompts((3, 9))
    gens = run_all(engine, [(ps[0], SamplingParams(max_new_tokens=5, seed=1)),
                            (ps[1], SamplingParams(max_new_tokens=1, seed=2))])
    assert [len(g.token_ids) for g in gens] == [5, 1]
    assert all(g.finish_reason == "length" for g in gens)
    assert engine.stats["generated_tokens"] == 6


def test_max_position_embeddings_gives_length() -> None:
    engine = HFEngine(tiny_model(max_positions=16), eos_token_ids=[])
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    near, full = prompts((12, 16))
    g_near, g_full = run_all(engine, [(near, sp), (full, sp)])
    assert len(g_near.token_ids) == 4 and g_near.finish_reason == "length"
    assert g_full.token_ids == [] and g_full.finish_reason == "length"


def test_stop_strings() -> None:
    model = tiny_model()
    tok = WordTokenizer()
    prompt = prompts((5,))[0]
    ref, _ = reference_greedy(model, prompt, 12)
    # A stop string spanning the end of token 4 and the start of token 5 (0-based).
    stop = tok.decode(ref[4:6])[-5:-1]
    cut = next(k for k in range(1, 13) if stop in tok.decode(ref[:k]))
    engine = HFEngine(model, tok, eos_token_ids=[])
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, stop=("never-there", stop))
    g = run_all(engine, [(prompt, sp), (prompts((3,), seed=5)[0], replace(sp, stop=()))])[0]
    assert g.finish_reason == "stop"
    assert g.token_ids == ref[:cut]
    assert stop in tok.decode(g.token_ids) and stop not in tok.decode(g.token_ids[:-1])


def test_stop_strings_need_tokenizer() -> None:
    engine = HFEngine(tiny_model(), eos_token_ids=[])
    with pytest.raises(ValueError, match="tokenizer"):
        run_all(engine, [([1, 2], SamplingParams(stop=("x",)))])


def test_seed_independent_of_batch() -> None:
    engine = HFEngine(tiny_model(), eos_token_ids=[])
    target = prompts((7,))[0]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = run_all(engine, [(target, sp)])[0]
    others = [(p, SamplingParams(max_new_tokens=n, temperature=1.0, seed=s))
              for p, n, s in zip(prompts((2, 15, 4), seed=9), (3, 20, 8), (None, 5, None))]
    batched = run_all(engine, others[:2] + [(target, sp)] + others[2:])[2]
    assert batched.token_ids == alone.token_ids
    assert max(abs(a - b) for a, b in zip(batched.logprobs, alone.logprobs)) < 1e-4
    # a fresh engine (other engine-level seed) gives the same seeded sample
    fresh = HFEngine(tiny_model(), eos_token_ids=[], seed=99)
    assert run_all(fresh, [(target, sp)])[0].token_ids == alone.token_ids
    different = run_all(engine, [(target, replace(sp, seed=4321))])[0]
    assert different.token_ids != alone.token_ids


def test_a_seeded_row_does_not_depend_on_other_rows_filtering() -> None:
    """A seeded row without top-p/top-k/min-p samples the same tokens alone and next to rows that
    filter (top-p, top-k, min-p): the filtered rows' truncation must not change its sampling."""
    engine = HFEngine(tiny_model(), eos_token_ids=[])
    target = prompts((6,))[0]
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=77)
    alone = run_all(engine, [(target, sp)])[0]
    for other in (SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.5),
                  SamplingParams(max_new_tokens=30, temperature=1.0, top_k=3),
                  SamplingParams(max_new_tokens=30, temperature=1.0, min_p=0.2)):
        batched = run_all(engine, [(prompts((9,), seed=4)[0], other), (target, sp)])[1]
        assert batched.token_ids == alone.token_ids, other
        assert max(abs(a - b) for a, b in zip(batched.logprobs, alone.logprobs)) < 1e-5


def test_concurrent_requests_are_batched() -> None:
    engine = HFEngine(tiny_model(), eos_token_ids=[], max_batch_size=3)
    ps = prompts((3, 4, 5, 6, 7, 8, 9))
    sp = SamplingParams(max_new_tokens=2, temperature=0.0)
    gens = run_all(engine, [(p, sp) for p in ps])
    assert len(gens) == 7
    assert engine.stats["batches"] == 3  # 3 + 3 + 1, never one forward per request
    assert engine.stats["max_batch_rows"] == 3
    assert [g.extra["batch_size"] for g in gens] == [3, 3, 3, 3, 3, 3, 1]


def test_requests_arriving_mid_batch_go_to_next_batch() -> None:
    engine = HFEngine(tiny_model(), eos_token_ids=[])
    sp = SamplingParams(max_new_tokens=30, temperature=0.0)

    async def late(p: list[int]) -> Generation:
        await asyncio.sleep(0.01)  # the first batch is already running by now
        return await engine.generate(p, sp)

    async def main() -> list[Generation]:
        first = [engine.generate(p, sp) for p in prompts((3, 4))]
        second = [late(p) for p in prompts((5, 6, 7), seed=3)]
        return await asyncio.gather(*first, *second)

    gens = asyncio.run(main())
    assert engine.stats["batches"] == 2
    assert [g.extra["batch_size"] for g in gens] == [2, 2, 3, 3, 3]


def test_finished_rows_are_dropped_from_the_batch() -> None:
    engine = HFEngine(tiny_model(), eos_token_ids=[])
    ps = prompts((4, 6))
    run_all(engine, [(ps[0], SamplingParams(max_new_tokens=2, temperature=0.0)),
                     (ps[1], SamplingParams(max_new_tokens=10, temperature=0.0))])
    # prefill: 2 rows; first decode: 2 rows; the 8 further decodes run the long row alone.
    assert engine.stats["forward_passes"] == 10
    assert engine.stats["forward_rows"] == 2 + 2 + 8


def test_update_weights_changes_output() -> None:
    model_a, model_b = tiny_model(seed=0), tiny_model(seed=1)
    engine = HFEngine(model_a, eos_token_ids=[])
    p = prompts((6,))[0]
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    before = run_all(engine, [(p, sp)])[0].token_ids
    ref_b, _ = reference_greedy(model_b, p, 10)
    assert before != ref_b
    engine.update_weights(model_b.state_dict().items())
    assert run_all(engine, [(p, sp)])[0].token_ids == ref_b
    # the engine owns a copy: the caller's model is untouched
    assert reference_greedy(model_a, p, 10)[0] == before


def test_update_weights_tied_embeddings() -> None:
    model_a, model_b = tiny_model(seed=0, tie=True), tiny_model(seed=1, tie=True)
    engine = HFEngine(model_a, eos_token_ids=[])
    # named_parameters() lists tied weights once; that is enough
    engine.update_weights(dict(model_b.named_parameters()))
    assert torch.equal(engine.model.lm_head.weight, model_b.lm_head.weight)
    p = prompts((6,))[0]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert run_all(engine, [(p, sp)])[0].token_ids == reference_greedy(model_b, p, 8)[0]


def test_update_weights_unknown_name_or_bad_shape_raises() -> None:
    engine = HFEngine(tiny_model(), eos_token_ids=[])
    with pytest.raises(KeyError, match="no_such.weight"):
        engine.update_weights([("no_such.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_update_weights_waits_for_running_batch() -> None:
    model_a, model_b = tiny_model(seed=0), tiny_model(seed=1)
    engine = HFEngine(model_a, eos_token_ids=[])
    p = prompts((6,))[0]
    sp = SamplingParams(max_new_tokens=40, temperature=0.0)

    async def main() -> Generation:
        task = asyncio.ensure_future(engine.generate(p, sp))
        while engine.stats["forward_passes"] == 0:  # the batch is running in the worker thread
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.update_weights, model_b.state_dict())
        return await task

    g = asyncio.run(main())
    assert g.token_ids == reference_greedy(model_a, p, 40)[0]  # no mid-sequence weight swap


def test_sleep_wake_and_factory() -> None:
    engine = make_engine("hf", tiny_model(), eos_token_ids=[])
    assert isinstance(engine, HFEngine)
    p = prompts((4,))[0]
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)
    before = run_all(engine, [(p, sp)])[0].token_ids
    engine.sleep()
    engine.wake()
    assert run_all(engine, [(p, sp)])[0].token_ids == before
    assert engine.stats["generation_seconds"] > 0
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_engine("vllm")


def test_from_pretrained(tmp_path) -> None:
    model = tiny_model()
    model.generation_config.eos_token_id = [7, 9]
    model.save_pretrained(tmp_path)
    engine = HFEngine.from_pretrained(str(tmp_path), tokenizer=WordTokenizer())
    assert engine.eos_token_ids == frozenset({7, 9})
    p = prompts((4,))[0]
    g = run_all(engine, [(p, SamplingParams(max_new_tokens=6, temperature=0.0))])[0]
    ref, _ = reference_greedy(model, p, 6)
    stops = [k for k, t in enumerate(ref) if t in (7, 9)]
    assert g.token_ids == (ref[: stops[0] + 1] if stops else ref)


def test_sampler_distribution_top_k_top_p() -> None:
    from train.engines.sampling import sample_tokens

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    rows = logits.expand(n, -1)
    u = 1.0 - torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def freqs(temperature: float, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tok, lp = sample_tokens(rows, torch.full((n,), temperature), torch.full((n,), top_p),
                                torch.full((n,), top_k, dtype=torch.long), u)
        # the log-prob is always the unfiltered one at that temperature
        full = torch.log_softmax(logits[0] / temperature, -1)
        assert torch.allclose(lp, full[tok])
        return torch.bincount(tok, minlength=6).float() / n, full.exp()

    got, p = freqs(1.0, 1.0, -1)
    assert (got - p).abs().max() < 0.015
    got, p = freqs(0.5, 1.0, 2)  # only the two best tokens, renormalised for sampling
    assert got[2:].sum() == 0 and (got[:2] - p[:2] / p[:2].sum()).abs().max() < 0.015
    got, p = freqs(1.0, 0.8, -1)  # smallest prefix with mass >= 0.8: tokens 0, 1, 2
    assert p[:2].sum() < 0.8 <= p[:3].sum()
    assert got[3:].sum() == 0 and (got[:3] - p[:3] / p[:3].sum()).abs().max() < 0.015
    tok, lp = sample_tokens(logits, torch.zeros(1), torch.ones(1), torch.full((1,), -1), torch.ones(1))
    assert tok.item() == 0 and torch.isclose(lp, torch.log_softmax(logits[0], -1)[0])


def test_rows_at_temperature_zero_or_one_skip_the_division_with_the_same_tokens_and_log_probs() -> None:
    """The engine passes unit_temperature when every row's temperature is 0 or 1 (most RL): the pass that
    divides by the temperature is skipped, and nothing may change, bit for bit."""
    from train.engines.sampling import sample_tokens

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 1000, generator=g) * 4
    temperature = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    top_p, top_k = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 0.5, 1.0]), torch.full((8,), -1)
    u = 1.0 - torch.rand(8, generator=g, dtype=torch.float64)
    divided = sample_tokens(logits, temperature, top_p, top_k, u)
    skipped = sample_tokens(logits, temperature, top_p, top_k, u, unit_temperature=True)
    assert torch.equal(divided[0], skipped[0]) and torch.equal(divided[1], skipped[1])


# 300: one running sum over the vocabulary; 3000: inverse_cdf's two levels (3 blocks of 1000)
@pytest.mark.parametrize("vocab", [300, 3000])
def test_only_the_rows_that_ask_for_top_p_or_top_k_are_filtered_as_a_float64_reference_samples(vocab) -> None:
    """The engine passes the index of the rows with top-p/top-k (`filtered`), and only those are sorted. Each
    row's token is the one a float64 inverse CDF of its own (truncated, renormalised) distribution gives,
    whether the index is passed, left for the sampler to find, or the row is sampled alone."""
    from train.engines.sampling import sample_tokens

    g = torch.Generator().manual_seed(5)
    n = 12
    logits = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.tensor([1.0, 0.7, 1.0, 0.0, 1.3, 1.0, 1.0, 0.9, 1.0, 1.0, 0.0, 1.0])
    top_p = torch.tensor([1.0, 0.8, 1.0, 0.5, 1.0, 0.6, 1.0, 1.0, 0.95, 1.0, 1.0, 1.0])
    top_k = torch.tensor([-1, -1, 5, -1, 40, -1, -1, vocab, -1, 1, -1, 0])
    u = 1.0 - torch.rand(n, generator=g, dtype=torch.float64)
    asks = [i for i in range(n) if top_p[i] < 1 or 0 < top_k[i] < vocab]
    assert asks == [1, 2, 3, 4, 5, 8, 9]

    def reference(i: int) -> int:
        if temperature[i] <= 0:
            return int(logits[i].argmax())
        p = torch.softmax(logits[i].double() / float(temperature[i]), -1)
        order = p.argsort(descending=True)
        ranked = p[order]
        keep = (ranked.cumsum(0) - ranked < float(top_p[i])) | (float(top_p[i]) >= 1)
        if 0 < int(top_k[i]) < vocab:
            keep &= torch.arange(vocab) < int(top_k[i])
        keep[0] = True
        kept = torch.zeros(vocab, dtype=torch.float64)
        kept[order] = ranked * keep
        cdf = kept.cumsum(0)
        return int(torch.searchsorted(cdf, float(u[i]) * cdf[-1:]).clamp(max=vocab - 1))

    want = [reference(i) for i in range(n)]
    passed = sample_tokens(logits, temperature, top_p, top_k, u, filtered=torch.tensor(asks))
    found = sample_tokens(logits, temperature, top_p, top_k, u)
    alone = [sample_tokens(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], top_k[i:i + 1], u[i:i + 1])
             for i in range(n)]
    assert passed[0].tolist() == want
    assert torch.equal(passed[0], found[0]) and torch.equal(passed[1], found[1])
    assert [int(t) for t, _ in alone] == want
    # none asks: no row is sorted, and the tokens are those of plain inverse-CDF sampling
    off_p, off_k = torch.ones(n), torch.full((n,), -1)
    plain = sample_tokens(logits, temperature, off_p, off_k, u, filtered=torch.tensor([], dtype=torch.long))
    assert torch.equal(plain[0], sample_tokens(logits, temperature, off_p, off_k, u)[0])


def test_the_two_level_inverse_cdf_picks_the_float64_reference_token_and_never_a_zero_probability_one() -> None:
    """inverse_cdf over a vocabulary of 151,936 (Qwen's: 1,187 blocks of 128) and of a prime size (one running
    sum): per row, the first token whose float64 cumulative probability reaches u x total; rows with most
    tokens at probability 0 (as after top-k) and u at the ends of (0, 1] never get a zero-probability token."""
    from train.engines.sampling import inverse_cdf

    g = torch.Generator().manual_seed(11)
    for vocab in (151936, 1009):
        rows = 24
        probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, -1)
        sparse = torch.rand(rows, vocab, generator=g) < 0.98  # rows 12-23 keep ~2% of their tokens
        sparse[:12] = False
        probs = torch.where(sparse, torch.zeros(()), probs)
        u = 1.0 - torch.rand(rows, generator=g, dtype=torch.float64)
        u[0], u[12], u[1], u[13] = 1.0, 1.0, 1e-9, 1e-9
        got = inverse_cdf(probs, u)
        cdf = probs.double().cumsum(-1)
        want = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:]).squeeze(1)
        assert (probs[torch.arange(rows), got] > 0).all()
        # float32 sums in another order than the float64 reference: a token may move only where the target
        # lies within rounding of a boundary, which these rows do not come near
        assert got.tolist() == want.tolist(), vocab


# ---------------------------------------------------------------------------------------- the full sampling set


def test_min_p_keeps_tokens_above_a_fraction_of_the_best() -> None:
    from train.engines.sampling import sample_tokens

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], dtype=torch.float64)
    n = 20000
    u = 1.0 - torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tok, lp = sample_tokens(logits.float().expand(n, -1), torch.ones(n), torch.ones(n), torch.full((n,), -1),
                            u, min_p=torch.full((n,), 0.3))
    p = torch.softmax(logits[0], -1)
    kept = p >= 0.3 * p.max()  # float64 reference: tokens 0 and 1 (e^-1 = 0.37 > 0.3, e^-1.5 = 0.22 < 0.3)
    assert kept.tolist() == [True, True, False, False, False, False]
    got = torch.bincount(tok, minlength=6).double() / n
    assert got[~kept].sum() == 0 and (got[kept] - p[kept] / p[kept].sum()).abs().max() < 0.015
    assert torch.allclose(lp.double(), torch.log_softmax(logits[0], -1)[tok], atol=1e-6)  # not renormalised


def reference_penalised(logits: torch.Tensor, prompt: list[int], response: list[int], rep: float, presence: float,
                        frequency: float) -> torch.Tensor:
    """vLLM / SGLang semantics in float64, one token at a time: repetition over prompt + response,
    presence and frequency over the response."""
    out = logits.double().clone()
    for t in set(prompt) | set(response):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(response):
        out[t] -= presence + frequency * response.count(t)
    return out


def test_penalties_against_a_float64_reference() -> None:
    from train.engines.sampling import Penalties

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, VOCAB, generator=g) * 3
    prompts_ = [[1, 2, 3, 3], [50]]
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25),
              SamplingParams(frequency_penalty=-0.5)]
    pen = Penalties(prompts_, params, VOCAB, torch.device("cpu"))
    responses: list[list[int]] = [[], []]
    for step_tokens in ([3, 7], [7, 50], [9, 50]):
        got = pen.apply(logits)
        for row in range(2):
            sp = params[row]
            ref = reference_penalised(logits[row], prompts_[row], responses[row], sp.repetition_penalty,
                                      sp.presence_penalty, sp.frequency_penalty)
            assert torch.allclose(got[row].double(), ref, atol=1e-5)
        pen.record(torch.tensor(step_tokens))
        for row, t in enumerate(step_tokens):
            responses[row].append(t)
    pen.select(torch.tensor([1]))  # row 0 finished
    ref = reference_penalised(logits[1], prompts_[1], responses[1], 1.0, 0.0, -0.5)
    assert torch.allclose(pen.apply(logits[1:])[0].double(), ref, atol=1e-5)


def test_engine_stop_token_ids_ignore_eos_and_repetition_penalty() -> None:
    model = tiny_model(5)
    engine = HFEngine(model, eos_token_ids=[], max_batch_size=8)
    prompt = prompts((5,))[0]
    [free] = run_all(engine, [(prompt, SamplingParams(max_new_tokens=20, temperature=0.0))])
    # stop_token_ids: the first occurrence ends the response, included, finish reason "stop"
    stop = free.token_ids[3]
    [g] = run_all(engine, [(prompt, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop,)))])
    assert g.token_ids == free.token_ids[: free.token_ids.index(stop) + 1] and g.finish_reason == "stop"
    # ignore_eos: an EOS id is generated and passed over; stop_token_ids still end it
    eos_engine = HFEngine(model, eos_token_ids=[stop], max_batch_size=8)
    [g] = run_all(eos_engine, [(prompt, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))])
    assert g.token_ids == free.token_ids and g.finish_reason == "length"
    # a huge repetition penalty: greedy never picks a token of the prompt or of its own response
    [g] = run_all(engine, [(prompt, SamplingParams(max_new_tokens=20, temperature=0.0, repetition_penalty=1e6))])
    assert len(set(g.token_ids)) == 20 and not set(g.token_ids) & set(prompt)


def test_penalised_logprobs_are_those_of_the_sampling_distribution() -> None:
    """With penalties the engine samples from (and reports log-probs of) the penalised distribution:
    a float64 reference from full forward passes, no cache, no batching, gives the same numbers."""
    model = tiny_model(6)
    engine = HFEngine(model, eos_token_ids=[], max_batch_size=8)
    prompt = prompts((4,))[0]
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, repetition_penalty=1.5, presence_penalty=0.3,
                        frequency_penalty=0.2, seed=11)
    [g] = run_all(engine, [(prompt, sp), (prompts((7,), seed=2)[0], replace(sp, seed=12))])[:1]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0].double()
    for k, t in enumerate(g.token_ids):
        ref = reference_penalised(logits[len(prompt) - 1 + k], prompt, g.token_ids[:k], 1.5, 0.3, 0.2)
        assert g.logprobs[k] == pytest.approx(float(torch.log_softmax(ref / 0.7, -1)[t]), abs=1e-4)


def test_the_hf_engine_refuses_engine_specific_keys() -> None:
    engine = HFEngine(tiny_model(), eos_token_ids=[0])
    with pytest.raises(ValueError, match="does not take regex"):
        run_all(engine, [([1, 2], SamplingParams(extra=(("regex", "[0-9]"),)))])


def test_a_groups_shared_prompt_is_prefilled_once_with_the_same_samples() -> None:
    """G requests with one prompt (a GRPO group) and others in the same batch: one prefill row per
    distinct prompt, and the same tokens and log-probs per seed as prefilling every request."""
    group, other = prompts((9, 5), seed=3)
    requests = [(group, SamplingParams(max_new_tokens=12, temperature=1.0, seed=100 + k)) for k in range(6)]
    requests.insert(3, (other, SamplingParams(max_new_tokens=7, temperature=1.0, seed=7)))
    requests.append((other, SamplingParams(max_new_tokens=9, temperature=0.0)))
    shared = HFEngine(tiny_model(), eos_token_ids=[])
    alone = HFEngine(tiny_model(), eos_token_ids=[], share_prefill=False)
    got, want = run_all(shared, requests), run_all(alone, requests)
    assert shared.stats["prefill_rows_shared"] == 6 and alone.stats["prefill_rows_shared"] == 0
    assert shared.stats["forward_rows"] < alone.stats["forward_rows"]
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert len({tuple(g.token_ids) for g in got[:3] + got[4:7]}) > 1  # the group's samples differ


@pytest.mark.parametrize("static", [False, True])
def test_a_long_prompt_is_prefilled_in_chunks_with_the_same_samples(static) -> None:
    """prefill_chunk=16: ragged left-padded prompts of 70, 33 and 9 tokens prefilled in 5 chunks of columns
    through the cache (the short rows' first chunks are all padding), then decoded on the dynamic or the
    static cache: the same seeded tokens and log-probs as one prefill pass."""
    requests = [(p, SamplingParams(max_new_tokens=10, temperature=1.0, seed=20 + k))
                for k, p in enumerate(prompts((70, 33, 9), seed=5))]
    chunked = HFEngine(tiny_model(), eos_token_ids=[], prefill_chunk=16, static_cache=static)
    whole = HFEngine(tiny_model(), eos_token_ids=[], prefill_chunk=None, static_cache=static)
    got, want = run_all(chunked, requests), run_all(whole, requests)
    assert chunked.stats["prefill_chunks"] == 5 and whole.stats["prefill_chunks"] == 0
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        HFEngine(tiny_model(), eos_token_ids=[], prefill_chunk=0)
