"""Make TORCH_CUDA_ARCH_LIST readable by DeepSpeed's op builder (no torch import here).

DeepSpeed 0.19.8 (`deepspeed/ops/op_builder/builder.py`, `CUDAOpBuilder.compute_capability_args`)
turns ' ' into ';', splits on ';', drops empty entries (JIT mode), then for every entry does
`major, minor = cc.split('.')`, `int(major)`, `minor.endswith('+PTX')` and
`int(minor.split('+')[0])`. So the only entries it understands are `X.Y` and `X.Y+PTX`:

- `9.0a` / `10.0f` (arch-specific suffixes PyTorch itself accepts; NVIDIA's images set `9.0a`)
  -> `ValueError: invalid literal for int() with base 10: '0a'` when FusedAdam/FusedLamb build.
- PyTorch's named arches (`Hopper`, `Ampere`, ...) -> IndexError (no '.').
- `8.6+ptx` (lower case) parses, but outside the JIT path the PTX request is silently dropped.

Kernels built for `9.0` run on every sm_90 GPU; the `a` variant only adds instructions
(wgmma, setmaxnreg) that DeepSpeed's JIT ops do not use, so dropping the suffix is safe.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

ENV_VAR = "TORCH_CUDA_ARCH_LIST"

# What DeepSpeed parses: digits '.' digits, optionally '+PTX' ('+ptx' parses too but, outside the
# JIT path, loses its PTX; it is normalized when the list is rewritten anyway).
_DS_OK = re.compile(r"^\d+\.\d+(\+PTX)?$", re.IGNORECASE)
# What we can turn into that: an arch with a letter suffix and/or a lower-case +ptx.
_FIXABLE = re.compile(r"^(\d+)\.(\d+)[A-Za-z]*(\+ptx)?$", re.IGNORECASE)
# PyTorch's named arches (torch/utils/cpp_extension.py `named_arches`), spelled as DeepSpeed wants.
_NAMED = {
    "kepler+tesla": "3.7",
    "kepler": "3.5+PTX",
    "maxwell+tegra": "5.3",
    "maxwell": "5.0;5.2+PTX",
    "pascal": "6.0;6.1+PTX",
    "volta+tegra": "7.2",
    "volta": "7.0+PTX",
    "turing": "7.5+PTX",
    "ampere+tegra": "8.7",
    "ampere": "8.0;8.6+PTX",
    "ada": "8.9+PTX",
    "hopper": "9.0+PTX",
}


def _entries(value: str) -> list[str]:
    """Split the way DeepSpeed's JIT path does: spaces and ';' separate, empties vanish."""
    return [e.strip() for e in value.replace(" ", ";").split(";") if e.strip()]


def unparseable_arch_entries(value: str) -> list[str]:
    """Entries of a TORCH_CUDA_ARCH_LIST value that DeepSpeed's op builder cannot parse."""
    return [e for e in _entries(value) if not _DS_OK.match(e)]


def _fix(entry: str) -> str | None:
    """DeepSpeed-readable replacement for one entry, or None when there is none."""
    m = _FIXABLE.match(entry)
    if m:
        return f"{m.group(1)}.{m.group(2)}" + ("+PTX" if m.group(3) else "")
    return _NAMED.get(entry.lower())


def sanitize_cuda_arch_list(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Rewrite TORCH_CUDA_ARCH_LIST in `environ` so DeepSpeed can parse it.

    `9.0a` -> `9.0`, `9.0a+PTX;8.0` -> `9.0+PTX;8.0`, `Hopper` -> `9.0+PTX`; an entry that means
    nothing is dropped, and if nothing is left the variable is removed (DeepSpeed then asks the
    visible GPUs). Returns one line saying what changed, or None when nothing did. Call it before
    the first DeepSpeed op build (before `import deepspeed` is simplest).
    """
    value = environ.get(ENV_VAR)
    if value is None or not unparseable_arch_entries(value):
        return None
    fixed: list[str] = []
    changes: list[str] = []
    dropped: list[str] = []
    for entry in _entries(value):
        new = _fix(entry)
        if new is None:
            dropped.append(entry)
            continue
        if new != entry:
            changes.append(f"{entry}->{new}")
        for part in new.split(";"):
            if part not in fixed:
                fixed.append(part)
    what = ", ".join(changes + [f"dropped {d!r}" for d in dropped])
    if fixed:
        environ[ENV_VAR] = ";".join(fixed)
        result = f"set {ENV_VAR}={environ[ENV_VAR]}"
    else:
        del environ[ENV_VAR]
        result = f"unset {ENV_VAR} (DeepSpeed will use the visible GPUs' capabilities)"
    return f"{ENV_VAR}={value!r} is not parseable by DeepSpeed's op builder ({what}): {result}"
