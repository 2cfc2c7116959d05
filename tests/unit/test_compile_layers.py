"""actor.compile (train/parallel/parallelize.py `apply_compile`): each decoder layer through torch.compile, in
place. Inductor's C++ backend on CPU; the update through the trainer's own path, on one process and on two FSDP2
ranks with activation checkpointing, is tests/integration/test_distributed.py::test_compiled_layers_give_the_eager_update."""
import copy

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from train.parallel.packing import segment_slots
from train.parallel.parallelize import apply_compile
from train.parallel.seq_parallel import install_packed_attention


def packed_loss(model: torch.nn.Module, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one packed row of segments of `lengths` (as the actor lays samples out), and a loss over them."""
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(input_ids=ids, position_ids=positions, packed_segments=segment_slots(lengths, ids.device),
                   use_cache=False).logits
    return logits, torch.log_softmax(logits, -1)[..., 0].sum()


def test_compiled_layers_give_the_eager_logits_and_gradients_with_one_graph_for_all_layers() -> None:
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    install_packed_attention(eager)
    compiled = copy.deepcopy(eager)
    names = [name for name, _ in compiled.named_parameters()]
    torch._dynamo.reset()  # graphs of earlier tests in this process would hide this one's
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert apply_compile(compiled) == 4
    assert [name for name, _ in compiled.named_parameters()] == names  # in place: checkpoints see the same names

    lengths = [5, 11, 7]
    want, want_loss = packed_loss(eager, lengths)
    want_loss.backward()
    got, got_loss = packed_loss(compiled, lengths)
    got_loss.backward()
    # one graph serves the four layers: no per-layer recompiles (a deep model would exhaust dynamo's cache)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in eager.modules())  # the copy stays eager
