"""Errors that name their cause (issue 33, item 5): a run folder the filesystem will not let the run
write, a LoRA checkpoint resumed without LoRA (and the reverse), a run whose every sample is an env
error, and an env that fails on every call in one source of a mixture. Row numbers that agree between
the loader and the mixture's routing check are in tests/integration/test_mixture.py; a run whose every update the
governor rolls back, in tests/integration/test_faults.py. Each test here failed on main 46b6008."""
from __future__ import annotations

import errno
import json
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, can_mount_in_a_namespace, read_jsonl, run_trainer, stub_train_slice, trainer_env
from train.parallel.distributed import DistContext
from train.runtime import run_folder
from train.runtime.checkpoint import lora_mismatch
from train.runtime.run_folder import RunFolderError, claim
from train.utils.disk import UnwritableError, explain_disk_full, is_under, unwritable_line

SMALL = ["data.prompts_per_rollout=4", "data.responses_per_prompt=4", "trainer.test_freq=null",
         "trainer.progress_bar=false"]
ONE_RANK = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), mesh=None)


def trainer_cmd(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
            "-m", "train.trainer.grpo", "--config-name", "stub", *overrides]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------------------ unwritable run folders


# Tests run as root, for whom chmod does not stop a write; a read-only mount stops everyone. The run
# folder's filesystem is a tmpfs in a private mount namespace (`unshare -rm`), remounted read-only.
@pytest.mark.slow
@pytest.mark.skipif(not can_mount_in_a_namespace(), reason="needs unshare -rm (user + mount namespaces)")
def test_a_read_only_run_folder_is_one_error_line_naming_it(tmp_path):
    """A read-only trainer.save_dir was `OSError: [Errno 30] Read-only file system` inside a long
    Hydra/torchrun dump with no `error:` line, for a new run and for a resume (the `.lock` file). Now one
    line names the folder, what was being written and what to do, and its advice for a resume works."""
    disk = tmp_path / "disk"
    disk.mkdir()
    elsewhere = tmp_path / "writable"
    one_step = ["trainer.total_steps=1", "trainer.save_freq=1", *SMALL]
    script = "\n".join([
        f"mount -t tmpfs -o size=64m tmpfs {disk} || exit 97",
        shlex.join(trainer_cmd([f"trainer.save_dir={disk / 'run'}", *one_step])) + " > /dev/null 2>&1 || exit 98",
        f"mount -o remount,ro {disk} || exit 99",
        shlex.join(trainer_cmd([f"trainer.save_dir={disk / 'new'}", *one_step])) + "; echo FRESH_EXIT $? >&2",
        shlex.join(trainer_cmd([f"trainer.save_dir={disk / 'run'}", "trainer.load_ckpt_from=latest",
                                "trainer.total_steps=2", *SMALL])) + "; echo RESUME_EXIT $? >&2",
        # the error's advice: the run goes on in a writable folder from the read-only checkpoint
        shlex.join(trainer_cmd([f"trainer.save_dir={elsewhere}", f"trainer.load_ckpt_from={disk / 'run' / 'step1'}",
                                "trainer.total_steps=2", *SMALL])) + " > /dev/null 2>&1; echo ADVICE_EXIT $? >&2",
    ])
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=trainer_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    fresh, resume = err.split("FRESH_EXIT")[0], err.split("FRESH_EXIT")[1].split("RESUME_EXIT")[0]
    assert "FRESH_EXIT 0" not in err and "RESUME_EXIT 0" not in err, err[-3000:]
    assert "exitcode: 2" in fresh and "exitcode: 2" in resume  # the rank's status: a user error (USER_ERRORS)
    [line] = error_lines(fresh)
    assert line == (f"error: trainer.save_dir '{disk / 'new'}' cannot be written: Read-only file system (errno EROFS) "
                    f"while creating the folder {disk / 'new'}: point trainer.save_dir at a writable folder "
                    "(e.g. trainer.save_dir=runs/my_run)"), fresh[-3000:]
    [line] = error_lines(resume)
    assert line.startswith(f"error: trainer.save_dir '{disk / 'run'}' cannot be written: Read-only file system "
                           f"(errno EROFS) while creating its lock file {disk / 'run' / '.lock'}: point "
                           "trainer.save_dir at a writable folder"), resume[-3000:]
    assert line.endswith(f"trainer.save_dir=<writable folder> trainer.load_ckpt_from={disk / 'run' / 'step1'}")
    assert "ADVICE_EXIT 0" in err
    assert [m["step"] for m in read_jsonl(elsewhere / "metrics.jsonl")] == [2]


