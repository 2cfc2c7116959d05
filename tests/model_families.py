"""The model families the trainer is checked on (docs/models.md): tiny random-init configs built in code with
transformers (nothing downloaded), saved with `save_pretrained` in the Hub's key layout (per-expert names for
mixtures of experts) beside the stub's tokenizer (vocabulary 512), so every family runs the stub task.

    .venv/bin/python tests/model_families.py --markdown     # the conformance matrix, as docs/models.md holds it

The matrix is data (MATRIX): a feature a family supports is a ✓ that a test checks
(tests/integration/test_model_families.py runs every cell), a feature it cannot run is ✗ with the reason, and
that test checks the reason is the error a user gets."""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)

# family -> (transformers model_type, config overrides, what it stands for)
FAMILIES: dict[str, tuple[str, dict, str]] = {
    "llama3": ("llama", dict(rope_theta=500000.0, tie_word_embeddings=False), "Llama 3"),
    "smollm": ("llama", dict(tie_word_embeddings=True), "SmolLM / SmolLM2 (Llama, tied embeddings)"),
    "qwen2.5": ("qwen2", dict(tie_word_embeddings=False), "Qwen2 / Qwen2.5 (q/k/v biases)"),
    "qwen3": ("qwen3", dict(head_dim=16, tie_word_embeddings=True), "Qwen3 (per-head q/k norms)"),
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=16), "Gemma 3 text (scaled embeddings, four norms per layer)"),
    "mistral": ("mistral", dict(sliding_window=None), "Mistral"),
    "phi3": ("phi3", dict(pad_token_id=0), "Phi-3 (fused qkv_proj, gate_up_proj)"),
    "olmo2": ("olmo2", dict(), "OLMo 2 (norms after attention and MLP)"),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
                  "Qwen3-MoE (Qwen3-30B-A3B's architecture)"),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "Mixtral"),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, eos_token_id=2), "OLMoE"),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                                layer_types=["sliding_attention", "full_attention"],
                                rope_parameters=dict(rope_type="default", rope_theta=150000.0)),
                "GPT-OSS (attention sinks, alternating sliding windows, biased router)"),
}




def build(family: str, folder: str | os.PathLike, seed: int = 0) -> str:
    """Save a random tiny model of `family` and the stub's tokenizer into `folder`; returns the folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides, _ = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    folder = Path(folder)
    model.save_pretrained(folder)
    for name in os.listdir(ROOT / "stub" / "model"):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(ROOT / "stub" / "model" / name, folder / name)
    return str(folder)


MIXTURES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")  # their training cells run with router replay and the load-balancing loss

# family -> feature -> None (works, a test checks it) or the reason it cannot (the start of the error users get)
FEATURES = ("load", "fsdp2", "tp2", "train_fsdp2", "train_tp2", "train_sp2", "train_ep2", "packing", "decode", "lora")
FEATURE_NAMES = {"load": "meta-device load = from_pretrained", "fsdp2": "FSDP2 x2 load, logits bit for bit",
                 "tp2": "TP x2 load, logits to 1e-4",
                 "train_fsdp2": "2 steps, 2 ranks, FSDP2; the export in the Hub's layout reloads bit for bit",
                 "train_tp2": "2 steps, 2 ranks, TP x2",
                 "train_sp2": "2 steps, 2 ranks, Ulysses SP x2, fused log-prob head",
                 "train_ep2": "2 steps, 2 ranks, experts split over EP x2; the export reloads bit for bit",
                 "packing": "packed rows, shared prompts: log-probs and gradients = each sequence alone",
                 "decode": "static-cache decode = dynamic", "lora": "LoRA on attention and MLP projections"}
# The projections LoRA adapts in each family (train/models/lora.py's defaults unless named here).
LORA_TARGETS = {"phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
MATRIX: dict[str, dict[str, str | None]] = {family: {f: None for f in FEATURES} for family in FAMILIES}
NO_TP = {"phi3": "no TP plan: the fused qkv_proj and gate_up_proj would split across the q/k/v and gate/up "
                 "boundaries (refused at start)",
         "olmo2": "no TP plan: its q/k norms span all heads (refused at start)",
         "qwen3_moe": "no TP plan for experts; FSDP2 shards them (refused at start)",
         "mixtral": "no TP plan for experts; FSDP2 shards them (refused at start)",
         "olmoe": "no TP plan for experts; FSDP2 shards them (refused at start)",
         "gpt_oss": "no TP plan for experts; FSDP2 shards them (refused at start)"}
for family, reason in NO_TP.items():
    for feature in ("tp2", "train_tp2"):
        MATRIX[family][feature] = reason
for family in FAMILIES:
    if family not in MIXTURES:
        MATRIX[family]["train_ep2"] = "not a mixture of experts: no experts to split (refused at start)"
for family in ("gemma3", "gpt_oss"):
    MATRIX[family]["decode"] = "sliding-window layers keep the dynamic cache (the engine chooses it)"
for family in MIXTURES:
    MATRIX[family]["lora"] = ("the experts are fused 3-D tensors, not linear layers: LoRA adapts the attention "
                              "projections only (refused at start naming the missing targets)")


def markdown() -> str:
    lines = ["| family | transformers `model_type` | " + " | ".join(FEATURE_NAMES[f] for f in FEATURES) + " |",
             "|---|---|" + "---|" * len(FEATURES)]
    for family, (model_type, _, what) in FAMILIES.items():
        cells = ["✓" if MATRIX[family][f] is None else f"✗ {MATRIX[family][f]}" for f in FEATURES]
        lines.append(f"| {what} | `{model_type}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="print the matrix as docs/models.md holds it")
    parser.add_argument("--build", nargs=2, metavar=("FAMILY", "FOLDER"), help="save a tiny model of FAMILY")
    args = parser.parse_args()
    if args.build:
        print(build(*args.build))
    else:
        print(markdown())
