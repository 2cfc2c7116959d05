"""The Tinker-compatible service (train/tinker_service), driven by the official `tinker` SDK: a service started
for real on 127.0.0.1, every call through the SDK a user would make."""
from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from conftest import ROOT, running  # noqa: E402
from train.utils.services import free_port  # noqa: E402

STUB = ROOT / "stub" / "model"
KEY = "tml-local-test"


def start(tmp: Path, nproc: int = 1, *extra: str):
    port = free_port()
    serve = ["-m", "train.tinker_service", "--base-model", f"stub={STUB}", "--port", str(port),
             "--root", str(tmp / "root"), "--api-key", KEY, *extra]
    if nproc == 1:
        cmd = [sys.executable, *serve]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", *serve]
    return port, running(cmd, f"http://127.0.0.1:{port}/api/v1/healthz", tmp / "service.log")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tinker")
    port, ctx = start(tmp)
    with ctx:
        yield {"url": f"http://127.0.0.1:{port}", "root": tmp / "root"}


@pytest.fixture(scope="module")
def client(service):
    c = tinker.ServiceClient(base_url=service["url"], api_key=KEY)
    yield c
    c.close("success")  # ends its session (and the SDK's heartbeat thread) before the service stops


def adapter(service, model_id: str, name: str) -> dict[str, torch.Tensor]:
    """A model's adapter as the service saved it for sampling (root/<model id>/sampler_weights/<name>)."""
    from safetensors.torch import load_file

    return load_file(service["root"] / model_id / "sampler_weights" / name / "weights.safetensors")


def batch(tokenizer, seed: int = 0) -> list[dict]:
    """Two datums of different lengths with random sampler log-probs, advantages and weights."""
    g = np.random.default_rng(seed)
    out = []
    for text in ("the quick brown fox jumps over", "a b c d e f g h i j k l"):
        ids = tokenizer.encode(text)
        n = len(ids) - 1
        out.append({"input": ids[:-1], "target_tokens": ids[1:], "weights": g.uniform(0, 1, n).astype(np.float32),
                    "logprobs": g.uniform(-9, -5, n).astype(np.float32),
                    "advantages": g.normal(0, 1, n).astype(np.float32),
                    "sequence_ratio_mask": (np.arange(n) >= 2).astype(np.float32)})
    return out


def datums(rows: list[dict], keys: tuple[str, ...]) -> list:
    return [types.Datum(model_input=types.ModelInput.from_ints(r["input"]),
                        loss_fn_inputs={k: r[k].tolist() if hasattr(r[k], "tolist") else r[k] for k in keys})
            for r in rows]


# Tinker's documented definitions (tinker-docs.thinkingmachines.ai/tinker/losses), written here from the docs,
# apart from train/tinker_service/losses.py, in float64: each datum's loss summed over its tokens.
def reference_loss(name: str, lp: torch.Tensor, r: dict, cfg: dict) -> torch.Tensor:
    t = {k: torch.tensor(np.asarray(r[k]), dtype=torch.float64) for k in ("weights", "logprobs", "advantages",
                                                                           "sequence_ratio_mask")}
    q, a = t["logprobs"], t["advantages"]
    if name == "cross_entropy":
        return -(lp * t["weights"]).sum()
    if name == "importance_sampling":
        return -(torch.exp(lp - q) * a).sum()
    if name == "ppo":
        ratio = torch.exp(lp - q)
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        return -torch.min(ratio * a, torch.clamp(ratio, lo, hi) * a).sum()
    if name == "cispo":
        ratio = torch.exp(lp - q)
        return -(torch.clamp(ratio, 0.0, 4.0).detach() * lp * a).sum()
    if name == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    if name == "gspo":
        m = t["sequence_ratio_mask"] != 0
        log_ratio = (lp.detach() - q)[m].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        return -torch.min(ratio * a, torch.clamp(ratio, 1 - 3e-4, 1 + 4e-4) * a).sum()
    raise AssertionError(name)


def float64_model(init: dict[str, torch.Tensor]):
    """The stub with the service's initial adapter, in float64 (the reference's model)."""
    from transformers import AutoModelForCausalLM

    from train.models.lora import LoraSettings, apply_lora

    model = AutoModelForCausalLM.from_pretrained(STUB, dtype=torch.float64)
    apply_lora(model, LoraSettings(rank=4, alpha=32.0))
    missing = model.load_state_dict({k: v.double() for k, v in init.items()}, strict=False)
    assert not missing.unexpected_keys
    return model


