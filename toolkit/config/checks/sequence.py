"""The rules of sequence parallelism (`train.sequence_parallel=N`, toolkit/runtime/sequence/): one line each,
checked by the run before any process group exists and by `toolkit check --sequence-parallel N` before launch.
"""

from __future__ import annotations

from importlib.metadata import version

MIN_DEEPSPEED = "0.19.8"
"""gloo-safe batch gathers, the compile-safe all-to-all (0.19.7) and checkpoint ranks (0.19.6):
../shared/notes/long_context.md section 1."""


def problems(sp: int, world: int, zero_stage: int | None = None, heads: int | None = None,
             kv_heads: int | None = None, seq_len: int | None = None, attn: str | None = None,
             task: str | None = None, micro: int | str | None = None) -> list[str]:
    """What stops train.sequence_parallel=sp from running, one line each; [] when nothing does. Arguments left
    None are not checked (`toolkit check` knows the launch, not the model)."""
    if sp == 1:
        return []
    if sp < 1:
        return [f"train.sequence_parallel={sp}: must be 1 (off) or more"]
    out = []
    from packaging.version import Version

    if Version(version("deepspeed")) < Version(MIN_DEEPSPEED):
        out.append(f"train.sequence_parallel needs deepspeed>={MIN_DEEPSPEED} (installed: {version('deepspeed')})")
    if world % sp:
        out.append(f"train.sequence_parallel={sp} does not divide the {world} ranks of the launch")
    if zero_stage == 0:
        out.append("train.sequence_parallel needs ZeRO stage 1, 2 or 3 (DeepSpeed's Ulysses crashes at stage 0, "
                   "deepspeed#7833)")
    if heads is not None and heads % sp:
        out.append(f"train.sequence_parallel={sp} does not divide the model's {heads} attention heads")
    if kv_heads is not None and kv_heads % sp and sp % kv_heads:
        out.append(f"train.sequence_parallel={sp} and the model's {kv_heads} key/value heads: one must divide the other")
    if seq_len is not None and seq_len % sp:
        out.append(f"data.seq_len={seq_len} is not a multiple of train.sequence_parallel={sp}")
    if attn == "eager":
        out.append("train.sequence_parallel needs sdpa (or flash) attention: eager builds a full mask per layer; "
                   "set model.attn_implementation=sdpa")
    if task is not None and task != "causal_lm":
        out.append(f"train.sequence_parallel is for causal LMs (model.task={task})")
    if micro == "auto":
        out.append("train.sequence_parallel needs a number for train.micro_batch_size (auto's probes run without it)")
    return out
