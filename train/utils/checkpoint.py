"""Resumable checkpoints and the Hugging Face export, both written atomically.

`step{N}/` holds the full (unsharded) model and optimizer state (Adam moments included), the
scheduler, the trainer state, and one file per rank with its RNG and dataloader state. It is
written as `step{N}.tmp/` and renamed only when complete, so a crash never leaves a half
checkpoint that `load_ckpt_from=latest` would pick up.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from train.parallel.distributed import DistContext
from train.parallel.collectives import barrier

STEP_DIR = re.compile(r"^step(\d+)$")
COMPLETE = "COMPLETE"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def find_latest(save_dir: str) -> str | None:
    """The complete step{N} folder with the highest N, or None."""
    if not os.path.isdir(save_dir):
        return None
    steps = [(int(m.group(1)), name) for name in os.listdir(save_dir) if (m := STEP_DIR.match(name))
             and os.path.exists(os.path.join(save_dir, name, COMPLETE))]
    return os.path.join(save_dir, max(steps)[1]) if steps else None


def _replace_dir(tmp: str, final: str) -> None:
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def _prefix(name: str) -> str:
    return "" if name == "actor" else f"{name}_"  # the actor's files keep their plain names


def save_checkpoint(save_dir: str, step: int, workers: dict, trainer_state: dict, rank_state: dict,
                    ctx: DistContext) -> str:
    """Every worker's state parts (Trainable.state_parts: model, optimizer, scheduler) as
    `{name}_model.pt`, `{name}_optimizer.pt`, `{name}_scheduler.pt` (plain names for the actor),
    the trainer state and one file per rank, in one atomic folder."""
    final = os.path.join(save_dir, f"step{step}")
    tmp = final + ".tmp"
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    states = {}
    for name, worker in workers.items():
        parts = worker.state_parts()
        m, opt = parts["model"], parts["optimizer"]
        # collectives: every rank calls them, in the same order
        states[_prefix(name)] = (get_model_state_dict(m, options=options),
                                 get_optimizer_state_dict(m, opt, options=options), parts["scheduler"].state_dict())
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for prefix, (model_sd, optim_sd, sched_sd) in states.items():
            torch.save(model_sd, os.path.join(tmp, f"{prefix}model.pt"))
            torch.save(optim_sd, os.path.join(tmp, f"{prefix}optimizer.pt"))
            torch.save(sched_sd, os.path.join(tmp, f"{prefix}scheduler.pt"))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(trainer_state, f)
    barrier()
    torch.save(rank_state, os.path.join(tmp, f"rank{ctx.rank}.pt"))
    barrier()
    if ctx.is_main:
        open(os.path.join(tmp, COMPLETE), "w").close()
        _replace_dir(tmp, final)
    barrier()
    return final


def load_checkpoint(path: str, workers: dict, ctx: DistContext) -> tuple[dict, dict]:
    """Restore every worker's state parts in place (as saved); return (trainer_state, this rank's state)."""
    if not os.path.exists(os.path.join(path, COMPLETE)):
        raise FileNotFoundError(f"trainer.load_ckpt_from: '{path}' is not a complete checkpoint")
    rank_file = os.path.join(path, f"rank{ctx.rank}.pt")
    if not os.path.exists(rank_file):
        raise ValueError(f"trainer.load_ckpt_from: '{path}' was written by fewer ranks; resume with "
                         "the same number of processes")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for name, worker in workers.items():
        prefix = _prefix(name)
        parts = worker.state_parts()
        m, opt = parts["model"], parts["optimizer"]
        if not os.path.exists(os.path.join(path, f"{prefix}model.pt")):
            raise ValueError(f"trainer.load_ckpt_from: '{path}' has no {prefix}model.pt (it was saved by a run "
                             "without this component); resume with the same algorithm settings")
        model_sd = torch.load(os.path.join(path, f"{prefix}model.pt"), weights_only=False) if ctx.is_main else {}
        set_model_state_dict(m, model_sd, options=options)
        optim_sd = torch.load(os.path.join(path, f"{prefix}optimizer.pt"), weights_only=False) if ctx.is_main else {}
        set_optimizer_state_dict(m, opt, optim_sd, options=options)
        parts["scheduler"].load_state_dict(torch.load(os.path.join(path, f"{prefix}scheduler.pt"), weights_only=False))
    with open(os.path.join(path, "trainer_state.json")) as f:
        trainer_state = json.load(f)
    return trainer_state, torch.load(rank_file, weights_only=False)


def export_hf(model, tokenizer, out_dir: str, ctx: DistContext) -> None:
    """A plain Hugging Face folder (model + tokenizer) that from_pretrained loads, atomically."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        with torch.device("meta"):  # a plain (unsharded) copy of the architecture, no memory yet
            export = AutoModelForCausalLM.from_config(model.config)
        export.load_state_dict(state, assign=True, strict=False)
        if getattr(model.config, "tie_word_embeddings", False):
            export.tie_weights()
        if getattr(model, "generation_config", None) is not None:
            export.generation_config = model.generation_config
        tmp = out_dir + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        export.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, out_dir)
    barrier()
