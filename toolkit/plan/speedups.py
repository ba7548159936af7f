"""The compile, float8, MLP-tiling and activation-offload decisions, pure: which runs compile, which Linear modules
float8 converts, and which GPUs can run it. Shared by the runtime (toolkit/runtime/speed/compile.py, fp8.py, sequence/) and
`toolkit plan`; testable without a GPU. The measurements behind each constant are in bench/results/fp8_compile.md.
"""

from __future__ import annotations

import math

# float8 tensor cores: Ada (SM 8.9) and Hopper (9.0) and later. Below that torchao can only emulate
# float8 (eager, slower than bf16), so the run is refused instead.
FP8_MIN_CAPABILITY = (8, 9)
FP8_RECIPES = ("tensorwise", "rowwise")

# train.compile=auto compiles CUDA runs long enough to pay the compile back, and every float8 run. Measured on
# one H200 (bench/results/fp8_compile.md): compiled against eager, bf16, ZeRO-2, GPT-2-124M 1.39x (288.8k against
# 208.0k tokens/s), Qwen2-0.5B 1.19x (102.6k against 86.0k), llama-1b 1.01x (67.7k against 67.2k); at ZeRO-3, with
# the decoder layers as leaf modules, llama-1b 1.06x (67.8k against 63.7k, run s26). The compile cost the first
# step 6-10 s (GPT-2: 9.0 s against 2.7 s eager), which GPT-2's 45 ms a step saved pays back in 140 steps. float8
# without compile ran at 0.41x of compiled float8 on llama-1b (32.4k against 79.4k, ../shared/anchors.md).
# At ZeRO-3 without leaf modules (LoRA: the first layer's input needs no gradient, toolkit/runtime/speed/compile.py
# leaves_safe) DeepSpeed's hooks split each compiled layer into a graph per module: 0.74x eager (run s23).
COMPILE_AUTO_MIN_STEPS = 200


def compile_on(setting: str, *, cuda: bool, steps: int | None, fp8: bool, stage: int,
               no_leaves: str | None = None) -> tuple[bool, str]:
    """(compile or not, why), for train.compile = off | torch | auto. no_leaves: why the decoder layers cannot be
    ZeRO-3 leaf modules in this run (`leaves_blocked`), or None."""
    if setting == "torch":
        return True, "train.compile=torch"
    if setting == "off":
        return False, "train.compile=off"
    if not cuda:
        return False, "train.compile=auto: no CUDA device"
    if fp8:
        return True, "train.compile=auto: float8 needs compile to be fast"
    if stage == 3 and no_leaves:
        return False, (f"train.compile=auto: {no_leaves}, the decoder layers cannot be ZeRO-3 leaf modules, and "
                       "ZeRO-3's hooks split the compiled layers into a graph per module (measured slower than eager "
                       "there); train.compile=torch compiles anyway")
    if steps is not None and steps < COMPILE_AUTO_MIN_STEPS:
        return False, (f"train.compile=auto: {steps} steps are too few to pay back the compile "
                       f"(>= {COMPILE_AUTO_MIN_STEPS}); train.compile=torch compiles anyway")
    return True, "train.compile=auto: CUDA, a run long enough to pay back the compile"


ZERO3_LEAVES = ("auto", "true", "false")
# train.zero3_leaves=auto makes eager decoder layers leaves where measured: Llama and Qwen2 full fine-tunes (SFT and
# preference; Mistral's layer is Llama's, not measured itself), H200s (bench/results/speed_model/README.md): llama-1b at
# ZeRO-3 9,934 -> 18,274 tokens/s at micro 2, 33,071 -> 44,386 at micro 8 with checkpointing, Qwen2.5-1.5B at micro 4
# 21,722 -> 36,950 (ZeRO-2: 37,145), llama-1b on 2 GPUs at micro 2 11,156 -> 26,873 per GPU; peaks within 2.4%. With a hook on every submodule the step waits on the host (DeepSpeed's fetch and release, about 1.4 ms a
# module call). Qwen3-4B and Phi-3-mini (12 layers) and Gemma-3-1B at seq 4,096, one H200
# (bench/results/speed_model/families/): 29,733 -> 42,607, 40,641 -> 45,867 and 13,003 -> 32,185 tokens/s at micro 4;
# 40,704 -> 41,088, 40,904 -> 40,748 and 25,571 -> 41,786 at micro 16 with checkpointing; peaks equal.
# Not measured: other model types (GPT-2, BERT, MoE blocks that are leaves already) and GRPO rollouts.
EAGER_LEAVES_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text"})


