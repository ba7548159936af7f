"""TRL's `DPOTrainer` on preference pairs, timed: the TRL side of the toolkit-vs-TRL DPO benchmark (and with
`--objective kto`, TRL's `KTOTrainer` on the same pairs split into unpaired rows: chosen desirable, rejected not).

    deepspeed --num_gpus N bench/preference_trl.py --model llama-1b --pairs pairs_short.jsonl \\
        --ds ds_configs/zero3.json --micro 8 --grad-accum 1 --steps 20 --warmup-steps 5 --max-length 2048 \\
        --mode default|best [--lora] [--precompute] --out OUT.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 bench/preference_trl.py --model tiny ...     # CPU check (gloo)

Pairs come from bench/preference_pairs.py; the model is a local HF directory (from_pretrained, bf16) or a
toolkit preset (toolkit/config/models.py) built at random init the toolkit's way (toolkit/runtime/model.py
`_random_init`, which also initializes correctly inside ZeRO-3's zero.Init). A preset's vocabulary is raised to
the tokenizer's when smaller (the `tiny` preset has 1,000 ids), and its positions to --max-length.

Settings. `--mode default`: DPOConfig at TRL's defaults (loss_type sigmoid, beta 0.1, padding to the longest
sequence of the batch, gradient checkpointing on as TRL defaults it, sdpa attention). `--mode best`: the
speed settings TRL documents: `use_liger_kernel=True`, `padding_free=True`, gradient checkpointing off;
`--precompute` (either mode) sets `precompute_ref_log_probs=True`. What these do in TRL 1.16 (read in
trl/trainer/dpo_trainer.py):
  - padding_free: DPOTrainer.__init__ warns "temporarily unavailable after a refactor" and sets it back to
    False, so batches stay padded; the JSON records requested and effective values.
  - use_liger_kernel: transformers' Trainer.train() patches the *policy* with Liger's layer kernels (RMSNorm,
    RoPE, SwiGLU); TRL turns off Liger's fused linear cross-entropy because it computes log-probs with its own
    chunked fused LM head (always on, both modes). TRL's separate reference model (full fine-tune without
    --precompute) keeps HF's RMSNorm and MLP (only RoPE, patched module-wide, reaches it), and the precompute
    pass runs in __init__, before train() patches anything. The JSON records what was patched (liger_patched_*).
    Liger needs Triton on a GPU: on CPU it is left off and the JSON says so.
  - precompute_ref_log_probs: runs in DPOTrainer.__init__ over the whole train dataset, so only the rows this run
    consumes (steps x micro x grad-accum x ranks, the file's first rows) are given to it; its wall time is
    measured around `_precompute_ref_logps` and reported apart from the steps. TRL caches its result in the
    datasets cache keyed by data and model hash: a fresh cache directory per launch keeps it from being reused.
    Under DeepSpeed with bf16 the stored reference log-probs are rounded to bf16 before the loss: transformers'
    Trainer._prepare_input casts every floating input to the DeepSpeed dtype, and these are sums over the
    completion (about 9 nats a token at random init: -500 to -9,000 for the short and long pairs, where bf16
    steps are 4 to 32 nats). So the first loss is not ln 2 (0.637 on the CPU check with the tiny model, 0.801
    with llama-1b on an H200); without DeepSpeed it is. `first_loss_minus_ln2` in the JSON shows it.
    Throughput is unaffected; the losses of such a run are not comparable.
Shared with the toolkit's defaults (toolkit/config/schema.py): lr 1e-3, warmup+cosine with 2 warmup steps, AdamW
betas/eps/weight decay and gradient clipping (the DeepSpeed JSON's "auto" values, filled by transformers from the
TrainingArguments, which get the JSON's path); LoRA r 8, alpha 16, dropout 0, q_proj/v_proj, and TRL's reference
is then the base model with the adapters disabled. max_length is --max-length (0: none); the run stops before
training if any pair, as TRL tokenized it, is longer (no truncation happens).

Measured. A TrainerCallback takes the wall time at train begin and at each step end (after
torch.cuda.synchronize on GPU). Real tokens are counted in DPOTrainer.compute_loss on the batch TRL feeds the
model: the sum of its attention_mask, whose rows are prompt+chosen and prompt+rejected (TRL's collator puts 1 on
every real token, 0 on padding), so both sequences of every pair, prompts included; padded tokens
(input_ids.numel()) are counted beside them. Per-step counts are summed over ranks. tokens/s = real tokens of
steps warmup+1..steps / (time at the end of the last step - time at the end of step warmup). Peak GPU memory is
torch.cuda.max_memory_allocated per rank, max over ranks, for the trainer's construction (model, reference,
precompute) and for training apart. Losses are the Trainer's logged loss at every step. Rank 0 writes one JSON.

KTO (`--objective kto`, default mode only): KTOConfig at its defaults but the shared ones above (loss_type kto,
beta 0.1, weights 1; its mismatched completions rotated within chunks of the prepared dataset); --micro counts rows, the first steps x micro x
grad-accum x ranks of the pairs' rows (pair i gives rows 2i, desirable, and 2i + 1). Real tokens count both forwards
of each row: prompt + completion and prompt + the batch's mismatched completion (KL_attention_mask). The first loss
must be 0.5.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# No hub calls (the GPU machines are offline; TRL pings telemetry from rank 0) and no per-rank progress bars
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the launcher puts bench/ first; toolkit is imported (read-only) from the repo
    sys.path.insert(1, str(ROOT))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local HF model directory, or a toolkit preset (tiny, llama-1b, ...)")
    ap.add_argument("--tokenizer", default="/tmp/dc/llama")
    ap.add_argument("--pairs", type=Path, required=True, help="jsonl of {prompt, chosen, rejected}")
    ap.add_argument("--ds", required=True, help="DeepSpeed JSON (its 'auto' values filled by transformers)")
    ap.add_argument("--micro", type=int, default=8, help="pairs per rank per forward")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of tokens/s (not the lr warmup)")
    ap.add_argument("--max-length", type=int, default=0, help="TRL's max_length; 0: none")
    ap.add_argument("--mode", choices=("default", "best"), default="default")
    ap.add_argument("--objective", choices=("dpo", "kto"), default="dpo")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs=True")
    ap.add_argument("--grad-ckpt", choices=("auto", "on", "off"), default="auto",
                    help="auto: TRL's default (on) in default mode, off in best")
    ap.add_argument("--seed", type=int, default=1234, help="the toolkit's train.seed default")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--local_rank", type=int, default=-1, help="appended by the deepspeed launcher")
    a = ap.parse_args()
    if not 0 <= a.warmup_steps < a.steps:
        ap.error("--warmup-steps must be below --steps: tokens/s is taken over the steps after it")
    if a.objective == "kto" and a.mode != "default":
        ap.error("--objective kto runs --mode default (KTOConfig's Liger flag is deprecated, it has no padding_free)")
    return a


def build_model(name: str, vocab: int, max_length: int, seed: int) -> tuple[Any, dict[str, Any]]:
    """A preset at random init (the toolkit's init) or a local directory, in bf16. Call after DPOConfig exists:
    its HfDeepSpeedConfig makes transformers build inside zero.Init under ZeRO-3."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from toolkit.config.models import PRESETS, SPECIAL_IDS
    from toolkit.runtime.model import _random_init

    kwargs = dict(attn_implementation="sdpa", dtype=torch.bfloat16)
    if name not in PRESETS:
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True, **kwargs)
        if model.config.vocab_size < vocab:
            raise SystemExit(f"{name}: vocab_size {model.config.vocab_size} < the tokenizer's {vocab}")
        return model, {"source": "directory"}
    spec = dict(PRESETS[name])
    changed: dict[str, Any] = {}
    if spec["vocab_size"] < vocab:  # the tokenizer's ids must exist in the embedding
        changed["vocab_size"] = spec["vocab_size"] = vocab
    if max_length and spec.get("max_position_embeddings", max_length) < max_length:
        changed["max_position_embeddings"] = spec["max_position_embeddings"] = max_length
    mc = CONFIG_MAPPING[spec.pop("model_type")](**spec, **SPECIAL_IDS)
    return _random_init(AutoModelForCausalLM, mc, seed, kwargs), {"source": "preset", "changed": changed}