def test_a_folder_the_run_may_not_write_is_one_line_naming_it(tmp_path, monkeypatch):
    """Permission denied (EACCES) takes the read-only path; a file where the folder or one of its
    parents should be is named too (real: root cannot write into a file either)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(RunFolderError, match=rf"trainer.save_dir '{a_file}' is a file, not a folder"):
        claim(str(a_file), None, False, ONE_RANK)
    with pytest.raises(RunFolderError, match=rf"trainer.save_dir '{a_file}/run' cannot be written: Not a directory "
                                             r"\(errno ENOTDIR\)"):
        claim(str(a_file / "run"), None, False, ONE_RANK)

    run = tmp_path / "run"
    run.mkdir()

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(run_folder, "open", denied, raising=False)
    with pytest.raises(RunFolderError) as e:
        claim(str(run), "latest", False, ONE_RANK)
    assert str(e.value) == (f"trainer.save_dir '{run}' cannot be written: Permission denied (errno EACCES) while "
                            f"creating its lock file {run / '.lock'}: point trainer.save_dir at a writable folder "
                            "(e.g. trainer.save_dir=runs/my_run)")


def test_a_folder_that_turns_read_only_mid_run_is_one_line():
    """A checkpoint or export write refused by the filesystem after start-up (a disk remounted read-only
    after errors) is an UnwritableError (exit status 4, like a full disk), not a DCP traceback."""
    step = "/runs/x/step3.tmp"
    with pytest.raises(UnwritableError) as e:
        with explain_disk_full("the checkpoint of step 3", step, "the complete checkpoints before it are untouched"):
            try:
                raise OSError(errno.EROFS, "Read-only file system", f"{step}/trainer_state.pt")
            except OSError as inner:
                raise RuntimeError("dcp failed on rank 0") from inner  # DCP wraps what the writer raised
    assert str(e.value) == ("cannot write the checkpoint of step 3 (/runs/x/step3.tmp/trainer_state.pt): Read-only "
                            "file system (errno EROFS): point trainer.save_dir at a writable folder; the complete "
                            "checkpoints before it are untouched")
    with pytest.raises(ValueError):  # anything else goes through as it was
        with explain_disk_full("x", step):
            raise ValueError("not a disk problem")
    # what main() says of a bare OSError under the run folder
    line = unwritable_line(PermissionError(errno.EACCES, "Permission denied", "/runs/x/metrics.jsonl"),
                           "into the run folder", "/runs/x")
    assert line.startswith("cannot write into the run folder (/runs/x/metrics.jsonl): Permission denied (errno EACCES)")
    assert is_under("/runs/x/metrics.jsonl", "/runs/x") and not is_under("/runs/xy/a", "/runs/x")
    assert not is_under("/data/train.jsonl", "/runs/x") and not is_under(None, "/runs/x")


# ------------------------------------------------------------------------------ LoRA checkpoints


def _shapes(rank: int | None, modules=("q_proj", "v_proj"), role: str = "actor") -> dict:
    """A worker's state entries (model part) as a checkpoint or a run holds them: with LoRA of `rank`
    on `modules`, adapters only; without (None), the full weights."""
    layer = f"{role}.model.model.layers.0.self_attn"
    if rank is None:
        return {f"{role}.model.model.embed_tokens.weight": (256, 64), f"{layer}.q_proj.weight": (64, 64)}
    return {f"{layer}.{m}.lora_{ab}.default.weight": (rank, 64) if ab == "A" else (64, rank)
            for m in modules for ab in "AB"}


DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_lora_checkpoint_mismatches_name_the_adapters_and_the_overrides():
    """Each way a checkpoint's adapters can differ from the run's says what the checkpoint holds and which
    overrides resume it; a meta.json written before these settings were recorded still loads (its
    adapters are read from the tensor names)."""
    meta = {"lora": {"rank": 8, "alpha": 32.0, "target_modules": ["q_proj", "v_proj"]}}
    older = {}  # a meta.json from before issue 33: no `lora`
    path = "/runs/x/step2"
    # LoRA checkpoint, full run (the case)
    said = lora_mismatch(path, "actor", meta, _shapes(8), _shapes(None), DEFAULT_TARGETS)
    assert said == ("trainer.load_ckpt_from: '/runs/x/step2' holds the actor's LoRA adapters of rank 8 on q_proj, "
                    "v_proj, not its full weights, and this run trains the whole actor (actor.lora.rank=0): resume "
                    "with actor.lora.rank=8 actor.lora.alpha=32 actor.lora.target_modules=[q_proj,v_proj]")
    said = lora_mismatch(path, "actor", older, _shapes(8), _shapes(None), DEFAULT_TARGETS)
    assert said.endswith("resume with actor.lora.rank=8 actor.lora.target_modules=[q_proj,v_proj]")
    # full checkpoint, LoRA run
    said = lora_mismatch(path, "critic", {"lora": None}, _shapes(None, role="critic"), _shapes(4, role="critic"),
                         DEFAULT_TARGETS)
    assert said == ("trainer.load_ckpt_from: '/runs/x/step2' holds the critic's full weights (saved by a run without "
                    "LoRA), and this run trains LoRA adapters (critic.lora.rank=4): resume with critic.lora.rank=0")
    # another rank, other modules
    said = lora_mismatch(path, "actor", meta, _shapes(8), _shapes(4), ("q_proj", "v_proj"))
    assert said.endswith("holds the actor's LoRA adapters of rank 8 on q_proj, v_proj, and this run's are rank 4 on "
                         "q_proj, v_proj: resume with actor.lora.rank=8")
    said = lora_mismatch(path, "actor", meta, _shapes(8), _shapes(8, ("q_proj",)), ("q_proj",))
    assert said.endswith("resume with actor.lora.target_modules=[q_proj,v_proj]")
    # what fits says nothing
    assert lora_mismatch(path, "actor", meta, _shapes(8), _shapes(8), ("q_proj", "v_proj")) is None
    assert lora_mismatch(path, "actor", {}, _shapes(None), _shapes(None), DEFAULT_TARGETS) is None


@pytest.mark.slow
def test_a_lora_checkpoint_resumed_without_lora_says_it_holds_adapters(tmp_path):
    """It said "'actor.model.model.embed_tokens.weight' is absent there (a different model shape)"; now
    the line says the checkpoint holds LoRA adapters and which overrides resume it, and meta.json
    records the adapters' settings."""
    lora = tmp_path / "lora"
    run_trainer([f"trainer.save_dir={lora}", "actor.lora.rank=4", "actor.lora.alpha=8", "trainer.total_steps=1",
                 "trainer.save_freq=1", *SMALL])
    meta = json.loads((lora / "step1" / "meta.json").read_text())
    assert meta["workers"]["actor"]["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    proc = run_trainer([f"trainer.save_dir={tmp_path / 'full'}", f"trainer.load_ckpt_from={lora / 'step1'}",
                        "trainer.total_steps=2", *SMALL], check=False)
    [line] = error_lines(proc.stderr)
    assert proc.returncode != 0 and line == (
        f"error: trainer.load_ckpt_from: '{lora / 'step1'}' holds the actor's LoRA adapters of rank 4 on down_proj, "
        "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj, not its full weights, and this run trains the whole actor "
        "(actor.lora.rank=0): resume with actor.lora.rank=4 actor.lora.alpha=8"), proc.stderr[-3000:]


