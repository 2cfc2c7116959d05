"""The docs' commands stay runnable as written, checked without running them (seconds).

Every fenced shell block (```bash, ```sh, ```shell, and the `$ ` lines of ```console) of README.md,
docs/*.md, stub/README.md and benchmarks/README.md, and the indented command lines of the
benchmarks' module docstrings, is split into commands. Each command must
- call the venv's programs by path (`.venv/bin/python`, `.venv/bin/torchrun`, `.venv/bin/pip`: the
  README's set-up, run from the repository root), or be one of ALLOWED / ANOTHER_MACHINE below;
- name modules that import (`-m X`) and repository files that exist (`environments/eq.py`,
  `--config-name stub`, `algorithm=dapo`, `scripts/install.sh`, ...);
- give a `train.trainer.grpo` run (also through torchrun, launch_grpo.sh, train.launch or the
  pre-flight check, and blocks of overrides alone) only keys its config has, or `+new.key`.
A failure names the file, the line and what is wrong. Also: pyproject.toml lists what the
requirements files list, and the environment written on docs/environments.md scores the stub.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import ROOT

DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
        "stub/README.md", "benchmarks/README.md"]
SHELL = {"bash", "sh", "shell", "console"}
VENV_PROGRAMS = {"python", "torchrun", "pip", "infinite-rl-plot"}

# Commands that need no `.venv/bin/` (why, for each).
ALLOWED = {
    "bash": "scripts run with bash (`bash scripts/install.sh`): they find .venv themselves",
    "./launch_grpo.sh": "the launch script: it picks .venv/bin/python itself",
    "cd": "shell built-in", "export": "shell built-in", "source": "shell built-in (`source .venv/bin/activate`)",
    "git": "not a Python program",
    "curl": "a request to a local service (127.0.0.1 / localhost only, checked)",
    "grep": "a filter feeding a pip command",
    "sbatch": "SLURM's submit command, run on the cluster's login node (scripts/slurm/grpo.sbatch: overrides checked)",
    "kubectl": "Kubernetes' client, run where the cluster is reachable (scripts/k8s/*.yaml: checked below)",
}
# (doc, program) pairs documented for another machine, and where that is.
ANOTHER_MACHINE = {
    ("docs/gpu.md", "python3"): "the air-gapped GPU node's own Python (a CUDA PyTorch image) installing the wheels",
    ("docs/design_guide.md", "torchrun"): "the design guide's commands quoted as written (run after activating .venv)",
    ("docs/design_guide.md", "python"): "the design guide's commands quoted as written (run after activating .venv)",
}
# Repository paths are words under these folders, or these root files; anything else (runs/, /tmp,
# out.json) is written by the command, not read.
REPO_DIRS = ("train", "environments", "config", "stub", "benchmarks", "scripts", "tests", "docs")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w-]|launch_grpo\.sh|requirements[\w-]*\.txt|pyproject\.toml)"
                       % "|".join(REPO_DIRS))
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OVERRIDE = re.compile(r"^[+~]?[A-Za-z_][\w-]*(\.[\w-]+)*=")
OPERATORS = {"&&", "||", ";", "|", "&"}
TRAINER = "train.trainer.grpo"


@dataclass
class Command:
    doc: str
    line: int
    words: list[str]  # env assignments removed
    env: dict[str, str]

    def where(self) -> str:
        return f"{self.doc}:{self.line}: `{' '.join(self.words)[:100]}`"


def fenced_blocks(doc: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(language, [(line number, text)]) of every fenced block."""
    blocks, current, lang, fence = [], None, "", ""
    for number, text in enumerate((ROOT / doc).read_text().splitlines(), 1):
        stripped = text.strip()
        if current is None and stripped.startswith("```"):
            fence, lang, current = stripped[:len(stripped) - len(stripped.lstrip("`"))], stripped.strip("`").strip(), []
        elif current is not None and stripped.startswith(fence) and stripped.strip("`") == "":
            blocks.append((lang, current))
            current = None
        elif current is not None:
            current.append((number, text))
    return blocks


def docstring_lines(path: Path) -> list[tuple[int, str]]:
    """The indented command lines of a module docstring (`    .venv/bin/python benchmarks/x.py ...`)."""
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree, clean=False)
    if not doc:
        return []
    first = tree.body[0].lineno
    command = re.compile(r"(\S+=\S+ )*(\.venv/bin/|python|torchrun|pip|bash )")
    return [(first + i, line) for i, line in enumerate(doc.splitlines())
            if line.startswith("    ") and command.match(line.strip())]