CASES = [("cross_entropy", {}), ("importance_sampling", {}),
         ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("cispo", {}), ("dro", {"beta": 0.05}),
         ("gspo", {})]
INPUTS = {"cross_entropy": ("target_tokens", "weights"), "gspo": ("target_tokens", "logprobs", "advantages",
                                                                   "sequence_ratio_mask")}


@pytest.mark.parametrize("loss_fn,cfg", CASES, ids=[c[0] for c in CASES])
def test_builtin_loss_value_and_gradient_match_tinkers_definition_in_float64(service, client, loss_fn, cfg):
    tc = client.create_lora_training_client(base_model="stub", rank=4, seed=3).result()
    rows = batch(tc.get_tokenizer())
    keys = INPUTS.get(loss_fn, ("target_tokens", "logprobs", "advantages"))
    tc.save_weights_for_sampler("init").result()
    out = tc.forward_backward(datums(rows, keys), loss_fn, loss_fn_config=cfg or None).result()
    # One Adam step with eps = lr = 1e8 moves each weight by -g * 1e8 / (|g| + 1e8) ~= -g: the gradient itself.
    tc.optim_step(types.AdamParams(learning_rate=1e8, eps=1e8, beta1=0.9, beta2=0.95)).result()
    tc.save_weights_for_sampler("after").result()
    init, after = adapter(service, tc.model_id, "init"), adapter(service, tc.model_id, "after")

    model = float64_model(init)
    total = torch.zeros((), dtype=torch.float64)
    for i, r in enumerate(rows):
        logits = model(input_ids=torch.tensor([r["input"]])).logits[0]
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(r["target_tokens"])[:, None])[:, 0]
        np.testing.assert_allclose(out.loss_fn_outputs[i]["logprobs"].to_numpy(), lp.detach().numpy(), atol=2e-5)
        total = total + reference_loss(loss_fn, lp, r, cfg)
    total.backward()
    assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-4, abs=1e-4)
    moved = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = name
            step = (init[key] - after[key]).double()
            np.testing.assert_allclose(step.numpy(), p.grad.numpy(), rtol=2e-3, atol=2e-5 * p.grad.abs().max().item()
                                       + 1e-9, err_msg=name)
            moved += int(p.grad.abs().sum() > 0)
    assert moved > 0  # B has a gradient (A's is 0 while B = 0)


def test_sampler_logprobs_are_the_trained_models_and_seeds_reproduce(client):
    tc = client.create_lora_training_client(base_model="stub", rank=4, seed=1).result()
    tok = tc.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("one two three"))
    sampler = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    first = sampler.sample(prompt, 3, params).result().sequences
    again = sampler.sample(prompt, 3, params).result().sequences
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert len({tuple(s.tokens) for s in first}) > 1  # each sample has its own seed
    s = first[0]
    full = prompt.to_ints() + s.tokens
    d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
    trained = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.asarray(s.logprobs), trained[-len(s.tokens):], atol=1e-4)
    assert s.stop_reason == "length"
    stop_id = s.tokens[1]
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=11, stop=[stop_id])).result()
    assert stopped.sequences[0].tokens == s.tokens[:2] and stopped.sequences[0].stop_reason == "stop"
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert scored[0] is None
    np.testing.assert_allclose(scored[-len(s.tokens):], s.logprobs, atol=1e-4)


def test_save_state_and_load_state_resume_training_exactly(service, client):
    tc = client.create_lora_training_client(base_model="stub", rank=4, seed=2).result()
    rows = batch(tc.get_tokenizer(), seed=5)
    data = datums(rows, ("target_tokens", "logprobs", "advantages"))
    adam = types.AdamParams(learning_rate=1e-2)

    def step(c):
        loss = c.forward_backward(data, "importance_sampling").result().metrics["loss:sum"]
        c.optim_step(adam).result()
        return loss
    step(tc)
    path = tc.save_state("mid").result().path
    assert path == f"tinker://{tc.model_id}/weights/mid"
    losses = [step(tc), step(tc)]
    tc.save_weights_for_sampler("end").result()
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert [step(resumed), step(resumed)] == losses
    resumed.save_weights_for_sampler("end").result()
    a, b = adapter(service, tc.model_id, "end"), adapter(service, resumed.model_id, "end")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh_optimizer = client.create_training_client_from_state(path).result()
    assert step(fresh_optimizer) == losses[0]  # same weights; the step after differs (Adam restarts)
    listed = [c.tinker_path for c in client.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints]
    assert path in listed and f"tinker://{tc.model_id}/sampler_weights/end" in listed