class Timed:
    """A TRL trainer that counts the tokens it trains on and times its reference precompute."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.precompute_s = 0.0
        self.real_tokens = torch.zeros((), dtype=torch.long)
        self.padded_tokens = 0
        super().__init__(*args, **kwargs)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if model.training:  # the batch exactly as the model gets it: [prompt+chosen; prompt+rejected], padded
            # kept on the device: read once per step by the callback, after its synchronize (no extra sync here)
            # (KTO: prompt+completion, and prompt+mismatched completion in the KL_ tensors, a forward of its own)
            for prefix in ("", "KL_"):
                if f"{prefix}attention_mask" in inputs:
                    mask = inputs[f"{prefix}attention_mask"]
                    self.real_tokens = self.real_tokens.to(mask.device) + mask.sum()
                    self.padded_tokens += mask.numel()
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _precompute_ref_logps(self, *args: Any, **kwargs: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        out = super()._precompute_ref_logps(*args, **kwargs)
        sync()
        self.precompute_s += time.perf_counter() - t0
        return out


class TimedDPOTrainer(Timed, DPOTrainer):
    pass


class TimedKTOTrainer(Timed, KTOTrainer):
    pass


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepClock(TrainerCallback):
    """Wall time at train begin and at each step end; the step's tokens (this rank); the logged losses."""

    def __init__(self, trainer: Timed) -> None:
        self.trainer = trainer
        self.begin = 0.0
        self.ends: list[float] = []
        self.real: list[int] = []
        self.padded: list[int] = []
        self.losses: list[float] = []
        self._seen = 0
        self._padded_seen = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        sync()
        self.begin = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        sync()
        self.ends.append(time.perf_counter())
        total = int(self.trainer.real_tokens)
        self.real.append(total - self._seen)
        self._seen = total
        self.padded.append(self.trainer.padded_tokens - self._padded_seen)
        self._padded_seen = self.trainer.padded_tokens

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def liger_patched(model: Any) -> dict[str, Any]:
    """What Liger actually patched: modules whose forward is bound from liger_kernel on the instance (RMSNorm,
    SwiGLU MLP), and whether the model family's apply_rotary_pos_emb is Liger's (RoPE is patched module-wide)."""
    model = getattr(model, "module", model)  # a DeepSpeed engine
    n = 0
    for m in model.modules():
        f = m.__dict__.get("forward")
        if f is not None and getattr(getattr(f, "__func__", f), "__module__", "").startswith("liger_kernel"):
            n += 1
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rope = getattr(sys.modules.get(type(base).__module__), "apply_rotary_pos_emb", None)
    return {"modules": n, "rope": getattr(rope, "__module__", "").startswith("liger_kernel")}


