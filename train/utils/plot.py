"""Plot a run's ``metrics.jsonl`` as PNG curves.

    python -m train.utils.plot RUN_DIR_or_metrics.jsonl [-o OUT_DIR] [--keys k1 k2 ...]

Writes one PNG per metric (``rewards/test`` -> ``rewards_test.png``) and a ``summary.png`` grid of the
main curves (a mixture's per-source curves, ``rewards/test/math``, drawn with their total), into ``OUT_DIR`` (default: ``plots/`` next to ``metrics.jsonl``), and prints each path.
Metrics logged at only some steps (``rewards/test`` every ``test_freq``) are plotted at those steps;
non-numeric values are skipped; malformed lines are reported with their line number and skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

# The object-oriented API with the Agg canvas renders PNGs without pyplot, so importing this module
# never switches the importer's backend or touches pyplot's global figure registry.
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

SUMMARY_KEYS = (
    "rewards/train",
    "rewards/test",
    "actor/loss",
    "actor/grad_norm",
    "response_length/train",
    "time/step_s",
    "tools/call_rate",  # multi-turn runs only
)

Series = dict[str, tuple[list[float], list[float]]]


def read_metrics(path: Path) -> Series:
    """Map metric name -> (steps, values) sorted by step, keeping only finite numeric values."""
    # step -> value per metric: a resumed run may log a step again; the later value wins, and
    # sorting by step keeps the curve from zigzagging back.
    points: dict[str, dict[float, float]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                print(f"{path}: line {lineno}: skipped, invalid JSON: {e.msg}", file=sys.stderr)
                continue
            if not isinstance(record, dict) or not _is_number(record.get("step")):
                print(f"{path}: line {lineno}: skipped, expected an object with a numeric 'step'", file=sys.stderr)
                continue
            step = float(record["step"])
            for key, value in record.items():
                if key == "step" or not _is_number(value):
                    continue
                points.setdefault(key, {})[step] = float(value)
    return {key: (sorted(p), [p[s] for s in sorted(p)]) for key, p in points.items()}


def _is_number(value: object) -> bool:
    # bool is an int subclass but a flag, not a curve; NaN/inf would break axis limits.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _file_name(key: str) -> str:
    return key.replace("/", "_").replace("\\", "_") + ".png"


def _draw(ax: Axes, key: str, steps: list[float], values: list[float],
          parts: dict[str, tuple[list[float], list[float]]] | None = None) -> None:
    """One curve; `parts` (a mixture's per-source curves, `rewards/test/math`) drawn with it, labelled."""
    # Markers keep sparse metrics (a few test points) visible.
    marker = "o" if len(steps) <= 50 else None
    ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.2, label="all" if parts else None)
    for name, (part_steps, part_values) in (parts or {}).items():
        ax.plot(part_steps, part_values, marker=marker, markersize=2, linewidth=0.9, alpha=0.8, label=name)
    if parts:
        ax.legend(fontsize="small")
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)


def _parts(series: Series, key: str) -> dict[str, tuple[list[float], list[float]]]:
    """The per-source curves of `key` (`rewards/train/<source>`), by source."""
    prefix = key + "/"
    return {k[len(prefix):]: v for k, v in sorted(series.items()) if k.startswith(prefix) and "/" not in k[len(prefix):]}


def _figure(figsize: tuple[float, float]) -> Figure:
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)  # attaches itself to fig
    return fig


def plot_metrics(metrics_path: Path, out_dir: Path, keys: list[str] | None = None) -> list[Path]:
    """Write the PNGs for ``metrics_path`` into ``out_dir``; return the written paths."""
    series = read_metrics(metrics_path)
    if keys:
        missing = [k for k in keys if k not in series]
        for k in missing:
            print(f"{metrics_path}: no numeric values for {k!r}", file=sys.stderr)
        series = {k: series[k] for k in keys if k in series}
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for key, (steps, values) in series.items():
        fig = _figure(figsize=(6, 4))
        _draw(fig.subplots(), key, steps, values, _parts(series, key))
        fig.tight_layout()
        path = out_dir / _file_name(key)
        fig.savefig(path, dpi=100)
        written.append(path)

    # --keys: those, in order; else the main curves, and pass@k at evaluation (trainer.test_samples)
    summary = list(series) if keys else [k for k in SUMMARY_KEYS if k in series] + sorted(
        (k for k in series if re.fullmatch(r"pass@\d+/test", k)), key=lambda k: int(k[5:-5]))
    if summary:
        cols = min(3, len(summary))
        rows = math.ceil(len(summary) / cols)
        fig = _figure(figsize=(5 * cols, 3.5 * rows))
        axes = fig.subplots(rows, cols, squeeze=False)
        for ax, key in zip(axes.flat, summary):
            _draw(ax, key, *series[key], _parts(series, key))
        for ax in list(axes.flat)[len(summary):]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / "summary.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.utils.plot", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run directory (holding metrics.jsonl) or a metrics.jsonl file")
    parser.add_argument("-o", "--out", dest="out_dir", help="output directory (default: plots/ beside metrics.jsonl)")
    parser.add_argument("--keys", nargs="+", help="plot only these metrics")
    args = parser.parse_args(argv)

    source = Path(args.source)
    metrics_path = source / "metrics.jsonl" if source.is_dir() else source
    if not metrics_path.is_file():
        print(f"{metrics_path}: no such file", file=sys.stderr)
        return 1
    out_dir = Path(args.out_dir) if args.out_dir else metrics_path.parent / "plots"
    written = plot_metrics(metrics_path, out_dir, args.keys)
    if not written:
        print(f"{metrics_path}: no numeric metrics to plot", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
