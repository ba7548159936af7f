"""Mixture-of-Experts models under ZeRO: what the run says of their experts, and which modules are ZeRO-3 leaves.

transformers 5.x runs a layer's experts as one module (3-D `gate_up_proj` / `down_proj`, `grouped_mm` by default),
on every rank every step, so ranks that route to different experts still run the same modules in the same order:
ZeRO-3's per-module hooks cannot diverge. Where a model keeps one module per expert in a ModuleList (older
transformers, remote code: DeepSeek, Kimi), only the routed experts run, the ranks' hook orders diverge and ZeRO-3
hangs (deepspeed#4808): the block holding the list must be a leaf, gathered whole on entry (../shared/notes/moe.md
section 1). So the policy here: leaves for the blocks whose experts are a ModuleList, found from the model's own
modules (any class name, remote code included), never a guessed name that could miss; DeepSpeed adds its own
default leaves (Mixtral, Qwen2-MoE, Qwen3-MoE blocks, `zero_optimization.leaf_module`), and the run reports both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from toolkit.config.checks import expert_parallel
from toolkit.config.ds_config import ConfigError
from toolkit.config.models import text_config
from toolkit.plan import experts
from toolkit.plan import liger as liger_rules
from toolkit.plan.experts import ExpertsChoice
from toolkit.plan.liger import LigerChoice


@dataclass(frozen=True)
class Experts:
    count: int
    top_k: int
    layers: int
    """Decoder layers with experts."""
    backend: str
    """transformers' experts implementation (grouped_mm, eager, ...), or "modules" for a list of expert modules."""
    block: str
    """The class of the block that routes and holds the experts."""
    block_params: int
    """Parameters of one such block (router and every expert): what ZeRO-3 gathers at once for a leaf."""


def experts_of(model: torch.nn.Module) -> Experts | None:
    """The model's experts, read from its modules (None for a dense model)."""
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]
    if not blocks:
        return None
    cfg = getattr(model, "config", None)
    text = text_config(cfg)
    first = blocks[0]
    per_expert = isinstance(first.experts, torch.nn.ModuleList)
    count = len(first.experts) if per_expert else int(
        getattr(text, "num_experts", None) or getattr(text, "num_local_experts", 0) or 0)
    backend = "modules" if per_expert else str(getattr(text, "_experts_implementation", None) or "eager")
    return Experts(count=count, top_k=int(getattr(text, "num_experts_per_tok", 0) or 0), layers=len(blocks),
                   backend=backend, block=type(first).__name__,
                   block_params=sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in first.parameters()))


def per_expert_blocks(model: torch.nn.Module) -> list[type]:
    """Classes of the blocks whose experts are one module each (a ModuleList named `experts`): the ones that
    must be ZeRO-3 leaves."""
    classes: list[type] = []
    for m in model.modules():
        if isinstance(getattr(m, "experts", None), torch.nn.ModuleList) and type(m) not in classes:
            classes.append(type(m))
    return classes


def set_leaves(model: torch.nn.Module) -> list[str]:
    """ZeRO-3 (before deepspeed.initialize): leaves for the per-expert blocks; returns their class names."""
    classes = per_expert_blocks(model)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]


def leaves_at_init(model: torch.nn.Module, ds: dict[str, Any]) -> list[torch.nn.Module]:
    """The modules that will be ZeRO-3 leaves once deepspeed.initialize has run: those set here (set_leaves) and
    those DeepSpeed's `zero_optimization.leaf_module` names (its defaults when the config names none)."""
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    from deepspeed.utils.z3_leaf_module import z3_leaf_module

    cfg = ds.get("zero_optimization", {}).get("leaf_module") or {}
    classes = set(cfg.get("classes", DEFAULT_LEAF_MODULE_CLASSES))
    names, suffixes = set(cfg.get("names", [])), tuple(cfg.get("name_suffixes", []))
    return [m for n, m in model.named_modules() if z3_leaf_module(m) or n in names or (suffixes and n.endswith(suffixes))
            or f"{type(m).__module__}.{type(m).__qualname__}" in classes]