# With checkpointing, DeepSpeed keeps every ZeRO-3 leaf layer gathered where parameters are partitioned (planner.
# _gathered_bytes; bench/results/speed_model/README.md, session 58). Above this share of a GPU the run says so at start.
LEAVES_GATHERED_SHARE = 0.5


def leaves_gathered_gib(total_params: int, *, stage: int, grad_ckpt: bool, world: int, offload_param: bool) -> float:
    """GiB of bf16 weights ZeRO-3 leaf layers keep gathered at once: the whole model with checkpointing where its
    parameters are partitioned (several ranks, or on the CPU); 0 where the reuse distance limits them."""
    return 2.0 * total_params / 2**30 if stage == 3 and grad_ckpt and (world > 1 or offload_param) else 0.0


def too_gathered(gathered_gib: float, gpu_gib: float) -> bool:
    """Leaf layers kept gathered (`leaves_gathered_gib`) would hold more than LEAVES_GATHERED_SHARE of a GPU of
    gpu_gib (0: not known, as on CPU ranks): auto takes hooks there, in the run (`leaves_on`) and the plan."""
    return bool(gpu_gib) and gathered_gib > LEAVES_GATHERED_SHARE * gpu_gib


def leaves_on(setting: str, *, stage: int, compiled: bool, blocked: str | None, model_type: str = "",
              objective: str = "sft", gathered_gib: float = 0.0, gpu_gib: float = 0.0) -> tuple[bool, str]:
    """`_leaves_on`, and where leaf layers would keep more than LEAVES_GATHERED_SHARE of the GPU gathered
    (gathered_gib: `leaves_gathered_gib`; gpu_gib 0: not known, as on CPU ranks): off under auto, a warning in
    the reason under true."""
    on, why = _leaves_on(setting, stage=stage, compiled=compiled, blocked=blocked, model_type=model_type,
                         objective=objective)
    if on and too_gathered(gathered_gib, gpu_gib):
        if setting == "auto":  # a default never takes what cannot fit: toolkit plan decides the same (planner.predict)
            return False, (f"train.zero3_leaves=auto: with checkpointing every leaf layer would stay gathered, "
                           f"{gathered_gib:.1f} GiB on a {gpu_gib:.0f} GiB GPU (more than half): a hook on each "
                           "submodule instead")
        why += (f"; warning: with checkpointing every leaf layer stays gathered, {gathered_gib:.1f} GiB on a "
                f"{gpu_gib:.0f} GiB GPU: set train.zero3_leaves=false if it runs out of memory")
    return on, why


def _leaves_on(setting: str, *, stage: int, compiled: bool, blocked: str | None, model_type: str,
               objective: str) -> tuple[bool, str]:
    """(the decoder layers are ZeRO-3 leaf modules or not, why), for train.zero3_leaves = auto | true | false.
    blocked: `leaves_blocked` for this run. A leaf is gathered whole before its forward and reduced once after its
    backward, with no DeepSpeed hook on its submodules. auto: leaves where the layers are compiled (one graph a
    layer instead of one per submodule), and eager where measured faster (EAGER_LEAVES_TYPES, not GRPO)."""
    if stage != 3:
        return False, f"train.zero3_leaves={setting}: not ZeRO-3"
    if setting == "false":
        return False, "train.zero3_leaves=false"
    if blocked:
        if setting == "true":
            raise ValueError(f"train.zero3_leaves=true: {blocked}, the decoder layers cannot be ZeRO-3 leaf modules "
                             "(toolkit/plan/speedups.py leaves_blocked); set train.zero3_leaves=auto or false")
        return False, f"train.zero3_leaves=auto: {blocked}, the decoder layers cannot be leaf modules"
    if setting == "true":
        return True, "train.zero3_leaves=true"
    if compiled:
        return True, "train.zero3_leaves=auto: compiled layers (one graph a layer)"
    if model_type in EAGER_LEAVES_TYPES and objective != "grpo":
        return True, ("train.zero3_leaves=auto: one gather and one reduce a layer instead of a hook on each submodule "
                      "(measured 1.1-2.5x faster eager)")
    why = "GRPO rollouts" if objective == "grpo" else f"model type {model_type or '?'}"
    return False, f"train.zero3_leaves=auto: eager leaves not measured for {why}; a hook on each submodule"


def reference_leaves(setting: str, *, model_type: str, objective: str) -> bool:
    """Whether a preference run's frozen ZeRO-3 reference engine makes its decoder layers leaf modules: where
    train.zero3_leaves would make an eager policy's so (it has no LoRA and runs no backward, so nothing blocks it)."""
    return leaves_on(setting, stage=3, compiled=False, blocked=None, model_type=model_type, objective=objective)[0]