def commands(doc: str, lines: list[tuple[int, str]], console: bool = False) -> list[Command | str]:
    """Logical lines (backslash continuations joined) split at && || ; | &; a parse error is a str."""
    if console:
        lines = [(n, t.strip()[2:]) for n, t in lines if t.strip().startswith("$ ")]
    out: list[Command | str] = []
    pending, start = "", 0
    for number, text in lines:
        if not pending:
            start = number
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        logical, pending = pending + text, ""
        try:
            words = shlex.split(logical, comments=True)
        except ValueError as e:
            out.append(f"{doc}:{start}: cannot split the command ({e}): {logical.strip()[:100]}")
            continue
        segment: list[str] = []
        for word in words + [";"]:
            if word not in OPERATORS:
                segment.append(word)
                continue
            env = {}
            while segment and ENV_ASSIGNMENT.match(segment[0]):
                key, _, value = segment.pop(0).partition("=")
                env[key] = value
            if segment:
                out.append(Command(doc, start, segment, env))
            segment = []
    return out


def all_commands() -> list[Command | str]:
    found: list[Command | str] = []
    for doc in DOCS:
        for lang, lines in fenced_blocks(doc):
            if lang in SHELL:
                found += commands(doc, lines, console=lang == "console")
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        found += commands(str(path.relative_to(ROOT)), docstring_lines(path))
    return found


def created_by_docs() -> set[str]:
    """Files a page tells the reader to write: a ```python block whose first line is `# path`."""
    made = set()
    for doc in DOCS:
        for lang, lines in fenced_blocks(doc):
            if lang == "python" and lines and (m := re.match(r"#\s*([\w./-]+\.py)\b", lines[0][1].strip())):
                made.add(m.group(1))
    return made


@functools.cache
def composed(config_name: str):
    from train.trainer.config import compose

    return compose(config_name)


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def check_overrides(cmd: Command, words: list[str], problems: list[str], config_name: str = "grpo") -> None:
    """`words`: what follows the trainer's module (or a block of overrides alone)."""
    args, i = [], 0
    while i < len(words):
        if words[i] in ("--config-name", "-cn") and i + 1 < len(words):
            config_name, i = words[i + 1], i + 2
            continue
        if words[i].startswith("--config-name="):
            config_name = words[i].split("=", 1)[1]
        elif words[i] != "...":  # a placeholder for more overrides
            args.append(words[i])
        i += 1
    if not (ROOT / "config" / f"{config_name}.yaml").exists():
        problems.append(f"{cmd.where()}: --config-name {config_name}: config/{config_name}.yaml does not exist")
        return
    cfg = composed(config_name)
    for word in args:
        if word.startswith("-"):
            problems.append(f"{cmd.where()}: '{word}' is not a trainer override (key=value)")
            continue
        if not OVERRIDE.match(word):
            problems.append(f"{cmd.where()}: '{word}' is not a key=value override")
            continue
        key, _, value = word.partition("=")
        if key.startswith("+") or key.startswith("hydra.") or key.startswith("hydra/"):
            continue  # a new key (checked by the trainer's own config checks), or Hydra's own settings
        key = key.lstrip("~")
        if key == "algorithm":
            if not (ROOT / "config" / "algorithm" / f"{value}.yaml").exists():
                problems.append(f"{cmd.where()}: algorithm={value}: config/algorithm/{value}.yaml does not exist")
            continue
        if OmegaConf.select(cfg, key, default=KeyError) is KeyError:
            problems.append(f"{cmd.where()}: override '{key}' is not a key of config/{config_name}.yaml "
                            f"(nor of config/grpo.yaml); a new key needs '+{key}'")


def check_python(cmd: Command, args: list[str], problems: list[str]) -> None:
    """`.venv/bin/python ARGS`: a module that imports, or a script that exists."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 1
    if i == len(args):
        return
    if args[i] == "-c":
        return
    if args[i] == "-m":
        if i + 1 == len(args):
            problems.append(f"{cmd.where()}: -m without a module")
            return
        module, rest = args[i + 1], args[i + 2:]
        if module == "torch.distributed.run":
            check_torchrun(cmd, rest, problems)
        elif not module_exists(module):
            problems.append(f"{cmd.where()}: -m {module}: no such module")
        elif module == TRAINER:
            check_overrides(cmd, rest, problems)
        elif module == "train.launch":
            check_torchrun(cmd, rest, problems)
        elif module == "train.trainer.config":
            check_overrides(cmd, without_check_options(rest), problems)
        return
    if not REPO_PATH.fullmatch(args[i]) and not (ROOT / args[i]).is_file():  # repository paths: checked already
        problems.append(f"{cmd.where()}: {args[i]}: no such script")


def without_check_options(words: list[str]) -> list[str]:
    """The pre-flight's arguments less its own options (`--check`, `--nproc N`): the trainer's."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word == "--nproc":
            skip = True
        elif word != "--check" and not word.startswith("--nproc="):
            out.append(word)
    return out


