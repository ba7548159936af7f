"""ZeRO-3 generation on 2 CPU ranks never hangs: uneven lengths (EOS) and uneven prompt counts.

One trained run picks an EOS token that ends rank 0's first prompt early while rank 1's prompts run
to max_new_tokens; both training paths, the stand-alone command and LoRA must then finish and match
a single-process greedy generation from the exported weights. The same setup with synced_gpus
forced off must hang (shown with a timeout, then the whole process group is killed).

Each launch costs ~30-40 s of imports on a 2-core machine, so the runs are few and tiny.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _net import free_port

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
MAX_NEW = 12
COMMON = [
    "train.max_steps=6",
    "data.num_samples=32",
    "data.seq_len=32",
    "memory.every=0",
    "eval.num_prompts=3",
    f"eval.max_new_tokens={MAX_NEW}",
]  # 3 prompts on 2 ranks: uneven counts
LAUNCH_TIMEOUT_S = 400

pytestmark = pytest.mark.dist


@dataclass
class Launch:
    rc: int | None  # None: still running when it was killed
    output: str


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the launcher and every rank (they share the session started for the launcher)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _group_gone(pgid: int, wait_s: float = 15.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def launch(
    script: str,
    args: list[str],
    *,
    timeout_s: float = LAUNCH_TIMEOUT_S,
    hang_after: str | None = None,
    hang_window_s: float = 0.0,
) -> Launch:
    """`deepspeed --num_gpus 2 <script> <args>` in its own process group; never outlives the call.

    With `hang_after`, returns rc=None if the run is still alive `hang_window_s` after printing that
    line (the window starts there, so slow imports or training on a busy machine do not count).
    """
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(WORLD),
        "--master_port",
        str(free_port()),
        str(REPO / script),
        *args,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    seen = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if hang_after is not None and hang_after in line:
                seen.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if seen.is_set():
                try:
                    proc.wait(timeout=hang_window_s)
                except subprocess.TimeoutExpired:
                    return Launch(None, "".join(lines))
                break
            time.sleep(0.2)
        if proc.poll() is None:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return Launch(None, "".join(lines))
    finally:
        _kill_group(proc)
        reader.join(timeout=5)
        assert _group_gone(proc.pid), "ranks of the launch are still running after SIGKILL"
    return Launch(proc.returncode, "".join(lines))


def _ok(run: Launch) -> str:
    assert run.rc == 0, run.output[-6000:]
    return run.output


def _regather_ds(path: Path) -> Path:
    """zero3.json, but every layer is re-gathered on every forward, as on a model too big to keep.

    With generous live/reuse limits (DeepSpeed's own defaults are 1e9 parameters; the tiny model has
    0.2M) the model stays gathered after its first forward, so later forwards need no collective,
    ranks never wait for each other, and a missing synced_gpus could not hang: the test would prove
    nothing. Zero limits make the test independent of how the shipped preset resolves them.
    """
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"].update(
        stage3_max_live_parameters=0,
        stage3_max_reuse_distance=0,
        stage3_prefetch_bucket_size=0,
        stage3_param_persistence_threshold=0,
    )
    path.write_text(json.dumps(ds, indent=2))
    return path


def _train_args(ds: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--ds", str(ds), *COMMON, f"train.run_dir={run_dir}", *extra]


def _expected_prompts() -> list[list[int]]:
    """What loops/run.py _finish must use: the masked prefix of the first 3 training rows."""
    from toolkit.config.schema import load_config
    from toolkit.runtime.data.batches import build_rows, even_rows
    from toolkit.runtime.generate import eval_prompts
    from toolkit.runtime.model import model_config

    cfg = load_config(None, COMMON)
    mc = model_config(cfg)
    rows, _ = build_rows(cfg, mc.vocab_size, mc.pad_token_id, None)
    rows = even_rows(rows, cfg.train.micro_batch_size * cfg.train.grad_accum, WORLD)
    return eval_prompts(rows, 3)


def _greedy(model: Any, prompts: list[list[int]], eos: int | None) -> list[list[int]]:
    """Single-process reference: plain HF generate, one prompt at a time, greedy."""
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            kw: dict[str, Any] = dict(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            if eos is not None:
                kw["eos_token_id"] = eos
            out.append(
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)[0, len(p) :].tolist()
            )
    return out


def _load_export(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _pick_eos(conts: list[list[int]]) -> int:
    """A token that ends prompt 0 (rank 0) early but never appears in prompts 1 and 2.

    shard_prompts deals prompts 0, 2 to rank 0 and 1, copy-of-2 to rank 1: rank 0 then makes fewer
    forwards than rank 1, which is exactly the case that hangs without synced_gpus.
    """
    others = set(conts[1]) | set(conts[2])
    for k, tok in enumerate(conts[0][: MAX_NEW - 2]):
        if tok not in others and tok not in conts[0][:k] and tok >= 4:
            return tok
    pytest.fail(f"no usable EOS in these continuations (did training change?): {conts}")


@dataclass
class Base:
    ds: Path
    export: Path
    prompts: list[list[int]]
    eos: int
    expected: list[list[int]]  # single-process greedy with that EOS


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    root = tmp_path_factory.mktemp("gen")
    ds = _regather_ds(root / "zero3_regather.json")
    run = root / "base"
    _ok(launch("toolkit/train.py", _train_args(ds, run, "train.path=raw")))
    prompts = _expected_prompts()
    model = _load_export(run / "export")
    eos = _pick_eos(_greedy(model, prompts, eos=None))
    expected = _greedy(model, prompts, eos=eos)
    assert expected[0][-1] == eos and len(expected[0]) < MAX_NEW, expected
    assert len(expected[1]) == MAX_NEW and len(expected[2]) == MAX_NEW, expected
    return Base(ds, run / "export", prompts, eos, expected)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", ["raw", "trainer"])
def test_train_paths_generate_under_zero3(base: Base, path: str, tmp_path: Path) -> None:
    run = tmp_path / path
    _ok(
        launch(
            "toolkit/train.py",
            _train_args(
                base.ds, run, f"train.path={path}", "eval.generate=true", f"eval.eos_token_id={base.eos}"
            ),
        )
    )
    rows = _read(run / "generations.jsonl")
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["prompt_ids"] for r in rows] == base.prompts
    got = [r["generated_ids"] for r in rows]
    # Rank 0 stopped early at EOS while rank 1 ran to max_new_tokens, and the run still completed.
    assert len(got[0]) < MAX_NEW and got[0][-1] == base.eos and len(got[1]) == MAX_NEW, got
    assert got == _greedy(_load_export(run / "export"), base.prompts, eos=base.eos)
    assert got == base.expected  # same seed, same weights on both paths


@pytest.mark.timeout(600)
def test_standalone_command_zero3(base: Base, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in base.prompts))
    out = tmp_path / "out.jsonl"
    _ok(
        launch(
            "toolkit/generate.py",
            [
                "--model",
                str(base.export),
                "--ds",
                str(base.ds),
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                str(MAX_NEW),
                "--eos-token-id",
                str(base.eos),
                "--out",
                str(out),
            ],
        )
    )
    assert [r["generated_ids"] for r in _read(out)] == base.expected


@pytest.mark.timeout(600)
def test_lora_generates_through_peft_model(base: Base, tmp_path: Path) -> None:
    from peft import PeftModel

    from toolkit.config.schema import load_config
    from toolkit.runtime.model import build_model, model_config

    run = tmp_path / "lora"
    _ok(
        launch(
            "toolkit/train.py",
            _train_args(
                base.ds,
                run,
                "train.path=raw",
                "lora.enabled=true",
                "eval.generate=true",
                f"eval.eos_token_id={base.eos}",
            ),
        )
    )
    got = [r["generated_ids"] for r in _read(run / "generations.jsonl")]
    # The base is a seeded random-init preset: rebuilt here, single process, it has the same weights.
    cfg = load_config(None, COMMON)
    model = PeftModel.from_pretrained(build_model(cfg, model_config(cfg)), run / "adapter")
    assert got == _greedy(model, base.prompts, eos=base.eos)


@pytest.mark.timeout(600)
def test_without_synced_gpus_it_never_finishes(base: Base, tmp_path: Path) -> None:
    """The protection matters: the same run with synced_gpus forced off never finishes generating.

    Rank 0 leaves generate after fewer forwards and enters the gather of results, while rank 1's
    next forward waits for rank 0's shards: a deadlock. NCCL would sit in it silently until its
    watchdog (a hang, as users report it). Gloo checks message sizes, so here it usually shows up
    as an abort instead ("Received data size doesn't match expected size ... collective
    mismatch": rank 0's result gather met rank 1's layer gather). Either way no result appears;
    both outcomes are accepted, a clean exit or any other error is not. The 60 s window starts
    when generation starts (synced, the whole generation takes a few seconds).
    """
    run = tmp_path / "unsafe"
    res = launch(
        "toolkit/train.py",
        _train_args(
            base.ds,
            run,
            "train.path=raw",
            "eval.generate=true",
            f"eval.eos_token_id={base.eos}",
            "eval.unsafe_no_sync=true",
        ),
        hang_after="eval.unsafe_no_sync=true",
        hang_window_s=60,
    )
    assert "eval.unsafe_no_sync=true" in res.output, res.output[-6000:]  # generation was reached
    hung = res.rc is None
    mismatch = res.rc not in (None, 0) and "collective mismatch" in res.output
    assert hung or mismatch, (
        f"expected a hang or a collective mismatch, got rc={res.rc}:\n{res.output[-6000:]}"
    )
    assert "generated 3 prompts" not in res.output
    assert not (run / "generations.jsonl").exists()


def test_standalone_bad_input_is_one_line(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [5, 6]}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 100,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    cases = [
        (["--model", str(tmp_path / "missing"), "--prompts", str(prompts)], "is not a directory"),
        (["--model", str(model), "--prompts", str(bad)], "not JSON"),
        (["--model", str(model), "--prompts", str(tmp_path / "none.jsonl")], "is not a file"),
    ]
    for args, msg in cases:
        r = subprocess.run(
            [sys.executable, str(REPO / "toolkit" / "generate.py"), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and msg in lines[0], r.stderr
