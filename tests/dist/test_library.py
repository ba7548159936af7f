"""The toolkit as a library (issue 24): the example in docs/library.md, taken from the page itself so the
two cannot drift, runs as a plain HF Trainer script on 2 CPU ranks through the real launcher; then
`toolkit report` reads the run directory the callback wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _net import free_port

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "library.md"


def doc_example() -> str:
    """The first ```python block under "## Example" in docs/library.md."""
    text = DOC.read_text()
    section = text[text.index("\n## Example"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "docs/library.md has no python block under ## Example"
    return m.group(1)


def test_example_is_short_and_complete() -> None:
    code = doc_example()
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) <= 12, "the docs promise a short example"
    assert "from toolkit import ToolkitCallback" in code and "trainer.train()" in code
    compile(code, str(DOC), "exec")


@pytest.mark.timeout(900)
def test_doc_example_runs_on_two_cpu_ranks_and_toolkit_report_reads_it(tmp_path: Path) -> None:
    if shutil.which("deepspeed") is None:
        pytest.skip("deepspeed launcher not on PATH")
    script = tmp_path / "train_mine.py"
    script.write_text(doc_example())
    shutil.copytree(REPO / "ds_configs", tmp_path / "ds_configs")  # the example's relative path
    env = os.environ | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    p = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port), str(script)],
                       capture_output=True, text=True, timeout=800, env=env, cwd=tmp_path)
    log = (p.stdout + p.stderr)[-6000:]
    assert p.returncode == 0, log
    # DeepSpeed's CPU allreduce files for this launch are gone (it never unlinks them; the callback does)
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    run = tmp_path / "runs" / "mine"

    # per-rank memory: every rank its own file, the phases and the step snapshot at memory_every=10
    for rank in (0, 1):
        rows = [json.loads(x) for x in (run / "memory" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [r["phase"] for r in rows] == ["engine_ready", "first_step", "step", "final"]
        assert all(r["rank"] == rank and r["host_rss_gib"] > 0 for r in rows)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert all(m["loss"] > 0 and m["grad_norm"] is not None and m["samples_per_s"] > 0 for m in metrics)
    assert metrics[0]["loss"] == pytest.approx(6.9, abs=0.5)  # ln(1000): a fresh model on 1000 tokens
    ds = json.loads((run / "ds_config.json").read_text())
    assert "auto" not in json.dumps(ds) and ds["train_batch_size"] == 4 * 1 * 2
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    assert "toolkit report runs/mine" in p.stdout  # the closing summary says what to run next

    r = subprocess.run([sys.executable, "-m", "toolkit", "report", str(run)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    report = (run / "report.md").read_text()
    assert "hf-trainer" in report and "8 (micro 4 x accum 1 x dp 2)" in report
    assert "10 (steps 1..10)" in report and "nothing skipped" in report
    assert (run / "report.png").stat().st_size > 0
