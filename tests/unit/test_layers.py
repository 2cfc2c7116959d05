"""The layers of `train/` (docs/design.md, "Layers"): a module imports only from its own layer or the
layers below it, and the modules' import graph has no cycle. Every `import train.x` / `from train.x
import y` counts, at module level or inside a function: a deferred import still ties the two modules
together. A package's `__init__` is its own node: importing `train.a.b` is an edge to `train.a.b`."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

# Low to high. Each entry is one layer: the folders (or top-level modules) of train/ that form it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils",),          # no project imports: small helpers (disk, hub, checksums, plots, lifecycle)
    ("algorithms",),     # RL math on plain tensors (advantages, losses, KL)
    ("parallel",),       # meshes, collectives, packing, the step batch, weight sync
    ("models",),         # the models that train (actor, critic, LoRA) and their loading
    ("datasets",),       # loading, the dataloader, tokenization, mixtures, curricula
    ("engines",),        # rollout engines (hf, sglang)
    ("workers",),        # rollout and its environments, the rollout ranks
    ("runtime",),        # checkpoints, export, run folder, watchdog, logging
    ("trainer",),        # the step loop and its config
    ("launch", "serve", "tinker_service", "eval"),  # entry points (tinker_service: the Tinker API)
)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "train") -> dict[str, set[str]]:
    """module -> the project modules it imports (at any depth of its code) under `root / package`."""
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target in files and target != name:
                    graph[name].add(target)
    return graph


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index of `module`'s layer (by its first folder under the package), None for the package's
    own `__init__` or a folder no layer names."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next((i for i, names in enumerate(layers) if parts[1] in names), None)


def unplaced(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Modules in no layer (a new folder must be given its place)."""
    return sorted(m for m in graph if "." in m and layer_of(m, layers) is None)


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import from a lower layer into a higher one, as 'importer -> imported'."""
    found = []
    for module, targets in sorted(graph.items()):
        low = layer_of(module, layers)
        for target in sorted(targets):
            high = layer_of(target, layers)
            if low is not None and high is not None and high > low:
                found.append(f"{module} ({layers[low][0]}) -> {target} ({layers[high][0]})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return found


def layer_problems(root: Path, package: str = "train", layers=LAYERS) -> list[str]:
    """Everything the layering rule forbids under `root / package`, one line each."""
    graph = import_graph(root, package)
    return ([f"in no layer: {m}" for m in unplaced(graph, layers)]
            + [f"upward import: {line}" for line in upward_imports(graph, layers)]
            + ["import cycle: " + " -> ".join(c) for c in cycles(graph)])


def test_every_module_of_train_sits_in_a_layer_and_imports_only_downward_without_cycles():
    graph = import_graph(ROOT)
    assert len(graph) > 30 and graph["train.trainer.grpo"]  # the walk found the package
    assert layer_problems(ROOT) == []


def test_every_layer_names_a_folder_or_module_that_exists_or_is_announced():
    present = {p.stem if p.is_file() else p.name for p in (ROOT / "train").iterdir()
               if (p.is_dir() and any(p.glob("*.py"))) or (p.suffix == ".py" and p.stem != "__init__")}
    named = {name for names in LAYERS for name in names}
    assert present <= named
    assert named - present <= {"algorithms"}  # train/algorithms/ arrives with the algorithms registry


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_fails_on_an_upward_import_even_inside_a_function(tmp_path):
    write_tree(tmp_path, {
        "train/__init__.py": "",
        "train/utils/disk.py": "def free():\n    from train.trainer.grpo import main\n",
        "train/trainer/grpo.py": "from train.utils.disk import free\n",
    })
    problems = layer_problems(tmp_path)
    assert "upward import: train.utils.disk (utils) -> train.trainer.grpo (trainer)" in problems
    assert "import cycle: train.trainer.grpo -> train.utils.disk -> train.trainer.grpo" in problems


def test_the_checker_fails_on_a_cycle_within_one_layer_and_on_a_folder_without_a_layer(tmp_path):
    write_tree(tmp_path, {
        "train/models/a.py": "import train.models.b\n",
        "train/models/b.py": "from train.models import a\n",
        "train/extras/x.py": "",
    })
    assert layer_problems(tmp_path) == ["in no layer: train.extras.x",
                                        "import cycle: train.models.a -> train.models.b -> train.models.a"]


def test_the_checker_accepts_downward_and_same_layer_imports(tmp_path):
    write_tree(tmp_path, {
        "train/utils/disk.py": "",
        "train/models/lora.py": "from train.utils import disk\n",
        "train/engines/hf.py": "def load():\n    from train.models.lora import x\n",
        "train/launch.py": "import train.engines.hf\nimport train.utils.disk\n",
    })
    assert layer_problems(tmp_path) == []
