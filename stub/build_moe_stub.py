#!/usr/bin/env python
"""A mixture-of-experts stub: the bundled model (`stub/model`, a tiny Llama) upcycled into a Mixtral.

    .venv/bin/python stub/build_moe_stub.py runs/moe_stub            # 4 experts, top-2
    .venv/bin/python stub/build_moe_stub.py runs/moe_stub --experts 8 --top-k 2

Sparse upcycling (Komatsuzaki et al., 2022): every expert starts as a copy of the dense model's MLP, with
a small multiplicative noise so the experts differ, and the routers are random. Mixtral renormalises the
top-k weights to sum to 1, so each layer's MoE output starts close to the dense MLP's and the model keeps
the stub's arithmetic (its greedy test reward starts near the dense model's), while the routing matters
from the first step: a token's log-prob depends on which experts it went to. Attention, norms and the
embeddings are the stub's, unchanged. Nothing is downloaded and nothing is bundled: the folder is built in
a second from `stub/model`, saved with `save_pretrained` in the Hub's per-expert key layout.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

STUB_MODEL = Path(__file__).resolve().parent / "model"


def build(out: str | Path, experts: int = 4, top_k: int = 2, noise: float = 0.02, seed: int = 0) -> str:
    """Write the upcycled Mixtral into `out` (with the stub's tokenizer); returns the folder."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(STUB_MODEL, dtype=torch.float32)
    c = dense.config
    config = MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                           max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                           rope_parameters=dict(c.rope_parameters), tie_word_embeddings=c.tie_word_embeddings,
                           num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
                           sliding_window=None, pad_token_id=c.pad_token_id, eos_token_id=c.eos_token_id,
                           bos_token_id=c.bos_token_id, router_aux_loss_coef=0.0)
    torch.manual_seed(seed)
    moe = MixtralForCausalLM(config)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, unexpected = moe.load_state_dict(state, strict=False)
    assert not unexpected and all(".mlp." in k for k in missing), (unexpected, missing)  # only the MoE blocks are new
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for dense_layer, layer in zip(dense.model.layers, moe.model.layers):
            mlp, block = dense_layer.mlp, layer.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # the fused [2 x inter, hidden] layout
            for e in range(experts):
                block.experts.gate_up_proj[e] = gate_up * (1 + noise * torch.randn(gate_up.shape, generator=g))
                block.experts.down_proj[e] = mlp.down_proj.weight * (
                    1 + noise * torch.randn(mlp.down_proj.weight.shape, generator=g))
            block.gate.weight.normal_(0.0, 0.1, generator=g)
    out = Path(out)
    moe.save_pretrained(out)
    for name in STUB_MODEL.iterdir():
        if "token" in name.name or name.suffix == ".jinja":
            shutil.copy(name, out / name.name)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description="Upcycle the bundled stub model into a tiny Mixtral.")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.02, help="relative noise on each expert's copy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.out, args.experts, args.top_k, args.noise, args.seed))


if __name__ == "__main__":
    main()
