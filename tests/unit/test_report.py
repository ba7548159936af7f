"""`toolkit report` on fabricated run dirs: one run with bad lines (reports what it can, names what it
skipped), two runs compared (settings diff, refusal of different workloads), bad input (one line, exit 1)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from toolkit.observe.report import run_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _snap(rank: int, phase: str, step: int, alloc: float | None, **extra: object) -> dict:
    gpu = alloc is not None
    row = {
        "ts": 1000.0 + step,
        "rank": rank,
        "local_rank": rank,
        "phase": phase,
        "step": step,
        "allocated_gib": alloc,
        "reserved_gib": alloc + 1 if gpu else None,
        "peak_allocated_gib": alloc + 0.5 if gpu else None,
        "peak_reserved_gib": alloc + 1.5 if gpu else None,
        "nvml_used_gib": alloc + 2 if gpu else None,
        "host_rss_gib": 1.0 + rank,
        "alloc_retries": 0 if gpu else None,
        "oom_count": 0 if gpu else None,
        "device": f"cuda:{rank}" if gpu else "cpu",
    }
    row.update(extra)
    return row


def report(*run_dirs: Path | str, output: Path | str | None = None, force: bool = False) -> int:
    return run_report(Namespace(run_dirs=[str(d) for d in run_dirs], output=output, force=force))


def make_run(tmp_path: Path, gpu: bool = True, name: str = "run") -> Path:
    run = tmp_path / name
    (run / "memory").mkdir(parents=True)
    for rank in (0, 1):
        base = (2.0 + rank) if gpu else None

        def a(x: float, base: float | None = base) -> float | None:
            return None if base is None else base + x

        rows = [
            _snap(rank, "model_loaded", 0, a(0)),
            _snap(rank, "engine_ready", 0, a(1)),
            _snap(rank, "first_step", 1, a(2)),
            _snap(rank, "step", 2, a(2)),
            _snap(rank, "step", 4, a(2.5)),
            _snap(rank, "final", 5, a(2)),
        ]
        lines = [json.dumps(r) for r in rows]
        if rank == 0:
            lines.insert(3, "this is not json {")  # corrupt line 4
            partial = _snap(rank, "step", 3, a(2.1))
            del partial["reserved_gib"]  # line 5: kept, with a missing field noted
            lines.insert(4, json.dumps(partial))
            no_phase = _snap(rank, "step", 3, a(2.1))
            del no_phase["phase"]  # line 6: skipped, missing required field
            lines.insert(5, json.dumps(no_phase))
            text = "\n".join(lines) + "\n"
        else:
            # Truncated last line: the writer died mid-write.
            text = "\n".join(lines) + "\n" + json.dumps(_snap(rank, "step", 6, a(3)))[:40]
        (run / "memory" / f"rank{rank}.jsonl").write_text(text)
    metrics = [
        {
            "step": s,
            "loss": 7.0 - s,
            "lr": 1e-3,
            "tokens_per_s": 100.0 * s,
            "samples_per_s": float(s),
            "grad_norm": None,
            "mfu": 0.1 * s if gpu else None,
            "elapsed_s": float(s),
        }
        for s in range(1, 6)
    ]
    mlines = [json.dumps(m) for m in metrics]
    mlines.insert(2, json.dumps({"loss": 1.0}))  # no step: skipped (line 3)
    (run / "metrics.jsonl").write_text("\n".join(mlines) + "\n")
    (run / "ds_config.json").write_text(
        json.dumps(
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            }
        )
    )
    (run / "config.yaml").write_text(
        "train:\n  path: raw\n  precision: bf16\n  micro_batch_size: 4\n  run_dir: /elsewhere/run\n"
        "model:\n  name: tiny\ndata:\n  source: synthetic\n  seq_len: 64\n"
    )
    (run / "versions.json").write_text(
        json.dumps({"torch": "2.13.0", "deepspeed": "0.19.8", "world_size": 2})
    )
    return run


def test_report_on_fake_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path)
    assert report(run) == 0
    out = capsys.readouterr().out
    png = run / "report.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    md = (run / "report.md").read_text()
    assert "](report.png)" in md  # relative link: the report travels with the run dir
    for text in (out, md):
        assert "memory/rank0.jsonl:4: not JSON" in text
        assert "memory/rank0.jsonl:5: missing reserved_gib (shown as -) (line kept)" in text
        assert "memory/rank0.jsonl:6: missing field phase" in text
        assert "memory/rank1.jsonl:7: truncated last line" in text
        assert "metrics.jsonl:3: missing field step" in text
        assert "zero stage" in text and "| 3 " in text
        assert "offload optimizer" in text and "cpu" in text
    # Per-phase peaks: rank 1 first_step peak = 3 + 2 + 0.5; spread over ranks = 1.
    assert "5.50" in md and "spread" in md
    # Throughput medians exclude step 1: tokens/s over steps 2..5 -> median 350.
    assert "350.0" in md
    assert "2.0000 (step 5)" in md  # final loss
    assert "| median MFU (excl. first step)         | 35.0%" in md  # median of 0.2..0.5
    assert "/elsewhere" not in md


def test_report_cpu_run_plots_host_rss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path, gpu=False)
    out_dir = tmp_path / "out"
    assert report(run, output=out_dir) == 0
    assert (out_dir / "report.png").read_bytes()[:8] == PNG_MAGIC
    md = (out_dir / "report.md").read_text()
    assert "Host RSS per phase" in md
    out = capsys.readouterr().out
    assert "Host RSS per phase" in out
    assert "MFU: not recorded" in out
    assert not (run / "report.md").exists()


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_bad_input_is_one_line_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report(tmp_path / "nope") == 1
    assert "does not exist" in _one_error_line(capsys)
    (tmp_path / "file.txt").write_text("x")
    assert report(tmp_path / "file.txt") == 1
    assert "is not a directory" in _one_error_line(capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report(empty) == 1
    assert "is not a run directory" in _one_error_line(capsys)
    # a run directory whose every line is unreadable: still one line, naming the first problem
    (empty / "memory").mkdir()
    (empty / "memory" / "rank0.jsonl").write_text("garbage\nmore garbage\n")
    assert report(empty) == 1
    line = _one_error_line(capsys)
    assert "nothing to report" in line and "2 skipped" in line and "rank0.jsonl:1: not JSON" in line
    # in a comparison, the directory that is not a run is named and nothing is written
    run = make_run(tmp_path)
    assert report(run, tmp_path / "nope", output=tmp_path / "cmp") == 1
    assert "nope does not exist" in _one_error_line(capsys)
    assert not (tmp_path / "cmp").exists()


def _variant(tmp_path: Path, name: str, stage: int, micro: int, config: dict[str, str] | None = None) -> Path:
    """A copy of the fabricated run with another ZeRO stage and micro batch (and config overrides)."""
    run = make_run(tmp_path, name=name)
    ds = json.loads((run / "ds_config.json").read_text())
    ds["zero_optimization"]["stage"] = stage
    ds["train_micro_batch_size_per_gpu"] = micro
    if stage == 3:
        ds["zero_optimization"]["stage3_max_live_parameters"] = 1e9
    (run / "ds_config.json").write_text(json.dumps(ds))
    text = (run / "config.yaml").read_text().replace("micro_batch_size: 4", f"micro_batch_size: {micro}")
    text = text.replace("run_dir: /elsewhere/run", f"run_dir: /elsewhere/{name}")
    for key, value in (config or {}).items():
        text = text.replace(f"{key}: ", f"{key}: {value} #")
    (run / "config.yaml").write_text(text)
    return run


def test_compare_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _variant(tmp_path, "z2", stage=2, micro=4)
    b = _variant(tmp_path, "z3", stage=3, micro=8)
    metrics = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    (b / "metrics.jsonl").write_text(
        "".join(
            json.dumps(m | {"tokens_per_s": 2 * m["tokens_per_s"]}) + "\n" for m in metrics if "step" in m
        )
    )
    out_dir = tmp_path / "cmp"
    assert report(a, b, output=out_dir) == 0
    out = capsys.readouterr().out
    assert (out_dir / "compare.png").read_bytes()[:8] == PNG_MAGIC
    md = (out_dir / "compare.md").read_text()
    assert "](compare.png)" in md
    section = md.split("## Settings that differ")[1].split("## Results")[0]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| setting")
    }
    # exactly the settings that differ; run_dir (different for every run) is not one of them
    assert rows == {
        "train.micro_batch_size": ["4", "8"],
        "ds_config: train_micro_batch_size_per_gpu": ["4", "8"],
        "ds_config: zero_optimization.stage": ["2", "3"],
        "ds_config: zero_optimization.stage3_max_live_parameters": ["(absent)", "1000000000.0"],
    }
    results = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in md.split("## Results")[1].splitlines()
        if line.startswith("| z")
    }
    # last step, median tokens/s after step 1, vs first, MFU, per-rank peak, final loss
    assert results["z2"] == ["5", "350", "1.00x", "35.0%", "5.00 / 6.00 (allocated)", "2.0000"]
    assert results["z3"] == ["5", "700", "2.00x", "35.0%", "5.00 / 6.00 (allocated)", "2.0000"]
    assert "Settings that differ" in out and "wrote" in out


def test_compare_refuses_other_models_or_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _variant(tmp_path, "tiny", stage=2, micro=4)
    b = _variant(tmp_path, "other", stage=2, micro=4, config={"name": "gpt2-124m", "seq_len": "128"})
    out_dir = tmp_path / "cmp"
    assert report(a, b, output=out_dir) == 1
    line = _one_error_line(capsys)
    assert "model.name: tiny vs gpt2-124m" in line and "data.seq_len: 64 vs 128" in line and "--force" in line
    assert not out_dir.exists()
    assert report(a, b, output=out_dir, force=True) == 0
    assert "compared with --force" in (out_dir / "compare.md").read_text()
    capsys.readouterr()
    # no config.yaml: the workload cannot be checked, so the same refusal applies
    (b / "config.yaml").unlink()
    assert report(a, b, output=out_dir) == 1
    assert "no readable config.yaml" in _one_error_line(capsys)


def _report_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", "report", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_on_copied_run_dirs(tmp_path: Path) -> None:
    make_run(tmp_path)
    # Copied from another machine, to a new place: relative paths, nothing absolute involved.
    elsewhere = tmp_path / "copied"
    shutil.copytree(tmp_path / "run", elsewhere / "run")
    res = _report_cli("run", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert "truncated last line" in res.stdout
    assert (elsewhere / "run" / "report.md").exists() and (elsewhere / "run" / "report.png").exists()
    shutil.copytree(elsewhere / "run", elsewhere / "run2")
    res = _report_cli("run", "run2", cwd=elsewhere)  # identical runs: comparable, nothing differs
    assert res.returncode == 0, res.stderr
    assert "no settings differ" in res.stdout
    assert (elsewhere / "compare.md").exists() and (elsewhere / "compare.png").exists()
    bad = _report_cli("missing", cwd=elsewhere)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_report_does_not_import_torch(tmp_path: Path) -> None:
    """Import and a full run of the report and a comparison (figures included): no torch, no deepspeed."""
    make_run(tmp_path)
    shutil.copytree(tmp_path / "run", tmp_path / "run2")
    code = f"""
