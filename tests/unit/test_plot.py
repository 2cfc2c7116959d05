import json

from train.utils.plot import main, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(path):
    lines = []
    for step in range(1, 21):
        rec = {
            "step": step,
            "rewards/train": 0.1 + 0.02 * step,
            "actor/loss": 1.0 / step,
            "actor/grad_norm": 0.5 + (step % 3) * 0.1,
            "time/step_s": 1.5,
            "note": "text is skipped",
            "flag": True,
        }
        if step % 5 == 0:
            rec["rewards/test"] = 0.05 * step  # logged only every test_freq steps
        lines.append(json.dumps(rec))
    lines.insert(3, "{not json")  # line 4
    lines.append(json.dumps({"step": 21, "actor/loss": "nan?"}))
    lines.append(json.dumps({"step": 3, "actor/loss": 9.0}))  # re-logged after a resume
    path.write_text("\n".join(lines) + "\n")


def test_read_metrics_sparse_and_malformed(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    _write_metrics(path)
    series = read_metrics(path)
    assert series["rewards/test"][0] == [5.0, 10.0, 15.0, 20.0]
    assert len(series["rewards/train"][0]) == 20
    steps, losses = series["actor/loss"]
    assert steps == sorted(steps) and len(steps) == 20 and losses[2] == 9.0  # last value per step wins
    assert "note" not in series and "flag" not in series
    assert "line 4" in capsys.readouterr().err


def test_main_writes_pngs(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _write_metrics(run / "metrics.jsonl")
    out = tmp_path / "plots"
    assert main([str(run), "-o", str(out)]) == 0
    names = {"rewards_train.png", "rewards_test.png", "actor_loss.png", "actor_grad_norm.png", "time_step_s.png"}
    assert {p.name for p in out.iterdir()} == names | {"summary.png"}
    for p in out.iterdir():
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, p
    printed = capsys.readouterr()
    assert str(out / "summary.png") in printed.out
    assert "line 4" in printed.err


def test_main_keys_and_file_argument(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_metrics(path)
    assert main([str(path), "--keys", "actor/loss", "missing/key"]) == 0
    out = tmp_path / "plots"  # default: beside metrics.jsonl
    assert {p.name for p in out.iterdir()} == {"actor_loss.png", "summary.png"}


def test_main_missing_file(tmp_path):
    assert main([str(tmp_path / "none.jsonl")]) == 1


def test_summary_holds_the_chosen_keys(tmp_path):
    """--keys picks the summary's panels too (in the given order), even keys outside the default set."""
    from matplotlib.image import imread

    path = tmp_path / "metrics.jsonl"
    _write_metrics(path)
    assert main([str(path), "--keys", "rewards/test", "actor/grad_norm", "-o", str(tmp_path / "two")]) == 0
    assert main([str(path), "-o", str(tmp_path / "default")]) == 0
    width = {name: imread(tmp_path / name / "summary.png").shape[1] for name in ("two", "default")}
    assert width == {"two": 2 * 500, "default": 3 * 500}  # 5 inches per column at 100 dpi
