"""Resumable checkpoints, sharded per rank with torch.distributed.checkpoint (DCP), written to a
temporary name and renamed when complete (the Hugging Face export is train/runtime/export.py).

    step{N}/
      dcp/                 every worker's trainable weights and optimizer state (Adam moments included; a
                           LoRA run's adapters, not its frozen base): each rank
                           writes its own shards (__{rank}_0.distcp), rank 0 the .metadata
      trainer_state.pt     the step, schedulers, the dataloader's global position, the governor, ...
      rank{r}.pt           each rank's RNG states
      meta.json            what wrote it: world size, each model's layout, shapes and LoRA settings (for
                           people and errors)
      COMPLETE             written last, then step{N}.tmp/ is renamed to step{N}/

Memory per rank for a save is its own shards (plus a staging copy with `trainer.async_save`); no
rank gathers the model. DCP reshards on load, so a checkpoint resumes under another layout or world
size (the dataloader's position is global; RNG states are per rank and re-seeded for ranks that did
not exist). `find_latest` only ever returns complete checkpoints.
"""
from __future__ import annotations

import ctypes
import json
import os
import random
import re
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from train.parallel.collectives import barrier
from train.parallel.distributed import DistContext
from train.utils.disk import explain_disk_full

# Frozen parameters (a LoRA run's base model) are not saved: they are the model folder's, loaded again
# at resume. A full fine-tune has none, so this changes nothing there.
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
# Loading them back: the frozen entries are absent by design (load checks that every saved entry
# is there and fits before DCP reads it, so nothing trainable can go missing silently).
LOAD_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
STEP_DIR = re.compile(r"^step(\d+)$")
COMPLETE = "COMPLETE"
RESUME_ADVICE = "the complete checkpoints before it are untouched: trainer.load_ckpt_from=latest resumes from the newest"
# For the kill-safety tests only: a pause between "every shard written" and the completion marker.
TEST_DELAY_S = float(os.environ.get("INFINITE_RL_TEST_CHECKPOINT_DELAY_S", "0"))


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: names the path and what does not match."""


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def complete_steps(save_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete step{N} folder, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    return sorted((int(m.group(1)), os.path.join(save_dir, name)) for name in os.listdir(save_dir)
                  if (m := STEP_DIR.match(name)) and os.path.exists(os.path.join(save_dir, name, COMPLETE)))


def find_latest(save_dir: str) -> str | None:
    """The complete step{N} folder with the highest N, or None."""
    steps = complete_steps(save_dir)
    return steps[-1][1] if steps else None


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _replace_dir(tmp: str, final: str) -> None:
    """`tmp` becomes `final`. Where `final` exists the two are swapped in one atomic step, so a crash
    leaves either the old or the new folder at `final`, never neither; the old one is then deleted."""
    if os.path.exists(final):
        if _exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # now the old folder
            return
        old = final + ".old"  # no atomic exchange here (not Linux, or the filesystem refuses)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def _shapes(state: dict, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Flattened name -> global shape of every tensor in a (nested) state dict."""
    out: dict[str, tuple[int, ...]] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_shapes(value, name + "."))
        elif isinstance(value, torch.Tensor):
            out[name] = tuple(value.shape)
    return out