def test_bad_requests_fail_alone_with_the_sdks_errors(service, client):
    with pytest.raises(tinker.NotFoundError, match="unknown base model 'nope'"):
        client.create_lora_training_client(base_model="nope", rank=4).result()
    tc = client.create_lora_training_client(base_model="stub", rank=4).result()
    ids = tc.get_tokenizer().encode("a b c d")
    good = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    short = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0]})
    with pytest.raises(tinker.RequestFailedError, match=r"data\[0\].loss_fn_inputs\['weights'\] has shape \[1\]"):
        tc.forward_backward([short], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="lacks 'logprobs', which loss_fn='ppo' needs"):
        tc.forward_backward([good], "ppo").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_config"):
        tc.forward_backward([good], "dro").result()
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce.*not supported"):
        tc.forward_backward([good], "stable_reinforce").result()
    context = json.loads((STUB / "config.json").read_text())["max_position_embeddings"]
    long = types.Datum(model_input=types.ModelInput.from_ints([1] * (context + 1)),
                       loss_fn_inputs={"target_tokens": [1] * (context + 1)})
    with pytest.raises(tinker.RequestFailedError, match="more than the model's context"):
        tc.forward_backward([long], "cross_entropy").result()
    import httpx

    r = httpx.post(f"{service['url']}/api/v1/no_such_thing", json={}, headers={"X-API-Key": KEY})
    assert r.status_code == 404 and "not implemented by this service" in r.json()["detail"]
    assert httpx.post(f"{service['url']}/api/v1/create_session", json={}).status_code == 401  # no key
    # The model and the service go on.
    assert tc.forward_backward([good], "cross_entropy").result().metrics["loss:sum"] > 0


def test_concurrent_clients_get_the_results_each_gets_alone(client):
    def run(seed: int) -> list[float]:
        tc = client.create_lora_training_client(base_model="stub", rank=4, seed=seed).result()
        data = datums(batch(tc.get_tokenizer(), seed), ("target_tokens", "logprobs", "advantages"))
        out = []
        for _ in range(3):
            f = tc.forward_backward(data, "importance_sampling")
            o = tc.optim_step(types.AdamParams(learning_rate=1e-2))  # submitted before the result: queued in order
            out.append(f.result().metrics["loss:sum"])
            o.result()
        return out
    alone = [run(7), run(8)]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(run, [7, 8]))
    assert together == alone


