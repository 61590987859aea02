"""Metrics log and the learning-curve table (no Ray)."""

import json
from pathlib import Path

import yaml

from ray_forge.config import to_dict
from ray_forge.config.schema import EnvConfig, JobConfig
from ray_forge.observe.metrics import MetricsLog, read_metrics


def test_metrics_rows_are_flushed_and_readable(tmp_path):
    log = MetricsLog(tmp_path, total_steps=2, progress=False)
    log.log(1, train_reward=-0.3, num_games=64, loss=float("nan"))
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["loss"] is None  # NaN becomes null, still valid JSON
    log.log(2, train_reward=-0.2, num_games=64, eval_return=-0.1, eval_agreement=0.6)
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["wall_time_s"] >= rows[0]["wall_time_s"]


def test_learning_curve_table(tmp_path):
    from jobs import learning_curve

    log = MetricsLog(tmp_path, total_steps=2, progress=False)
    log.log(1, num_games=64)
    log.log(2, num_games=64, eval_return=-0.0612, eval_agreement=0.9)
    log.close()
    (tmp_path / "eval.json").write_text(json.dumps(dict(exact_return=-0.06, mc_return=-0.05, mc_stderr=0.01,
                                                         eval_return=-0.06, eval_agreement=0.9, eval_policy_version=2)))
    table = learning_curve.curve_table(tmp_path)
    assert table.splitlines()[0] == "| step | games | wall time | return | agreement |"  # the env's metrics, return first
    assert "| 2 | 128 | 0:00 | -0.0612 | 0.9000 |" in table
    assert "Final policy: return **-0.0600**, agreement **0.9000**." in table


def test_runs_side_by_side_png(tmp_path, capsys):
    from pictures import png_size

    from jobs import learning_curve

    for name, restarts in (("chaos", [0, 1, 3]), ("plain", [0, 0, 0])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump(to_dict(JobConfig(env=EnvConfig(name="blackjack")))))
        log = MetricsLog(tmp_path / name, total_steps=3, progress=False)
        for step, count in enumerate(restarts, 1):
            log.log(step, num_games=64, actor_restarts=count, eval_return=-0.1 + 0.01 * step)
        log.close()
    out = tmp_path / "side.png"
    learning_curve.main([str(tmp_path / "chaos"), "--beside", str(tmp_path / "plain"), "--png", str(out),
                         "--labels", "killed", "undisturbed"])
    assert png_size(out) == (1200, 800) and str(out) in capsys.readouterr().out


def test_the_grafana_dashboard_charts_every_exported_metric():
    import json
    import re

    from ray_forge.observe.metrics import EXPORTED

    dashboard = json.loads((Path(__file__).resolve().parent.parent / "cluster/grafana-dashboard.json").read_text())
    charted = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"ray_forge_(\w+)\{", t["expr"])}
    assert charted == set(EXPORTED)
    assert all('run=~"$run"' in t["expr"] for p in dashboard["panels"] for t in p["targets"])
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "run"}


def test_progress_off_a_terminal_is_whole_lines():
    """What `ray job logs` shows: one readable line per interval and at the end, never a redraw."""
    import io

    from ray_forge.observe.metrics import PlainProgress

    out = io.StringIO()
    bar = PlainProgress(total=3, file=out, interval_s=3600)
    for step in range(1, 4):
        bar.set_postfix({"reward": f"{-0.1 * step:.4g}"})
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 1 and lines[0].startswith("GRPO step 3/3 (100%),") and lines[0].endswith("reward=-0.3")
    every = io.StringIO()
    bar = PlainProgress(total=3, file=every, interval_s=0)
    for _ in range(3):
        bar.update(1)
    assert [line.split(",")[0] for line in every.getvalue().splitlines()] == [f"GRPO step {i}/3 ({100 * i // 3}%)"
                                                                             for i in (1, 2, 3)]


def test_every_row_reaches_tensorboard_and_an_offline_wandb_run_at_its_step(tmp_path, monkeypatch, caplog):
    """The same rows at the same steps, read back with TensorBoard's reader and from wandb's
    record file; wandb without an API key runs offline and says so (no network is touched)."""
    from tracker_files import assert_trackers_hold_every_scalar

    from ray_forge.observe.trackers import open_trackers

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with caplog.at_level("INFO"):
        trackers = open_trackers(("jsonl", "tensorboard", "wandb"), tmp_path, {"run": {"steps": 3}}, resumed_at=0)
    assert "wandb: offline (no WANDB_API_KEY)" in caplog.text
    log = MetricsLog(tmp_path, total_steps=3, progress=False, trackers=trackers)
    for step in (1, 2, 3):
        log.log(step, train_reward=-0.3 + 0.1 * step, loss=1.0 / step, num_games=64, skipped=False,
                eval_return=-0.06 if step == 3 else None)
    log.images([_png(tmp_path / "learning_curve.png")], step=3)
    log.close()
    assert_trackers_hold_every_scalar(tmp_path, images={"learning_curve"})


def _png(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(2, 2))
    plt.plot([0, 1], [0, 1])
    fig.savefig(path)
    plt.close(fig)
    return path
