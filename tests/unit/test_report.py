"""`toolkit report` on a fabricated run dir with bad lines: reports what it can, names what it skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from toolkit.report import run_report

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


def make_run(tmp_path: Path, gpu: bool = True) -> Path:
    run = tmp_path / "run"
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
        "train:\n  path: raw\n  precision: bf16\n  run_dir: /elsewhere/run\nmodel:\n  name: tiny\n"
    )
    return run


def test_report_on_fake_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path)
    assert run_report(Namespace(run_dir=str(run), output=None)) == 0
    out = capsys.readouterr().out
    png = run / "memory.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    md = (run / "report.md").read_text()
    assert "](memory.png)" in md  # relative link: the report travels with the run dir
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
    assert "/elsewhere" not in md


def test_report_cpu_run_plots_host_rss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path, gpu=False)
    out_dir = tmp_path / "out"
    assert run_report(Namespace(run_dir=str(run), output=str(out_dir))) == 0
    assert (out_dir / "memory.png").read_bytes()[:8] == PNG_MAGIC
    md = (out_dir / "report.md").read_text()
    assert "Host RSS per phase" in md
    assert "Host RSS per phase" in capsys.readouterr().out


def test_missing_dir_one_line_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_report(Namespace(run_dir=str(tmp_path / "nope"), output=None)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "does not exist" in captured.err


def test_empty_dir_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_report(Namespace(run_dir=str(tmp_path), output=None)) == 1
    assert "nothing to report" in capsys.readouterr().err


def _report_cli(run_dir: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "toolkit", "report", run_dir], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_cli_subprocess(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    # Copied from another machine: relative cwd, no absolute paths involved.
    res = _report_cli("run", tmp_path)
    assert res.returncode == 0, res.stderr
    assert "truncated last line" in res.stdout
    assert (run / "report.md").exists() and (run / "memory.png").exists()
    bad = _report_cli("missing", tmp_path)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_report_does_not_import_torch() -> None:
    code = "import sys, toolkit.report, toolkit.cli; sys.exit(int('torch' in sys.modules or 'deepspeed' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