def test_two_ranks_train_what_one_rank_trains(service, client, tmp_path):
    """The service under torchrun: FSDP2 over 2 ranks, rank 0 serving and driving rank 1. The datums of a call
    are split over the ranks (3 datums: 2 and 1) and each runs alone (--micro-batch-tokens 8): rank 0 runs two
    micro-batches, rank 1 one and a zero-loss one. The loss and the update equal the 1-rank service's."""
    port, ctx = start(tmp_path, 2, "--micro-batch-tokens", "8")
    with ctx:
        two = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
        results = []
        for c, svc in ((client, service), (two, {"root": tmp_path / "root"})):
            tc = c.create_lora_training_client(base_model="stub", rank=4, seed=4).result()
            rows = batch(tc.get_tokenizer(), seed=9)
            rows = rows + rows[:1]
            out = tc.forward_backward(datums(rows, ("target_tokens", "logprobs", "advantages")), "ppo").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            tc.save_weights_for_sampler("after").result()
            results.append((out, adapter(svc, tc.model_id, "after")))
        two.close("success")
    (one, w1), (two_out, w2) = results
    assert two_out.metrics["loss:sum"] == pytest.approx(one.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(one.loss_fn_outputs, two_out.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=1e-4)


def grpo_batch(prompts, samples, rewards) -> tuple[list[list[int]], list[dict]]:
    """GRPO's datums: each sample's advantage is its reward minus its group's mean, on its sampled tokens."""
    rows = []
    for prompt, group, rs in zip(prompts, samples, rewards):
        mean = sum(rs) / len(rs)
        for (tokens, logprobs), r in zip(group, rs):
            full, p = prompt + tokens, len(prompt)
            rows.append({"input": full[:-1], "target_tokens": np.array(full[1:]),
                         "logprobs": np.array([0.0] * (p - 1) + logprobs, dtype=np.float32),
                         "advantages": np.array([0.0] * (p - 1) + [r - mean] * len(tokens), dtype=np.float32)})
    return rows


def reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def test_sdk_grpo_loop_equals_the_same_loop_run_natively(service, client):
    """Three GRPO steps through the SDK and the same three steps on the service's own parts in this process
    (TrainedModel, SamplerPool, no HTTP): the same samples, losses and final adapter."""
    import asyncio

    from train.tinker_service.sampler import SamplerPool, Snapshot
    from train.tinker_service.trainee import AdamStep, TrainedModel, lora_settings
    from train.tinker_service.wire import Datum

    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=21)
    tc = client.create_lora_training_client(base_model="stub", rank=4, seed=5).result()
    tok = tc.get_tokenizer()
    prompts = [tok.encode("1 + 1 ="), tok.encode("count: a b")]
    sdk_log = []
    for _ in range(3):
        sampler = tc.save_weights_and_get_sampling_client()
        samples = [[(s.tokens, list(s.logprobs)) for s in
                    sampler.sample(types.ModelInput.from_ints(p), 4, params).result().sequences] for p in prompts]
        rows = grpo_batch(prompts, samples, [[reward(t) for t, _ in g] for g in samples])
        loss = tc.forward_backward(datums(rows, ("target_tokens", "logprobs", "advantages")),
                                   "importance_sampling").result().metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        sdk_log.append(([[t for t, _ in g] for g in samples], loss))
    tc.save_weights_for_sampler("grpo").result()

    torch.set_num_threads(1)  # as the service process runs (OMP_NUM_THREADS=1)
    model = TrainedModel(str(STUB), lora_settings(4), 5, torch.device("cpu"))
    pool = SamplerPool(torch.device("cpu"))
    native_log = []
    for step in range(3):
        snap = Snapshot(f"native-{step}", str(STUB), model.lora, model.sampler_weights())
        samples = []
        for p in prompts:
            seqs, _ = asyncio.run(pool.sample(snap, p, 4, params.model_dump()))
            samples.append([(s.tokens, s.logprobs) for s in seqs])
        rows = grpo_batch(prompts, samples, [[reward(t) for t, _ in g] for g in samples])
        data = [Datum(r["input"], {k: np.asarray(r[k]) for k in ("target_tokens", "logprobs", "advantages")})
                for r in rows]
        _, metrics = model.forward_backward(data, "importance_sampling", {}, False)
        model.optim_step(AdamStep(learning_rate=2e-2))
        native_log.append(([[t for t, _ in g] for g in samples], metrics["loss:sum"]))
    pool.close()
    for (sdk_tokens, sdk_loss), (nat_tokens, nat_loss) in zip(sdk_log, native_log):
        assert sdk_tokens == nat_tokens
        assert sdk_loss == pytest.approx(nat_loss, rel=1e-5, abs=1e-5)  # ~0: A sums to 0 in a group at ratio 1
    served = adapter(service, tc.model_id, "grpo")
    native = model.sampler_weights()
    assert served.keys() == native.keys()
    for k in served:  # float32 sums in two processes: Adam turns ~1e-8 gradient noise on a near-zero gradient
        torch.testing.assert_close(served[k], native[k], atol=2e-4, rtol=1e-2)  # into < 1% of a 2e-2 step
        assert not torch.equal(served[k], torch.zeros_like(served[k])) or "lora_B" not in k


def test_micro_batches_sum_to_the_gradient_of_one_batch():
    """A call's datums in micro-batches (here one each) give the loss, log-probs and gradient of one batch."""
    from train.tinker_service.trainee import TrainedModel, lora_settings
    from train.tinker_service.wire import Datum

    rows = batch(__import__("transformers").AutoTokenizer.from_pretrained(STUB), seed=2)
    data = [Datum(r["input"], {k: np.asarray(r[k]) for k in ("target_tokens", "logprobs", "advantages")})
            for r in rows]
    results = []
    for budget in (1, 1 << 20):
        model = TrainedModel(str(STUB), lora_settings(4), 7, torch.device("cpu"), micro_batch_tokens=budget)
        assert len(model._micro_batches(data, [0, 1])) == (2 if budget == 1 else 1)
        outs, metrics = model.forward_backward(data, "ppo", {}, False)
        results.append((outs, metrics, {n: p.grad.clone() for n, p in model.model.named_parameters()
                                        if p.grad is not None}))
    (o1, m1, g1), (o2, m2, g2) = results
    assert m1["loss:sum"] == pytest.approx(m2["loss:sum"], rel=1e-5)
    for a, b in zip(o1, o2):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    assert g1.keys() == g2.keys() and g1
    for k in g1:  # float32: another padding is another matmul shape
        torch.testing.assert_close(g1[k], g2[k], atol=1e-4 * g2[k].abs().max().item(), rtol=1e-3)


