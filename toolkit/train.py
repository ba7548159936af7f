"""What `deepspeed toolkit/train.py [--config x.yaml] [--ds ds.json] [key=value ...]` runs.

parse -> Config -> checks (before any process-group work) -> resolved DeepSpeed dict -> model built
with ZeRO-3 partitioning active -> HF Trainer path or raw deepspeed.initialize loop -> export.
Both paths draw the same batches, fill "auto" the same way and log the same metrics.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script by the deepspeed launcher: sys.path[0] is toolkit/ itself, where our module
    # names (data, model, config, ...) would shadow or be shadowed. Put the repo root there instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from toolkit import dist
from toolkit.config import Config, load_config
from toolkit.ds_config import AutoValues, ConfigError, adapter_autocast, load_ds_config, precision_of, resolve


@dataclass
class Plan:
    """Everything decided before the process group exists."""

    cfg: Config
    ds: dict[str, Any]  # resolved: no "auto" left
    model_config: Any
    run_dir: Path
    world_size: int
    precision: str
    total_steps: int | None  # None until a data file is tokenized (max_steps=0, one epoch)
    warnings: list[str]
    adapter_autocast: bool = False  # LoRA under bf16: fp32 adapters, bf16 frozen base, torch autocast


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="toolkit/train.py", description=__doc__)
    p.add_argument("--config", default=None, help="training YAML (defaults: the embedded tiny CPU job)")
    p.add_argument("--ds", default=None, help="DeepSpeed JSON; overrides train.ds_config")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=50 lora.enabled=true")
    return p.parse_args(argv)


def _precision(cfg: Config, ds: dict[str, Any]) -> str:
    pinned = precision_of(ds)
    if cfg.train.precision != "auto":
        return cfg.train.precision
    if pinned is not None:
        return pinned
    import torch

    return "bf16" if (not dist.on_cpu() and torch.cuda.is_bf16_supported()) else "fp32"


def plan(cfg: Config) -> Plan:
    """All input validation that can run before init_process_group: one clear error, no hang."""
    from toolkit.data import check_data_file, steps_per_epoch
    from toolkit.model import hidden_size, model_config

    world = dist.world_size()
    ds_raw = load_ds_config(cfg.train.ds_config)
    warnings = _run_checks(ds_raw, cfg, world)
    mc = model_config(cfg)
    check_data_file(cfg)
    precision = _precision(cfg, ds_raw)
    autocast = adapter_autocast(ds_raw, precision, cfg.lora.enabled)
    t = cfg.train
    if t.resume:
        _check_resume_mode(Path(t.run_dir), autocast)
    # max_steps=0 means one epoch: known here for synthetic data, after tokenizing for a file
    # (loop.run fills it then; a DeepSpeed scheduler "auto" needing it is reported as unfillable).
    synthetic = cfg.data.source == "synthetic"
    total = t.max_steps or (steps_per_epoch(cfg.data.num_samples, cfg, world) if synthetic else None)
    values = AutoValues(micro_batch=t.micro_batch_size, grad_accum=t.grad_accum, world_size=world,
                        precision=precision, grad_clip=t.grad_clip, lr=t.lr, betas=(t.betas[0], t.betas[1]),
                        eps=t.eps, weight_decay=t.weight_decay, hidden_size=hidden_size(mc),
                        warmup_steps=t.warmup_steps, total_steps=total, adapter_autocast=autocast,
                        zero_sizes=t.zero_sizes)
    ds = resolve(ds_raw, values)
    return Plan(cfg, ds, mc, Path(t.run_dir), world, precision, total, warnings, autocast)


def _check_resume_mode(run_dir: Path, autocast: bool) -> None:
    """Checkpoints written under one LoRA precision mode do not load under the other (another
    optimizer wrapper, other file names), so stop before training and say how to get the old one back."""
    try:
        before = bool(json.loads((run_dir / "versions.json").read_text()).get("adapter_autocast", False))
    except (OSError, ValueError, AttributeError):
        return  # no record (or an unreadable one): nothing to compare with
    if before != autocast:
        how = ('set "bf16": {"enabled": true} in the DeepSpeed JSON' if not before else
               'leave bf16.enabled "auto" and add no torch_autocast block, below ZeRO-3')
        raise ConfigError(f"train.resume: the checkpoints in {run_dir} were written with adapter_autocast={before} "
                          f"(versions.json) and this run would use {autocast}; to resume them, {how}")


def _run_checks(ds: dict[str, Any], cfg: Config, world: int) -> list[str]:
    from toolkit.checks import check_config

    findings = check_config(ds, world_size=world, path=cfg.train.path,
                            micro_batch=cfg.train.micro_batch_size, grad_accum=cfg.train.grad_accum)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        lines = "\n  ".join(f"{f.key}: {f.message}" for f in errors)
        raise ConfigError(f"{cfg.train.ds_config} will not run (toolkit check):\n  {lines}")
    return [f"warning: {f.key}: {f.message}" for f in findings if f.level == "warning"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes = dist.prepare_env()  # before deepspeed is imported anywhere
    main_rank = dist.rank() == 0
    try:
        cfg = load_config(args.config, args.overrides)
        if args.ds:
            cfg.train.ds_config = args.ds
        p = plan(cfg)
    except ConfigError as e:
        if main_rank:
            print(f"error: {e}", file=sys.stderr)
        return 1
    if main_rank:
        for line in notes + p.warnings:
            print(line, flush=True)
    _quiet_libraries()
    dist.init_distributed()
    from toolkit.loop import run

    return run(p)


def _quiet_libraries() -> None:
    """DeepSpeed and transformers log at INFO on every rank; keep the console to our own lines."""
    import logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_warning()
    if dist.rank() != 0:
        transformers.logging.set_verbosity_error()


if __name__ == "__main__":
    raise SystemExit(main())
