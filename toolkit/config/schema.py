"""Typed training config: dataclass defaults + YAML + `key=value` overrides (omegaconf stays inside).

Unknown keys and values of the wrong type are errors that name the key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

from toolkit.config.ds_config import ConfigError

EXPERTS_PATHS = ("auto", "grouped_mm", "batched_mm", "eager", "liger")
ACTIVATION_OFFLOAD = ("auto", "true", "pinned", "pageable", "false")


@dataclass
class ModelConfig:
    name: str = "tiny"
    """A preset (tiny, gpt2-124m, qwen2-0.5b, llama-1b, bert-large; random init, no download), a local HF model
    directory, or a hub id (org/name: fetched once per node into the HF cache and pinned to its commit; docs/hub.md)."""
    revision: str | None = None
    """A hub id's branch, tag or commit sha (default: its default branch); the run records the sha it resolved to."""
    trust_remote_code: bool = False
    """Run a repository's own Python (its config's auto_map), pinned to the resolved commit. Off: such a model is
    refused in one line before anything loads."""
    task: str = "causal_lm"
    """causal_lm (SFT: prompt tokens masked with -100) or seq_cls (sequence classification)."""
    num_labels: int = 2
    """Classes for seq_cls."""
    attn_implementation: str = "sdpa"
    """eager, sdpa, varlen, or flash_attention_2 (when flash-attn is installed). sdpa: on CUDA, packed rows go
    through variable-length attention (toolkit/runtime/attention/), everything else through sdpa; on CPU packed
    rows use sdpa with a block-diagonal mask. varlen: the toolkit's attention on any device (on CPU a
    per-document reference, for tests)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    liger: bool = True
    """Liger kernels (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE) on CUDA for the families Liger
    supports. The run prints what was applied and why not."""
    liger_fused_loss: str = "auto"
    """auto, true, or false: Liger's fused linear cross-entropy (no logits tensor). auto = true, except for a
    Mixture-of-Experts micro-batch of up to 8,192 tokens whose logits fit, where the plain loss is faster
    (toolkit/plan/liger.py). Under ZeRO-3
    lm_head.weight is registered as an external parameter of the model, so ZeRO-3 gathers it with the
    model's forward instead of blocking on it."""
    liger_chunk_mem_const: str = "auto"
    """auto or a positive integer: Liger's `chunk_mem_const`, which sets how many rows a chunk of the fused loss holds
    (about micro-batch tokens x chunk_mem_const x hidden / vocabulary; 1 is Liger's default). auto: chunks of
    2,048 rows (all the tokens, if fewer), one bf16 logit a row and vocabulary entry at a time: Gemma 3's head loss
    ran 2.2x faster than at Liger's default (toolkit/plan/liger.py)."""
    rope_factor: float = 1.0
    """Train beyond the model's positions: max_position_embeddings x this factor, through YaRN rope scaling from
    the model's own positions when it has none, else its own scaling's factor multiplied (Llama 3.1/3.2's
    llama3, Qwen2.5's YaRN). 1: the model as it is. Fine-tune at the longer length for the model to use it."""
    tiled_mlp: str = "auto"
    """auto, true or false: each decoder layer's MLP runs over the sequence in tiles (DeepSpeed's TiledMLP,
    recomputed in backward), so its (tokens x intermediate) activations exist for one tile at a time. auto:
    on when a rank holds at least 65,536 tokens of a row (data.seq_len / train.sequence_parallel), where the
    MLP's activations dominate a layer's memory; the run says which (toolkit/runtime/sequence/tiling.py)."""
    tiled_mlp_shards: int = 0
    """Tiles per MLP call; 0: ceil(tokens / hidden size), DeepSpeed's and ALST's choice."""
    tiled_loss: str = "auto"
    """auto, true or false: a causal LM's logits and loss computed over the sequence in tiles of about 1 GiB of
    fp32 logits, each recomputed in backward, so the (tokens x vocabulary) logits never exist whole; the loss and
    gradients are the plain ones. Only where Liger's fused loss is not in use (it keeps no logits either). auto:
    on when a rank holds at least 32,768 tokens of a row; the run says which (toolkit/runtime/sequence/
    tiling.py)."""
    activation_offload: str = "auto"
    """auto, true, pinned, pageable or false: the layer inputs gradient checkpointing keeps go to CPU memory during
    forward and come back for their layer's backward (DeepSpeed's offload context, CUDA only; needs
    model.gradient_checkpointing). auto: on when they would take at least a quarter of the GPU (layers x hidden x
    tokens per rank, bf16). true: on. Host buffers: pinned (copies overlap compute; PyTorch rounds each to a power of
    two) when they fit in half the host's memory, else pageable (exact sizes, each copy waits); pinned or pageable
    turn it on with that kind. The run says which (toolkit/runtime/sequence/offload.py)."""
    new_weights: list[str] = field(default_factory=list)
    """Tensors a model directory's checkpoint may lack, to be trained from new (random) weights on purpose: fnmatch
    patterns of their names, e.g. ['score.*'] or ['model.layers.*.mlp.gate.*']. Any other tensor it lacks, one it holds
    that no module has, or one of another shape stops the run before loading (toolkit/runtime/faults/load_report.py)."""
    tokenizer: str | None = None
    """Tokenizer for text data: a local directory or a hub id; defaults to the model's."""
    num_layers: int = 0
    """Presets only: build the preset with this many decoder layers (full width, random init), to measure a large
    shape's speed and memory on fewer GPUs; `toolkit plan --layers` plans the same. 0: the preset's own."""
    load_in_4bit: bool = False
    """QLoRA: a frozen 4-bit base (bitsandbytes NF4/FP4, double quantization, stored and computed in the run's float
    dtype so ZeRO-3 shards it like bf16 weights) under the LoRA adapters (lora.enabled=true); the head stays in the
    float dtype (toolkit/runtime/quant, docs/qlora.md)."""
    bnb_4bit_quant_type: str = "nf4"
    """model.load_in_4bit: nf4 (NormalFloat, QLoRA's) or fp4."""
    experts: str = "auto"
    """Mixture-of-Experts models: how a layer's experts run. grouped_mm, batched_mm or eager (transformers' experts
    implementations), liger (Liger's fused MoE kernel, CUDA, the families Liger patches: Qwen3-MoE, Mixtral: 5.7%
    faster once tuned, but autotuned for minutes at each new batch shape), or auto: grouped_mm (measured:
    bench/results/moe.md); the run says which (toolkit/plan/experts.py)."""


