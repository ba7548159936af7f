"""`toolkit/generate.py`: generation from an exported model or a LoRA adapter, with or without a DeepSpeed JSON.

    deepspeed toolkit/generate.py --model runs/x/export --ds ds_configs/zero3.json --prompts p.jsonl
    python toolkit/generate.py --model runs/x/export --prompts p.jsonl --out out.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import EvalConfig
from toolkit.launch import dist
from toolkit.runtime.generation.batched import generate_all
from toolkit.runtime.generation.evaluate import write_generations
from toolkit.runtime.generation.guard import guard_generate, unwrap
from toolkit.runtime.generation.prompts import Prompt, load_prompts


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
    p.add_argument("--prompts", required=True,
                   help='JSON lines with "input_ids" (list of ints), "prompt"/"text" or "messages" (chat template), '
                        'and optionally "reference"')
    p.add_argument("--out", default=None, help="output JSON lines (default: stdout, rank 0)")
    d = EvalConfig()
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument("--batch-size", default=d.generate_batch_size,
                   help="prompts per generate call on a rank, or auto (what fits free memory; default)")
    p.add_argument("--gather", choices=("auto", "true", "false"), default=d.generate_gather,
                   help="ZeRO-3: gather the whole model once (auto: where every rank has room)")
    p.add_argument("--unsafe-no-sync", action="store_true", help=argparse.SUPPRESS)  # debugging only
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher"
    )
    return p.parse_args(argv)


def _model_dirs(model: Path, base: str | None) -> tuple[Path, Path | None]:
    """(weights dir, adapter dir or None), checked before any process-group work. Either may be a hub id (org/name):
    its snapshot, fetched once per node (toolkit/hub)."""
    from toolkit.hub import local_dir

    found = local_dir(str(model), what="--model")
    if found is None:
        raise ConfigError(f"--model: {model} is neither a directory nor a hub id (org/name)")
    model = found
    if (model / "adapter_config.json").is_file():
        if base is None:
            base = (
                json.loads((model / "adapter_config.json").read_text()).get("base_model_name_or_path") or None
            )
        if base is None:
            raise ConfigError(
                f"--model: {model} is a LoRA adapter without a base_model_name_or_path; pass --base DIR"
            )
        base_dir = local_dir(base, what="--base") or Path(base)
        if not (base_dir / "config.json").is_file():
            raise ConfigError(f"--base: {base_dir} is not a Hugging Face model directory (no config.json)")
        return base_dir, model
    if not (model / "config.json").is_file():
        raise ConfigError(f"--model: {model} has neither config.json nor adapter_config.json")
    return model, None


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
            generate_batch_size=args.batch_size if args.batch_size == "auto" else _positive(args.batch_size),
            generate_gather=args.gather,
        )
        from transformers import AutoConfig

        mc = AutoConfig.from_pretrained(weights_dir, local_files_only=True)
        tokenizer = _tokenizer(adapter_dir, weights_dir)
        prompts = load_prompts(Path(args.prompts), tokenizer, "--prompts")
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


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--batch-size: expected a positive integer or auto, got {text!r}")
    return n


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
    prompts: list[Prompt],
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
    guard_generate(unwrap(engine))
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
    outputs, stats = generate_all(engine, [q.ids for q in prompts], eval_cfg, mc=mc, zero3=zero3, pad_id=pad_id,
                                  eos_id=eos_id)
    if outputs is not None:
        print(stats.line(), file=sys.stderr, flush=True)
    del keep_alive
    return outputs


def _emit(out: str | None, prompts: list[Prompt], outputs: list[list[int]], tokenizer: Any | None) -> None:
    if out is not None:
        write_generations(Path(out), prompts, outputs, tokenizer)
        return
    for i, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
        row: dict[str, Any] = {"index": i, "prompt_ids": prompt.ids, "generated_ids": new}
        if tokenizer is not None:
            row["text"] = tokenizer.decode(new, skip_special_tokens=True)
        print(json.dumps(row), flush=True)
