"""Shared by the distributed tests that put many runs in one `deepspeed` launch (tests/dist/_multi_train.py)
and compare an export with the engine's logits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _net import free_port

ROOT = Path(__file__).resolve().parents[2]


def launch(tmp: Path, runs: list[dict], gpus: int = 2, name: str = "launch", timeout: int = 900) -> int:
    """Every run in one launch of `gpus` CPU ranks; NAME.json holds the runs, NAME.log the output. A launcher that
    exits non-zero (a run that should have passed did not, or a hang past `timeout`) fails the caller. Returns
    the master port (DeepSpeed names its shared-memory files by it)."""
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(runs))
    env = os.environ | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "TOOLKIT_CACHE": str(tmp / "cache")}
    port = free_port()
    cmd = ["deepspeed", "--num_gpus", str(gpus), "--master_port", str(port),
           str(ROOT / "tests/dist/_multi_train.py"), str(spec)]
    log = tmp / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"launcher exited {proc.returncode}:\n{log.read_text()[-6000:]}")
    return port


def run_logs(log: Path) -> dict[str, str]:
    """A shared launch's output by run: from a run's first `=== run NAME` line to the next run's first one. Rank 0
    prints a run's console; the other ranks only their marker, and no rank starts a run before every rank has
    ended the one before (its collectives), so a run's start-of-run lines never fall in another's part."""
    text = log.read_text(errors="replace")
    starts: dict[str, int] = {}
    for m in re.finditer(r"^=== run (\S+)$", text, flags=re.M):
        starts.setdefault(m.group(1), m.start())
    bounds = [*sorted(starts.values()), len(text)]
    return {name: text[at:bounds[bounds.index(at) + 1]] for name, at in starts.items()}


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