@dataclass
class DataConfig:
    source: str = "synthetic"
    """synthetic (embedded, learnable), a local .jsonl / .json / .parquet / .txt file, or a hub dataset id (org/name:
    its data.split file, fetched once per node and pinned; docs/hub.md), tokenized once into data.cache_dir and
    memory-mapped by every rank (later launches reuse it)."""
    split: str = "train"
    """A hub dataset's split (data.source); data.eval_source by id reads its own split named by data.eval_split."""
    eval_split: str = "test"
    """The split a hub dataset id in data.eval_source reads."""
    revision: str | None = None
    """A hub dataset's branch, tag or commit sha (data.source and data.eval_source)."""
    format: str = "auto"
    """auto (from the columns: messages, else prompt+response, else text), prompt_response (prompt masked
    from the loss), text (all tokens trained on; long documents split into seq_len samples) or messages
    (chat rows rendered with the tokenizer's chat template, loss on the assistant turns only)."""
    num_samples: int = 256
    """Synthetic samples to generate."""
    seq_len: int = 64
    """Maximum tokens per sample (synthetic samples have exactly this length)."""
    prompt_field: str = "prompt"
    """jsonl/parquet column holding the prompt (masked from the loss)."""
    response_field: str = "response"
    """jsonl/parquet column holding the response (trained on)."""
    text_field: str = "text"
    """Column with plain text (no masking) when prompt/response columns are absent."""
    label_field: str = "label"
    """Column with the class for seq_cls."""
    messages_field: str = "messages"
    """Column with the conversation, a list of {"role": system|user|assistant|tool, "content": str}."""
    packing: Union[bool, str] = "auto"  # noqa: UP007 (omegaconf reads typing.Union)
    """auto, true or false. true: fill seq_len blocks with whole samples (causal_lm only); position ids restart per
    sample and, on CUDA, each sample attends only within itself through variable-length attention (no padding,
    no mask). auto: on for causal-LM file data (prompt_response, text, messages), off for synthetic data (rows of
    full length already) and sequence classification; the run says which and why. Off: batches are grouped by
    length (as HF's group_by_length) so little is padded."""
    eval_source: str | None = None
    """A held-out file (same format) for the eval loss; tokenized and cached like data.source."""
    eval_fraction: float = 0.0
    """Hold out this fraction of data.source (a seeded draw) for the eval loss instead; 0: none."""
    cache_dir: str | None = None
    """Where tokenized files are cached; default $TOOLKIT_CACHE/data (~/.cache/toolkit/data)."""
    num_proc: int = 0
    """Processes that tokenize a file on its first launch; 0: the machine's cores (at most 16)."""
    shuffle: bool = True
    """Shuffle with the run seed; the same order on both paths."""


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Module names LoRA wraps (peft's target_modules)."""


@dataclass
class TrainConfig:
    path: str = "trainer"
    """trainer (HF Trainer) or raw (deepspeed.initialize loop)."""
    objective: str = "sft"
    """sft (next-token loss); a preference objective on pairs: dpo, ipo, simpo, orpo (pref.*), reward (a
    Bradley-Terry reward model); kto, on unpaired rows marked desirable or not; or grpo, online RL with reward
    functions (rl.*, raw path)."""
    ds_config: str = "ds_configs/zero2.json"
    """DeepSpeed JSON; "auto" values are filled from this config."""
    precision: str = "auto"
    """bf16, fp16, fp32, fp8, or auto: the DeepSpeed JSON's if it pins one, else bf16 on GPUs that support it, fp32
    on CPU. fp8: bf16 training (DeepSpeed's bf16 mode) with torchao float8 matmuls in the decoder layers' Linear
    modules (toolkit/runtime/speed/fp8.py); needs float8 tensor cores (SM 8.9+), compile, and no LoRA."""
    fp8_recipe: str = "tensorwise"
    """train.precision=fp8 scaling: tensorwise (one dynamic scale per tensor; fastest) or rowwise (one per row)."""
    micro_batch_size: Union[int, str] = 4  # noqa: UP007 (omegaconf reads typing.Union, not int | str)
    """Sequences per rank per forward, or auto: the fastest that fits train.global_batch_size, found by short
    probe runs before training (toolkit/runtime/speed/autotune.py), recorded in run_dir/micro_batch.json and reused."""
    grad_accum: int = 1
    global_batch_size: int = 0
    """Sequences per optimizer step over all ranks (needed with micro_batch_size=auto); 0: micro x accum x ranks.
    When set with a number micro-batch, micro x accum x ranks must equal it."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    muon_lr: float = 0.02
    """With the DeepSpeed config's Muon optimizer: the learning rate of its 2-D hidden matrices (DeepSpeed's
    muon_lr; its default, Keller Jordan's). train.lr is its Adam half's (embeddings, head, norms, biases)."""
    check_moved: str = "warn"
    """warn, error or off: after the first two optimizer steps with a learning rate, every trainable parameter should
    have moved; one that did not (frozen by mistake, a ZeRO-3 hook that never passes its gradient) is named in a
    warning (warn) or stops the run (error). Experts that got no tokens are named, never stopped on
    (toolkit/runtime/faults/moved.py). warn, not error, by default: some parameters legitimately stay, e.g.
    Reformer's unused lm_head.bias, or norm weights at 1.0 under bf16 master weights rounded to nearest, whose
    updates fall below bf16's resolution."""
    bf16_rounding: str = "auto"
    """With bf16 master weights and optimizer states (the DeepSpeed config's bf16_master_weights_and_grads and
    bf16_optimizer_states) and AdamW on the GPU: stochastic (torchao's AdamW rounds each update into the bf16 master
    up or down with the odds of its remainder, so small updates add up), nearest (DeepSpeed's FusedAdam: an update
    under half a bf16 step is lost), or auto: stochastic where it applies (toolkit/runtime/low_precision.py)."""
    grad_clip: float | None = None
    """Clip the gradients' global norm to this (0: off). Unset: 1.0, or off with Muon at ZeRO 1-3, where DeepSpeed
    clips Muon's orthogonalized update instead of the gradient (toolkit/config/optimizers.py)."""
    warmup_steps: int = 2
    max_steps: int = 20
    """Optimizer steps; 0 means one epoch."""
    seed: int = 1234
    log_every: int = 1
    eval_every: int = 0
    """Eval loss (and perplexity) on the held-out data every N optimizer steps, and always at the end when
    held-out data is set (data.eval_source or data.eval_fraction); 0: at the end only."""
    save_every: int = 0
    """DeepSpeed checkpoint every N steps (0: only at the end)."""
    resume: str | None = None
    """latest, or a checkpoint tag, to continue from run_dir/checkpoints."""
    export: bool = True
    """Write an HF directory (safetensors) or a LoRA adapter at the end."""
    run_dir: str = "runs/default"
    """Where the run's records go. A directory holding another run is refused (resume it, pick another
    directory, or train.overwrite=true), except the default: there the earlier run is moved aside to
    runs/default.<time>, so the same command works twice in a row."""
    overwrite: bool = False
    """Replace the earlier run in train.run_dir (only the toolkit's own files; anything else is refused)."""
    keep_checkpoints: int = 0
    """Keep only the newest N complete checkpoints (0: keep all)."""
    max_skipped_steps: int = 10
    """fp16: stop after this many optimizer steps in a row skipped on overflow (the loss scale keeps
    falling). bf16 and fp32 stop at the first NaN/Inf loss or gradient norm."""
    collective_timeout_s: int = 600
    """A rank waiting in a collective for a peer that died fails after this many seconds (the HF
    Trainer's own default is 30 minutes). Raise it when one rank alone does long work, e.g. slow saves."""
    heartbeat_timeout_s: int = 30
    """A rank (or host) whose heartbeat through the rendezvous store stops for this long is lost, and the
    job ends on every host with its stacks in logs/rank{N}.log and the lost ranks in status.json; a training
    step past train.collective_timeout_s + twice the slowest step is a hang and ends it the same way
    (toolkit/runtime/faults/watchdog.py). 0: off."""
    check_export: str = "auto"
    """auto, full, keys or off: after train.export writes its files, they are held to the trained model (every
    tensor, its shape and dtype; a LoRA adapter's under PEFT's names), then reloaded in plain transformers (PEFT for an
    adapter) on the CPU and run on two rows: its logits must equal the engine's within the precision's noise. A
    failed check stops the run in one line and leaves the files in <dir>.tmp (toolkit/runtime/faults/export_check.py).
    auto: the logits where the model, in the dtype it is saved in, takes at most half the host's free memory; full: always; keys: names,
    shapes and dtypes only."""
    save_probe: bool = False
    """Save the final engine's logits on two samples (probe.pt) to verify the export against."""
    zero_sizes: str = "speed"
    """How "auto" ZeRO bucket, prefetch and live-parameter sizes resolve: speed (DeepSpeed's defaults,
    measured fastest) or memory (h^2-based rules: about 2 GiB less per rank on a 1B model at ZeRO-3,
    at a third of its speed). memory also replaces a size the JSON sets to DeepSpeed's default, as the
    presets do where a plain HF Trainer cannot fill "auto"."""
    compile: str = "auto"
    """torch: compile each decoder layer in place (inductor) before DeepSpeed starts, both paths; Liger then keeps
    only its fused loss. off: eager. auto: compile where it pays (toolkit/plan/speedups.py compile_on: every fp8
    run, and CUDA runs of at least 200 steps; eager at ZeRO-3 under LoRA); the run says which. The first
    optimizer step pays the compile, 6-12 s on an H200 (toolkit/runtime/speed/compile.py; docs/speed.md)."""
    zero3_leaves: str = "auto"
    """ZeRO-3 only: each decoder layer a leaf module (one gather of the whole layer before its forward, one reduce
    after its backward, no hook on its submodules). true, false, or auto: leaves where the layers are compiled, and
    eager for Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 3 full fine-tunes (SFT, preference: measured 1.1-2.5x
    faster; toolkit/plan/speedups.py leaves_on). Never under LoRA or NVMe parameter offload (true is refused there). With gradient
    checkpointing on several GPUs (or parameters on the CPU) DeepSpeed keeps every leaf layer gathered: the whole
    model's bf16 weights, which `toolkit plan` counts and the run warns of at start where they take over half the GPU
    (false then keeps the reuse distance's few)."""
    stop_after: int = 0
    """Stop (with a checkpoint) after this many steps, keeping the schedule of max_steps: for resume tests."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last]: record torch.profiler (host and CUDA) over these optimizer steps on every rank, into
    run_dir/profile/: rank{N}.trace.json (Perfetto / chrome://tracing) and rank{N}.summary.json (GPU busy
    time against wall time, host time waiting in CUDA syncs, top operators). Empty: off."""
    sequence_parallel: int = 1
    """Ulysses sequence parallelism (DeepSpeed's): each sample's tokens are split over this many ranks, which
    exchange attention heads around each attention; the ranks of a group share every batch, so the global
    batch is micro x accum x ranks / sequence_parallel. Both paths, ZeRO 1-3, causal LMs (toolkit/runtime/sequence/)."""
    plan: str | None = None
    """plan.json written by `toolkit plan -o DIR` (its train.yaml sets this): copied into the run directory,
    so `toolkit report` shows the plan's per-rank prediction next to what was measured."""


@dataclass
class MemoryConfig:
    every: int = 10
    """Snapshot every N optimizer steps (0: phases only)."""
    spread_warn_gib: float = 2.0
    """Warn when max-min of allocated across ranks passes this."""
    gpu_limit_gib: float = 0.0
    """Cap each rank's PyTorch allocator at this many GiB of its GPU (torch.cuda.set_per_process_memory_fraction);
    0: the whole GPU. Tries a plan for a smaller card on a bigger one (an 80 GB H100's 77 GiB left after the CUDA
    context, on a 141 GB H200): past it an allocation fails with CUDA out of memory as on the smaller card, and
    the run's memory rules (micro_batch_size=auto, activation_offload=auto) size against it."""

    def __post_init__(self) -> None:
        if self.gpu_limit_gib < 0:
            raise ConfigError(f"memory.gpu_limit_gib must be >= 0 (0: the whole GPU), got {self.gpu_limit_gib}")


@dataclass
class MetricsConfig:
    report_to: Any = field(default_factory=lambda: ["tensorboard"])
    """Trackers that get the training scalars (loss, lr, grad norm, tokens/s, MFU, eval loss) and every rank's
    memory, on both paths: a list of tensorboard, wandb, mlflow, or one name, or none. wandb and mlflow log from
    rank 0 (per-rank memory as memory/rank{N}/...), set up by their own variables (WANDB_PROJECT, WANDB_MODE,
    MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME); their packages are optional (docs/training.md)."""
    tensorboard: bool = True
    """Write TensorBoard event files under run_dir/tb/: training scalars from rank 0, memory per rank
    in tb/rank{N}/ (`tensorboard --logdir RUN_DIR/tb`). false takes tensorboard out of report_to (the older
    switch); after loading, it says whether tensorboard is in report_to."""
    peak_tflops: float = 0.0
    """Dense bf16/fp16 peak TFLOPS of one GPU, for MFU; 0: look the GPU up by name (A100, H100, H200, ...).
    MFU is left out where the peak is unknown (fp32 runs, CPU, GPUs not in the table)."""

    def __post_init__(self) -> None:
        if self.peak_tflops < 0:
            raise ConfigError("metrics.peak_tflops must be >= 0 (0: look the GPU up by name)")
        # Typed Any so that both `metrics.report_to=wandb` (as HF's report_to="wandb") and a list load.
        names = self.report_to
        if isinstance(names, str):
            names = [n for n in names.replace(" ", "").split(",") if n]
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"metrics.report_to must be a list of tensorboard, wandb, mlflow, got {names!r}")
        names = [n.lower() for n in names if n.lower() != "none"]
        bad = [n for n in names if n not in ("tensorboard", "wandb", "mlflow")]
        if bad:
            raise ConfigError(f"metrics.report_to: unknown tracker {bad[0]!r}; known: tensorboard, wandb, mlflow, none")
        if not self.tensorboard:
            names = [n for n in names if n != "tensorboard"]
        self.report_to = list(dict.fromkeys(names))
        self.tensorboard = "tensorboard" in self.report_to