import sys
from toolkit.cli import main
assert main(["report", {str(tmp_path / "run")!r}]) == 0
assert main(["report", {str(tmp_path / "run")!r}, {str(tmp_path / "run2")!r}, "-o", {str(tmp_path)!r}]) == 0
heavy = [m for m in ("torch", "deepspeed", "transformers") if m in sys.modules]
assert not heavy, heavy
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_report_of_a_moe_run_has_the_aux_loss_and_each_layers_expert_load(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path)
    lines = [json.dumps({"step": s, "loss": 3.0, "tokens_per_s": 100.0, "moe_aux_loss": aux, "expert_load": load})
             for s, aux, load in ((1, 2.1, [1.5, 1.2]), (2, 2.05, [2.4, 1.1]), (3, 2.0, [1.3, 1.0]))]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert report(run) == 0
    md = (run / "report.md").read_text()
    assert "## Mixture-of-Experts" in md and "first 2.1000, final 2.0000, median excl. first 2.0250" in md
    assert "| 0     |  1.50 |  1.30 | 2.40 (step 2) |" in md and "| 1     |  1.20 |  1.00 | 1.20 (step 1) |" in md
    dense = make_run(tmp_path, name="dense")
    assert report(dense) == 0 and "Mixture-of-Experts" not in (dense / "report.md").read_text()


