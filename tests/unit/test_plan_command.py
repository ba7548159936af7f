"""`toolkit plan` as a command: the --json contract, -o DIR, one-line refusals, launch.sh --plan, and
the report's predicted-vs-measured section (toolkit/plan/command.py, toolkit/observe/plan_vs_run.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.cli import main
from toolkit.config.checks import check_config
from toolkit.plan.command import CANDIDATE_KEYS

ROOT = Path(__file__).resolve().parents[2]
BASE = ["plan", "--model", "llama-1b", "--gpus", "2", "--seq", "2048", "--global-batch", "32", "--gpu-mem", "80"]


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*BASE, "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_every_candidate_fitting_first_fastest_first(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys)
    cands = data["candidates"]
    assert cands and all(set(CANDIDATE_KEYS) <= set(c) for c in cands)
    fits = [c["fits"] for c in cands]
    assert fits == sorted(fits, reverse=True)
    fitting = [c["tokens_per_s_per_gpu"] for c in cands if c["fits"]]
    assert fitting == sorted(fitting, reverse=True)
    chosen = data["chosen"]
    assert chosen["fits"] and set(CANDIDATE_KEYS) <= set(chosen)
    assert {c["stage"] for c in cands} == {0, 1, 2, 3} and {c["grad_ckpt"] for c in cands} == {False, True}
    assert all(c["micro_batch"] * c["grad_accum"] * 2 == 32 for c in cands)
    # the chosen DeepSpeed JSON passes the toolkit's checks at the plan's world size and batch split
    errors = [f for f in check_config(chosen["ds_config"], world_size=2, consumer="trainer",
                                      micro_batch=chosen["micro_batch"], grad_accum=chosen["grad_accum"])
              if f.level == "error"]
    assert not errors, errors


def test_options_narrow_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--stage", "3", "--offload", "optimizer", "--micro-batch", "4", "--grad-ckpt")
    assert {(c["stage"], c["offload"], c["micro_batch"], c["grad_ckpt"]) for c in data["candidates"]} == {
        (3, "optimizer", 4, True)}
    assert {c["offload_ratio"] for c in data["candidates"]} == {k / 8 for k in range(1, 9)}
    lora = _json(capsys, "--lora", "--no-liger")
    assert all(not c["liger"] for c in lora["candidates"])
    assert lora["chosen"]["train_overrides"]["lora.enabled"] is True


def test_output_dir_holds_a_config_a_training_yaml_and_the_plan(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    out = tmp_path / "plan"
    assert main([*BASE, "--gpu-mem", "139", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chosen: ZeRO-" in text and f"./launch.sh --plan {out}" in text
    plan = json.loads((out / "plan.json").read_text())
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds == plan["chosen"]["ds_config"]
    cfg = yaml.safe_load((out / "train.yaml").read_text())
    c = plan["chosen"]
    assert cfg["train"]["micro_batch_size"] == c["micro_batch"] and cfg["train"]["grad_accum"] == c["grad_accum"]
    assert cfg["model"]["gradient_checkpointing"] == c["grad_ckpt"] and cfg["train"]["plan"] == str(out / "plan.json")
    from toolkit.config.schema import load_config

    assert load_config(out / "train.yaml").train.ds_config == str(out / "ds_config.json")  # the schema takes it
    assert main([*BASE, "-o", str(out)]) == 1  # an earlier plan is not overwritten without --force
    assert "exist; pass --force" in capsys.readouterr().err


def test_a_partial_offload_writes_the_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3-8b", "--gpus", "1", "--seq", "2048", "--global-batch", "16",
            "--gpu-mem", "139", "--host-mem", "125", "--json", "-o", str(tmp_path / "p")]
    assert main(argv) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    zero = json.loads((tmp_path / "p" / "ds_config.json").read_text())["zero_optimization"]
    assert chosen["stage"] == 3 and zero["offload_optimizer"]["ratio"] == chosen["offload_ratio"] < 1
    assert not [f for f in check_config({**chosen["ds_config"]}, world_size=1, consumer="raw") if f.level == "error"]


def test_an_autoep_plan_writes_the_expert_parallel_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "qwen3-30b-a3b", "--layers", "3", "--gpus", "4", "--seq", "4096", "--global-batch", "32",
            "--gpu-mem", "139", "--expert-parallel", "4", "--json", "-o", str(tmp_path / "p")]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    ds = json.loads((tmp_path / "p" / "ds_config.json").read_text())
    assert ds["expert_parallel"] == {"enabled": True, "autoep_size": 4, "preset_model": "qwen3_moe"}
    assert data["chosen"]["stage"] == 3 and data["inputs"]["expert_parallel"] == 4
    assert "--expert-parallel 4" in data["command"]
    assert not [f for f in check_config(ds, world_size=4, consumer="raw") if f.level == "error"]


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama-1b", "--gpus", "4", "--global-batch", "8", "--expert-parallel", "2"],
     "needs a Mixture-of-Experts model"),
    (["--model", "qwen3-30b-a3b", "--gpus", "4", "--global-batch", "8", "--stage", "2", "--expert-parallel", "4"],
     "models AutoEP at ZeRO-3"),
    (["--model", "olmoe-1b-7b", "--gpus", "4", "--global-batch", "8", "--expert-parallel", "4"],
     "AutoEP has no preset for 'olmoe'"),
    (["--model", "no-such-model", "--gpus", "1"], "neither a preset"),
    (["--model", "llama-1b", "--gpus", "0"], "--gpus must be at least 1"),
    (["--model", "llama-3-70b", "--gpus", "1", "--gpu-mem", "24", "--host-mem", "64"], "nothing fits"),
    (["--model", "llama-3-70b", "--gpus", "1", "--gpu-mem", "4"], "nothing fits in 4 GiB per GPU"),
    (["--model", "gpt2-124m", "--gpus", "1", "--lora", "--lora-targets", "c_attn"], "toolkit plan models LoRA on causal LM decoder layers"),
    (["--model", "gpt2-124m", "--gpus", "1", "--precision", "fp8"], "has none to convert (GPT-2: Conv1D)"),
    (["--model", "llama-1b", "--gpus", "3"], "does not split evenly over 3 ranks"),
])
def test_an_impossible_request_is_one_line_and_exit_1(argv: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "toolkit", "plan", "--seq", "1024", "--global-batch", "8", *argv]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr
    assert out.stdout == ""


def test_launch_sh_runs_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch", "8", "-o", str(out)]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    env |= {"DS_ACCELERATOR": "cpu", "PYTHON": sys.executable}
    run = subprocess.run([str(ROOT / "launch.sh"), "--plan", str(out), "--dry-run", "--", "train.max_steps=2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    fields = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert fields["config"] == f"{out}/ds_config.json" and fields["world size"] == "2"
    cmd = shlex.split(fields["command"])
    assert cmd[cmd.index("--config") + 1] == f"{out}/train.yaml"
    assert f"train.plan={out}/plan.json" in cmd and cmd[-1] == "train.max_steps=2"
    refused = subprocess.run([str(ROOT / "launch.sh"), "--plan", str(out), "--stage", "2", "--dry-run"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--plan DIR sets the stage" in refused.stderr


def _fake_run(run_dir: Path, stage: int = 2) -> None:
    (run_dir / "memory").mkdir(parents=True)
    plan = {"command": "toolkit plan --model llama-1b ...", "inputs": {"world_size": 2},
            "chosen": {"stage": 2, "offload": "none", "offload_ratio": None, "micro_batch": 16, "grad_accum": 1,
                       "grad_ckpt": False, "gpu_peak_gib": 49.62, "host_rank_gib": 5.92,
                       "persistent_gib": {"params": 2.30, "grads": 0.0, "optimizer": 6.91}}}
    (run_dir / "plan.json").write_text(json.dumps(plan))
    (run_dir / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": stage},
                                                        "train_micro_batch_size_per_gpu": 16,
                                                        "gradient_accumulation_steps": 1}))
    for rank, peak in ((0, 49.35), (1, 49.30)):
        (run_dir / "memory" / f"rank{rank}.jsonl").write_text(json.dumps({"phase": "final", "step": 3}) + "\n")
        (run_dir / "memory" / f"breakdown_rank{rank}.json").write_text(json.dumps({
            "rank": rank, "gpu": {"params_gib": 2.30, "optimizer_gib": 6.91, "peak_allocated_gib": peak,
                                  "other_at_peak_gib": peak - 9.21},
            "host": {"peak_rss_gib": 5.9}}))


def test_report_puts_the_plan_beside_each_rank(tmp_path: Path) -> None:
    from toolkit.observe.plan_vs_run import measured_breakdown_table, plan_vs_measured

    _fake_run(tmp_path / "run")
    text = plan_vs_measured(tmp_path / "run")
    assert text is not None
    row = next(line for line in text.splitlines() if line.startswith("| peak allocated"))
    assert "49.62" in row and "49.35" in row and "49.30" in row and "+0.6%" in row
    assert "differs" not in text
    assert "everything else at the peak (gpu)" in measured_breakdown_table(tmp_path / "run")
    _fake_run(tmp_path / "other", stage=3)
    assert "this run used ZeRO-3, the plan ZeRO-2" in plan_vs_measured(tmp_path / "other")
    assert plan_vs_measured(tmp_path / "nothing") is None


def test_layers_plans_a_preset_with_fewer_layers_and_the_training_yaml_builds_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "1", "--seq", "4096", "--global-batch", "32"]
    assert main([*argv, "--layers", "3", "-o", str(tmp_path / "p")]) == 0
    text = capsys.readouterr().out
    assert "qwen3-30b-a3b (2.49B parameters" in text and "--layers 3" in (tmp_path / "p" / "plan.json").read_text()
    assert yaml.safe_load((tmp_path / "p" / "train.yaml").read_text())["model"]["num_layers"] == 3
    assert main([*argv, "--layers", "-2"]) == 1
    assert "--layers must be at least 1" in capsys.readouterr().err
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    assert main(["plan", "--model", str(tmp_path / "dir"), "--gpus", "1", "--seq", "64", "--global-batch", "1",
                 "--layers", "1"]) == 1  # the run would refuse model.num_layers for a directory: so does the plan
    assert "--layers applies to presets" in capsys.readouterr().err
    # stacks of their own widths (BLT): one count cuts none of them alike; the plan and the run both refuse it
    assert main(["plan", "--model", "blt-1b-bytes", "--gpus", "1", "--seq", "4096", "--global-batch", "2",
                 "--layers", "8"]) == 1
    assert "layer stacks of their own widths" in capsys.readouterr().err
    from omegaconf import OmegaConf

    from toolkit.config.ds_config import ConfigError
    from toolkit.config.schema import Config
    from toolkit.runtime.model import model_config

    cfg = OmegaConf.structured(Config)
    cfg.model.name, cfg.model.num_layers = "blt-1b-bytes", 8
    with pytest.raises(ConfigError, match="layer stacks of their own widths"):
        model_config(cfg)


def test_a_grpo_plan_writes_the_runs_rl_settings(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--objective", "grpo", "--seq", "128", "--completion", "256", "--generations", "8",
                 "--global-batch", "8")
    over = data["chosen"]["train_overrides"]
    assert over["train.objective"] == "grpo" and over["data.seq_len"] == 384
    assert (over["rl.max_prompt_length"], over["rl.max_completion_length"], over["rl.num_generations"]) == (128, 256, 8)
    assert not any(c["liger"] for c in data["candidates"])
    assert main([*BASE, "--objective", "grpo"]) != 0
    assert "--completion (>= 1)" in capsys.readouterr().err


def test_issue_50s_case_plans_no_offload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Qwen2.5-1.5B-shaped local model at 262,144 tokens on one 137 GiB GPU: the plan that chose ZeRO-3 with every
    parameter on the CPU (run at 0.55x the plain choice) now takes the choice without offload, and says why."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "hidden_act": "silu"}))
    assert main(["plan", "--model", str(tmp_path), "--rope-factor", "16", "--gpus", "1", "--gpu-mem", "137",
                 "--host-mem", "120", "--global-batch", "1", "--seq", "262144", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert (chosen["stage"], chosen["offload"]) == (0, "none"), chosen
    assert chosen["why"].startswith("no offload: one fits")


def test_the_loss_chunk_setting_is_planned_and_written_to_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--liger-chunk-mem-const: Liger's own chunks (1) plan Gemma 3's 262K-vocabulary step slower than auto's 2,048-row
    chunks (its fused loss walks 128 chunks, bench/results/speed_model/fused_loss_h200.json); the setting reaches the
    run's overrides and the plan's inputs."""
    args = ["plan", "--model", "gemma3-1b", "--gpus", "1", "--seq", "4096", "--global-batch", "4", "--stage", "2",
            "--micro-batch", "4", "--json"]
    speeds = {}
    for setting in ("auto", "1"):
        assert main([*args, "--liger-chunk-mem-const", setting, "-o", str(tmp_path / setting)]) == 0
        plan = json.loads((tmp_path / setting / "plan.json").read_text())
        speeds[setting] = plan["chosen"]["tokens_per_s_per_gpu"]
        assert plan["inputs"]["loss_chunks"] == setting
    capsys.readouterr()
    assert speeds["auto"] > 1.15 * speeds["1"]
    from toolkit.config.schema import load_config

    assert load_config(str(tmp_path / "1" / "train.yaml"), []).model.liger_chunk_mem_const == "1"
    assert "liger_chunk_mem_const" not in (tmp_path / "auto" / "train.yaml").read_text()