@dataclass
class EvalConfig:
    generate: bool = False
    """Generate from eval prompts at the end of training (run_dir/generations.jsonl); ZeRO-3 safe."""
    generate_every: int = 0
    """With eval.generate: also every N optimizer steps (run_dir/generations/step_N.jsonl); 0: at the end only."""
    generate_source: str | None = None
    """A prompt file (JSON lines: "prompt"/"text", "messages" (chat template) or "input_ids", and optionally a
    "reference" for the exact-match score); default: eval.num_prompts prompts from the first training samples."""
    num_prompts: int = 3
    """Prompts taken from the first training samples (causal_lm: the tokens whose labels are -100)."""
    generate_batch_size: Union[int, str] = "auto"  # noqa: UP007 (omegaconf reads typing.Union)
    """Prompts per generate call on a rank (left-padded), or auto: as many as free memory holds beside the KV
    cache, at most 128."""
    generate_cache: str = "dynamic"
    """dynamic (transformers' default KV cache, grown per token) or static: a preallocated cache, and on CUDA
    transformers compiles the decode step (once per batch shape: prompts are then left-padded to a multiple of
    64 and batches filled to one size). Whole-model paths only; layer by layer under ZeRO-3 stays dynamic."""
    generate_gather: str = "auto"
    """ZeRO-3: gather the whole model once per generation (one all-gather instead of one per layer per token).
    auto: where every rank has room for it, else layer by layer; true; false."""
    max_new_tokens: int = 16
    """New tokens per prompt at most; a prompt stops earlier at EOS."""
    do_sample: bool = False
    """Sample (temperature, top_p) instead of greedy decoding."""
    temperature: float = 1.0
    """Sampling temperature (do_sample only)."""
    top_p: float = 1.0
    """Nucleus sampling mass (do_sample only)."""
    seed: int = 0
    """Sampling seed: prompt i draws from seed + i, so results do not depend on the world size."""
    eos_token_id: int | None = None
    """Stop token override; default: the tokenizer's EOS, else the model config's."""
    unsafe_no_sync: bool = False
    """Debug only: turn synced_gpus off even under ZeRO-3 with >1 rank. Deadlocks when ranks finish at
    different steps (NCCL hangs; gloo may abort with a collective mismatch); exists so a test can
    show that the protection matters."""

    def __post_init__(self) -> None:
        self.generate_gather = str(self.generate_gather).lower()  # omegaconf turns `false` into "False"
        checks = [
            (self.num_prompts >= 0, "eval.num_prompts must be >= 0"),
            (self.max_new_tokens >= 1, "eval.max_new_tokens must be >= 1"),
            (self.temperature > 0, "eval.temperature must be > 0"),
            (0 < self.top_p <= 1, "eval.top_p must be in (0, 1]"),
            (self.generate_every >= 0, "eval.generate_every must be >= 0"),
            (self.generate_batch_size == "auto" or (isinstance(self.generate_batch_size, int)
                                                    and not isinstance(self.generate_batch_size, bool)
                                                    and self.generate_batch_size >= 1),
             f"eval.generate_batch_size must be >= 1 or auto, got {self.generate_batch_size!r}"),
            (self.generate_cache in ("dynamic", "static"),
             f"eval.generate_cache must be dynamic or static, got {self.generate_cache!r}"),
            (self.generate_gather in ("auto", "true", "false"),
             f"eval.generate_gather must be auto, true or false, got {self.generate_gather!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)


def _non_negative(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


@dataclass
class MoeConfig:
    aux_loss_coef: str = "auto"
    """Mixture-of-Experts models: the weight of the router's load-balancing loss added to the training loss (as
    TRL does; transformers adds none unless asked). auto: the model's own router_aux_loss_coef (0.001 for Qwen-MoE
    and Mixtral, 0.01 for OLMoE); 0: off. Scaled as the token loss is, so its gradient is the same at any world
    size and accumulation (toolkit/runtime/moe/); eval losses and the resume check leave it out."""


OBJECTIVES = ("sft", "dpo", "ipo", "simpo", "orpo", "kto", "reward", "grpo")


@dataclass
class PrefConfig:
    """Preference training (train.objective other than sft); the knobs named as TRL names them."""

    beta: float = 0.1
    """dpo/ipo/kto: how far the policy may move from the reference; simpo: the reward scale; orpo: the odds-ratio
    weight (the paper's lambda)."""
    label_smoothing: float = 0.0
    """dpo/simpo: the share of pairs assumed mislabelled (conservative DPO)."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin."""
    reference: str = "auto"
    """dpo/ipo/kto: adapter (LoRA: the base with the adapters off), engine (a frozen copy at ZeRO-3, no optimizer),
    precomputed (every pair's reference log-probs computed once before training, by the policy before its first
    update, and cached), or auto: adapter for LoRA runs, else engine."""
    reference_offload: bool = False
    """reference=engine: its parameters on the CPU (fetched per layer as ZeRO-3 offload does)."""
    max_length: int = 0
    """Tokens per sequence (prompt + completion) at most; 0: data.seq_len."""
    desirable_weight: float = 1.0
    """kto: the weight of a desirable row's loss (TRL's name). The paper keeps desirable_weight x desirable rows over
    undesirable_weight x undesirable rows between 1 and 4/3; the run's data line gives both counts."""
    undesirable_weight: float = 1.0
    """kto: the weight of an undesirable row's loss."""
    center_rewards_coefficient: float = 0.0
    """reward: weight of the mean squared sum of each pair's rewards (Eisenstein et al. 2023), keeping them centred
    on 0; TRL's RewardConfig name. 0: off."""

    def __post_init__(self) -> None:
        checks = [(self.beta > 0, f"pref.beta must be > 0, got {self.beta}"),
                  (0 <= self.label_smoothing < 0.5, f"pref.label_smoothing must be in [0, 0.5), got {self.label_smoothing}"),
                  (self.reference in ("auto", "adapter", "engine", "precomputed"),
                   f"pref.reference must be auto, adapter, engine or precomputed, got {self.reference!r}"),
                  (self.max_length >= 0, "pref.max_length must be >= 0"),
                  (self.center_rewards_coefficient >= 0, "pref.center_rewards_coefficient must be >= 0"),
                  (self.desirable_weight > 0 and self.undesirable_weight > 0,
                   "pref.desirable_weight and pref.undesirable_weight must be > 0")]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class RLConfig:
    """Online RL (train.objective=grpo, docs/rl.md); the knobs named as TRL's GRPOConfig names them, with its
    defaults. train.micro_batch_size counts prompts (TRL counts completions): each brings num_generations."""

    rewards: Any = field(default_factory=list)
    """Reward functions: path/to/rewards.py:fn (then fn2 for another of the same file), or built-ins exact_match[=FIELD],
    format=REGEX, length[=N] (toolkit/runtime/rl/rewards.py)."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward function (empty: 1.0 each); the reward is their weighted sum."""
    num_generations: int = 8
    """Completions per prompt (the group its advantages are normalized in)."""
    max_prompt_length: int = 512
    """Prompt tokens at most (a longer prompt keeps its end); 0: no limit (TRL 1.16 has no such limit)."""
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    generate_cache: str = "auto"
    """The rollouts' KV cache: auto (static on CUDA: every rollout has the same shapes, so the decode step compiled
    once serves the run; dynamic elsewhere), static or dynamic (eval.generate_cache says what each does)."""
    epsilon: float = 0.2
    """The ratio's clip: [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float = 0.0
    """0: epsilon (DAPO's clip-higher sets it above epsilon, e.g. 0.28)."""
    beta: float = 0.0
    """KL weight to the reference; 0 (TRL's default): no reference model at all."""
    loss_type: str = "dapo"
    """grpo (each sequence's mean), bnpo (the micro-batch's token mean), dr_grpo (sum over sequences x
    max_completion_length), dapo (the step's token mean over all ranks; TRL's default)."""
    scale_rewards: str = "group"
    """Advantages divided by the group's reward std (group), the step's (batch) or not (none: Dr. GRPO)."""
    num_iterations: int = 1
    """Optimizer steps on each rollout (TRL's mu): the same prompts and completions trained on that many times, the
    ratio to the rollout's policy clipped to [1 - epsilon, 1 + epsilon_high]; an epoch takes mu times the steps."""
    log_completions_every: int = 10
    """Every N steps (and step 1) a few prompts' completions and rewards go to run_dir/completions.jsonl; 0: never."""

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"  # TRL's old bool
        checks = [(self.num_generations >= 2, f"rl.num_generations must be >= 2 (a group to compare within), got "
                                              f"{self.num_generations}"),
                  (self.max_completion_length >= 1, "rl.max_completion_length must be >= 1"),
                  (self.max_prompt_length >= 0, "rl.max_prompt_length must be >= 0"),
                  (self.temperature > 0, f"rl.temperature must be > 0 (completions are sampled), got {self.temperature}"),
                  (0 < self.top_p <= 1, f"rl.top_p must be in (0, 1], got {self.top_p}"),
                  (self.generate_cache in ("auto", "static", "dynamic"),
                   f"rl.generate_cache must be auto, static or dynamic, got {self.generate_cache!r}"),
                  (0 <= self.epsilon < 1, f"rl.epsilon must be in [0, 1), got {self.epsilon}"),
                  (self.epsilon_high >= 0, "rl.epsilon_high must be >= 0"),
                  (self.beta >= 0, f"rl.beta must be >= 0, got {self.beta}"),
                  (self.loss_type in LOSS_TYPES, f"rl.loss_type must be one of {', '.join(LOSS_TYPES)}, got "
                                                 f"{self.loss_type!r}"),
                  (self.scale_rewards in SCALE_REWARDS, f"rl.scale_rewards must be one of {', '.join(SCALE_REWARDS)}, "
                                                        f"got {self.scale_rewards!r}"),
                  (self.num_iterations >= 1, f"rl.num_iterations must be >= 1, got {self.num_iterations}"),
                  (self.log_completions_every >= 0, "rl.log_completions_every must be >= 0")]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    pref: PrefConfig = field(default_factory=PrefConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def __post_init__(self) -> None:
        t = self.train
        # YAML reads on/off/true/false as booleans, which the str field then holds as "True"/"False"
        self.model.liger_fused_loss = str(self.model.liger_fused_loss).lower()
        self.model.tiled_mlp = str(self.model.tiled_mlp).lower()
        self.model.liger_chunk_mem_const = str(self.model.liger_chunk_mem_const).lower()
        self.model.tiled_loss = str(self.model.tiled_loss).lower()
        self.model.activation_offload = str(self.model.activation_offload).lower()
        self.moe.aux_loss_coef = str(self.moe.aux_loss_coef).lower()
        c = str(t.compile).lower()  # off/on arrive as booleans too: off -> off, true -> torch
        t.compile = {"false": "off", "true": "torch"}.get(c, c)
        t.zero3_leaves = str(t.zero3_leaves).lower()  # true/false arrive as booleans
        if isinstance(self.data.packing, str):  # "true"/"false" given as strings (a dotlist of a quoted value)
            self.data.packing = {"true": True, "false": False}.get(self.data.packing.lower(), self.data.packing.lower())
        checks = [
            (self.model.liger_fused_loss in ("auto", "true", "false"),
             f"model.liger_fused_loss must be auto, true or false, got {self.model.liger_fused_loss!r}"),
            (self.model.liger_chunk_mem_const == "auto" or (self.model.liger_chunk_mem_const.isdigit()
                                                             and int(self.model.liger_chunk_mem_const) >= 1),
             f"model.liger_chunk_mem_const must be auto or a positive integer, got "
             f"{self.model.liger_chunk_mem_const!r}"),
            (self.model.tiled_mlp in ("auto", "true", "false"),
             f"model.tiled_mlp must be auto, true or false, got {self.model.tiled_mlp!r}"),
            (self.model.tiled_loss in ("auto", "true", "false"),
             f"model.tiled_loss must be auto, true or false, got {self.model.tiled_loss!r}"),
            (self.model.activation_offload in ACTIVATION_OFFLOAD,
             f"model.activation_offload must be one of {', '.join(ACTIVATION_OFFLOAD)}, "
             f"got {self.model.activation_offload!r}"),
            (self.model.activation_offload in ("auto", "false") or self.model.gradient_checkpointing,
             f"model.activation_offload={self.model.activation_offload} offloads the layer inputs gradient "
             "checkpointing keeps: set model.gradient_checkpointing=true"),
            (self.model.num_layers >= 0, f"model.num_layers must be >= 0 (0: the preset's own), got {self.model.num_layers}"),
            (not self.model.load_in_4bit or self.lora.enabled,
             "model.load_in_4bit=true trains LoRA adapters on a frozen 4-bit base (QLoRA): set lora.enabled=true"),
            (self.model.bnb_4bit_quant_type in ("nf4", "fp4"),
             f"model.bnb_4bit_quant_type must be nf4 or fp4, got {self.model.bnb_4bit_quant_type!r}"),
            (not (self.model.load_in_4bit and t.precision in ("fp16", "fp8")),
             f"model.load_in_4bit with train.precision={t.precision}: the 4-bit weights are stored in the run's float "
             "dtype and DeepSpeed's fp16 mode would cast them (float8 converts Linears the base no longer has); use bf16"),
            (self.model.experts in EXPERTS_PATHS,
             f"model.experts must be one of {', '.join(EXPERTS_PATHS)}, got {self.model.experts!r}"),
            (self.model.rope_factor >= 1, f"model.rope_factor must be >= 1, got {self.model.rope_factor}"),
            (self.model.tiled_mlp_shards >= 0, "model.tiled_mlp_shards must be >= 0 (0: tokens / hidden size)"),
            (t.sequence_parallel >= 1, f"train.sequence_parallel must be >= 1, got {t.sequence_parallel}"),
            (self.moe.aux_loss_coef == "auto" or _non_negative(self.moe.aux_loss_coef),
             f"moe.aux_loss_coef must be auto or a number >= 0, got {self.moe.aux_loss_coef!r}"),
            (t.path in ("trainer", "raw"), f"train.path must be trainer or raw, got {t.path!r}"),
            (t.objective in OBJECTIVES, f"train.objective must be one of {', '.join(OBJECTIVES)}, got {t.objective!r}"),
            (t.precision in ("auto", "bf16", "fp16", "fp32", "fp8"),
             f"train.precision must be auto, bf16, fp16, fp32 or fp8, got {t.precision!r}"),
            (t.fp8_recipe in ("tensorwise", "rowwise"), f"train.fp8_recipe must be tensorwise or rowwise, got {t.fp8_recipe!r}"),
            (t.zero_sizes in ("speed", "memory"), f"train.zero_sizes must be speed or memory, got {t.zero_sizes!r}"),
            (t.check_export in ("auto", "full", "keys", "off"),
             f"train.check_export must be auto, full, keys or off, got {t.check_export!r}"),
            (t.check_moved in ("error", "warn", "off"),
             f"train.check_moved must be error, warn or off, got {t.check_moved!r}"),
            (t.compile in ("off", "torch", "auto"), f"train.compile must be auto, off or torch, got {t.compile!r}"),
            (t.zero3_leaves in ("auto", "true", "false"),
             f"train.zero3_leaves must be auto, true or false, got {t.zero3_leaves!r}"),
            (t.keep_checkpoints >= 0, "train.keep_checkpoints must be >= 0"),
            (t.collective_timeout_s >= 1, "train.collective_timeout_s must be >= 1"),
            (t.heartbeat_timeout_s >= 0, "train.heartbeat_timeout_s must be >= 0 (0: no watchdog)"),
            (t.micro_batch_size == "auto" or (isinstance(t.micro_batch_size, int) and t.micro_batch_size >= 1),
             f"train.micro_batch_size must be >= 1 or auto, got {t.micro_batch_size!r}"),
            (t.global_batch_size >= 0, "train.global_batch_size must be >= 0"),
            (t.grad_accum >= 1, "train.grad_accum must be >= 1"),
            (t.max_steps >= 0, "train.max_steps must be >= 0"),
            (not t.profile_steps or (len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1]),
             f"train.profile_steps must be [first, last] with 1 <= first <= last, got {list(t.profile_steps)!r}"),
            (t.lr > 0, "train.lr must be > 0"),
            (t.muon_lr > 0, "train.muon_lr must be > 0"),
            (t.bf16_rounding in ("auto", "stochastic", "nearest"),
             f"train.bf16_rounding must be auto, stochastic or nearest, got {t.bf16_rounding!r}"),
            (t.grad_clip is None or t.grad_clip >= 0, "train.grad_clip must be >= 0 (0: off)"),
            (len(t.betas) == 2, "train.betas must have two values"),
            (self.model.task in ("causal_lm", "seq_cls"), f"model.task must be causal_lm or seq_cls, got {self.model.task!r}"),
            (self.model.attn_implementation in ("eager", "sdpa", "varlen", "flash_attention_2"),
             "model.attn_implementation must be eager, sdpa, varlen or flash_attention_2, "
             f"got {self.model.attn_implementation!r}"),
            (self.data.seq_len >= 8, "data.seq_len must be >= 8"),
            (self.data.num_samples >= 1, "data.num_samples must be >= 1"),
            (self.data.packing in (True, False, "auto"), f"data.packing must be auto, true or false, got {self.data.packing!r}"),
            (not (self.data.packing is True and self.model.task != "causal_lm"), "data.packing needs model.task=causal_lm"),
            (self.data.format in ("auto", "prompt_response", "text", "messages"),
             f"data.format must be auto, prompt_response, text or messages, got {self.data.format!r}"),
            (not (self.data.format == "messages" and self.model.task != "causal_lm"),
             "data.format=messages needs model.task=causal_lm"),
            (0 <= self.data.eval_fraction < 1, f"data.eval_fraction must be in [0, 1), got {self.data.eval_fraction}"),
            (not (self.data.eval_source and self.data.eval_fraction),
             "set data.eval_source or data.eval_fraction, not both"),
            (self.data.num_proc >= 0, "data.num_proc must be >= 0 (0: the machine's cores)"),
            (t.eval_every >= 0, "train.eval_every must be >= 0"),
            (self.lora.r >= 1, "lora.r must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def packing(cfg: Config) -> tuple[bool, str]:
    """(pack this run's rows, why): data.packing with auto resolved."""
    d, task = cfg.data, cfg.model.task
    if cfg.train.objective == "reward":
        return False, "train.objective=reward: each sequence's last token is scored, so pairs go side by side, padded"
    if cfg.train.objective == "grpo":
        return True, "train.objective=grpo: each micro-batch's completions packed into one row, kept apart, no padding"
    if cfg.train.objective != "sft":
        if d.packing is False:
            return False, "data.packing=false: each pair's chosen and rejected side by side, padded to the longest"
        return True, (f"data.packing={str(d.packing).lower()}: each micro-batch's pairs packed into one row, "
                      "chosen and rejected kept apart, no padding")
    if d.packing is not True and d.packing is not False:  # auto
        if task != "causal_lm":
            return False, f"data.packing=auto: off for {task} (one label per row)"
        if d.source == "synthetic":
            return False, "data.packing=auto: off for synthetic data (every row is seq_len long)"
        return True, "data.packing=auto: on for causal-LM file data"
    return bool(d.packing), f"data.packing={str(d.packing).lower()}"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < YAML file < `section.key=value` overrides, validated against the dataclasses."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(Config)
    try:
        merged = schema
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"{p}: no such config file")
            merged = OmegaConf.merge(merged, OmegaConf.load(p))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like section.key=value, got {bad[0]!r}")
        if overrides:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config key {key}: {msg}" if key else f"config: {msg}") from None
    assert isinstance(obj, Config)
    return obj


def save_config(cfg: Config, path: Path) -> None:
    from omegaconf import OmegaConf

    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