class Checkpointer:
    """Saves and restores the trainable workers' state parts (Trainable.state_parts) and the
    trainer's state. Every method is collective unless it says otherwise."""

    def __init__(self, save_dir: str, ctx: DistContext, *, async_save: bool = False, keep_last_n: int | None = None):
        self.save_dir, self.ctx = save_dir, ctx
        self.async_save, self.keep_last_n = async_save, keep_last_n
        # Its own gloo group: an asynchronous save talks from a background thread, never on the
        # group the training step uses at the same time.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: tuple[Future, str, str] | None = None  # (DCP future, tmp folder, final folder)
        self._finished = False  # rank 0 already renamed the pending save (poll)
        self.loaded_from: str | None = None  # the checkpoint folder `load` read

    # -- saving ----------------------------------------------------------------------------------
    def _states(self, workers: dict) -> dict:
        states = {}
        for name, worker in workers.items():
            worker.optimizer_state_made()  # (actor.offload_optimizer: a bucket at a time, not all on the device)
            parts = worker.state_parts()
            model_sd, optim_sd = get_state_dict(parts["model"], parts["optimizer"], options=TRAINABLE_ONLY)
            # A frozen tied weight (lm_head tied to the embedding) has no name of its own in
            # named_parameters, so TRAINABLE_ONLY keeps it: drop it by name.
            frozen = {n for n, p in parts["model"].named_parameters(remove_duplicate=False) if not p.requires_grad}
            states[name] = {"model": {k: v for k, v in model_sd.items() if k not in frozen}, "optimizer": optim_sd}
        return states

    def save(self, step: int, workers: dict, trainer_state: dict, rank_state: dict) -> str:
        """Write step{step}/ (see the module docstring); with async_save the shards are written in
        the background and the folder is renamed once they are (`poll`, `wait`). A full disk is a
        DiskFullError naming the folder; the earlier checkpoints stay as they were."""
        self.wait()  # one save in flight at a time
        final = os.path.join(self.save_dir, f"step{step}")
        with explain_disk_full(f"the checkpoint of step {step}", final + ".tmp", RESUME_ADVICE):
            return self._save(step, workers, trainer_state, rank_state, final)

    def _save(self, step: int, workers: dict, trainer_state: dict, rank_state: dict, final: str) -> str:
        tmp = final + ".tmp"
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of the same step
            os.makedirs(tmp)
            schedulers = {name: w.state_parts()["scheduler"].state_dict() for name, w in workers.items()}
            torch.save({**trainer_state, "schedulers": schedulers}, os.path.join(tmp, "trainer_state.pt"))
        barrier()
        torch.save(rank_state, os.path.join(tmp, f"rank{self.ctx.rank}.pt"))
        states = self._states(workers)
        if self.ctx.is_main:
            meta = {"step": step, "world_size": self.ctx.world_size,
                    "workers": {name: {"layout": vars(w.layout.sizes), "shapes": _shapes(states[name]["model"]),
                                       "lora": _lora_settings(w)}
                                for name, w in workers.items()}}
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
        target = os.path.join(tmp, "dcp")
        if self.async_save:
            future = dcp.async_save(states, checkpoint_id=target, process_group=self.group)
            self._pending = (future, tmp, final)
        else:
            dcp.save(states, checkpoint_id=target, process_group=self.group)
            barrier()  # every rank's shards are on disk
            self._finish(tmp, final)
        return final

    def _finish(self, tmp: str, final: str) -> None:
        """Rank 0 marks the folder complete, renames it and applies the retention (no collective)."""
        if not self.ctx.is_main:
            return
        if TEST_DELAY_S:  # tests/integration/test_checkpoints.py kills the run inside this window
            time.sleep(TEST_DELAY_S)
        open(os.path.join(tmp, COMPLETE), "w").close()
        _replace_dir(tmp, final)
        if self.keep_last_n:
            for _, path in complete_steps(self.save_dir)[: -self.keep_last_n]:
                shutil.rmtree(path, ignore_errors=True)  # only older complete ones, after the newer is complete

    def poll(self) -> None:
        """Finish an asynchronous save whose shards are written (rank 0; no collective): called
        between steps, it never waits. Every rank still calls `wait` before the next save."""
        if self._pending is not None and self.ctx.is_main and not self._finished and self._pending[0].done():
            with explain_disk_full("a checkpoint (in the background)", self._pending[1], RESUME_ADVICE):
                self._pending[0].result()  # raises what the background write raised
            self._finish(*self._pending[1:])
            self._finished = True

    def wait(self) -> None:
        """Block until an asynchronous save is complete and renamed (collective)."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        with explain_disk_full("a checkpoint (in the background)", tmp, RESUME_ADVICE):
            future.result()
        barrier()  # every rank's shards are on disk
        if self.ctx.is_main and not self._finished:
            self._finish(tmp, final)
        self._pending, self._finished = None, False
        barrier()

    # -- loading ---------------------------------------------------------------------------------
    def load(self, path: str, workers: dict) -> tuple[dict, dict | None]:
        """Restore every worker's model and optimizer state (resharded to the current layouts) and
        schedulers; return (trainer state, this rank's state or None if the checkpoint had fewer ranks)."""
        meta = read_meta(path)
        missing = [name for name in workers if name not in meta["workers"]]
        if missing:
            raise CheckpointError(f"trainer.load_ckpt_from: '{path}' holds no state for {missing} (it was saved by a "
                                  f"run with {sorted(meta['workers'])}); resume with the same algorithm settings")
        states = self._states(workers)
        saved = dcp.FileSystemReader(os.path.join(path, "dcp")).read_metadata().state_dict_metadata
        saved_shapes = {k: tuple(v.size) for k, v in saved.items() if hasattr(v, "size")}
        for name, worker in workers.items():
            here = _shapes(states[name]["model"], f"{name}.model.")
            targets = getattr(getattr(worker, "lora", None), "target_modules", None)
            lora = lora_mismatch(path, name, meta["workers"][name], saved_shapes, here, targets)
            if lora:
                raise CheckpointError(lora)
            for key, shape in here.items():
                entry = saved.get(key)
                if entry is None or tuple(entry.size) != shape:
                    found = "absent" if entry is None else tuple(entry.size)
                    raise CheckpointError(f"trainer.load_ckpt_from: '{path}' does not fit this model: '{key}' is "
                                          f"{found} there and {shape} here (a different model shape)")
        dcp.load(states, checkpoint_id=os.path.join(path, "dcp"), process_group=self.group)
        trainer_state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        for name, worker in workers.items():
            parts = worker.state_parts()
            with worker.loading_optimizer_state():  # (actor.offload_optimizer: the state stays on the host)
                set_state_dict(parts["model"], parts["optimizer"], model_state_dict=states[name]["model"],
                               optim_state_dict=states[name]["optimizer"], options=LOAD_TRAINABLE)
            parts["scheduler"].load_state_dict(trainer_state["schedulers"][name])
        self.loaded_from = path  # (state a rank of another world size reads from its saving ranks' files)
        rank_file = os.path.join(path, f"rank{self.ctx.rank}.pt")
        rank_state = torch.load(rank_file, weights_only=False) if os.path.exists(rank_file) else None
        return trainer_state, rank_state

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def _lora_settings(worker) -> dict | None:
    """A worker's LoRA settings for meta.json (None: no adapters, the whole model trains)."""
    lora = getattr(worker, "lora", None)
    if lora is None or not lora.enabled:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}