def test_generation_lines_reach_the_report_and_the_summary(tmp_path: Path) -> None:
    from toolkit.observe.metrics import closing_summary

    run = make_run(tmp_path)
    gen = {"step": 3, "gen_prompts": 4, "gen_new_tokens": 60, "gen_s": 2.0, "gen_tokens_per_s": 30.0,
           "gen_path": "whole-model gather", "gen_batch_size": 2, "gen_exact_match": 0.5}
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(gen) + "\n")
    assert report(run) == 0
    md = (run / "report.md").read_text()
    assert "generate (step 3)" in md and "4 prompts, 60 new tokens, 30.0 tokens/s, whole-model gather, exact match 0.500" in md
    history = [{"step": 1, "loss": 2.0, "tokens_per_s": 10.0, "elapsed_s": 1.0}, gen]
    text = closing_summary(history, run, 3, 3, {}, False)
    assert "generate    4 prompts, 30 new tokens/s (whole-model gather, step 3), exact match 0.500" in text
    assert "loss        2.0000 (step 1)" in text  # the generation line is not a loss line


def test_a_preference_run_shows_its_accuracy_and_margin(tmp_path: Path) -> None:
    from toolkit.observe.metrics import closing_summary

    run = make_run(tmp_path)
    lines = [{"step": s, "loss": 0.69 - 0.1 * s, "tokens_per_s": 100.0, "rewards/accuracies": acc,
              "rewards/margins": margin, "rewards/chosen": 0.0, "rewards/rejected": 0.0}
             for s, acc, margin in ((1, 0.0, 0.0), (2, 0.5, 0.01), (3, 0.875, 0.2))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert report(run) == 0
    md = (run / "report.md").read_text()
    assert "preference accuracy" in md and "0.000 (step 1) -> 0.875 (step 3)" in md
    text = closing_summary(lines, run, 3, 3, {}, False)
    assert "preference  accuracy 0.000 -> 0.875, reward margin 0.0000 -> 0.2000" in text


def test_a_preference_runs_plot_shows_its_reward_accuracy_and_the_held_out_one(tmp_path: Path) -> None:
    from toolkit.observe.plot import _pyplot, plot_preference
    from toolkit.observe.rundata import load_run

    run = make_run(tmp_path)
    lines = [{"step": s, "loss": 0.69 - 0.1 * s, "tokens_per_s": 100.0, "rewards/accuracies": acc, "rewards/margins": acc}
             for s, acc in ((1, 0.0), (2, 0.5), (3, 0.875))]
    held = {"step": 3, "eval_loss": 0.5, "eval_pairs": 12, "eval_rewards/accuracies": 0.75, "eval_rewards/margins": 0.1}
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [*lines, held]))
    assert report(run, output=tmp_path / "out") == 0
    assert (tmp_path / "out" / "report.png").read_bytes()[:8] == PNG_MAGIC
    plt = _pyplot()
    fig, ax = plt.subplots()
    acc = plot_preference(ax, load_run(run))
    got = {line.get_label(): list(line.get_ydata()) for line in acc.get_lines()}
    assert got == {"reward accuracy": [0.0, 0.5, 0.875], "reward accuracy (held out)": [0.75]}
    plt.close(fig)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "tokens_per_s": 1.0}) + "\n")
    fig, ax = plt.subplots()
    assert plot_preference(ax, load_run(run)) is None  # an SFT run: no second axis
    plt.close(fig)


def test_an_rl_run_shows_its_reward_in_the_summary_and_the_plot(tmp_path: Path) -> None:
    from toolkit.observe.metrics import closing_summary
    from toolkit.observe.plot import _pyplot, plot_preference
    from toolkit.observe.rundata import load_run

    run = make_run(tmp_path)
    lines = [{"step": s, "loss": 0.0, "tokens_per_s": 100.0, "reward": r, "reward_std": 0.1,
              "frac_reward_zero_std": z, "completions/mean_length": 7.5}
             for s, r, z in ((1, 0.1, 0.5), (2, 0.2, 0.25), (3, 0.45, 0.25))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert report(run, output=tmp_path / "out") == 0
    text = closing_summary(lines, run, 3, 3, {}, False)
    assert "reward      0.1000 (step 1) -> 0.4500 (step 3), completions 7.5 tokens, 25% of groups" in text
    plt = _pyplot()
    fig, ax = plt.subplots()
    rew = plot_preference(ax, load_run(run))  # no reward accuracy: the RL axis
    assert {line.get_label(): list(line.get_ydata()) for line in rew.get_lines()} == {"mean reward": [0.1, 0.2, 0.45]}
    plt.close(fig)