def check_torchrun(cmd: Command, args: list[str], problems: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    try:
        parsed = get_args_parser().parse_args(args)
    except SystemExit:
        problems.append(f"{cmd.where()}: torchrun cannot parse these arguments")
        return
    if parsed.module:
        if not module_exists(parsed.training_script):
            problems.append(f"{cmd.where()}: -m {parsed.training_script}: no such module")
        elif parsed.training_script == TRAINER:
            check_overrides(cmd, parsed.training_script_args, problems)
    elif not REPO_PATH.fullmatch(parsed.training_script) and not (ROOT / parsed.training_script).is_file():
        problems.append(f"{cmd.where()}: {parsed.training_script}: no such script")


def check_command(cmd: Command, problems: list[str], made: set[str]) -> None:
    first, rest = cmd.words[0], cmd.words[1:]
    for word in cmd.words + list(cmd.env.values()):
        for path in REPO_PATH.findall(word):
            if "<" not in path and path not in made and not (ROOT / path).exists():
                problems.append(f"{cmd.where()}: {path}: no such file or folder in the repository")
    if OVERRIDE.match(first) and "." in first.split("=")[0]:
        check_overrides(cmd, cmd.words, problems)  # overrides to add to a launch command
        return
    if first.startswith(".venv/bin/"):
        program = first.removeprefix(".venv/bin/")
        if program not in VENV_PROGRAMS:
            problems.append(f"{cmd.where()}: .venv/bin/{program}: not one of the venv's documented programs "
                            f"{sorted(VENV_PROGRAMS)}")
            return
    elif (cmd.doc, first) in ANOTHER_MACHINE or (first == "python3" and rest[:2] == ["-m", "venv"]):
        program = first  # allowed bare there (creating a venv needs a Python outside it); arguments checked
    elif first in ALLOWED:
        program = first
    else:
        hint = f" (.venv/bin/{first})" if first in VENV_PROGRAMS | {"python3", "pytest"} else ""
        problems.append(f"{cmd.where()}: '{first}' is run bare: call the venv's program by path{hint}, or add "
                        f"it to ALLOWED / ANOTHER_MACHINE in tests/unit/test_docs.py with the reason")
        return
    if program in ("python", "python3"):
        check_python(cmd, rest, problems)
    elif program == "torchrun":
        check_torchrun(cmd, rest, problems)
    elif program == "pip" and "-r" in rest:
        requirements = rest[rest.index("-r") + 1]
        if requirements != "/dev/stdin" and not (ROOT / requirements).is_file():
            problems.append(f"{cmd.where()}: -r {requirements}: no such file")
    elif program == "./launch_grpo.sh":
        check_overrides(cmd, rest, problems, cmd.env.get("CONFIG", "stub"))
    elif program == "sbatch":  # sbatch [options] SCRIPT [overrides for launch_grpo.sh]
        words = [w for w in rest if not w.startswith("-")]
        if not words or not (ROOT / words[0]).is_file():
            problems.append(f"{cmd.where()}: sbatch submits a script of the repository (scripts/slurm/...)")
        else:
            check_overrides(cmd, words[1:], problems, cmd.env.get("CONFIG", "stub"))
    elif program == "bash":
        if not rest or not (ROOT / rest[0]).is_file():
            problems.append(f"{cmd.where()}: bash runs a script of the repository (scripts/...)")
    elif program == "curl":
        urls = [w for w in rest if re.match(r"(https?://)?[\w.-]+:\d+", w)]
        if not urls or not all(re.match(r"(https?://)?(127\.0\.0\.1|localhost)[:/]", u) for u in urls):
            problems.append(f"{cmd.where()}: curl only to a local service (127.0.0.1 / localhost)")


def test_every_documented_command_runs_as_written():
    found = all_commands()
    assert sum(isinstance(c, Command) for c in found) > 60, "the block parser found too few commands"
    made = created_by_docs()
    problems = [c for c in found if isinstance(c, str)]
    for cmd in found:
        if isinstance(cmd, Command):
            check_command(cmd, problems, made)
    assert not problems, f"{len(problems)} documented command(s) would fail:\n" + "\n".join(problems)


def test_the_checker_catches_what_it_should():
    """A bare program, a missing module, file, config, preset and key are each reported."""
    bad = """torchrun --nproc_per_node=2 -m train.trainer.grpo trainer.save_dir=x
.venv/bin/python -m train.nothing_here
.venv/bin/python benchmarks/no_such.py
.venv/bin/torchrun --standalone -m train.trainer.grpo --config-name nope
.venv/bin/torchrun --standalone -m train.trainer.grpo algorithm=nope actor.no_such_key=1 +actor.new_key=1 \\
    rollout.env_path=environments/missing.py
NPROC=2 ./launch_grpo.sh trainer.no_such=1
sbatch --nodes=2 scripts/slurm/grpo.sbatch trainer.nope=1
.venv/bin/python -m train.trainer.config --check --nproc 2 --config-name stub actor.lrr=1
curl -s example.com:80/x
"""
    problems: list[str] = []
    for cmd in commands("x.md", list(enumerate(bad.splitlines(), 1))):
        check_command(cmd, problems, set())
    expected = ["x.md:1: `torchrun", "-m train.nothing_here: no such module", "benchmarks/no_such.py: no such",
                "config/nope.yaml does not exist", "config/algorithm/nope.yaml does not exist",
                "'actor.no_such_key' is not a key", "environments/missing.py: no such file",
                "'trainer.no_such' is not a key", "'trainer.nope' is not a key", "'actor.lrr' is not a key",
                "curl only to a local service"]
    for text in expected:
        assert any(text in p for p in problems), f"not reported: {text}\n" + "\n".join(problems)
    assert not any("new_key" in p for p in problems)
    assert len(problems) == len(expected), "\n".join(problems)


SHELL_SCRIPTS = ["launch_grpo.sh", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*")
                                          if p.suffix in (".sh", ".sbatch"))]