def adapters_in(shapes: dict[str, tuple[int, ...]], prefix: str) -> tuple[int, list[str]] | None:
    """(rank, targeted module names) of the LoRA adapters among the entries under `prefix`, or None."""
    ranks, modules = set(), set()
    for key, shape in shapes.items():
        if key.startswith(prefix) and ".lora_A." in key:
            ranks.add(int(shape[0]))
            modules.add(key.split(".lora_A.")[0].rsplit(".", 1)[-1])
    return (max(ranks), sorted(modules)) if modules else None


def lora_mismatch(path: str, name: str, meta: dict, saved: dict[str, tuple[int, ...]],
                  here: dict[str, tuple[int, ...]], target_modules: Sequence[str] | None = None) -> str | None:
    """Why a checkpoint's LoRA adapters (or their absence) do not fit this run's `name` worker, with the
    overrides that resume it; None when they fit. `meta`: the worker's meta.json entry (its `lora`
    settings, recorded since issue 33; an older checkpoint's adapters are read from its tensor names);
    `target_modules`: those this run's `<name>.lora.target_modules` names (its default when LoRA is off)."""
    key, prefix = f"{name}.lora", f"{name}.model."
    then, now = adapters_in(saved, prefix), adapters_in(here, prefix)
    if then is None and now is None:
        return None
    where = f"trainer.load_ckpt_from: '{path}' holds"
    if then is None:
        return (f"{where} the {name}'s full weights (saved by a run without LoRA), and this run trains LoRA adapters "
                f"({key}.rank={now[0]}): resume with {key}.rank=0")
    rank, modules = then
    recorded = meta.get("lora") or {}
    wanted_modules = sorted(target_modules) if target_modules is not None else None
    fix = [f"{key}.rank={rank}"] if now is None or now[0] != rank else []
    if recorded.get("alpha") is not None and now is None:
        fix.append(f"{key}.alpha={recorded['alpha']:g}")
    if (now[1] if now is not None else wanted_modules) != modules:
        fix.append(f"{key}.target_modules=[{','.join(modules)}]")
    if not fix:
        return None
    held = f"{where} the {name}'s LoRA adapters of rank {rank} on {', '.join(modules)}"
    if now is None:
        return (f"{held}, not its full weights, and this run trains the whole {name} ({key}.rank=0): resume with "
                f"{' '.join(fix)}")
    return f"{held}, and this run's are rank {now[0]} on {', '.join(now[1])}: resume with {' '.join(fix)}"


def read_meta(path: str) -> dict:
    """A checkpoint folder's meta.json, or a CheckpointError saying why the folder is not one."""
    if not os.path.isdir(path):
        raise CheckpointError(f"trainer.load_ckpt_from: '{path}' is not a folder")
    if not os.path.exists(os.path.join(path, COMPLETE)):
        raise CheckpointError(f"trainer.load_ckpt_from: '{path}' is not a complete checkpoint (no {COMPLETE} "
                              "marker: a save that did not finish); use trainer.load_ckpt_from=latest")
    meta_file = os.path.join(path, "meta.json")
    if not os.path.exists(meta_file) or not os.path.isdir(os.path.join(path, "dcp")):
        raise CheckpointError(f"trainer.load_ckpt_from: '{path}' was not written by this trainer's sharded "
                              "checkpoints (no meta.json and dcp/)")
    with open(meta_file) as f:
        return json.load(f)


def consolidate(path: str) -> dict:
    """A checkpoint's model and optimizer states as full tensors in this process, keyed
    {worker: {"model": ..., "optimizer": ...}}, plus "trainer_state": for inspection, tests and
    converting; a whole model in memory, so not for the trainer's own use."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    read_meta(path)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(os.path.join(path, "dcp"), out)
        state = torch.load(out, weights_only=False)
    state["trainer_state"] = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    return state
