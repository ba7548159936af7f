"""Generation that never hangs under ZeRO-3, for both training paths and as a stand-alone command.

Under ZeRO-3 every forward gathers each layer's shards from all ranks, so a rank that stops
generating early (EOS) or has fewer prompts leaves the others blocked in a collective forever.
Two rules prevent that, both enforced here:
  1. every rank makes the same number of `generate` calls (`shard_prompts` pads with copies), and
  2. `synced_gpus=True` whenever ZeRO-3 runs on more than one rank, so a finished rank keeps
     running dummy forwards until all ranks are done (off otherwise: it only costs time).

Stand-alone (an exported HF directory or a LoRA adapter directory, the same ZeRO config):

    deepspeed toolkit/generate.py --model runs/x/export --ds ds_configs/zero3.json --prompts p.jsonl
    python toolkit/generate.py --model runs/x/export --prompts p.jsonl --out out.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import EvalConfig
from toolkit.launch import dist
from toolkit.runtime.data.jsonl import read_objects

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunSpec

T = TypeVar("T")
IGNORE_INDEX = -100  # same value as toolkit.runtime.data.batches.IGNORE_INDEX; not imported to keep this import light
_UNGUARDED = "_toolkit_unguarded_generate"


# ----------------------------------------------------------------------------- sharding


def shard_prompts(prompts: Sequence[T], rank: int, world: int) -> list[tuple[int | None, T]]:
    """This rank's prompts as (original index, prompt); padding copies carry index None.

    Strided (prompt i -> rank i % world) after padding the list with copies of its last prompt to a
    multiple of `world`, so every rank gets the same count and makes the same number of generate
    calls. Zero prompts give every rank an empty list (zero calls everywhere: still equal).
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    n = len(prompts)
    if n == 0:
        return []
    padded: list[tuple[int | None, T]] = [(i, p) for i, p in enumerate(prompts)]
    padded += [(None, prompts[-1])] * (-n % world)
    return padded[rank::world]


def unshard(gathered: Sequence[Sequence[tuple[int | None, T]]], n: int) -> list[T]:
    """Inverse of `shard_prompts` over all ranks' results: padding dropped, original order."""
    out: list[Any] = [None] * n
    for part in gathered:
        for i, value in part:
            if i is not None:
                out[i] = value
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        raise RuntimeError(f"no result gathered for prompts {missing[:5]}")
    return out


# ----------------------------------------------------------------------------- the guard


def _world() -> int:
    import torch.distributed as tdist

    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def is_zero3_partitioned(model: Any) -> bool:
    """True when ZeRO-3 manages this model's parameters (they carry DeepSpeed's ds_status)."""
    return any(hasattr(q, "ds_status") for q in model.parameters())


def guard_generate(model: Any, zero3: bool | None = None) -> Any:
    """Make `model.generate` safe under ZeRO-3: synced_gpus is forced on when >1 rank runs.

    transformers 5 already defaults synced_gpus to True under ZeRO-3, but only while an
    HfDeepSpeedConfig is alive, and an explicit `synced_gpus=False` (common in scripts written for
    one GPU) still hangs every rank. Here an explicit False is overridden with a warning: the run
    completes, the only cost is the dummy forwards. Idempotent; returns the model.
    """
    if getattr(model, _UNGUARDED, None) is not None:
        return model
    original = model.generate
    warned: list[bool] = []

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        on = is_zero3_partitioned(model) if zero3 is None else zero3
        if on and _world() > 1 and kwargs.get("synced_gpus") is not True:
            if kwargs.get("synced_gpus") is False and not warned and dist.rank() == 0:
                warned.append(True)
                print(
                    "warning: generate(synced_gpus=False) under ZeRO-3 with >1 rank would hang when ranks "
                    "finish at different steps; using synced_gpus=True",
                    file=sys.stderr,
                    flush=True,
                )
            kwargs["synced_gpus"] = True
        return original(*args, **kwargs)

    # Plain attributes on the instance (functions are not Modules, so nn.Module stores them as-is).
    setattr(model, _UNGUARDED, original)
    model.generate = generate
    return model


# ----------------------------------------------------------------------------- generation


def _unwrap(engine_or_model: Any) -> Any:
    """The HF model (or PeftModel) inside a DeepSpeed engine; the object itself otherwise."""
    if "deepspeed" in sys.modules:
        from deepspeed import DeepSpeedEngine

        if isinstance(engine_or_model, DeepSpeedEngine):
            return engine_or_model.module
    return engine_or_model