def is_moe(model_config: Any) -> bool:
    text = text_config(model_config)
    return bool(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0)
                or getattr(text, "n_routed_experts", 0))


def fused_loss_setting(cfg: Any, model_config: Any, ds: dict[str, Any], world: int, compiled: bool, tiled_mlp: bool,
                       gpu_bytes: int) -> tuple[str, str]:
    """model.liger_fused_loss for this run and why it is off ("" when it is not turned off here): on a
    Mixture-of-Experts model at small micro-batches whose logits fit this GPU (gpu_bytes, 0 without CUDA), auto means
    off (toolkit/plan/liger.py moe_fused_loss; the fit is toolkit plan's prediction for this run without it).
    compiled, tiled_mlp: the run's resolved train.compile and model.tiled_mlp (toolkit/runtime/resolved.py)."""
    setting, t = cfg.model.liger_fused_loss, cfg.train
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 0
    tokens = micro * cfg.data.seq_len
    if (setting != "auto" or not micro or not is_moe(model_config) or not gpu_bytes
            or tokens > liger_rules.MOE_FUSED_LOSS_OFF_TOKENS):
        return setting, ""
    from toolkit.plan.planner import fitting_micro_batches, run_settings

    gpu_gib = gpu_bytes / 2**30  # a card, as the planner counts one
    # fp8 left out: the planner refuses float8 on MoE models (experts are not nn.Linear), the run converts the rest
    settings = run_settings(cfg, compiled, tiled_mlp) | {"fused_loss": "false", "fp8": None}
    try:
        fit = micro in fitting_micro_batches(model_config, ds, world, cfg.data.seq_len, micro * t.grad_accum, gpu_gib,
                                             **settings)
    except Exception:  # a shape the planner does not model (or cannot read): the fused loss stays, as before
        return setting, ""
    return liger_rules.moe_fused_loss(setting, moe=True, tokens=tokens, logits_fit=fit)


def choose_path(cfg: Any, model_config: Any, liger: LigerChoice) -> ExpertsChoice | None:
    """model.experts for this run (None for a dense model); ConfigError for a path that cannot run here."""
    if not is_moe(model_config):
        if cfg.model.experts != "auto":
            raise ConfigError(f"model.experts={cfg.model.experts} applies to Mixture-of-Experts models; "
                              f"{model_config.model_type} has no experts")
        return None
    path = experts.choose(cfg.model.experts, model_type=str(model_config.model_type),
                          liger_layers=bool(liger.kwargs.get("swiglu")), liger_why=liger.reason)
    if path.implementation is not None and not _can_switch(model_config):
        raise ConfigError(f"model.experts={path.implementation}: {model_config.model_type} models run one experts "
                          "implementation only (transformers cannot switch it); use model.experts=auto")
    return path


def _can_switch(model_config: Any) -> bool:
    """Whether the model's class takes an experts implementation by name (transformers raises otherwise)."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(model_config), None)
    check = getattr(cls, "_can_set_experts_implementation", None)
    return True if check is None else bool(check())  # remote code: not known here, transformers decides


def with_experts(liger: LigerChoice, path: ExpertsChoice, model_type: str) -> LigerChoice:
    """Liger's swiglu patch replaces these families' experts (for Qwen3-Next also its dense and shared-expert MLPs'
    SwiGLU): it follows the experts path, and the run's Liger line says why it is off."""
    if model_type not in experts.LIGER_EXPERTS or "swiglu" not in liger.kwargs or liger.kwargs["swiglu"] == path.liger:
        return liger
    why = "swiglu follows model.experts, whose experts path is not Liger's"
    return replace(liger, kwargs={**liger.kwargs, "swiglu": path.liger},
                   reason=f"{liger.reason}; {why}" if liger.reason else why)


