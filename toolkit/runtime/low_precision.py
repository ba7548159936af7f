"""bf16 master weights and optimizer states (DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states), with
the two things DeepSpeed 0.19 leaves out.

Stochastic rounding. DeepSpeed's FusedAdam writes each step into the bf16 master rounded to nearest, so an update
under half a bf16 step (1/256 of the weight) is lost; late in a decaying schedule most are (measured: the loss ended
6.4% above fp32 states after 1,000 steps, bench/results/optimizers/quality). torchao's AdamW with
bf16_stochastic_round computes the step in fp32 and rounds it into the bf16 weight up or down with the odds of its
remainder, so small updates add up in expectation (torchao/optim README, "BF16 stochastic rounding"). It takes the
place of DeepSpeed's optimizer as a client optimizer with the same hyperparameters; the config's other keys stay.

One copy of the weights. Where the master dtype is the weights' own, ZeRO-3 means to make its master partition the
weight partition itself (stage3.py _create_fp32_partitions, for torch autocast), but it compares a tensor's
torch.device with a device name string ("cuda:0"), which is never equal, and clones; ZeRO-1/2 always clone
(stage_1_and_2.py weights_partition = ...clone()). That is 2 bytes a parameter for nothing: 15 GiB on a Llama-3-8B,
which ran it out of memory on an 80 GiB card (bench/results/optimizers/speed_llama3_8b). `share_masters` points each
master at its weight partition; the step then writes the weights in place and DeepSpeed's copy back (ZeRO-1/2 step,
ZeRO-3 _reassign_or_swap_out_partitioned_parameters) is a copy onto itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from toolkit.config import optimizers as opt
from toolkit.config.ds_config import ConfigError
from toolkit.launch import dist

GIB = 1024**3


def stochastic(mode: str, ds: dict[str, Any]) -> bool:
    """train.bf16_rounding resolved: True where torchao's stochastic-rounding AdamW steps the bf16 masters."""
    blocker = opt.stochastic_rounding_blocker(ds)
    if mode == "stochastic" and blocker:
        raise ConfigError(f"train.bf16_rounding=stochastic: {blocker}; use auto or nearest")
    return blocker is None and mode != "nearest"


def adamw_kwargs(ds: dict[str, Any]) -> dict[str, Any]:
    """The optimizer section's hyperparameters (filled, no "auto" left) as torchao's AdamW takes them, with
    DeepSpeed's FusedAdam defaults where the section leaves one out."""
    params = (ds.get("optimizer") or {}).get("params") or {}
    return {"lr": float(params.get("lr", 1e-3)), "betas": tuple(float(b) for b in params.get("betas", (0.9, 0.999))),
            "eps": float(params.get("eps", 1e-8)), "weight_decay": float(params.get("weight_decay", 0.0)),
            "amsgrad": bool(params.get("amsgrad", False))}


def sr_adamw(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """torchao's AdamW with stochastic rounding into bf16 parameters (its documented use: `_AdamW(...,
    bf16_stochastic_round=True)`); it keeps its moments in the parameter's dtype and steps each tensor with one
    compiled kernel."""
    from torchao.optim import _AdamW

    return _AdamW(params, **kwargs, bf16_stochastic_round=True)


def engine_config(ds: dict[str, Any], stochastic_on: bool) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    """(the DeepSpeed dict to initialize with, the client optimizer's factory or None). With stochastic rounding the
    optimizer section goes (DeepSpeed would build FusedAdam from it) and the factory builds torchao's AdamW from its
    values; ZeRO takes an optimizer it has not tested only when told (zero_allow_untested_optimizer)."""
    if not stochastic_on:
        return ds, None
    kwargs = adamw_kwargs(ds)
    out = copy.deepcopy(ds)
    out.pop("optimizer")
    out["zero_allow_untested_optimizer"] = True
    return out, lambda params: sr_adamw(params, **kwargs)


def _pairs(zero_optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(master partition, the weight partition it was cloned from) of each group on this rank; none under offload."""
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: sub-groups
        if zero_optimizer.offload_optimizer or zero_optimizer.params_in_nvme_and_cpu:
            return []
        return [(m, w) for m, w in zip(zero_optimizer.fp32_partitioned_groups_flat,
                                       zero_optimizer.fp16_partitioned_groups_flat, strict=True) if w is not None]
    masters = getattr(zero_optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    if not masters or zero_optimizer.cpu_offload:
        return []
    import deepspeed.comm as ds_comm

    # the rank's partition as stage_1_and_2.py finds it
    return [(m, zero_optimizer.parallel_partitioned_bit16_groups[i][ds_comm.get_rank(
        group=zero_optimizer.real_dp_process_group[i])]) for i, m in enumerate(masters)]


def share_masters(zero_optimizer: Any) -> int:
    """Make each bf16 master partition the bf16 weight partition it was cloned from; bytes freed on this rank (0
    where nothing is shared: fp32 masters, offload, ZeRO-0)."""
    freed = 0
    for master, weights in _pairs(zero_optimizer):
        if (master.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16 or master.device != weights.device
                or master.numel() != weights.numel() or master.data_ptr() == weights.data_ptr()):
            continue
        freed += master.numel() * master.element_size()
        master.data = weights.data  # the optimizer keeps the same tensor object; its storage is now the weights'
    if freed:
        # each parameter's views into the master (its _hp_mapping: what universal checkpoints and safe_get_full_*
        # read and write) were cut from the old storage at initialize: cut again from the shared one
        zero_optimizer._link_all_hp_params()
    if freed and dist.rank() == 0:
        print(f"bf16 master weights: the ZeRO optimizer's masters share the weights' storage ({freed / GIB:.3g} GiB "
              "a rank freed)", flush=True)
    return freed