# ------------------------------------------------------------------------------ env errors


RAISING_ENV = """
def reward_fn(messages, answer):
    raise RuntimeError("the scorer is down")
"""


def test_a_run_whose_every_sample_is_an_env_error_says_so_at_the_time_and_at_the_end(tmp_path):
    """Its closing "made no update ... see the warnings above" pointed at warnings never printed. Now the
    first step warns (once, not every step) naming the env file and the error, and the closing line
    counts the cause."""
    env = tmp_path / "raising.py"
    env.write_text(RAISING_ENV)
    run = tmp_path / "run"
    proc = run_trainer([f"trainer.save_dir={run}", f"rollout.env_path={env}", "trainer.total_steps=3",
                        f"data.train_data_path={stub_train_slice(tmp_path / 'train.jsonl', 8)}", *SMALL])
    out = proc.stdout + proc.stderr
    warned = [line for line in out.splitlines() if "ended in an env error" in line]
    assert warned == [f"warning: step 1: every one of its 16 samples ended in an env error in {env} (each scored "
                      "rollout.env_error_reward=0); the first: raising.py:reward_fn: exception: RuntimeError: the "
                      "scorer is down; see env/errors and the env_error events in trajectories.jsonl (warned again "
                      "only after a step where some succeed)"], out[-3000:]
    assert ("warning: this run made no update in its 3 steps: nothing was learned (3 step(s) every sample an env "
            "error (the env warning above, env/errors, env_error events in trajectories.jsonl))") in out, out[-3000:]
    assert "see the warnings above" not in out


def test_an_env_failing_in_one_source_is_counted_and_named(tmp_path):
    """It showed only as `rewards/train/<source> 0.0`. Now `env/errors/<source>` counts it every step, and
    a warning names the source, its env file and the first error, once per streak."""
    env = tmp_path / "raising.py"
    env.write_text(RAISING_ENV)
    math = stub_train_slice(tmp_path / "math.jsonl", 2)
    flaky = stub_train_slice(tmp_path / "flaky.jsonl", 2)  # every step draws all 4 rows: 2 of each source
    run = tmp_path / "run"
    proc = run_trainer([f"trainer.save_dir={run}", "trainer.total_steps=2",
                        f"data.train_data_path={{math: {math}, flaky: {flaky}}}",
                        f"rollout.env_path={{math: environments/eq.py, flaky: {env}}}", *SMALL])
    out = proc.stdout + proc.stderr
    warned = [line for line in out.splitlines() if "ended in an env error" in line]
    assert warned == [f"warning: step 1: every one of the 8 samples from source 'flaky' ended in an env error in "
                      f"{env} (each scored rollout.env_error_reward=0); the first: raising.py:reward_fn: exception: "
                      "RuntimeError: the scorer is down; see env/errors/flaky and the env_error events in "
                      "trajectories.jsonl (warned again only after a step where some succeed)"], out[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["env/errors/flaky"] for r in rows] == [8.0, 8.0]
    assert [r["env/errors/math"] for r in rows] == [0.0, 0.0]
    events = [e for e in read_jsonl(run / "trajectories.jsonl") if e["type"] == "env_error"]
    assert events and {e["source"] for e in events} == {"flaky"}