def describe(model: torch.nn.Module, ds: dict[str, Any], liger: bool = False) -> str | None:
    """The run's line about experts: how many, top-k, the backend, and at ZeRO-3 the leaves and their size against
    stage3_max_live_parameters (a leaf is gathered whole: above half the budget, prefetching stalls).
    liger: Liger's fused MoE runs the experts (its backend, whatever transformers' setting says)."""
    e = experts_of(model)
    if e is None:
        return None
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    line = (f"experts: {e.count} per layer in {e.layers} layers ({e.block}), top-{e.top_k}, "
            f"backend {'liger fused MoE' if liger else e.backend}, {e.block_params / 1e6:,.2f}M parameters per block")
    if stage != 3:
        return line + f"; ZeRO-{stage}: no leaf modules needed"
    if expert_parallel.enabled(ds):  # AutoEP swaps the blocks out during deepspeed.initialize
        return line + "; ZeRO-3 leaves: none (AutoEP replaces the blocks; each rank keeps its own experts whole)"
    leaves = leaves_at_init(model, ds)
    if not leaves:
        return line + "; ZeRO-3 leaves: none (the experts run as one module on every rank: ranks cannot diverge)"
    names = sorted({type(m).__name__ for m in leaves})
    line += f"; ZeRO-3 leaves: {len(leaves)} x {', '.join(names)} (each gathered whole on entry)"
    max_live = zero.get("stage3_max_live_parameters")
    if isinstance(max_live, (int, float)) and e.block_params > max_live / 2:
        line += (f"; warning: a leaf of {e.block_params:,} parameters is above half of stage3_max_live_parameters="
                 f"{int(max_live):,}: set it to at least {2 * e.block_params:,}")
    return line


def take_aux_loss(model: torch.nn.Module, setting: str) -> float:
    """moe.aux_loss_coef: the coefficient the toolkit adds the load-balancing loss with (0: none), taken over from
    the model, whose own addition is switched off on this instance (its config, which an export writes, keeps the
    value). The model adds `coef x aux` to a loss that the training paths then multiply by the world size for the
    token mean and never divide by the accumulation steps (transformers#48690 on the Trainer), so its gradient
    grew with both; `aux_term` adds it at the right scale instead."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm = next((m for m in base.modules() if hasattr(m, "router_aux_loss_coef")), None)
    if lm is None or experts_of(base) is None:
        return 0.0
    coef = float(lm.config.router_aux_loss_coef) if setting == "auto" else float(setting)
    lm.router_aux_loss_coef = 0.0
    return coef


def aux_term(outputs: Any, coef: float, grad_accum: int) -> torch.Tensor | float:
    """What a micro-step adds to its (already world-scaled) loss: coef x aux / accumulation steps. DeepSpeed then
    averages over the ranks, so the step's gradient is coef x the mean of the micro-batches' aux losses."""
    aux = getattr(outputs, "aux_loss", None)
    if not coef or aux is None:
        return 0.0
    return coef * aux / grad_accum


class ExpertLoad:
    """Tokens the routers send to each expert of each layer, summed on the device over a log window (no host
    sync per step); `take()` (a collective on log steps) gives per layer the busiest expert's tokens over the
    mean: 1.0 is perfectly balanced, the expert count when one expert takes every token."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.counts: torch.Tensor | None = None

    def add(self, router_logits: Any) -> None:
        if not router_logits:
            return
        logits = torch.stack([r.detach().reshape(-1, r.shape[-1]) for r in router_logits])  # (layers, tokens, E)
        picked = logits.topk(self.top_k, dim=-1).indices.flatten(1)  # (layers, tokens x k)
        counts = torch.zeros(logits.shape[0], logits.shape[-1], device=logits.device).scatter_add_(
            1, picked, torch.ones_like(picked, dtype=torch.float32))
        self.counts = counts if self.counts is None else self.counts + counts

    def take(self) -> list[float] | None:
        """Every rank calls it on the same steps (an all-reduce when counts exist anywhere: they do on every rank
        of a run with the load-balancing loss on, as each forward returns router logits)."""
        if self.counts is None:
            return None
        from toolkit.launch import dist

        counts = dist.all_reduce_tensor(self.counts)
        self.counts = None
        mean = counts.mean(dim=1).clamp(min=1e-9)
        return [round(float(x), 3) for x in (counts.max(dim=1).values / mean)]