def leaves_blocked(*, lora: bool, ds: dict | None = None) -> str | None:
    """Why the decoder layers of a ZeRO-3 run cannot be leaf modules (toolkit/runtime/speed/compile.py), or None.

    LoRA: the first layer's input needs no gradient, and DeepSpeed would reduce a leaf's gradients before they
    exist. Parameters offloaded to NVMe: a leaf swaps in all its weights at once, and DeepSpeed's swapper holds
    `offload_param.buffer_count` of them (5 by default, fewer than a Llama layer's 7 Linears): it asserts."""
    if lora:
        return "under LoRA"
    off = ((ds or {}).get("zero_optimization") or {}).get("offload_param") or {}
    if isinstance(off, dict) and off.get("device") == "nvme":
        return "with parameters offloaded to NVMe"
    return None


def fp8_converts(recipe: str, in_features: int, out_features: int) -> bool:
    """Whether a decoder layer's Linear (in -> out features) gets float8 matmuls.

    Its dimensions, never its weight's shape: under ZeRO-3 a partitioned weight has shape (0,), and a
    filter on `weight.shape` converts nothing and trains in bf16 without a word. Both dimensions must be
    multiples of 16 (`torch._scaled_mm`); below torchao's size thresholds (measured on H100, its
    float8_linear_utils._auto_filter_for_recipe) the casts cost more than the float8 matmul saves.
    """
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    raise ValueError(f"float8 recipe must be one of {FP8_RECIPES}, got {recipe!r}")


def fp8_support_error(capability: tuple[int, int] | None, gpu: str = "") -> str | None:
    """One line when this machine cannot train in float8 (None: it can); capability None means no CUDA GPU."""
    if capability is None:
        return ("train.precision=fp8 needs a CUDA GPU with float8 tensor cores (SM 8.9+: L4, L40, H100, H200, "
                "B200); this run has none (CPU ranks); use train.precision=bf16")
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return (f"train.precision=fp8 needs float8 tensor cores (SM 8.9+); {gpu or 'this GPU'} is SM "
                f"{capability[0]}.{capability[1]}; use train.precision=bf16")
    return None


# model.tiled_mlp=auto: on when a rank holds at least this many tokens of a row (../shared/notes/long_context.md
# section 6: from about 64K tokens the MLP's recompute memory dominates a layer's). Not measured here yet.
TILED_MLP_AUTO_MIN_TOKENS = 65_536


def tiled_mlp_on(setting: str, seq_len: int, sequence_parallel: int) -> tuple[bool, str]:
    """(tile or not, why) for model.tiled_mlp = auto | true | false (toolkit/runtime/sequence/tiling.py)."""
    if setting in ("true", "false"):
        return setting == "true", f"model.tiled_mlp={setting}"
    per_rank = seq_len // max(1, sequence_parallel)
    if per_rank >= TILED_MLP_AUTO_MIN_TOKENS:
        return True, (f"model.tiled_mlp=auto: {per_rank:,} tokens of a row per rank (>= {TILED_MLP_AUTO_MIN_TOKENS:,}): "
                      "the MLP's activations would dominate")
    return False, f"model.tiled_mlp=auto: {per_rank:,} tokens of a row per rank (< {TILED_MLP_AUTO_MIN_TOKENS:,})"


# model.tiled_loss=auto: on where Liger's fused loss is not in use and a rank holds at least this many tokens of a
# row (long sequences; short rows in big micro-batches keep the plain loss and its speed); then the logits exist one
# tile at a time (toolkit/runtime/sequence/tiling.py tile_loss).
TILED_LOSS_AUTO_MIN_TOKENS = 32_768
# Tokens per loss tile: about this many bytes of fp32 logits each (a 128,256 vocabulary: 2,092 tokens).
TILED_LOSS_TILE_BYTES = 1 << 30


def tiled_loss_on(setting: str, *, fused_loss: bool, tokens: int, causal_lm: bool = True, moe: bool = False
                  ) -> tuple[bool, str]:
    """(tile the loss or not, why) for model.tiled_loss = auto | true | false; tokens: a rank's tokens of a row
    (seq_len / sequence_parallel); fused_loss: Liger's fused loss is in use."""
    if setting == "false":
        return False, "model.tiled_loss=false"
    if not causal_lm or moe or fused_loss:
        why = ("Liger's fused loss keeps no logits" if fused_loss else
               "a Mixture-of-Experts model (its router loss rides on the forward)" if moe else "not a causal LM")
        return False, f"model.tiled_loss={setting}: off ({why})"
    if setting == "true":
        return True, "model.tiled_loss=true"
    if tokens >= TILED_LOSS_AUTO_MIN_TOKENS:
        return True, (f"model.tiled_loss=auto: {tokens:,} tokens of a row per rank (>= "
                      f"{TILED_LOSS_AUTO_MIN_TOKENS:,}) without Liger's fused loss")
    return False, f"model.tiled_loss=auto: {tokens:,} tokens of a row per rank (< {TILED_LOSS_AUTO_MIN_TOKENS:,})"


