"""Throughput, MFU and loss: a rank-0 progress bar, run_dir/metrics.jsonl and TensorBoard scalars (the
same for both paths), what the console says while the engine starts, and the closing summary."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.config.models import per_layer, text_config
from toolkit.launch import dist
from toolkit.observe import trackers
from toolkit.observe.tables import _fmt

# Dense (no sparsity) bf16/fp16 tensor-core peak per GPU, from NVIDIA's data sheets, matched as a
# substring of torch.cuda.get_device_name(); the most specific names come first.
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM
    ("H200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("B200", 2250.0),
)


def peak_flops_per_gpu(device_name: str | None, precision: str, override_tflops: float = 0.0) -> float | None:
    """The GPU's dense peak in FLOP/s for this precision, or None where it is not known.

    fp32 runs get None: whether matmuls use TF32 tensor cores depends on torch settings, so no single
    peak is honest there.
    """
    if override_tflops > 0:
        return override_tflops * 1e12
    if device_name is None or precision not in ("bf16", "fp16"):
        return None
    for key, tflops in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


def flops_per_token(
    total_params: int, trainable_params: int, num_layers: int, hidden: int, seq_len: int
) -> float:
    """Training FLOPs per token: 2N forward + 2N activation gradients + 2N_trainable weight gradients,
    plus 12·L·H·T for attention (PaLM, appendix B; `hidden` is H, the attention width: `attention_width`).
    Without frozen weights this is the usual 6N + 12LHT (bench/speed.py's formula); with LoRA, frozen weights get
    no weight gradient, so 6N would overstate MFU.
    """
    return 4.0 * total_params + 2.0 * trainable_params + 12.0 * num_layers * hidden * seq_len


def attention_width(config: Any) -> int | None:
    """The query width attention runs at (heads x head dim: the 12·L·H·T term's H). Most models' hidden size;
    not Qwen3-MoE's (32 heads of 128 over a hidden size of 2048); the mean over the layers where a config sets them
    per layer."""
    text = text_config(config)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    layers = int(getattr(text, "num_hidden_layers", None) or 1)
    widths = [h * d for h, d in zip(per_layer(text, "num_attention_heads", layers), per_layer(text, "head_dim", layers),
                                    strict=True) if h and d]
    # heads or head dims set per layer (Gemma 4): the mean width, which sums to the layers' attention FLOPs
    if len(widths) == layers:
        return round(sum(widths) / len(widths))
    if not hidden:
        # stacks of their own widths, none the config's own (BLT): the widest stack's, every layer at it over the whole
        # row, an upper bound on their attention (its global stack runs over patches)
        from toolkit.plan.trace import stack_configs

        hidden = max((getattr(getattr(text, k), "hidden_size", 0) or 0 for k in stack_configs(text)), default=0)
    return int(hidden) if hidden else None


def count_params(model: Any) -> tuple[int, int]:
    """(all, trainable) parameters a token runs through, for FLOPs. Under ZeRO-3 each rank holds a shard;
    ``ds_numel`` is the full size. Mixture-of-Experts: a token runs top-k of a layer's experts, so an experts
    module counts top-k / experts of its parameters (MFU on active parameters, as MoE papers report it)."""
    import torch

    cfg = getattr(model, "config", None)
    text = text_config(cfg)
    count = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    share: dict[int, float] = {}
    if count and top_k:
        for m in model.modules():
            experts = getattr(m, "experts", None)
            if isinstance(experts, torch.nn.Module):
                share |= {id(p): top_k / count for p in experts.parameters()}
    total = trainable = 0.0
    for p in model.parameters():
        # bitsandbytes' 4-bit weights (model.load_in_4bit) are packed, two a byte in a float dtype's elements: the
        # weights a token runs through are the quantization state's shape, not the storage's numel
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        n = (math.prod(shape) if shape else int(getattr(p, "ds_numel", p.numel()))) * share.get(id(p), 1.0)
        total += n
        trainable += n if p.requires_grad else 0
    return round(total), round(trainable)


class TokenCounter:
    """Counts the real (non-pad) tokens, the positions computed (tokens + padding) and the samples this rank
    trains on; padding waste = 1 - tokens / positions.

    The token sum stays a tensor on the batch's device: reading it (`tokens`) synchronizes, so it is
    read on log steps only, never per micro-batch.
    """

    def __init__(self) -> None:
        self._tokens: Any = 0
        self.positions = 0
        self.samples = 0

    def add(self, batch: dict[str, Any]) -> None:
        mask = batch.get("attention_mask")
        pos = batch.get("position_ids")
        self.positions += int(batch["input_ids"].numel())
        if mask is None and pos is not None:  # packed blocks: a pad is a position 0 not followed by 1
            import torch

            nxt = torch.nn.functional.pad(pos[:, 1:], (0, 1))
            self._tokens = self._tokens + pos.numel() - ((pos == 0) & (nxt != 1)).sum()
            self.samples += int(pos.shape[0])  # rows (packed blocks): counting samples would wait for the device
            return
        if mask is None:  # an unpadded batch (Collator.drop_full_mask): every position is a token
            self._tokens = self._tokens + batch["input_ids"].numel()
            self.samples += int(batch["input_ids"].shape[0])
            return
        self._tokens = self._tokens + mask.sum()
        self.samples += int(mask.shape[0])

    def add_counted(self, tokens: Any, positions: int, samples: int) -> None:
        """A batch counted elsewhere (sequence parallelism's slices carry their whole batch's token count)."""
        self._tokens = self._tokens + tokens
        self.positions += positions
        self.samples += samples

    @property
    def tokens(self) -> int:
        return int(self._tokens)


@dataclass
class MetricsLogger:
    """Every rank builds one and calls ``log`` on log steps (it is a collective); rank 0 writes."""

    run_dir: Path
    total_steps: int
    counter: TokenCounter
    is_main: bool = field(default_factory=lambda: dist.rank() == 0)
    flops_per_token: float | None = None
    """Training FLOPs per token (``flops_per_token()``); with peak_flops, each line gets an MFU."""
    peak_flops: float | None = None
    """Peak FLOP/s of all ranks together (per-GPU peak x world size); None where unknown."""
    tensorboard: bool = True
    report_to: tuple[str, ...] = ()
    """metrics.report_to: wandb and mlflow (toolkit/observe/trackers.py) open on rank 0 at start."""
    run_config: dict[str, Any] | None = None
    """The training config, recorded with a wandb / mlflow run."""
    memory_reading: Callable[[], dict[str, float | None]] | None = None
    """This rank's memory now (MemoryMonitor.reading). With wandb or mlflow on, every rank's reading rides
    on the log line's all-reduce to rank 0, which logs it as memory/rank{N}/..."""

    def __post_init__(self) -> None:
        self._t0 = self._last_t = time.perf_counter()
        self._last_tokens = self._last_samples = self._last_positions = 0
        self._last_step = 0
        self._bar: Any = None
        self._tb: Any = None
        self._trackers: Any = None
        self._engine_t0: float | None = None
        self.history: list[dict[str, Any]] = []  # the lines written (rank 0), for the closing summary

    def engine_starting(self, what: str) -> None:
        """Say what the silent minute before the first step is (rank 0). The progress bar only
        appears once the engine exists, so it never sits at 0/N while DeepSpeed compiles."""
        self._engine_t0 = time.perf_counter()
        if self.is_main:
            print(
                f"starting the DeepSpeed engine ({what}); on the first run on a machine DeepSpeed "
                "compiles the ops it needs here, which takes a minute or more (cached for later runs)",
                flush=True,
            )

    def start(self, step: int) -> None:
        """Resume-aware start, once the engine exists: step counts and clock from here."""
        self._t0 = self._last_t = time.perf_counter()
        self._last_step = step
        self._last_tokens, self._last_samples = self.counter.tokens, self.counter.samples
        self._last_positions = self.counter.positions
        if not self.is_main:
            return
        ready = "" if self._engine_t0 is None else f"engine ready in {self._t0 - self._engine_t0:.1f} s; "
        print(f"{ready}training steps {step + 1}..{self.total_steps}", flush=True)
        if self.tensorboard:
            from toolkit.observe.tb import TrainWriter

            self._tb = TrainWriter(self.run_dir, step)
        if trackers.external(self.report_to):
            self._trackers = trackers.Trackers(list(self.report_to), self.run_dir, self.run_config or {}, step)
        from tqdm import tqdm

        self._bar = tqdm(
            total=self.total_steps, initial=step, desc="train", dynamic_ncols=True, mininterval=0.5
        )

    def log(
        self, step: int, loss: float, lr: float, grad_norm: float | None, loss_scale: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Collective (all ranks call): sums token counts across ranks, rank 0 writes the line.

        With `loss_scale`, `loss` is this rank's value and the line shows sum over ranks x loss_scale,
        reduced in the same all-reduce as the counts (one host sync per log line).
        """
        now = time.perf_counter()
        seen_tokens, seen_samples, seen_positions = self.counter.tokens, self.counter.samples, self.counter.positions
        # every rank decides alike (report_to is the same everywhere), so the vectors have one length
        reading = self.memory_reading() if self.memory_reading and trackers.external(self.report_to) else None
        tokens, samples, positions, summed, *slots = dist.all_reduce_sum(
            [float(seen_tokens - self._last_tokens), float(seen_samples - self._last_samples),
             float(seen_positions - self._last_positions), float(loss),
             *trackers.memory_slots(reading, dist.rank(), dist.world_size())]
        )
        if loss_scale is not None:
            loss = summed * loss_scale
        dt = max(now - self._last_t, 1e-9)
        tokens_per_s = tokens / dt
        mfu = (
            tokens_per_s * self.flops_per_token / self.peak_flops
            if self.flops_per_token and self.peak_flops
            else None
        )
        rec = {
            "step": step,
            "loss": loss,
            "lr": float(lr),  # a tensor where the optimizer keeps its lr as one (torchao's AdamW)
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "samples_per_s": samples / dt,
            # pad positions / computed positions in this window: what the batching (packing, length groups) wastes
            "padding_waste": 1 - tokens / positions if positions else None,
            "mfu": mfu,
            "step_time_s": dt / max(step - self._last_step, 1),
            "elapsed_s": now - self._t0,
            **(extra or {}),
        }
        self._last_t, self._last_step = now, step
        self._last_tokens, self._last_samples, self._last_positions = seen_tokens, seen_samples, seen_positions
        if not self.is_main:
            return rec  # every rank sees the reduced line (first-loss checks decide alike everywhere)
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self.history.append(rec)
        if self._tb is not None:
            self._tb.write(rec)
        if self._trackers is not None:
            self._trackers.log(rec, step, trackers.memory_from_slots(slots, dist.world_size()))
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", lr=f"{lr:.2e}")
            self._bar.update(step - self._bar.n)
        return rec

    def log_eval(self, step: int, rec: dict[str, Any]) -> None:
        """The held-out loss (runtime/loops/evaluate.py; already reduced over ranks): rank 0 writes its own line
        to metrics.jsonl (a line with eval_loss and no loss), TensorBoard's eval/ tags and the console."""
        if not self.is_main:
            return
        self._write({"step": step, **rec})
        if "eval_pairs" in rec:  # held-out preference pairs (kto: rows; a side without rows has no margin)
            msg = f"eval step {step}: loss {rec['eval_loss']:.4f}, accuracy {rec['eval_rewards/accuracies']:.3f}, " \
                  f"margin {_fmt(rec.get('eval_rewards/margins'), 4)} ({rec['eval_pairs']:,} " \
                  f"{'rows' if 'eval_kl' in rec else 'pairs'}, {rec['eval_s']:.1f} s)"
        else:
            msg = f"eval step {step}: loss {rec['eval_loss']:.4f}, perplexity {rec['eval_ppl']:.2f} " \
                  f"({rec['eval_tokens']:,} tokens, {rec['eval_s']:.1f} s)"
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def log_generation(self, step: int, rec: dict[str, Any]) -> None:
        """An eval.generate call (runtime/generation/evaluate.py; already summed over ranks, which printed its
        line): rank 0 writes it to metrics.jsonl (a line with gen_tokens_per_s and no loss), TensorBoard's
        generate/ tags and the trackers."""
        if self.is_main:
            self._write({"step": step, **rec})

    def _write(self, line: dict[str, Any]) -> None:
        """Rank 0: a line that is not a training step's (eval, generation) to metrics.jsonl, the summary's history,
        TensorBoard and the trackers (their numbers only)."""
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        self.history.append(line)
        if self._tb is not None:
            self._tb.write(line)
        if self._trackers is not None:
            self._trackers.log({k: v for k, v in line.items() if not isinstance(v, str)}, int(line["step"]))

    def close(self) -> None:
        """Idempotent: the loop calls it at the end and again on the way out of a failure."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._trackers is not None:
            self._trackers.close()
            self._trackers = None


# ----------------------------------------------------------------------------- closing summary


def median_after_first(values: list[float | None]) -> float | None:
    """Median over the logged lines after the first (compile, warm-up and allocator growth land in
    step 1); the only line when there is one. The report uses the same rule."""
    vals = [v for v in values if v is not None]
    if len(vals) > 1:
        vals = vals[1:]
    return statistics.median(vals) if vals else None


def _per_rank(values: dict[int, float]) -> str:
    if len(values) <= 8:
        return ", ".join(f"rank {r} {v:.2f}" for r, v in sorted(values.items())) + " GiB"
    hi, lo = max(values, key=values.__getitem__), min(values, key=values.__getitem__)
    return f"max {values[hi]:.2f} GiB (rank {hi}), min {values[lo]:.2f} GiB (rank {lo}), {len(values)} ranks"


def closing_summary(
    history: list[dict[str, Any]],
    run_dir: Path,
    step: int,
    total_steps: int,
    peaks: dict[int, dict[str, float | None]],
    tensorboard: bool,
    why_stopped: str = "train.stop_after",
) -> str:
    """What rank 0 prints at the end: steps, loss, speed, per-rank peak, where the run is and what to
    run next. ``peaks`` is rank -> run-wide peaks from MemoryMonitor (empty if none were gathered)."""
    evals = [r for r in history if r.get("eval_loss") is not None]
    gens = [r for r in history if r.get("gen_tokens_per_s") is not None]
    history = [r for r in history if r.get("eval_loss") is None and r.get("gen_tokens_per_s") is None]
    lines = [
        f"done: {step} of {total_steps} steps"
        + (f" in {history[-1]['elapsed_s']:.1f} s" if history and history[-1].get("elapsed_s") else "")
    ]
    if step < total_steps:
        lines[0] = f"stopped after step {step} of {total_steps} ({why_stopped}); " + (
            "continue with train.resume=latest"
        )
    losses = [r for r in history if r.get("loss") is not None]
    if losses:
        first, last = losses[0], losses[-1]
        lines.append(
            f"  loss        {first['loss']:.4f} (step {first['step']})"
            f" -> {last['loss']:.4f} (step {last['step']})"
        )
    if evals:
        first, last = evals[0], evals[-1]
        tail = f"perplexity {last['eval_ppl']:.2f}" if "eval_ppl" in last else \
            f"accuracy {last['eval_rewards/accuracies']:.3f} on {last['eval_pairs']:,} held-out " \
            f"{'rows' if 'eval_kl' in last else 'pairs'}"
        lines.append(f"  eval loss   {first['eval_loss']:.4f} (step {first['step']}) -> {last['eval_loss']:.4f} "
                     f"(step {last['step']}), {tail}")
    pref = [r for r in losses if r.get("rewards/accuracies") is not None]
    if pref:
        a, b = pref[0], pref[-1]
        # kto: a window without rows of one side has no margin ("-")
        lines.append(f"  preference  accuracy {a['rewards/accuracies']:.3f} -> {b['rewards/accuracies']:.3f}, "
                     f"reward margin {_fmt(a.get('rewards/margins'), 4)} -> {_fmt(b.get('rewards/margins'), 4)}")
    rl = [r for r in losses if r.get("reward") is not None and r.get("completions/mean_length") is not None]
    if rl:  # train.objective=grpo (runtime/rl/)
        a, b = rl[0], rl[-1]
        lines.append(f"  reward      {a['reward']:.4f} (step {a['step']}) -> {b['reward']:.4f} (step {b['step']}), "
                     f"completions {b['completions/mean_length']:.1f} tokens, "
                     f"{b['frac_reward_zero_std']:.0%} of groups without reward spread")
    if gens:
        g = gens[-1]
        match = "" if g.get("gen_exact_match") is None else f", exact match {g['gen_exact_match']:.3f}"
        lines.append(f"  generate    {g['gen_prompts']} prompts, {g['gen_tokens_per_s']:,.0f} new tokens/s "
                     f"({g['gen_path']}, step {g['step']}){match}")
    tps = median_after_first([r.get("tokens_per_s") for r in history])
    if tps is not None:
        mfu = median_after_first([r.get("mfu") for r in history])
        lines.append(
            f"  tokens/s    {tps:,.0f} (all ranks, median after step 1)"
            + (f", MFU {100 * mfu:.1f}%" if mfu is not None else "")
        )
    windows, before = [], 0
    for r in history:  # each logged window's share, weighted by its steps (step 1 is a window of its own)
        if r.get("padding_waste") is not None and r.get("step") is not None:
            windows.append((r["padding_waste"], max(int(r["step"]) - before, 1)))
            before = int(r["step"])
    if windows:
        waste = sum(w * n for w, n in windows) / sum(n for _, n in windows)
        lines.append(f"  padding     {100 * waste:.1f}% of computed positions (over the logged steps; data.packing "
                     "and length-grouped batches keep it low)")
    gpu = {r: p["peak_allocated_gib"] for r, p in peaks.items() if p.get("peak_allocated_gib") is not None}
    rss = {r: p["host_rss_gib"] for r, p in peaks.items() if p.get("host_rss_gib") is not None}
    if gpu:
        lines.append(f"  peak GPU    {_per_rank(gpu)} allocated")
    elif rss:
        lines.append(f"  peak host   {_per_rank(rss)} RSS (CPU run: no GPU memory)")
    lines.append(f"  run dir     {run_dir}")
    nxt = f"toolkit report {run_dir}"
    if tensorboard:
        nxt += f"   |   tensorboard --logdir {run_dir / 'tb'}"
    lines.append(f"  next        {nxt}")
    return "\n".join(lines)
