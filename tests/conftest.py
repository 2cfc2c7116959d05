"""Shared test helpers for tests/unit and tests/integration: the bundled stub model, a launcher for
real trainer runs, and services started for real (tests/README.md)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from train.utils.services import free_port, running_all

ROOT = Path(__file__).resolve().parents[1]
STUB_MODEL = ROOT / "stub" / "model"
STUB_MATH = ROOT / "stub" / "data" / "math"


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.slow` tests run only when the marker expression selects them (`-m slow`, `-m "slow or
    not slow"`); the README's `pytest -q` (and CI) skips them, saying how to run them. A slow test is one
    whose behaviour a faster test already guards, or a rebuild of a bundled artefact."""
    expr = config.getoption("markexpr") or ""
    if "slow" in expr and "not slow" not in expr.replace("or not slow", ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow (pytest -m slow tests/...)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def slow(*values, id: str | None = None):
    """One parametrize case marked slow (run with -m slow): the cases left unmarked guard the same
    behaviour in the default suite."""
    return pytest.param(*values, marks=pytest.mark.slow, id=id)


def repository_first_path() -> str:
    """PYTHONPATH for a child: the repository, then what this process's PYTHONPATH holds (scripts/gpu_check.sh
    puts its wheels there)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def trainer_env() -> dict:
    """The environment of a trainer or check a test starts: offline, the repository first on the path
    (repository_first_path), and no rank of the caller's."""
    from train.parallel.distributed import without_launcher_env

    env = without_launcher_env(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
               PYTHONPATH=repository_first_path(),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def ranks_cmd(nproc: int, *target: str) -> list[str]:
    """The command that runs `target` (`-m module ...`, or a script, and its arguments) on `nproc` local ranks:
    torchrun for several, plain python for one (the trainer and the checks set up their own one-rank group, as
    a one-process user's `python -m train.trainer.grpo` does; torchrun's launcher would add ~3 s to each)."""
    if nproc == 1:
        return [sys.executable, *target]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *target]


def run_torchrun(cmd: list[str], timeout: int = 600, cwd: Path | str = ROOT,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a torchrun command (or a one-rank plain python one: ranks_cmd) with trainer_env() plus `env`; relaunch
    once if a rank was killed by a signal (torchrun reports "exitcode: -N"; python returns -N). Seen once in ~40
    launches on this CPU: a rank aborting at interpreter exit ("terminate called without an active exception")
    after its work was done. A second crash, or any ordinary failure, is returned as is."""
    full_env = {**trainer_env(), **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode < 0 or (proc.returncode != 0 and "exitcode: -" in proc.stderr):
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return proc


def run_trainer(overrides: list[str], nproc: int = 1, config: str = "stub", timeout: int = 600,
                check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch the trainer for real, as a user would (`torchrun -m train.trainer.grpo`; one process: `python -m`)."""
    cmd = ranks_cmd(nproc, "-m", "train.trainer.grpo", "--config-name", config, "trainer.progress_bar=false", *overrides)
    proc = run_torchrun(cmd, timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def kill_when(cmd: list[str], save_dir: Path, ready, what: str, env: dict | None = None, timeout: float = 240) -> None:
    """Run the trainer command `cmd` (writing into `save_dir`) in a session of its own and SIGKILL every process of
    it as soon as `ready()` holds; an AssertionError naming `what` if the run ends (or `timeout` passes) first."""
    import signal
    import time

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or trainer_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while not ready():
            assert proc.poll() is None and time.time() < deadline, f"the run ended before {what}"
            time.sleep(0.05)
    finally:
        # every process of the run: torchrun puts its ranks in sessions of their own
        subprocess.run(["pkill", "-9", "-f", f"trainer.save_dir={save_dir}"], check=False)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def launch_check(nproc: int, out: Path, *args: str, timeout: int = 300) -> dict:
    """Run tests/dist_checks.py `args` on `nproc` ranks (torchrun, gloo); what rank 0 saved to `out` ({} when the
    check saves per-rank files)."""
    import torch

    cmd = ranks_cmd(nproc, str(ROOT / "tests" / "dist_checks.py"), *args, "--out", str(out))
    proc = run_torchrun(cmd, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(out) if Path(out).exists() else {}


def flat(state, prefix: str = "") -> dict:
    """A nested state (a consolidated checkpoint: dicts and lists) as {"a/b/0/": leaf}."""
    if isinstance(state, dict):
        return {k2: v2 for k, v in state.items() for k2, v2 in flat(v, f"{prefix}{k}/").items()}
    if isinstance(state, (list, tuple)):
        return {k2: v2 for i, v in enumerate(state) for k2, v2 in flat(v, f"{prefix}{i}/").items()}
    return {prefix: state}


def assert_same_update(one: dict, other: dict, weight_atol: float = 1e-5, all_learn: bool = True,
                       grad_rtol: float = 1e-5) -> None:
    """Two `dist_checks.py grads`-style results agree: each gradient to `grad_rtol` of its tensor's scale (float32
    sums in another order), the clipped global norm (clipping active: > 0.05), the updated weights to ~1% of a step
    plus what Adam's first step makes of each run's own gradient: an entry near Adam's eps (1e-8) turns its
    gradient's rounding into up to a whole step, so that part is computed, not tolerated blindly.
    `all_learn`: every parameter has a gradient from the batch."""
    import torch

    assert one["grads"].keys() == other["grads"].keys()
    for name, g in one["grads"].items():
        scale = float(g.abs().max())
        assert scale > 0 or not all_learn, name
        torch.testing.assert_close(other["grads"][name], g, rtol=0, atol=grad_rtol * scale, msg=name)
    assert one["norm"] > 0.05 and abs(one["norm"] - other["norm"]) < 1e-5 * one["norm"]
    for name, w in one["weights"].items():
        got = other["weights"][name]
        assert got.shape == w.shape, name
        allowed = weight_atol + 1e-5 * w.abs()
        if name in one["grads"]:
            allowed = allowed + (adam_first_step(one, name) - adam_first_step(other, name)).abs()
        worst = float(((got - w).abs() - allowed).max())
        assert worst <= 0, f"{name}: the updated weights differ by {worst:.3g} more than allowed"


def adam_first_step(result: dict, name: str):
    """The size of AdamW's first step on one parameter from a run's own clipped gradient: lr * g / (|g| + eps)
    (bias-corrected moments of one step are g and g^2; `result["adam"]` holds lr, eps and the clip norm)."""
    adam, g = result["adam"], result["grads"][name].double()
    g = g * min(1.0, adam["max_norm"] / (result["norm"] + 1e-6))
    return adam["lr"] * g / (g.abs() + adam["eps"])


def stub_train_slice(path: Path, n: int) -> Path:
    """The first `n` rows of the stub math training set written to `path` (short epochs, revisits)."""
    path.write_text("".join((STUB_MATH / "train.jsonl").read_text().splitlines(keepends=True)[:n]))
    return path


def load_file(path: Path | str):
    """A Python file that is not in a package (a stub build script, an env module), imported by path."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_oracle():
    """verl 0.9.1's loss module and rollout-correction helpers (requirements-oracle.txt, installed by
    scripts/install.sh with --no-deps), as (core_algos, rollout_corr_helper, ActorConfig).

    verl/__init__.py is not run (it starts its Ray-based trainer's setup): the package is registered as
    a plain namespace over its folder. Its `protocol` module, which the loss modules import, imports Ray
    for the types of its futures; Ray (a 240 MB cluster runtime that no loss calls) is not installed, so a
    named stand-in that only answers attribute lookups is present while these modules import, and removed
    after."""
    import sys
    import types

    if "verl.trainer.ppo.core_algos" not in sys.modules:
        spec = importlib.util.find_spec("verl")
        if spec is None or not spec.submodule_search_locations:
            pytest.fail("the verl oracle is not installed: bash scripts/install.sh installs requirements-oracle.txt")
        package = types.ModuleType("verl")
        package.__spec__ = spec
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["verl"] = package
        stand_in = None
        if importlib.util.find_spec("ray") is None:
            stand_in = types.ModuleType("ray")

            def ray_name(name: str):  # ray.ObjectRef etc.: names for annotations, nothing that runs
                if name.startswith("__"):
                    raise AttributeError(name)
                return type(name, (), {})

            stand_in.__getattr__ = ray_name
            sys.modules["ray"] = stand_in
        try:
            importlib.import_module("verl.trainer.ppo.core_algos")
            importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
        finally:
            if stand_in is not None and sys.modules.get("ray") is stand_in:
                del sys.modules["ray"]
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    from verl.workers.config.actor import ActorConfig

    return core_algos, rollout_corr_helper, ActorConfig


def can_mount_in_a_namespace() -> bool:
    """Whether `unshare -rm` works here (user + mount namespaces): tests that need a small or
    read-only filesystem mount a tmpfs in a private namespace (root ignores chmod)."""
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def stub_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(STUB_MODEL)


def compose_config(overrides=(), name: str = "stub", save_dir: str | None = "/tmp/x"):
    """config/<name>.yaml composed with Hydra as a run would, `trainer.save_dir` set to `save_dir`
    (None: left as the preset has it), plus `overrides` (paths relative to ROOT)."""
    from hydra import compose, initialize_config_dir

    preset = [] if save_dir is None else [f"trainer.save_dir={save_dir}"]
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        return compose(config_name=name, overrides=[*preset, *overrides])


def run_config(overrides: dict | None = None, name: str = "grpo"):
    """The typed config (train/trainer/schema.py's RunConfig) of config/<name>.yaml with `overrides`
    ({dotted key: value}, any value OmegaConf holds) set on the composed config, as a run loads it."""
    from omegaconf import OmegaConf

    from train.trainer.config import resolve_aliases, resolve_device_defaults
    from train.trainer.schema import load

    cfg = compose_config(name=name, save_dir=None)
    for key, value in (overrides or {}).items():
        OmegaConf.update(cfg, key, value, force_add=True)
    resolve_aliases(cfg)
    resolve_device_defaults(cfg)  # (validate does it in a run, with the run's device)
    return load(cfg)


@pytest.fixture
def in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths are relative to the repo root


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """10 stub prompts: with 4 per step an epoch ends inside step 3 and again inside step 5."""
    return stub_train_slice(tmp_path_factory.mktemp("data") / "train.jsonl", 10)


STUB_HUB_ID = "stub-org/stub-chat"


@pytest.fixture(scope="session")
def stub_hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache (the Hub's own layout) holding the stub model as `STUB_HUB_ID`: hub ids
    resolve from it with HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing here."""
    from train.utils.hub import add_to_cache

    cache = tmp_path_factory.mktemp("hf_hub_cache")
    add_to_cache(str(STUB_MODEL), STUB_HUB_ID, str(cache))
    return cache


def tiny_model(tmp_path_factory, family: str) -> str:
    """A random tiny model of another family, saved like a checkpoint (vocabulary covers the
    batch's token ids): Qwen2 has q/k/v biases and untied embeddings, Qwen3 per-head q/k norms."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = (Qwen2Config(**common, tie_word_embeddings=False) if family == "qwen2"
              else Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(family)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture
def scoped_registries(monkeypatch):
    """Registrations a test makes into train/algorithms' registries are undone after it (the
    registries are module-level tables shared by the whole test session)."""
    from train.algorithms.advantages import ESTIMATORS
    from train.algorithms.aggregation import AGG_MODES
    from train.algorithms.kl import KL_ESTIMATORS
    from train.algorithms.policy_loss import POLICY_LOSSES
    for registry in (ESTIMATORS, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
        monkeypatch.setattr(registry, "_listed", list(registry._listed))


# ------------------------------------------------ services started for real (the integration tests)
SEARCH_DATA = ROOT / "stub" / "data" / "search"


# The services' helpers are the project's own (train/utils/services.py); tests import them from here too.
SERVICE_ENV = {"PYTHONPATH": repository_first_path(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@contextlib.contextmanager
def running(cmd: list[str], health_url: str, log_path: Path, timeout: float = 180.0,
            env: dict | None = None) -> Iterator[subprocess.Popen]:
    """Start a server process, wait until `health_url` answers 200, stop it afterwards."""
    with running_all({" ".join(map(str, cmd[:3])): (cmd, health_url, log_path)}, timeout=timeout, cwd=ROOT,
                     env={**SERVICE_ENV, **(env or {})}) as procs:
        yield next(iter(procs.values()))


def build_index(index_path: Path) -> None:
    """The search index of the stub corpus (stub/data/search), built by its documented command."""
    cmd = [sys.executable, "environments/build_search_index.py", "--corpus_path", str(SEARCH_DATA / "corpus.jsonl"),
           "--index_path", str(index_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "indexed 60 documents" in out.stdout


@contextlib.contextmanager
def search_service(tmp: Path, top_k: int = 3) -> Iterator[str]:
    """environments/local_search_service.py on the stub corpus, started for real; its URL."""
    index = tmp / "stub.index"
    if not index.exists():
        build_index(index)
    port = free_port()
    cmd = [sys.executable, "environments/local_search_service.py", "--index_path", str(index),
           "--corpus_path", str(SEARCH_DATA / "corpus.jsonl"), "--top_k", str(top_k), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with running(cmd, url + "/health", tmp / "search.log"):
        yield url


@pytest.fixture(scope="session")
def search_tiny(request):
    """stub/model taught the protocol's shapes (stub/data/search/warm_model.py), cached."""
    warm = load_file(ROOT / "stub" / "data" / "search" / "warm_model.py")
    return str(warm.cached(request.config.cache.mkdir("search-tiny")))