K8S_MANIFESTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*.yaml"))


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_every_shell_script_parses(script):
    import subprocess

    proc = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{script}: {proc.stderr}"


def test_the_cluster_recipes_exist_and_are_documented():
    text = (ROOT / "docs" / "training.md").read_text()
    for path in ("scripts/slurm/grpo.sbatch", "scripts/k8s/grpo-pytorchjob.yaml"):
        assert (ROOT / path).is_file() and path in text, path
    sbatch = (ROOT / "scripts/slurm/grpo.sbatch").read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=TERM@120", "#SBATCH --ntasks-per-node=1"):
        assert line in sbatch.splitlines(), line


@pytest.mark.parametrize("manifest", K8S_MANIFESTS)
def test_every_kubernetes_manifest_parses_and_launches_what_exists(manifest):
    """Each container's command is checked as a documented command is (launch_grpo.sh's overrides,
    modules, repository files), with its env as the command's."""
    import yaml

    documents = [d for d in yaml.safe_load_all((ROOT / manifest).read_text()) if d]
    assert documents and all("apiVersion" in d and "kind" in d for d in documents), manifest
    containers = []

    def walk(node):
        if isinstance(node, dict):
            containers.extend(c for c in node.get("containers", []) if isinstance(c, dict))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(documents)
    assert containers, f"{manifest}: no container"
    problems: list[str] = []
    for container in containers:
        words = [str(w) for w in container.get("command", []) + container.get("args", [])]
        env = {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}
        check_command(Command(manifest, 0, words, env), problems, set())
        for value in env.values():
            for path in REPO_PATH.findall(value):
                if not (ROOT / path).exists():
                    problems.append(f"{manifest}: {path}: no such file or folder in the repository")
    assert not problems, "\n".join(problems)