def tiled_loss_tile(vocab: int) -> int:
    """Tokens per loss tile: about TILED_LOSS_TILE_BYTES of fp32 logits, at least 256."""
    return max(256, TILED_LOSS_TILE_BYTES // (4 * vocab))


# model.activation_offload=auto: on when the layer inputs gradient checkpointing keeps on a rank (layers x hidden x
# tokens, bf16) would take at least this share of its GPU. ../shared/notes/long_context.md section 6: from about
# 256K tokens (an 8B Llama: 256 KiB a token) they are the largest term of the peak; offloaded, each comes back for
# its layer's backward only. The copies run on a side stream, hidden behind a layer's compute at such lengths.
ACTIVATION_OFFLOAD_AUTO_SHARE = 0.25
# Pinned (page-locked) host buffers when every rank's fits in this share of the host's memory: PyTorch's pinned
# allocator rounds each buffer up to a power of two (a 3 GiB layer input locks 4 GiB), and locked memory cannot be
# swapped or shared with the page cache. Above it, pageable buffers: exact sizes, each copy waits for the GPU.
PINNED_HOST_SHARE = 0.5


def pinned_bytes(n_bytes: float) -> float:
    """What one pinned host buffer of n_bytes locks: PyTorch's caching host allocator rounds every pinned allocation
    up to a power of two (CachingHostAllocator: PowerOf2Ceil) and cudaHostAlloc locks all of it, so RSS pays the
    rounding. Checked against issue 11's Llama-2-7B full offload: 121 GiB measured, 121.3 predicted."""
    return float(1 << math.ceil(math.log2(n_bytes))) if n_bytes >= 1 else 0.0


def activation_offload_on(setting: str, *, grad_ckpt: bool, cuda: bool, layers: int, hidden: int, tokens: int,
                          gpu_bytes: float) -> tuple[bool, str]:
    """(offload or not, why) for model.activation_offload = auto | true | pinned | pageable | false
    (toolkit/runtime/sequence/offload.py). tokens: one micro-batch's tokens on a rank (micro x seq_len / sequence
    parallel)."""
    if setting == "false":
        return False, "model.activation_offload=false"
    if not grad_ckpt:  # `toolkit check` and the run refuse `true` without checkpointing
        return False, "model.activation_offload: no checkpointed inputs (model.gradient_checkpointing=false)"
    if not cuda:
        return False, f"model.activation_offload={setting}: no effect on CPU ranks (nothing to move off a GPU)"
    kept = layers * 2.0 * hidden * tokens
    share = kept / gpu_bytes if gpu_bytes else 0.0
    what = f"checkpointed layer inputs {kept / 2**30:.1f} GiB per rank, {share:.0%} of the GPU"
    if setting != "auto":
        return True, f"model.activation_offload={setting}: {what}"
    if share >= ACTIVATION_OFFLOAD_AUTO_SHARE:
        return True, f"model.activation_offload=auto: {what} (>= {ACTIVATION_OFFLOAD_AUTO_SHARE:.0%})"
    return False, f"model.activation_offload=auto: {what} (< {ACTIVATION_OFFLOAD_AUTO_SHARE:.0%})"


def offload_pinned(*, layers: int, layer_bytes: float, ranks_per_node: int, host_bytes: float | None,
                   setting: str = "auto") -> tuple[bool, str]:
    """(pinned host buffers or pageable, why) for offloaded layer inputs of layer_bytes each (DeepSpeed's pool keeps
    a buffer per layer input, reused every step). host_bytes None: not known, pinned. setting: model.activation_offload
    (pinned and pageable decide it)."""
    kept = max(layers - 1, 0)  # the newest input stays on the GPU
    locked = ranks_per_node * kept * pinned_bytes(layer_bytes)
    if setting == "pageable":
        return False, f"pageable host buffers, {ranks_per_node * kept * layer_bytes / 2**30:.0f} GiB per node"
    if setting == "pinned" or host_bytes is None or locked <= PINNED_HOST_SHARE * host_bytes:
        return True, f"pinned host buffers, {locked / 2**30:.0f} GiB per node"
    return False, (f"pageable host buffers, {ranks_per_node * kept * layer_bytes / 2**30:.0f} GiB per node (pinned "
                   f"would lock {locked / 2**30:.0f} GiB, over {PINNED_HOST_SHARE:.0%} of the host's "
                   f"{host_bytes / 2**30:.0f}): each copy waits for the GPU")
