"""Shared by the distributed tests that put many runs in one `deepspeed` launch (tests/dist/_multi_train.py)
and compare an export with the engine's logits."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _net import free_port

ROOT = Path(__file__).resolve().parents[2]


FAILED = "failed_runs.json"  # beside the launches: every run of them that failed, with why; read by Runs


class RunFailed(Exception):
    """Raised by a shared launch's helpers where a test reads a run that failed (pytest.fail's message names it)."""


def _failed(tmp: Path) -> dict[str, str]:
    f = tmp / FAILED
    return json.loads(f.read_text()) if f.exists() else {}


def check_run(tmp: Path, name: str) -> None:
    """Fail the calling test, naming the run, when run `name` of a shared launch under `tmp` failed."""
    why = _failed(tmp).get(name)
    if why is not None:
        pytest.fail(f"run {name} of the shared launch failed: {why}", pytrace=False)


class Runs(type(Path())):  # PosixPath: subclassing Path itself needs Python 3.12
    """A shared launch's folder. `runs / NAME` fails the test that reads run NAME when that run failed, naming it
    and why; every other run reads as a plain Path. So one red run of the 78 in a launch is the red tests that read
    it, not every test of the file."""

    def __truediv__(self, key: str | os.PathLike[str]) -> Path:
        check_run(Path(self), str(key))
        return Path(self) / key

    def joinpath(self, *keys: str | os.PathLike[str]) -> Path:
        if keys:
            check_run(Path(self), str(keys[0]))
        return Path(self).joinpath(*keys)


def _outcomes(prefix: Path, gpus: int) -> dict[int, dict[int, dict]]:
    """index -> rank -> that rank's last record of the run ("start", or its end with rc and expect_rc)."""
    got: dict[int, dict[int, dict]] = {}
    for rank in range(gpus):
        f = prefix.with_name(f"{prefix.name}.rank{rank}.jsonl")
        for line in f.read_text().splitlines() if f.exists() else []:
            with contextlib.suppress(json.JSONDecodeError):  # a rank killed mid-write leaves half a line
                rec = json.loads(line)
                got.setdefault(rec["i"], {})[rank] = rec
    return got


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launch(tmp: Path, runs: list[dict], gpus: int = 2, name: str = "launch", timeout: int = 900,
           env: dict[str, str] | None = None) -> list[int]:
    """Every run in one launch of `gpus` CPU ranks; NAME.json holds the runs, NAME.log the output. Each rank records
    every run's start and end (tests/dist/_multi_train.py); a run that ends otherwise than it should, on any rank,
    goes into failed_runs.json and fails only the tests that read it (Runs, run_logs). A run that takes its
    processes down (a rank killed, the watchdog's exit) is failed, and the runs after it go on in a new launch. A
    launch past `timeout` in all is killed: the run it was in and those after fail. Returns the master ports used
    (DeepSpeed names its shared-memory files by them)."""
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(runs))
    prefix = tmp / f"{name}.outcomes"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "TOOLKIT_CACHE": str(tmp / "cache"),
                        **(env or {}), "TOOLKIT_TEST_OUTCOMES": str(prefix)}
    failed = _failed(tmp)
    deadline = time.monotonic() + timeout
    pending = list(range(len(runs)))
    ports: list[int] = []
    while pending:
        part = spec if len(ports) == 0 else tmp / f"{name}.relaunch{len(ports)}.json"
        part.write_text(json.dumps([{**runs[i], "i": i} for i in pending]))
        log = part.with_suffix(".log")  # a relaunch's own log: run_logs reads a rerun run's output from there
        port = free_port()
        ports.append(port)
        cmd = ["deepspeed", "--num_gpus", str(gpus), "--master_port", str(port),
               str(ROOT / "tests/dist/_multi_train.py"), str(part)]
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
        got = _outcomes(prefix, gpus)
        ended = [i for i in pending if len(got.get(i, {})) == gpus and all("rc" in r for r in got[i].values())]
        missed = False  # a run here ended otherwise than it should: the launcher's exit 1 says so, nothing more
        for i in ended:
            bad = {rank: r for rank, r in got[i].items() if r["rc"] != r["expect_rc"]}
            if bad:
                missed = True
                failed[runs[i]["name"]] = "; ".join(
                    f"rank {rank} exited {r['rc']} (expected {r['expect_rc']}){': ' + r['error'] if r.get('error') else ''}"
                    for rank, r in sorted(bad.items())) + f" (see {log.name})"
        rest = [i for i in pending if i not in ended]
        if rest and rc is None:
            for i in rest:
                failed[runs[i]["name"]] = (f"the launch passed its {timeout} s in this run" if i == rest[0] else
                                           f"never ran: the launch passed its {timeout} s in run {runs[rest[0]]['name']}")
            rest = []
        elif rest:
            started = rest[0] in got  # the run the processes ended in; none started: the launch never got going
            if not started:
                (tmp / FAILED).write_text(json.dumps(failed, indent=1))
                pytest.fail(f"launcher exited {rc} before run {runs[rest[0]]['name']} started:\n{log.read_text()[-6000:]}")
            failed[runs[rest[0]]["name"]] = f"its processes ended (launcher exit {rc}) in this run (see {log.name})"
            rest = rest[1:]
        elif rc != 0 and not (missed and rc == 1):
            (tmp / FAILED).write_text(json.dumps(failed, indent=1))
            pytest.fail(f"every run ended as it should, yet the launcher exited {rc}:\n{log.read_text()[-6000:]}")
        pending = rest
    (tmp / FAILED).write_text(json.dumps(failed, indent=1))
    return ports


