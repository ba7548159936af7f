"""ZeRO-3 generation on 2 CPU ranks: fast paths that never hang, tokens as one prompt at a time.

One trained run picks an EOS token that ends rank 0's first prompt early while rank 1's prompt runs
to max_new_tokens. Then, each run matching a single-process greedy generation of the same weights:
the whole model gathered on both training paths (different call counts per rank; LoRA mid-run, with
training going on after it), layer by layer in left-padded batches under synced_gpus, the stand-alone
command with no prompt on one rank and one rank without room for the gather. The layer-by-layer
setup with synced_gpus forced off must hang (shown with a timeout, then the process group is killed).

Each launch costs ~30-40 s of imports on a 2-core machine, so the runs are few and tiny, and the three training
runs that generate (once the base run has picked the EOS token) share one launch (tests/dist/_multi_train.py).
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
from _launch import Runs, run_logs
from _launch import launch as launch_runs
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
    env: dict[str, str] | None = None,
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
    env = dict(os.environ, PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu", **(env or {}))
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
    from toolkit.runtime.generation.prompts import from_rows
    from toolkit.runtime.model import model_config

    cfg = load_config(None, COMMON)
    mc = model_config(cfg)
    rows, _ = build_rows(cfg, mc.vocab_size, mc.pad_token_id, None)
    rows = even_rows(rows, cfg.train.micro_batch_size * cfg.train.grad_accum, WORLD)
    return [p.ids for p in from_rows(rows, 3)]


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

    Prompts 0 and 2 go to rank 0, prompt 1 to rank 1: rank 0's call on prompt 0 then makes fewer forwards
    than rank 1's, which is exactly the case that hangs layer by layer without synced_gpus.
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


def _generated(run: Path, name: str = "generations.jsonl") -> list[list[int]]:
    rows = _read(run / name)
    assert [r["index"] for r in rows] == list(range(len(rows)))
    return [r["generated_ids"] for r in rows]


def _gen_lines(run: Path) -> list[dict[str, Any]]:
    return [r for r in _read(run / "metrics.jsonl") if "gen_tokens_per_s" in r]


def _lora_reference(run: Path, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """The trained adapter on the seeded random-init preset, rebuilt here in one process."""
    from peft import PeftModel

    from toolkit.config.schema import load_config
    from toolkit.runtime.model import build_model, model_config

    cfg = load_config(None, COMMON)
    return _greedy(PeftModel.from_pretrained(build_model(cfg, model_config(cfg)), run / "adapter"), prompts, eos=eos)


@pytest.fixture(scope="module")
def runs(base: Base, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The training runs that generate, in one launch after the base run: (their folder, each run's output)."""
    tmp = Runs(tmp_path_factory.mktemp("gen_runs"))
    eos = f"eval.eos_token_id={base.eos}"
    specs = {
        "trainer": ["train.path=trainer", "eval.generate=true", eos, "eval.generate_batch_size=1"],
        "lora": ["train.path=raw", "lora.enabled=true", "eval.generate=true", "eval.generate_every=3", eos],
        "layers": ["train.path=raw", "eval.generate=true", eos, "eval.generate_gather=false",
                   "eval.generate_batch_size=2"],
    }
    launch_runs(tmp, [{"name": name, "argv": _train_args(base.ds, tmp / name, *extra)} for name, extra in specs.items()],
                name="generate", timeout=LAUNCH_TIMEOUT_S * 2)
    return tmp, run_logs(tmp / "generate.log")


@pytest.mark.timeout(900)
def test_trainer_path_gathers_and_ranks_make_different_numbers_of_calls(
        base: Base, runs: tuple[Path, dict[str, str]]) -> None:
    """The whole model gathered once, one prompt per call: rank 0 makes two generate calls and rank 1 one,
    without synced_gpus (a gathered forward runs no collective), and rank 0's first prompt ends at EOS."""
    run, out = runs[0] / "trainer", runs[1]["trainer"]
    got = _generated(run)
    assert len(got[0]) < MAX_NEW and got[0][-1] == base.eos and len(got[1]) == MAX_NEW, got
    assert got == _greedy(_load_export(run / "export"), base.prompts, eos=base.eos)
    assert got == base.expected  # same seed, same weights as the raw path's run
    assert "generate: 3 prompts" in out and "whole-model gather, batch 1 per rank" in out, out[-3000:]
    (line,) = _gen_lines(run)
    assert line["gen_path"] == "whole-model gather" and line["gen_prompts"] == 3
    assert line["gen_new_tokens"] == sum(map(len, got)) and line["gen_tokens_per_s"] > 0


@pytest.mark.timeout(900)
def test_raw_lora_generates_mid_run_and_trains_on(base: Base, runs: tuple[Path, dict[str, str]]) -> None:
    """LoRA, raw path: a whole-model generation at step 3 (DeepSpeed's hooks off, then on again), training goes
    on to step 6, and the final generation matches the trained adapter; both calls are in metrics.jsonl."""
    run = runs[0] / "lora"
    assert _generated(run) == _lora_reference(run, base.prompts, base.eos)
    assert len(_generated(run, "generations/step_3.jsonl")) == 3
    losses = [r["loss"] for r in _read(run / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 6 and all(loss == loss for loss in losses), losses  # trained after the gather
    assert [(r["step"], r["gen_path"]) for r in _gen_lines(run)] == [(3, "whole-model gather"),
                                                                     (6, "whole-model gather")]


@pytest.mark.timeout(900)
def test_layer_by_layer_batches_under_synced_gpus(base: Base, runs: tuple[Path, dict[str, str]]) -> None:
    """eval.generate_gather=false: every layer gathered per forward, rank 0's two prompts in one left-padded
    batch (one stops at EOS inside it) while rank 1 runs its one; greedy tokens as one prompt at a time."""
    run, out = runs[0] / "layers", runs[1]["layers"]
    assert _generated(run) == base.expected
    assert "layer by layer, batch 2 per rank: eval.generate_gather=false" in out, out[-3000:]


@pytest.mark.timeout(600)
def test_standalone_zero_prompts_on_a_rank_and_a_rank_without_room(base: Base, tmp_path: Path) -> None:
    """One prompt on two ranks (rank 1 has none) and rank 1 reporting no free memory: every rank goes layer by
    layer (a gather is a collective all must join), rank 1 runs a throwaway call beside rank 0's, no hang."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": base.prompts[1], "reference": base.expected[1]}) + "\n")
    out_file = tmp_path / "out.jsonl"
    args = ["--model", str(base.export), "--ds", str(base.ds), "--prompts", str(prompts), "--max-new-tokens",
            str(MAX_NEW), "--eos-token-id", str(base.eos), "--batch-size", "1", "--out", str(out_file)]
    out = _ok(launch("toolkit/generate.py", args, env={"TOOLKIT_FAULT_GEN_FREE_BYTES": "1:1000"}))
    assert [r["generated_ids"] for r in _read(out_file)] == [base.expected[1]]
    assert "generate: 1 prompts" in out and "layer by layer" in out and "another rank has no room" in out, out[-3000:]


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
            "eval.generate_gather=false",  # layer by layer: a gathered model runs no collective to hang in
            "eval.generate_batch_size=1",  # rank 0's first prompt then ends a call early on its own
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
    assert "generate: 3 prompts" not in res.output
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
        (["--model", str(tmp_path / "missing"), "--prompts", str(prompts)], "is neither a directory nor a hub id"),
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