def strict_json(obj: Any) -> Any:
    """Non-finite floats as strings: the resolved DeepSpeed config holds steps_per_print=inf, not valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict_json(v) for v in obj]
    return obj


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for pkg in ("trl", "transformers", "torch", "deepspeed", "accelerate", "peft", "datasets", "liger-kernel"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def main() -> None:
    a = parse_args()
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from toolkit.config.schema import LoraConfig as ToolkitLora
    from toolkit.config.schema import TrainConfig

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    best = a.mode == "best"
    liger_note = "off (default mode)"
    use_liger = False
    if best:
        import importlib.util

        if not cuda:
            liger_note = "off: Liger's Triton kernels need a GPU"
        elif importlib.util.find_spec("liger_kernel") is None:
            raise SystemExit("--mode best needs liger-kernel on GPU (pip install liger-kernel)")
        else:
            use_liger, liger_note = True, "on"
    grad_ckpt = {"on": True, "off": False}.get(a.grad_ckpt, not best)
    tk = TrainConfig()
    out_dir = a.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)

    # DeepSpeed's own process group first: on CPU, accelerate would start a plain torch one, and zero.Init would
    # then see world size 1 (its batch-size check fails)
    import deepspeed

    if cuda:  # before any collective: NCCL's object collectives run on the current device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    # DPOConfig before the model: its HfDeepSpeedConfig makes transformers build the model inside zero.Init
    kto = a.objective == "kto"
    shared = dict(
        output_dir=str(out_dir / f".{a.out.stem}_trainer"), deepspeed=a.ds, bf16=True, use_cpu=not cuda,
        per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.grad_accum, max_steps=a.steps,
        learning_rate=tk.lr, lr_scheduler_type="cosine", warmup_steps=tk.warmup_steps, weight_decay=tk.weight_decay,
        adam_beta1=tk.betas[0], adam_beta2=tk.betas[1], adam_epsilon=tk.eps, max_grad_norm=1.0 if tk.grad_clip is None else tk.grad_clip,
        seed=a.seed, max_length=a.max_length or None, gradient_checkpointing=grad_ckpt,
        precompute_ref_log_probs=a.precompute,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_drop_last=True,
    )
    cfg = KTOConfig(**shared) if kto else DPOConfig(**shared, use_liger_kernel=use_liger, padding_free=best)
    rank, world = dist.get_rank(), dist.get_world_size()

    # A fresh datasets cache per launch, shared by the ranks: TRL's precompute reuses a cached result otherwise
    holder = [tempfile.mkdtemp(prefix="trl_dpo_cache_", dir=out_dir) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    cache_dir = str(holder[0])
    if rank == 0:  # also when the run stops early (a pair too long, an error): after the barrier at the end else
        atexit.register(shutil.rmtree, cfg.output_dir, ignore_errors=True)
        atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    rows = a.steps * a.micro * a.grad_accum * world  # exactly what the run consumes: the precompute sees no more
    with cfg.main_process_first(desc="load pairs"):
        data = load_dataset("json", data_files=str(a.pairs), split="train", cache_dir=cache_dir)
        if kto:  # each pair as two unpaired rows, in order: chosen (desirable), then rejected
            from datasets import Dataset

            data = Dataset.from_list([{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                                      for r in data for side in ("chosen", "rejected")])
    if len(data) < rows:
        raise SystemExit(f"{a.pairs}: {len(data)} pairs, the run needs {rows} (steps x micro x grad-accum x ranks)")
    data = data.select(range(rows))

    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    t0 = time.perf_counter()
    model, built = build_model(a.model, len(tok), a.max_length, a.seed)
    # Full fine-tune without precompute needs a reference model: TRL would reload it from config._name_or_path,
    # which a preset has not, so it is built here the same way (same seed: the same weights as the policy)
    ref = None if a.lora or a.precompute else build_model(a.model, len(tok), a.max_length, a.seed)[0]
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    tl = ToolkitLora()
    peft_config = LoraConfig(r=tl.r, lora_alpha=tl.alpha, lora_dropout=tl.dropout,
                             target_modules=list(tl.target_modules), task_type="CAUSAL_LM") if a.lora else None
    trainer = (TimedKTOTrainer if kto else TimedDPOTrainer)(
        model=model, ref_model=ref, args=cfg, train_dataset=data, processing_class=tok, peft_config=peft_config)
    sync()
    construct_s = time.perf_counter() - t0

    # No truncation: every sequence, as TRL tokenized it (EOS included), must fit max_length
    prepared = trainer.train_dataset
    second = ("completion_ids", "KL_completion_ids") if kto else ("chosen_ids", "rejected_ids")
    triples = list(zip(prepared["prompt_ids"], prepared[second[0]], prepared[second[1]], strict=True))
    lens = [len(p) + max(len(c), len(r)) for p, c, r in triples]
    pair_tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in triples)  # both sequences, prompts included
    if len(prepared) != rows or (a.max_length and max(lens) > a.max_length):
        raise SystemExit(f"TRL would truncate or drop pairs: {len(prepared)} of {rows} kept, longest sequence "
                         f"{max(lens)} tokens, --max-length {a.max_length}")

    peak_construct = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock(trainer)
    trainer.add_callback(clock)
    t_train = time.perf_counter()
    trainer.train()
    sync()
    engine_init_s = clock.begin - t_train
    peak_train = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    # Per-rank figures to rank 0: tokens are summed over ranks, peaks are the max over ranks
    mine = {"real": clock.real, "padded": clock.padded, "peak_construct": peak_construct, "peak_train": peak_train,
            "precompute_s": trainer.precompute_s,
            "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        real = [sum(r["real"][i] for r in every) for i in range(len(clock.ends))]
        padded = [sum(r["padded"][i] for r in every) for i in range(len(clock.ends))]
        ends = [clock.begin, *clock.ends]
        step_s = [b - e for e, b in itertools.pairwise(ends)]
        w = a.warmup_steps
        timed = ends[-1] - ends[w]
        peaks = [r["peak_train"] for r in every if r["peak_train"] is not None]
        peaks_c = [r["peak_construct"] for r in every if r["peak_construct"] is not None]
        pre_s = max(r["precompute_s"] for r in every) if a.precompute else None
        result = {
            "bench": f"trl_{a.objective}", "versions": versions(),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "ranks": world,
            "model": a.model, "model_build": built, "n_params": n_params, "tokenizer": a.tokenizer,
            "pairs": str(a.pairs), "rows": rows, "ds_config": a.ds,
            "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
            "micro": a.micro, "grad_accum": a.grad_accum, "steps": a.steps, "warmup_steps": a.warmup_steps,
            "settings": {
                "mode": a.mode, "lora": a.lora, "precompute_ref_log_probs": a.precompute,
                "loss_type": cfg.loss_type, "beta": cfg.beta, "max_length": cfg.max_length, "bf16": cfg.bf16,
                "gradient_checkpointing": cfg.gradient_checkpointing, "attn_implementation": "sdpa",
                "use_liger_kernel": use_liger, "liger": liger_note,
                # after train(): Liger patches the policy there; TRL's separate reference model is never patched
                "liger_patched_policy": liger_patched(trainer.model),
                "liger_patched_reference": liger_patched(trainer.ref_model) if trainer.ref_model is not None else None,
                "padding_free_requested": best, "padding_free_effective": getattr(trainer, "padding_free", False),
                "lr": cfg.learning_rate, "lr_scheduler": "cosine", "lr_warmup_steps": cfg.warmup_steps,
                "weight_decay": cfg.weight_decay, "max_grad_norm": cfg.max_grad_norm, "seed": a.seed,
                "reference": "adapters disabled" if a.lora else ("precomputed" if a.precompute else "model copy"),
                "lora_config": {"r": tl.r, "alpha": tl.alpha, "dropout": tl.dropout, "target_modules": tl.target_modules}
                if a.lora else None,
            },
            "tokens_per_s": sum(real[w:]) / timed,
            "padded_tokens_per_s": sum(padded[w:]) / timed,
            "real_tokens_per_step": real, "padded_tokens_per_step": padded,
            "longest_sequence": max(lens), "mean_sequence": pair_tokens / (2 * rows),
            "step_times_s": step_s, "timed_s": timed, "losses": clock.losses,
            # the policy starts as the reference: the first DPO (sigmoid) loss must be ln 2, KTO's 0.5
            "first_loss_minus_ln2": clock.losses[0] - math.log(2) if clock.losses and not kto else None,
            "first_loss_minus_half": clock.losses[0] - 0.5 if clock.losses and kto else None,
            "peak_gpu_gib": max(peaks + peaks_c) if peaks else None,
            "peak_gpu_gib_train": max(peaks) if peaks else None,
            "peak_gpu_gib_construct": max(peaks_c) if peaks_c else None,
            "host_rss_gib_max": max(r["host_rss_gib"] for r in every),
            "precompute_s": pre_s,
            "precompute_tokens_per_s": pair_tokens / pre_s if pre_s else None,
            "construct_s": construct_s, "engine_init_s": engine_init_s,
            "resolved_ds_config": trainer.accelerator.state.deepspeed_plugin.deepspeed_config,
        }
        a.out.write_text(json.dumps(strict_json(result), indent=1, default=str) + "\n")
        print(f"trl {result['versions']['trl']} {a.mode}{' lora' if a.lora else ''}"
              f"{' precompute' if a.precompute else ''} zero{result['zero_stage']} x{world}: "
              f"{result['tokens_per_s']:.1f} tokens/s over steps {w + 1}-{a.steps}, peak "
              f"{result['peak_gpu_gib']} GiB, precompute {pre_s} s, losses {[round(x, 4) for x in clock.losses]}"
              f" -> {a.out}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
