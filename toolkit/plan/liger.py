"""Which Liger kernels a run gets, and why not: a pure decision, shared by the planner (what a CUDA run
would get) and the runtime (toolkit/runtime/speed/kernels.py applies it). Testable without a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LigerChoice:
    """What will be applied (kwargs for Liger's apply function), or why nothing is."""

    kwargs: dict[str, bool] = field(default_factory=dict)
    reason: str = ""
    external_head: bool = False  # ZeRO-3 + fused loss: declare lm_head.weight to the model's forward
    chunk_mem_const: str = "auto"  # model.liger_chunk_mem_const: the fused loss's chunks (loss_chunk_const)

    @property
    def enabled(self) -> bool:
        return bool(self.kwargs)

    def describe(self) -> str:
        if not self.enabled:
            return f"liger kernels off: {self.reason}"
        on = [k for k, v in self.kwargs.items() if v]
        off = [k for k, v in self.kwargs.items() if not v]
        line = f"liger kernels on: {', '.join(on)}"
        if self.kwargs.get("fused_linear_cross_entropy"):
            line += (f" (loss chunks of {LOSS_CHUNK_ROWS:,} rows where a micro-batch has them)"
                     if self.chunk_mem_const == "auto" else f" (chunk_mem_const {self.chunk_mem_const})")
        return line + (f" ({', '.join(off)} off: {self.reason})" if off else "")


# The model types Liger patches (liger_kernel 0.8.5 monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN): what the planner and
# `toolkit check --explain --gpu-mem` assume a CUDA run gets; a run reads the installed Liger's own table
# (runtime/speed/kernels.supported_model_types).
LIGER_MODEL_TYPES = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text",
    "gemma4", "gemma4_text", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "granite", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "internvl", "llama", "llama4", "llama4_text", "llava", "ministral", "mistral", "mixtral", "mllama",
    "mllama_text_model", "muse_glimmer", "nemotron", "olmo2", "olmo3", "paligemma", "phi3", "pixtral", "qwen2",
    "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text", "qwen3", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "qwen3_vl_text", "smollm3", "smolvlm",
})

# model.liger_fused_loss=auto on a Mixture-of-Experts model: off at up to this many tokens per micro-batch where the
# logits fit without it. The fused loss costs about the same per micro-batch whatever its size (it walks the head's
# gradient once per chunk, and the chunk count is vocabulary / hidden), so a small micro-batch pays it most. Measured
# on one H200, the reduced-layer Qwen3-30B-A3B shape at micro 2 x seq 4096, ZeRO-2: 67.5k tokens/s with it, 84.3k
# without (the bare loop 76.8k; run s44, bench/results/moe.md); at micro 8 (32,768 tokens) its logits would not
# fit an H100 and the fused loss gave 1.57x the bare loop (s39). Dense models: not measured, unchanged.
MOE_FUSED_LOSS_OFF_TOKENS = 8192


def moe_fused_loss(setting: str, *, moe: bool, tokens: int, logits_fit: bool) -> tuple[str, str]:
    """(model.liger_fused_loss as resolved, why it is off or ""). tokens: one micro-batch's, per rank."""
    if setting != "auto" or not moe or tokens > MOE_FUSED_LOSS_OFF_TOKENS or not logits_fit:
        return setting, ""
    return "false", (f"model.liger_fused_loss=auto: a Mixture-of-Experts micro-batch of {tokens:,} tokens (<= "
                     f"{MOE_FUSED_LOSS_OFF_TOKENS:,}) whose logits fit: the plain loss is faster there")


