"""What every rule shares: `Finding` (one line of `toolkit check` output), `Ctx` (what a rule sees)
and the small constructors. Imports nothing else from the package, so every module can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from toolkit.config import ds_config as dc

Level = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    level: Level
    key: str  # dotted path in the DeepSpeed JSON, e.g. "zero_optimization.offload_optimizer.device"
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.key}: {self.message}"


@dataclass(frozen=True)
class Ctx:
    """What every rule sees: the file as written, the same with "auto" filled, and the launch facts."""

    raw: dict[str, Any]
    resolved: dict[str, Any]
    world_size: int
    optimizer: str | None
    consumer: str  # who reads the file: ds_config.CONSUMERS
    micro_batch: int | None
    grad_accum: int | None

    @property
    def via_accelerate(self) -> bool:
        """The optimizer reaches DeepSpeed through accelerate's glue (the toolkit's Trainer path, a plain
        HF Trainer script, accelerate itself), which swaps a torch Adam for DeepSpeed's CPU one under
        offload; the raw loop and bare deepspeed.initialize hand it over as it is."""
        return self.consumer in ("trainer", "hf-trainer", "accelerate")

    @property
    def stage(self) -> int:
        return dc.zero_stage(self.raw)

    @property
    def zero(self) -> dict[str, Any]:
        z = self.raw.get("zero_optimization")
        return z if isinstance(z, dict) else {}

    def offload(self, which: str) -> tuple[str, dict[str, Any]]:
        """(device, block) of zero_optimization.offload_{optimizer,param}; device "none" when absent."""
        return dc.offload(self.raw, which)


def _err(key: str, msg: str) -> Finding:
    return Finding("error", key, msg)


def _warn(key: str, msg: str) -> Finding:
    return Finding("warning", key, msg)


def _num(v: Any) -> int | None:
    """An explicit positive integer from JSON (not "auto", not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        return None
    return int(v)
