"""How a Mixture-of-Experts model's experts run (`model.experts`): a pure decision, shared by the run and tests.

transformers 5.x runs a layer's experts as one module with 3-D weights through one of its experts implementations
(`grouped_mm` by default, `batched_mm`, `eager`: a loop over the experts hit); Liger's swiglu patch replaces that
module's forward with its fused MoE kernel (`LigerExperts`) for the families below. auto leaves the model's own
implementation (grouped_mm where it can switch). Measured on one H100 (bench/results/moe.md, the Qwen3-30B-A3B
shape): Liger's kernel trains 5.7% faster than grouped_mm once tuned, but Triton autotunes it for every new token
count before the first step (71 s at micro 2 x 4096, over 170 s at micro 8), and train.compile (on for runs of 200+
steps) turns Liger's layer kernels off anyway; eager is 25x slower than grouped_mm per experts call. So Liger's is
opt-in (model.experts=liger).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.config.ds_config import ConfigError

# Liger 0.8.5 (monkey_patch.py): families whose experts module its swiglu patch replaces with LigerExperts
LIGER_EXPERTS = frozenset({"qwen3_moe", "mixtral", "qwen3_next", "qwen3_vl_moe", "qwen3_5_moe", "deepseek_v2",
                           "deepseek_v3", "hunyuan_v1_moe", "glm4v_moe"})
TRANSFORMERS_PATHS = ("grouped_mm", "batched_mm", "eager")
LIGER_WHY_NOT = ("Liger's fused MoE autotunes for minutes at every new batch shape (model.experts=liger runs it: "
                 "5.7% faster once tuned, bench/results/moe.md)")


@dataclass(frozen=True)
class ExpertsChoice:
    implementation: str | None
    """transformers' experts_implementation to build with; None: the model's own default, left unset (grouped_mm
    where the model can switch implementations; some families cannot, and naming one makes transformers raise)."""
    liger: bool
    """Liger's fused MoE runs the experts (its swiglu patch applied to them)."""
    reason: str

    def describe(self) -> str:
        path = "liger fused MoE" if self.liger else self.implementation or "transformers' default"
        return f"experts path: {path} ({self.reason})"


def choose(setting: str, *, model_type: str, liger_layers: bool, liger_why: str = "") -> ExpertsChoice:
    """setting: model.experts. liger_layers: Liger's layer kernels (swiglu among them) are applied to this run
    (CUDA, liger-kernel installed, the family supported, no train.compile); liger_why: why not, when not."""
    fused = liger_layers and model_type in LIGER_EXPERTS
    if setting == "liger":
        if not fused:
            why = (liger_why if not liger_layers else
                   f"Liger 0.8 has no fused MoE for model type {model_type!r} ({', '.join(sorted(LIGER_EXPERTS))})")
            raise ConfigError(f"model.experts=liger: Liger's fused MoE cannot run here: {why}; "
                              f"use one of {', '.join(TRANSFORMERS_PATHS)}")
        return ExpertsChoice(None, True, "model.experts=liger")
    if setting in TRANSFORMERS_PATHS:
        return ExpertsChoice(setting, False, f"model.experts={setting}")
    why = (f"Liger's fused MoE does not apply: {liger_why or f'no fused MoE for {model_type!r}'}" if not fused
           else f"transformers' default; {LIGER_WHY_NOT}")
    return ExpertsChoice(None, False, f"model.experts=auto: {why}")
