"""Batch arithmetic: train_batch_size = micro * grad_accum * world_size at the REAL world size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.config.checks.base import Ctx, Finding, _err, _num


@dataclass(frozen=True)
class _Batch:
    micro: int
    accum: int
    findings: tuple[Finding, ...]


def _batch(ds: dict[str, Any], world: int, micro_arg: int | None, accum_arg: int | None) -> _Batch:
    """DeepSpeed's inference rules (DeepSpeedConfig._set_batch_related_parameters) at the REAL world
    size: DeepSpeedConfig itself only knows torch.distributed's world size, which is 1 before launch."""
    tb, mb, ga = (
        _num(ds.get(k))
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    out: list[Finding] = []
    for key, have, arg, flag in (
        ("train_micro_batch_size_per_gpu", mb, micro_arg, "--micro-batch"),
        ("gradient_accumulation_steps", ga, accum_arg, "--grad-accum"),
    ):
        if have is not None and arg is not None and have != arg:
            out.append(
                _err(
                    key,
                    f"file says {have} but the training config gives {arg} ({flag}); "
                    f'set it to "auto" so the training config owns it',
                )
            )
    mb = mb if mb is not None else micro_arg
    ga = ga if ga is not None else accum_arg
    if tb is None:
        if "train_batch_size" not in ds and "train_micro_batch_size_per_gpu" not in ds:
            out.append(
                _err(
                    "train_batch_size",
                    "neither train_batch_size nor "
                    'train_micro_batch_size_per_gpu is set; DeepSpeed needs one ("auto" is fine)',
                )
            )
        return _Batch(mb or 1, ga or 1, tuple(out))
    if mb is not None and ga is not None:
        if tb != mb * ga * world:
            out.append(
                _err(
                    "train_batch_size",
                    f"{tb} != micro {mb} * grad_accum {ga} * world_size {world} "
                    f'= {mb * ga * world}; set it to "auto" or to {mb * ga * world}',
                )
            )
        return _Batch(mb, ga, tuple(out))
    ga = ga or 1  # DeepSpeed: only train_batch_size (and maybe micro) given -> accumulation 1 or derived
    if mb is None:
        mb, rest = divmod(tb, world * ga)
        if rest or mb == 0:
            out.append(
                _err(
                    "train_batch_size",
                    f"{tb} is not divisible by world_size {world} * grad_accum "
                    f"{ga}; DeepSpeed's batch assertion fails on {world} ranks",
                )
            )
        return _Batch(max(mb, 1), ga, tuple(out))
    ga, rest = divmod(tb, mb * world)
    if rest or ga == 0:
        out.append(
            _err(
                "train_batch_size",
                f"{tb} is not divisible by micro {mb} * world_size {world}; "
                f"DeepSpeed's batch assertion fails on {world} ranks",
            )
        )
    return _Batch(mb, max(ga, 1), tuple(out))


def rule_batch(c: Ctx) -> list[Finding]:
    return list(_batch(c.raw, c.world_size, c.micro_batch, c.grad_accum).findings)
