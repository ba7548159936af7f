"""Prompts dealt to ranks evenly, and the results put back in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def deal(prompts: Sequence[T], rank: int, world: int) -> list[tuple[int, T]]:
    """This rank's prompts as (original index, prompt): prompt i goes to rank i % world.

    Counts may differ by one between ranks, and a rank may get none: generation evens out the calls
    where it must (layer by layer under ZeRO-3), not the prompts.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    return [(i, p) for i, p in enumerate(prompts) if i % world == rank]


def unshard(gathered: Sequence[Sequence[tuple[int | None, T]]], n: int) -> list[T]:
    """Inverse of `deal` over all ranks' results, in the original order (entries with index None dropped)."""
    out: list[Any] = [None] * n
    for part in gathered:
        for i, value in part:
            if i is not None:
                out[i] = value
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise RuntimeError(f"no result gathered for prompts {missing[:5]}")
    return out