def test_lora_models_on_one_base_hold_it_once_and_train_apart():
    """Two LoRA models on one rank share the base model's tensors (memory per model: its adapter and Adam state);
    training one leaves the other's outputs as they were."""
    from train.tinker_service.ranks import Operations
    from train.tinker_service.trainee import AdamStep
    from train.tinker_service.wire import Datum

    ops = Operations(torch.device("cpu"), None)
    for model_id, seed in (("a", 1), ("b", 2)):
        ops.create(model_id, str(STUB), {"rank": 4}, seed)
    a, b = ops.models["a"].model, ops.models["b"].model
    base = dict(a.named_parameters())
    shared = [n for n, p in b.named_parameters() if not p.requires_grad]
    assert shared and all(base[n].data_ptr() == p.data_ptr() for n, p in b.named_parameters() if n in shared)
    adapters = [n for n, p in b.named_parameters() if p.requires_grad]
    assert adapters and all(base[n].data_ptr() != dict(b.named_parameters())[n].data_ptr() for n in adapters)
    ids = list(range(5, 25))
    data = [Datum(ids[:-1], {"target_tokens": np.array(ids[1:]), "weights": np.ones(len(ids) - 1, np.float32)})]
    before = ops.forward_backward("b", data, "cross_entropy", {}, True)[0][0]["logprobs"]
    for _ in range(2):
        ops.forward_backward("a", data, "cross_entropy", {}, False)
        ops.optim_step("a", AdamStep(learning_rate=1e-1).__dict__)
    assert not np.allclose(ops.forward_backward("a", data, "cross_entropy", {}, True)[0][0]["logprobs"], before)
    np.testing.assert_array_equal(ops.forward_backward("b", data, "cross_entropy", {}, True)[0][0]["logprobs"],
                                  before)


def test_closing_a_client_finishes_its_session(service):
    c = tinker.ServiceClient(base_url=service["url"], api_key=KEY)
    tc = c.create_lora_training_client(base_model="stub", rank=4).result()
    assert tc.get_info().model_data.model_name == "stub"
    c.close("success")  # POST /api/v1/sessions/{id}/finish, which tinker-cookbook sends at the end of a run


def test_a_fully_trained_model_samples_with_its_new_weights():
    """lora_config None (create_model without an adapter; the SDK itself only asks for LoRA): every weight
    trains, and a sampler of it runs the "full" engine, whose log-probs are the trained model's."""
    import asyncio

    from train.tinker_service.ranks import Operations
    from train.tinker_service.sampler import SamplerPool, Snapshot
    from train.tinker_service.trainee import AdamStep
    from train.tinker_service.wire import Datum

    ops = Operations(torch.device("cpu"), None)
    ops.create("full", str(STUB), None, 0)
    model = ops.models["full"]
    assert model.lora is None and all(p.requires_grad for p in model.model.parameters())
    ids = list(range(5, 25))
    data = [Datum(ids[:-1], {"target_tokens": np.array(ids[1:]), "weights": np.ones(len(ids) - 1, np.float32)})]
    ops.forward_backward("full", data, "cross_entropy", {}, False)
    ops.optim_step("full", AdamStep(learning_rate=1e-2).__dict__)
    tensors = ops.sampler_weights("full")
    assert "model.embed_tokens.weight" in tensors  # every weight, not an adapter
    pool = SamplerPool(torch.device("cpu"))
    seqs, scored = asyncio.run(pool.sample(Snapshot("full-1", str(STUB), None, tensors), ids[:5], 1,
                                           {"max_tokens": 4, "seed": 3}, prompt_logprobs=True))
    pool.close()
    trained = ops.forward_backward("full", data, "cross_entropy", {}, True)[0][0]["logprobs"]
    np.testing.assert_allclose(scored[1:], trained[:4], atol=1e-4)  # the prompt, scored by the new weights
