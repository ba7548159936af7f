"""TensorBoard event files under ``run_dir/tb/``, through torch's SummaryWriter (the real format).

Layout, as TensorBoard shows it (`tensorboard --logdir RUN_DIR/tb`):

    tb/          training scalars, written by rank 0 only: train/loss, train/lr, train/grad_norm,
                 train/tokens_per_s, train/samples_per_s, train/step_time_s, train/mfu, train/padding_waste
    tb/rank{N}/  that rank's memory: memory/allocated_gib, memory/peak_allocated_gib,
                 memory/nvml_used_gib, memory/host_rss_gib

Why a directory per rank rather than the rank in the tag (memory/rank0/allocated_gib): TensorBoard
treats every directory with event files as a run and draws one chart per tag with one line per run.
So each memory chart holds every rank's line, ranks compare at a glance, and each rank keeps one
colour across all memory charts. Tags per rank would give one chart per rank and quantity (8 charts
for 2 ranks) with nothing side by side. Each rank also writes only its own files: no collective, and
a rank's memory survives a crash on another rank, like memory/rank{N}.jsonl.

Scalars are written where the JSON lines are written (a metrics line, a memory snapshot), so the
training loop gains no host synchronization; SummaryWriter queues events and a background thread
writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# metrics.jsonl key -> tag; the same tags on both training paths (both log through MetricsLogger).
TRAIN_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "samples_per_s": "train/samples_per_s",
    "step_time_s": "train/step_time_s",
    "mfu": "train/mfu",
    "padding_waste": "train/padding_waste",
}
MOE_TAGS = {"moe_aux_loss": "moe/aux_loss"}  # Mixture-of-Experts runs only
EVAL_TAGS = {"eval_loss": "eval/loss", "eval_ppl": "eval/perplexity"}
PREF_TAGS = {k: f"pref/{k}" for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                                      "logps/chosen", "logps/rejected")}  # train.objective other than sft
PREF_TAGS |= {f"eval_{k}": f"eval/{k}" for k in ("rewards/accuracies", "rewards/margins", "rewards/chosen",
                                                 "rewards/rejected")}  # held-out pairs
KTO_TAGS = {"kl": "pref/kl", "eval_kl": "eval/kl"}  # train.objective=kto: the KL estimate
RL_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/max_length",
           "completions/clipped_ratio", "clip_ratio", "kl", "time/generate_s", "time/reward_s", "time/reference_s",
           "time/train_s")
RL_TAGS = {k: f"rl/{k}" for k in RL_KEYS}  # train.objective=grpo (runtime/rl/), with each function's rewards/NAME/mean
GEN_TAGS = {"gen_tokens_per_s": "generate/tokens_per_s", "gen_s": "generate/seconds",
            "gen_exact_match": "generate/exact_match"}  # eval.generate lines (runtime/generation/)
# memory snapshot key -> tag. Null values (GPU fields on CPU) are left out, not written as NaN.
MEMORY_TAGS = {
    "allocated_gib": "memory/allocated_gib",
    "peak_allocated_gib": "memory/peak_allocated_gib",
    "nvml_used_gib": "memory/nvml_used_gib",
    "host_rss_gib": "memory/host_rss_gib",
}
# The JSON lines are the durable record; events reach disk within this many seconds (and at close).
FLUSH_SECS = 30
# Events queued before add_scalar waits for the writer thread: SummaryWriter's default of 10 is fewer
# than one log line's scalars plus a memory snapshot, and a full queue blocks the training thread.
MAX_QUEUE = 100


def tb_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "tb"


def _writer(log_dir: Path, purge_step: int | None = None) -> Any:
    from torch.utils.tensorboard import SummaryWriter  # imports torch: never at module level

    return SummaryWriter(
        log_dir=str(log_dir), purge_step=purge_step, flush_secs=FLUSH_SECS, max_queue=MAX_QUEUE
    )


def _add(
    writer: Any, tags: dict[str, str], values: dict[str, Any], step: int, walltime: float | None
) -> None:
    for key, tag in tags.items():
        value = values.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            writer.add_scalar(tag, float(value), global_step=step, walltime=walltime)


class TrainWriter:
    """Rank 0's training scalars in ``tb/``. Created at the training start step: on resume from step
    S, ``purge_step=S+1`` makes TensorBoard drop the events an earlier attempt wrote after S, so a
    crashed-and-resumed run draws one curve, not two overlapping ones."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        self._w = _writer(tb_dir(run_dir), purge_step=start_step + 1 if start_step else None)

    def write(self, rec: dict[str, Any]) -> None:
        _add(self._w, TRAIN_TAGS, rec, int(rec["step"]), None)
        _add(self._w, EVAL_TAGS, rec, int(rec["step"]), None)
        _add(self._w, GEN_TAGS, rec, int(rec["step"]), None)
        pref = "rewards/chosen" in rec or "eval_rewards/chosen" in rec  # a preference line: a kl in it is KTO's
        _add(self._w, PREF_TAGS | (KTO_TAGS if pref else {}), rec, int(rec["step"]), None)
        _add(self._w, MOE_TAGS, rec, int(rec["step"]), None)
        rl = {} if pref else RL_TAGS | {k: f"rl/{k}" for k in rec if k.startswith("rewards/") and k.endswith("/mean")}
        _add(self._w, rl, rec, int(rec["step"]), None)
        for layer, value in enumerate(rec.get("expert_load") or []):  # MoE: busiest expert / mean, per layer
            self._w.add_scalar(f"moe/expert_load_layer{layer}", float(value), global_step=int(rec["step"]))

    def close(self) -> None:
        self._w.close()


class MemoryWriter:
    """One rank's memory snapshots in ``tb/rank{N}/``, at the snapshot's step and wall time (phase
    snapshots share step 0; TensorBoard's "wall" axis separates them)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self._w = _writer(tb_dir(run_dir) / f"rank{rank}")

    def write(self, snap: dict[str, Any]) -> None:
        _add(self._w, MEMORY_TAGS, snap, int(snap["step"]), snap.get("ts"))

    def close(self) -> None:
        self._w.close()