class RunLogs(dict):
    """run_logs' answer: reading a run that failed fails the test, naming it (as Runs does)."""

    def __init__(self, tmp: Path, parts: dict[str, str]) -> None:
        super().__init__(parts)
        self.tmp = tmp

    def __getitem__(self, name: str) -> str:
        check_run(self.tmp, name)
        return super().__getitem__(name)


def _parts(log: Path) -> dict[str, str]:
    text = log.read_text(errors="replace")
    starts: dict[str, int] = {}
    for m in re.finditer(r"^=== run (\S+)$", text, flags=re.M):
        starts.setdefault(m.group(1), m.start())
    bounds = [*sorted(starts.values()), len(text)]
    return {name: text[at:bounds[bounds.index(at) + 1]] for name, at in starts.items()}


def run_logs(log: Path) -> dict[str, str]:
    """A shared launch's output by run: from a run's first `=== run NAME` line to the next run's first one. Rank 0
    prints a run's console; the other ranks only their marker, and no rank starts a run before every rank has
    ended the one before (its collectives), so a run's start-of-run lines never fall in another's part. A run that
    a relaunch ran again (NAME.relaunchK.log, after a run that took the processes down) is read from there."""
    parts = _parts(log)
    for again in sorted(log.parent.glob(f"{log.stem}.relaunch*.log"), key=lambda f: int(f.stem.rsplit("relaunch")[1])):
        parts |= _parts(again)
    return RunLogs(log.parent, parts)


def reload_logits(run_dir: Path, kind: str = "export") -> None:
    """In a fresh process: load the export (or base + adapter) and compare with the engine's logits (probe.pt)."""
    code = f"""
import torch, sys
sys.path.insert(0, {str(ROOT)!r})
probe = torch.load({str(run_dir / 'probe.pt')!r})
if {kind!r} == "export":
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained({str(run_dir / 'export')!r})
else:
    from peft import PeftModel
    from toolkit.config.schema import load_config
    from toolkit.runtime.model import build_model, model_config
    cfg = load_config({str(run_dir / 'config.yaml')!r}, ["lora.enabled=false"])
    base = build_model(cfg, model_config(cfg))  # the seeded random-init preset
    model = PeftModel.from_pretrained(base, {str(run_dir / 'adapter')!r})
model.eval()
with torch.no_grad():
    logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
diff = (logits - probe["logits"]).abs().max().item()
print("max abs diff", diff)
assert diff < 1e-4, diff
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def write_chat(path: Path) -> Path:
    """96 chat rows (a user turn, an assistant answer); every 8th answer fills a 48-token row alone (cut to it),
    so packed batches hold rows of one document (sdpa's causal kernel) beside packed ones."""
    with path.open("w") as f:
        for i in range(96):
            answer = f"the {['cat', 'dog'][i % 2]} sat on the {['mat', 'log'][i % 3 % 2]}" * (1 if i % 8 else 8)
            f.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(["what did the", ["cat", "dog"][i % 2], "do"] + ["a"] * (i % 4))},
                {"role": "assistant", "content": answer}]}) + "\n")
    return path