def requirement_names(lines: list[str]) -> dict[str, str]:
    """{normalised name: specifier} of requirement lines (comments and blanks dropped)."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.match(r"[A-Za-z0-9._-]+", line).group(0)
            out[re.sub(r"[-_.]+", "-", name).lower()] = line[len(name):].strip()
    return out


def test_pyproject_lists_what_the_requirements_files_list():
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = requirement_names(project["dependencies"])
    required = requirement_names((ROOT / "requirements.txt").read_text().splitlines())
    assert set(deps) == set(required), f"only in pyproject.toml: {set(deps) - set(required)}; " \
                                       f"only in requirements.txt: {set(required) - set(deps)}"
    for name, spec in required.items():
        if name == "torch":  # pinned there; a range here that the pinned build satisfies (pip keeps it)
            assert "2.13.0" in SpecifierSet(deps[name]), f"pyproject.toml's torch range {deps[name]} excludes 2.13.0"
        else:
            assert SpecifierSet(deps[name]) == SpecifierSet(spec), f"{name}: {deps[name]} in pyproject.toml, " \
                                                                   f"{spec} in requirements.txt"
    extras = project["optional-dependencies"]
    bench = requirement_names((ROOT / "requirements-bench.txt").read_text().splitlines())
    assert requirement_names(extras["bench"]) == bench
    gpu = requirement_names((ROOT / "requirements-gpu.txt").read_text().splitlines())
    gpu.pop("sglang")  # installed by itself first (docs/gpu.md), never through the extra
    assert requirement_names(extras["gpu"]) == gpu
    assert project["scripts"]["infinite-rl-plot"] == "train.utils.plot:main"


def test_the_environment_written_on_the_docs_scores_the_stub_s_replies():
    """docs/environments.md's `environments/exact.py` must reward what the stub model writes."""
    blocks = [lines for lang, lines in fenced_blocks("docs/environments.md")
              if lang == "python" and lines and lines[0][1].strip() == "# environments/exact.py"]
    assert len(blocks) == 1
    env: dict = {}
    exec(compile("\n".join(text for _, text in blocks[0]), "exact.py", "exec"), env)

    def score(reply: str, answer="68") -> float:
        return env["reward_fn"]([{"role": "user", "content": "23 + 45"}, {"role": "assistant", "content": reply}],
                                answer)

    assert env["interact"]([]) == []
    assert score("<answer>68</answer>") == 1.0  # the stub's format
    assert score("68") == 1.0
    assert score("<answer>67</answer>") == 0.0 and score("<answer>6</answer>8") == 0.0


@pytest.mark.parametrize("doc", DOCS)
def test_every_page_says_how_its_commands_run(doc):
    """The convention, near the top of every page with commands: from the repository root, after
    the README's set-up, with `.venv/bin/...` (or an activated venv)."""
    text = (ROOT / doc).read_text()
    if not any(lang in SHELL for lang, _ in fenced_blocks(doc)):
        return
    head = "\n".join(text.splitlines()[:25])
    assert "source .venv/bin/activate" in head, f"{doc}: say in its first lines how its commands run"


def test_curricula_have_a_command_to_copy():
    """docs/data.md described the curriculum policies in a table with nothing to run (issue 33): a
    trainer command there sets a policy (its keys and files are checked with every other command)."""
    found = [c for lang, lines in fenced_blocks("docs/data.md") if lang in SHELL
             for c in commands("docs/data.md", lines) if isinstance(c, Command)]
    assert any(TRAINER in c.words and any(w.startswith("data.curriculum.policy=") for w in c.words) for c in found)


TEST_REF = re.compile(r"(tests/[\w/]+\.py)(::[\w*]+)?|(?<![\w/])::([\w*]+)")


def missing_tests(text: str, where: str) -> list[str]:
    """Problems with the `tests/x.py::test_name` references of one text: a file that does not exist, a
    test the file does not define (`test_gae*`: some test starting so). A bare `::name` continues the
    last file named on the same line, as the tables write it."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        current = None
        for match in TEST_REF.finditer(line):
            path, name = match.group(1), (match.group(2) or "")[2:] or match.group(3)
            if path:
                current = path
                if not (ROOT / path).is_file():
                    problems.append(f"{where}:{number}: {path} does not exist")
                    current = None
                    continue
            if not name or current is None:
                continue
            source = (ROOT / current).read_text()
            end = "" if name.endswith("*") else r"\("
            pattern = r"^\s*(?:async\s+)?def " + re.escape(name.rstrip("*")) + end
            if not re.search(pattern, source, re.M):
                problems.append(f"{where}:{number}: {current} defines no {name}")
    return problems


def test_every_test_the_docs_name_exists():
    """The rule -> mechanism -> test tables and the prose name tests by path and name; a renamed or
    moved test must take its references with it."""
    pages = [*DOCS, "tests/README.md"]
    problems = [p for doc in pages for p in missing_tests((ROOT / doc).read_text(), doc)]
    assert not problems, "\n".join(problems)
    planted = "`tests/unit/test_algorithms.py::test_no_such_thing`, `::test_gae*`, `tests/unit/gone.py`"
    assert missing_tests(planted, "planted") == [
        "planted:1: tests/unit/test_algorithms.py defines no test_no_such_thing",
        "planted:1: tests/unit/gone.py does not exist"]