def _stop_ids(model: Any, eos_id: int | None) -> set[int]:
    if eos_id is not None:
        return {eos_id}
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    """New tokens up to and including the first stop token (a synced rank can pad after it)."""
    for k, t in enumerate(tokens):
        if t in stops:
            return tokens[: k + 1]
    return tokens


def generate_all(
    engine_or_model: Any,
    prompts: list[list[int]],
    eval_cfg: EvalConfig,
    *,
    zero3: bool,
    pad_id: int,
    eos_id: int | None,
) -> list[list[int]] | None:
    """Generate for every prompt across all ranks; rank 0 gets the new tokens per prompt, others None.

    Must be called on every rank with the same prompts (it is a collective under ZeRO-3). One prompt
    per generate call: no left-padding, so outputs equal a single-process `generate` token for token.
    """
    import torch
    import torch.distributed as tdist

    model = _unwrap(engine_or_model)
    rank, world = (tdist.get_rank(), _world()) if _world() > 1 else (0, 1)
    sync = zero3 and world > 1
    gen = model.generate
    if sync and eval_cfg.unsafe_no_sync:
        # The debug switch must bypass guard_generate too, or it could not show the hang.
        gen = getattr(model, _UNGUARDED, model.generate)
        sync = False
        if rank == 0:
            print(
                "warning: eval.unsafe_no_sync=true: synced_gpus is off under ZeRO-3; ranks that finish at "
                "different steps will hang",
                file=sys.stderr,
                flush=True,
            )
    kw: dict[str, Any] = dict(
        max_new_tokens=eval_cfg.max_new_tokens,
        do_sample=eval_cfg.do_sample,
        pad_token_id=pad_id,
        synced_gpus=sync,
    )
    if eval_cfg.do_sample:
        kw.update(temperature=eval_cfg.temperature, top_p=eval_cfg.top_p)
    else:  # a model's generation_config may carry sampling defaults; greedy must not warn about them
        kw.update(temperature=None, top_p=None, top_k=None)
    if eos_id is not None:
        kw["eos_token_id"] = eos_id
    stops = _stop_ids(model, eos_id)
    device = dist.device()
    mine: list[tuple[int | None, list[int]]] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i, prompt in shard_prompts(prompts, rank, world):
                if eval_cfg.do_sample:
                    # Per-prompt seed: a padding copy or another world size draws the same tokens.
                    torch.manual_seed(eval_cfg.seed + (i if i is not None else len(prompts)))
                ids = torch.tensor([prompt], dtype=torch.long, device=device)
                out = gen(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
                mine.append((i, _cut(out[0, ids.shape[1] :].tolist(), stops)))
    finally:
        model.train(was_training)
    if world == 1:
        return unshard([mine], len(prompts))
    gathered: list[Any] = [None] * world
    tdist.all_gather_object(gathered, mine)
    return unshard(gathered, len(prompts)) if rank == 0 else None


def write_generations(
    path: Path, prompts: list[list[int]], outputs: list[list[int]], tokenizer: Any | None
) -> None:
    """One JSON object per prompt: index, prompt ids, generated ids (+ decoded text with a tokenizer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
            row: dict[str, Any] = {"index": i, "prompt_ids": prompt, "generated_ids": new}
            if tokenizer is not None:
                row["prompt_text"] = tokenizer.decode(prompt)
                row["text"] = tokenizer.decode(new, skip_special_tokens=True)
            f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- end of training


def eval_prompts(rows: list[dict[str, Any]], n: int) -> list[list[int]]:
    """The first n training samples' prompts: the leading tokens whose labels are -100.

    Plain-text rows (labels == input_ids) have no masked prefix; their first half is the prompt.
    """
    out = []
    for r in rows[:n]:
        ids, labels = list(r["input_ids"]), list(r["labels"])
        k = 0
        while k < len(labels) and labels[k] == IGNORE_INDEX:
            k += 1
        if k == 0 or k >= len(ids):
            k = max(1, len(ids) // 2)
        out.append(ids[:k])
    return out


def run_eval_generation(p: RunSpec, engine: Any, tokenizer: Any | None, rows: list[dict[str, Any]]) -> None:
    """eval.generate at the end of training; all ranks call, rank 0 writes run_dir/generations.jsonl."""

    cfg = p.cfg
    if cfg.model.task != "causal_lm":
        if dist.rank() == 0:
            print("eval.generate: skipped (model.task is not causal_lm)", flush=True)
        return
    mc = p.model_config
    pad_id = tokenizer.pad_token_id if tokenizer is not None else (mc.pad_token_id or 0)
    eos_id = cfg.eval.eos_token_id
    if eos_id is None:
        eos_id = tokenizer.eos_token_id if tokenizer is not None else getattr(mc, "eos_token_id", None)
    guard_generate(_unwrap(engine))
    prompts = eval_prompts(rows, cfg.eval.num_prompts)
    t0 = time.perf_counter()
    outputs = generate_all(
        engine, prompts, cfg.eval, zero3=p.resolved.stage == 3, pad_id=pad_id, eos_id=eos_id
    )
    if outputs is not None:
        path = p.run_dir / "generations.jsonl"
        write_generations(path, prompts, outputs, tokenizer)
        print(f"generated {len(prompts)} prompts in {time.perf_counter() - t0:.1f}s -> {path}", flush=True)


# ----------------------------------------------------------------------------- stand-alone command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="toolkit/generate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="exported HF model directory or LoRA adapter directory")
    p.add_argument(
        "--base",
        default=None,
        help="base model directory for an adapter (default: the adapter config's base_model_name_or_path)",
    )
    p.add_argument(
        "--ds", default=None, help="DeepSpeed JSON (e.g. the training one); without it: plain model"
    )
    p.add_argument("--prompts", required=True, help='JSON lines with "input_ids" (list of ints) or "text"')
    p.add_argument("--out", default=None, help="output JSON lines (default: stdout, rank 0)")
    d = EvalConfig()
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument("--unsafe-no-sync", action="store_true", help=argparse.SUPPRESS)  # debugging only
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher"
    )
    return p.parse_args(argv)


def _model_dirs(model: Path, base: str | None) -> tuple[Path, Path | None]:
    """(weights dir, adapter dir or None), checked before any process-group work."""
    if not model.is_dir():
        raise ConfigError(f"--model: {model} is not a directory")
    if (model / "adapter_config.json").is_file():
        if base is None:
            base = (
                json.loads((model / "adapter_config.json").read_text()).get("base_model_name_or_path") or None
            )
        if base is None:
            raise ConfigError(
                f"--model: {model} is a LoRA adapter without a base_model_name_or_path; pass --base DIR"
            )
        base_dir = Path(base)
        if not (base_dir / "config.json").is_file():
            raise ConfigError(f"--base: {base_dir} is not a Hugging Face model directory (no config.json)")
        return base_dir, model
    if not (model / "config.json").is_file():
        raise ConfigError(f"--model: {model} has neither config.json nor adapter_config.json")
    return model, None


def load_prompts(path: Path, tokenizer: Any | None) -> list[list[int]]:
    if not path.is_file():
        raise ConfigError(f"--prompts: {path} is not a file")
    prompts: list[list[int]] = []
    for lineno, row in read_objects(path, "--prompts"):
        where = f"--prompts: {path}:{lineno}"
        if "input_ids" in row:
            ids = row["input_ids"]
            if not (
                isinstance(ids, list)
                and ids
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise ConfigError(f"{where}: input_ids must be a non-empty list of non-negative ints")
        elif "text" in row:
            if tokenizer is None:
                raise ConfigError(
                    f'{where}: "text" prompts need a tokenizer in the model directory; '
                    'give "input_ids" instead'
                )
            ids = tokenizer(str(row["text"]))["input_ids"]
            if not ids:
                raise ConfigError(f"{where}: text tokenizes to nothing")
        else:
            raise ConfigError(f'{where}: expected "input_ids" or "text", got keys {sorted(row)}')
        prompts.append(ids)
    if not prompts:
        raise ConfigError(f"--prompts: {path} has no prompts")
    return prompts


def _tokenizer(*dirs: Path | None) -> Any | None:
    from transformers import AutoTokenizer

    for d in dirs:
        if d is not None and any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            return tok
    return None


def inference_ds_config(ds_raw: dict[str, Any], world: int, hidden: int) -> dict[str, Any]:
    """A training DeepSpeed JSON made fit for inference: no optimizer/scheduler, "auto" resolved.

    Without an optimizer ZeRO-3 builds its parameter-offload engine (inference only). Batch keys
    are training-only; they are replaced with one sample per rank so no explicit value can clash.
    """
    import torch

    from toolkit.config.ds_config import AutoValues, precision_of, resolve

    ds = {
        k: v
        for k, v in ds_raw.items()
        if k
        not in (
            "optimizer",
            "scheduler",
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "gradient_clipping",
        )
    }
    precision = precision_of(ds)
    if precision is None:
        precision = "bf16" if (not dist.on_cpu() and torch.cuda.is_bf16_supported()) else "fp32"
    values = AutoValues(
        micro_batch=1,
        grad_accum=1,
        world_size=world,
        precision=precision,
        grad_clip=0.0,
        lr=0.0,
        hidden_size=hidden,
    )
    ds = resolve(ds, values)
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world)
    return ds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes = dist.prepare_env()  # before deepspeed is imported anywhere
    main_rank = dist.rank() == 0
    world = dist.world_size()
    try:
        weights_dir, adapter_dir = _model_dirs(Path(args.model), args.base)
        eval_cfg = EvalConfig(
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            eos_token_id=args.eos_token_id,
            unsafe_no_sync=args.unsafe_no_sync,
        )
        from transformers import AutoConfig

        mc = AutoConfig.from_pretrained(weights_dir, local_files_only=True)
        tokenizer = _tokenizer(adapter_dir, weights_dir)
        prompts = load_prompts(Path(args.prompts), tokenizer)
        ds = None
        if args.ds:
            from toolkit.config.ds_config import load_ds_config
            from toolkit.runtime.model import hidden_size

            ds = inference_ds_config(load_ds_config(args.ds), world, hidden_size(mc))
    except (ConfigError, OSError, ValueError) as e:
        if main_rank:
            print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 1
    if main_rank:
        for line in notes:
            print(line, file=sys.stderr, flush=True)
    from toolkit.launch.dist import quiet_libraries

    quiet_libraries()
    if ds is not None or world > 1:
        _single_process_env()
        dist.init_distributed()
    outputs = _run(args, ds, weights_dir, adapter_dir, mc, tokenizer, prompts, eval_cfg)
    if outputs is not None:
        _emit(args.out, prompts, outputs, tokenizer)
    dist.barrier()
    return 0


def _single_process_env() -> None:
    """`python toolkit/generate.py --ds ...` without a launcher: a world of one on this host.

    DeepSpeed would otherwise go looking for an MPI environment (mpi4py) when RANK etc. are unset.
    """
    import os
    import socket

    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for k, v in env.items():
        os.environ.setdefault(k, v)


def _run(
    args: argparse.Namespace,
    ds: dict[str, Any] | None,
    weights_dir: Path,
    adapter_dir: Path | None,
    mc: Any,
    tokenizer: Any | None,
    prompts: list[list[int]],
    eval_cfg: EvalConfig,
) -> list[list[int]] | None:
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.config.ds_config import zero_stage

    # Under ZeRO-3 the config must be alive BEFORE from_pretrained: the weights then load straight
    # into partitions (zero.Init) and no rank ever holds the full model.
    keep_alive = None
    if ds is not None:
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(ds)
    model = AutoModelForCausalLM.from_pretrained(weights_dir, local_files_only=True, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    if ds is not None:
        import deepspeed

        engine = deepspeed.initialize(model=model, config=ds)[0]  # no optimizer: inference engine
        zero3 = zero_stage(ds) == 3
    else:
        engine, zero3 = model.to(dist.device()), False
    guard_generate(_unwrap(engine))
    pad_id = next(
        (
            t
            for t in (getattr(tokenizer, "pad_token_id", None), mc.pad_token_id, mc.eos_token_id)
            if t is not None
        ),
        0,
    )
    eos_id = eval_cfg.eos_token_id
    if eos_id is None and tokenizer is not None:
        eos_id = tokenizer.eos_token_id  # else: the model's generation_config decides
    t0 = time.perf_counter()
    outputs = generate_all(engine, prompts, eval_cfg, zero3=zero3, pad_id=pad_id, eos_id=eos_id)
    if outputs is not None:
        print(
            f"generated {len(prompts)} prompts in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    del keep_alive
    return outputs


def _emit(out: str | None, prompts: list[list[int]], outputs: list[list[int]], tokenizer: Any | None) -> None:
    if out is not None:
        write_generations(Path(out), prompts, outputs, tokenizer)
        return
    for i, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
        row: dict[str, Any] = {"index": i, "prompt_ids": prompt, "generated_ids": new}
        if tokenizer is not None:
            row["text"] = tokenizer.decode(new, skip_special_tokens=True)
        print(json.dumps(row), flush=True)