def choose(wanted: bool, *, cuda: bool, model_type: str, task: str, stage: int,
           supported: frozenset[str] | None, fused_loss: str = "auto", compiled: bool = False,
           fused_off_reason: str = "", objective: str = "sft", chunk_mem_const: str = "auto") -> LigerChoice:
    """Pure decision, so it is testable without a GPU. `supported` is None when liger-kernel is
    not installed (or not importable: it needs triton).

    compiled (train.compile on): the fused loss only. Liger's RMSNorm, SwiGLU and RoPE kernels inside a
    compiled decoder layer crash inductor (Liger #1364/#1366, pytorch #170049: Triton CompilationError,
    then an illegal memory access, seen on llama-1b), and inductor fuses those three itself; the fused
    loss runs in the model's forward, outside the compiled layers."""
    if not wanted:
        return LigerChoice(reason="model.liger=false")
    if objective == "grpo":
        # Measured on one H200, llama-1b, 32 rows decoding (bench/results/grpo/): a static KV cache's compiled decode
        # step took 3.6 ms a token without Liger's kernels and 19.5 ms with them (inductor cannot take them in), and
        # an RL step's time is mostly its rollouts; its loss runs through the toolkit's chunked head either way
        return LigerChoice(reason="train.objective=grpo: the rollouts' compiled decode step runs 5x faster without "
                                  "Liger's kernels, and an RL step is mostly generation")
    if not cuda:
        return LigerChoice(reason="no CUDA device (Liger's kernels are Triton)")
    if supported is None:
        return LigerChoice(reason="liger-kernel is not installed (pip install liger-kernel)")
    if model_type not in supported:
        return LigerChoice(reason=f"Liger has no kernels for model type {model_type!r}")
    if task != "causal_lm":
        return LigerChoice(reason=f"only causal_lm models are patched (task {task!r})")
    fused = fused_loss != "false"
    if compiled and not fused:
        return LigerChoice(reason="train.compile fuses RMSNorm, SwiGLU and RoPE itself and "
                                  "model.liger_fused_loss=false turns off the one kernel left")
    layer = not compiled
    kwargs = {"rope": layer, "rms_norm": layer, "swiglu": layer, "fused_linear_cross_entropy": fused}
    reason = ("train.compile: inductor fuses these inside the compiled decoder layers, where Liger's "
              "kernels crash it" if compiled else "" if fused else fused_off_reason or "model.liger_fused_loss=false")
    return LigerChoice(kwargs=kwargs, reason=reason, external_head=fused and stage == 3,
                       chunk_mem_const=str(chunk_mem_const))


# Liger's fused loss splits a micro-batch's BT tokens into chunks of next_pow2(BT / ceil(V / (C x H))) rows, C its
# `chunk_mem_const` (1 by default), so it walks about V / H chunks whatever BT is, and each chunk reads the head's V x H
# weight twice and reads and writes its gradient: a cost that grows with V^2 and not with the tokens. Measured on one
# H200 (bench/fused_loss.py, bench/results/speed_model/fused_loss_h200.json): Gemma 3's head (1,152 x 262,144) at
# 16,384 tokens took 114.8 ms in 128 chunks of 128 rows and 52.8 ms in 8 chunks of 2,048; Llama-3-8B's at the same
# tokens 91.2 against 79.4 ms; beyond 2,048 rows a chunk the best of the larger chunks gained at most 5.4% (Phi-3's
# head at 16,384 tokens), most under 3%. Liger keeps the small chunks for memory, which here is one bf16 logit a row and
# vocabulary entry: 2,048 rows of 262,144 are 1 GiB.
LOSS_CHUNK_ROWS = 2048
LOSS_CHUNK_MAX_CONST = 256


def loss_chunk_rows(tokens: int, hidden: int, vocab: int, const: int) -> int:
    """Rows of a chunk of Liger's fused loss (liger_kernel/ops/fused_linear_cross_entropy.py, 0.8.5)."""
    inc = -(-vocab // (const * hidden))
    rows = 1 << max(0, (-(-tokens // inc) - 1).bit_length())
    return min(rows, tokens)


# chunk_mem_const a Liger model forward passes itself (liger_kernel/transformers/model/gpt_oss.py, 0.8.5): auto takes
# at least this; an integer setting replaces it
LOSS_CHUNK_FLOORS = {"gpt_oss": 8}


def loss_chunk_const(setting: str | int, *, tokens: int, hidden: int, vocab: int, floor: int = 1) -> int:
    """Liger's chunk_mem_const for a fused loss over `tokens` rows: model.liger_chunk_mem_const as an integer, or auto: the
    smallest power of two, at least `floor` (what the model's forward asks, LOSS_CHUNK_FLOORS), whose chunks hold
    LOSS_CHUNK_ROWS rows (all the tokens, if fewer)."""
    if str(setting) != "auto":
        return int(setting)
    want, const = min(tokens, LOSS_CHUNK_ROWS), max(1, floor)
    while loss_chunk_rows(tokens, hidden, vocab, const) < want and const < LOSS_CHUNK_MAX_CONST:
        const *= 2
    return const
