"""`toolkit check`: one fixture per pattern that has burned users, plus the CLI contract (exit codes,
one-line load errors, --json). Fixtures are small hand-written configs under tests/fixtures/ds/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.config import ds_config as dc
from toolkit.config.checks import Finding, check_config, check_file

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ds"
REPO = Path(__file__).resolve().parents[2]


def by_key(findings: list[Finding]) -> dict[str, Finding]:
    return {f.key: f for f in findings}


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


def check(name: str, **kw: object) -> list[Finding]:
    return check_file(FIX / name, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(dc.PRESETS))
def test_presets_pass(name: str, tmp_path: Path) -> None:
    cfg = dc.preset(name)
    if "nvme" in name:
        for block in ("offload_optimizer", "offload_param"):
            cfg["zero_optimization"][block]["nvme_path"] = str(tmp_path)
    assert errors(check_config(cfg, world_size=2)) == []


def test_aio_nested_in_zero_is_an_error() -> None:
    f = by_key(check("aio_in_zero.json"))["zero_optimization.aio"]
    assert f.level == "error" and "top-level" in f.message


def test_unknown_top_level_keys_warn_with_suggestion() -> None:
    found = by_key(check("unknown_top_level.json"))
    assert {"fp8", "gradient_clippin", "monitor_config"} <= found.keys()
    assert all(found[k].level == "warning" for k in ("fp8", "gradient_clippin", "monitor_config"))
    assert "gradient_clipping" in found["gradient_clippin"].message
    assert not errors(list(found.values()))


def test_known_keys_are_not_flagged() -> None:
    # keys DeepSpeed reads through get_* helpers, not pydantic: must not look unknown
    cfg = dc.preset("zero2") | {
        "zero_allow_untested_optimizer": True,
        "tensorboard": {"enabled": False},
        "activation_checkpointing": {"partition_activations": False},
    }
    assert check_config(cfg) == []


def test_deprecated_cpu_offload_names_replacement() -> None:
    f = by_key(check("deprecated_cpu_offload.json"))["zero_optimization.cpu_offload"]
    assert f.level == "warning" and "offload_optimizer" in f.message


def test_lamb_with_offload() -> None:
    assert by_key(check("lamb_offload.json"))["optimizer.type"].level == "error"


def test_one_bit_with_zero() -> None:
    f = by_key(check("onebit_zero.json"))["optimizer.type"]
    assert f.level == "error" and "stage 2" in f.message


def test_torch_adam_under_offload_warns() -> None:
    found = check("torch_adam_offload.json")
    assert [f.key for f in found] == ["optimizer.params.torch_adam"] and found[0].level == "warning"


@pytest.mark.parametrize(
    ("optimizer", "path", "level"),
    [
        # the Trainer path goes through Accelerate, which maps torch/bnb Adam-family to DeepSpeedCPUAdam
        ("torch.optim.AdamW", "trainer", None),
        ("torch.optim.SGD", "trainer", "warning"),
        ("torch.optim.AdamW", "raw", "error"),
        ("bnb.optim.AdamW8bit", "raw", "error"),
        ("DeepSpeedCPUAdagrad", "raw", "error"),  # not in engine's isinstance check, see toolkit/config/checks/optimizer.py
        ("DeepSpeedCPUAdam", "raw", None),
        ("deepspeed.ops.lion.DeepSpeedCPULion", "raw", None),
        (None, "trainer", None),
        (None, "raw", "warning"),
        # a plain HF Trainer script and accelerate go through the same mapping; bare deepspeed does not
        ("torch.optim.AdamW", "hf-trainer", None),
        ("torch.optim.AdamW", "accelerate", None),
        ("torch.optim.AdamW", "deepspeed", "error"),
    ],
)
def test_client_optimizer_under_offload(optimizer: str | None, path: str, level: str | None) -> None:
    found = by_key(check("offload_no_optimizer.json", optimizer=optimizer, consumer=path))
    f = found.get("zero_optimization.offload_optimizer")
    assert (f.level if f else None) == level
    if level == "error" and optimizer is None:
        assert "gen-config" in f.message  # type: ignore[union-attr]


def test_client_optimizer_allowed_when_not_forced() -> None:
    found = check("offload_no_optimizer_unforced.json", optimizer="torch.optim.AdamW")
    assert [f.level for f in found] == ["warning"]


def test_fp16_and_bf16_both_enabled() -> None:
    found = check("fp16_and_bf16.json")
    assert len(errors(found)) == 1 and "both" in found[0].message


def test_fp16_bf16_auto_is_fine() -> None:
    assert errors(check_config(dc.preset("zero1"))) == []


def test_torch_autocast_beside_bf16_mode_warns_and_alone_is_clean() -> None:
    both = dc.preset("zero2") | {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    both["bf16"]["enabled"] = True
    found = [f for f in check_config(both) if f.key == "torch_autocast.enabled"]
    assert [f.level for f in found] == ["warning"] and "pick one" in found[0].message
    alone = dc.preset("zero2") | {"torch_autocast": {"enabled": True, "dtype": "bfloat16",
                                                     "lower_precision_safe_modules": []}}
    alone["bf16"]["enabled"] = False
    assert check_config(alone) == []


def test_batch_arithmetic_uses_real_world_size() -> None:
    assert check("bad_batch_world2.json", world_size=1) == []  # 4 == 2 * 2 * 1
    found = by_key(check("bad_batch_world2.json", world_size=2))
    assert found["train_batch_size"].level == "error" and "world_size 2" in found["train_batch_size"].message


def test_batch_inference_not_divisible() -> None:
    assert check("batch_not_divisible.json", world_size=1) == []  # DeepSpeed infers accumulation 3
    assert (
        "not divisible" in by_key(check("batch_not_divisible.json", world_size=2))["train_batch_size"].message
    )


def test_batch_file_disagrees_with_training_config() -> None:
    found = by_key(check("bad_batch_world2.json", world_size=1, micro_batch=4))
    assert found["train_micro_batch_size_per_gpu"].level == "error"


def test_offload_param_and_stage3_keys_at_stage2_warn() -> None:
    found = by_key(check("offload_param_stage2.json"))
    assert {
        "zero_optimization.offload_param",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.sub_group_size",
    } == found.keys()
    assert all(f.level == "warning" for f in found.values())


def test_ratio_below_one_needs_stage3() -> None:
    found = check("ratio_stage2.json")
    assert [(f.level, f.key) for f in found] == [("error", "zero_optimization.offload_optimizer.ratio")]


def test_nvme_path(tmp_path: Path) -> None:
    assert (
        "not set"
        in by_key(check("nvme_no_path.json"))["zero_optimization.offload_optimizer.nvme_path"].message
    )
    cfg = dc.preset("zero3_offload_nvme")
    msgs = [f.message for f in errors(check_config(cfg))]
    if not Path(dc.DEFAULT_NVME_PATH).exists():
        assert msgs and all("--nvme-path" in m for m in msgs)
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    cfg = dc.gen_config(3, "nvme", "none", nvme_path=str(ro))
    import os

    if os.geteuid() != 0:  # root writes anywhere
        assert "not writable" in errors(check_config(cfg))[0].message


def test_unfillable_auto_each_key_reported() -> None:
    found = by_key(check("auto_unfillable.json"))
    assert found["zero_optimization.sub_group_size"].level == "error"
    # the toolkit resolves these (ds_config.SPEED_SIZES, or the hidden-size rules)
    assert "zero_optimization.allgather_bucket_size" not in found
    assert "zero_optimization.stage3_max_live_parameters" not in found
    assert "zero_optimization.stage3_max_reuse_distance" not in found


def test_wrong_type_names_dotted_key() -> None:
    assert by_key(check("stage_wrong_type.json"))["zero_optimization.stage"].level == "error"


def test_hjson_comments_accepted() -> None:
    assert check("hjson_comments.hjson") == []


def test_load_errors() -> None:
    with pytest.raises(dc.ConfigError, match=r":3:\d+: syntax error"):
        check("malformed.json")
    with pytest.raises(dc.ConfigError, match="duplicate key"):
        check("duplicate_keys.json")
    with pytest.raises(dc.ConfigError, match="top level must be an object"):
        check("top_level_list.json")


def test_import_has_no_side_effects() -> None:
    code = "import toolkit.config.checks, sys; assert 'deepspeed' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------- CLI contract


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", "check", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "target", ["missing.json", ".", "malformed.json", "duplicate_keys.json", "top_level_list.json"]
)
def test_cli_load_errors_are_one_line(target: str) -> None:
    p = run_cli(str(FIX / target))
    assert p.returncode == 1
    lines = (p.stdout + p.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in p.stderr


def test_cli_findings_and_exit_codes() -> None:
    bad = run_cli(str(FIX / "stage_wrong_type.json"))
    assert bad.returncode == 1 and "error: zero_optimization.stage:" in bad.stdout
    assert "will not run" in bad.stderr and "Traceback" not in bad.stderr
    warn = run_cli(str(FIX / "unknown_top_level.json"), "--json")
    assert warn.returncode == 0
    data = json.loads(warn.stdout)  # nothing but JSON on stdout
    assert {d["key"] for d in data} == {"fp8", "gradient_clippin", "monitor_config"}
    assert set(data[0]) == {"level", "key", "message"}


def test_cli_usage_error_exits_2() -> None:
    assert run_cli().returncode == 2
    assert run_cli(str(FIX / "hjson_comments.hjson"), "--world-size", "0").returncode == 2
