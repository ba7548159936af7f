"""TORCH_CUDA_ARCH_LIST sanitizing: our rewrite must give values DeepSpeed's op builder parses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from toolkit.launch.cuda_arch import ENV_VAR, sanitize_cuda_arch_list, unparseable_arch_entries


@pytest.mark.parametrize(
    ("value", "bad"),
    [
        ("9.0", []),
        ("8.0;8.6;9.0+PTX", []),
        ("7.5 8.0 8.6+PTX", []),
        ("9.0a", ["9.0a"]),
        ("9.0a;8.0", ["9.0a"]),
        ("10.0f 9.0a+PTX", ["10.0f", "9.0a+PTX"]),
        ("Hopper", ["Hopper"]),
        ("9", ["9"]),
        (" ;9.0; ", []),
    ],
)
def test_unparseable_entries(value: str, bad: list[str]) -> None:
    assert unparseable_arch_entries(value) == bad


@pytest.mark.parametrize(
    ("value", "fixed"),
    [
        ("9.0a", "9.0"),
        ("9.0a;8.0", "9.0;8.0"),
        ("9.0a+PTX 8.0", "9.0+PTX;8.0"),
        ("8.0 9.0a+ptx", "8.0;9.0+PTX"),
        ("10.0f;9.0a;9.0", "10.0;9.0"),
        ("Ampere;9.0a", "8.0;8.6+PTX;9.0"),
        ("junk;9.0a", "9.0"),
    ],
)
def test_sanitize_rewrites_in_place(value: str, fixed: str) -> None:
    env = {ENV_VAR: value, "OTHER": "x"}
    msg = sanitize_cuda_arch_list(env)
    assert env == {ENV_VAR: fixed, "OTHER": "x"}
    assert msg is not None and "\n" not in msg
    assert value in msg and fixed in msg


@pytest.mark.parametrize("env", [{}, {ENV_VAR: "9.0"}, {ENV_VAR: "8.0;9.0+PTX"}, {ENV_VAR: "7.5 8.6"}])
def test_sanitize_leaves_good_values_alone(env: dict[str, str]) -> None:
    before = dict(env)
    assert sanitize_cuda_arch_list(env) is None
    assert env == before


def test_nothing_usable_unsets_the_variable() -> None:
    env = {ENV_VAR: "garbage"}
    msg = sanitize_cuda_arch_list(env)
    assert ENV_VAR not in env
    assert msg is not None and "unset" in msg


def test_no_torch_import() -> None:
    code = (
        "import sys, toolkit.launch.cuda_arch; assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("value", ["9.0a", "9.0a;8.0", "9.0a+PTX 8.0", "Hopper", "10.0f;9.0a"])
def test_deepspeed_parses_the_sanitized_value(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ask DeepSpeed's own CUDAOpBuilder (the code that raised '0a') to parse before and after."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    fused_adam = pytest.importorskip("deepspeed.ops.op_builder.fused_adam")

    def parse(arch: str) -> None:
        builder = fused_adam.FusedAdamBuilder()
        builder.jit_mode = True  # the path a JIT build takes at first use
        builder._jit_arch_list = arch
        monkeypatch.setenv(ENV_VAR, arch)  # the builder rewrites it; monkeypatch restores it
        builder.compute_capability_args()

    with pytest.raises((ValueError, IndexError)):
        parse(value)
    env = {ENV_VAR: value}
    sanitize_cuda_arch_list(env)
    parse(env[ENV_VAR])
