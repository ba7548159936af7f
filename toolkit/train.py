"""What `deepspeed toolkit/train.py [--config x.yaml] [--ds ds.json] [key=value ...]` runs.

parse -> Config -> run inputs read once -> checks (before any process-group work) -> resolved DeepSpeed dict -> model built
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

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.launch import dist
from toolkit.observe import console
from toolkit.runtime.spec import build_spec, read_inputs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="toolkit/train.py", description=__doc__)
    p.add_argument("--config", default=None, help="training YAML (defaults: the embedded tiny CPU job)")
    p.add_argument("--ds", default=None, help="DeepSpeed JSON; overrides train.ds_config")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=50 lora.enabled=true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes = dist.prepare_env()  # before deepspeed is imported anywhere
    console.quiet_third_party()  # Liger's warnings about kernel backends for other hardware: the rank logs only
    main_rank = dist.rank() == 0
    try:
        cfg = load_config(args.config, args.overrides)
        if args.ds:
            cfg.train.ds_config = args.ds
        inputs = read_inputs(cfg)  # the one read of the DeepSpeed JSON and the model's config
        auto_micro = cfg.train.micro_batch_size == "auto"
        if auto_micro:
            # the probes are child jobs coordinated over the process group, so it starts first here
            dist.quiet_libraries()
            # no cap yet: capping creates a CUDA context, and this parent keeps the probes' GPU free of one
            dist.init_distributed(cfg.train.collective_timeout_s)
            from toolkit.runtime.speed.autotune import resolve

            record = resolve(inputs, sys.argv[1:])
            dist.limit_gpu_memory(cfg.memory.gpu_limit_gib)
        p = build_spec(inputs)
        if auto_micro:
            p.autotune = record
    except ConfigError as e:
        if main_rank:
            print(f"error: {e}", file=sys.stderr)
        return 1
    if main_rank:
        for line in notes + p.warnings:
            print(line, flush=True)
    if not auto_micro:
        dist.quiet_libraries()
        dist.init_distributed(p.cfg.train.collective_timeout_s, p.cfg.memory.gpu_limit_gib)
    from toolkit.runtime.loops.run import run

    return run(p)


if __name__ == "__main__":
    dist.exit_process(main())
