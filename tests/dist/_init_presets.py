"""Launched by tests/dist/test_presets_deepspeed.py as `deepspeed --num_gpus 2 _init_presets.py ...`.

For every preset JSON in --presets-dir: resolve "auto" the way training does, build a tiny model (inside
zero.Init for stage 3), deepspeed.initialize, one forward/backward/step, destroy. One launch for all
presets: each launch costs ~10 s and the CPU ops build once. Prints `PRESET <name> ok loss=...` per preset.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import os
import sys
import traceback
from pathlib import Path

# script mode: this file's folder is first on sys.path; make `import toolkit` find the repo
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from torch import nn

from toolkit.config import ds_config as dc

HIDDEN = 32


def run_one(path: Path, world: int) -> float:
    ds = dc.load_ds_config(path)
    cfg = dc.resolve(
        ds,
        dc.AutoValues(
            micro_batch=2,
            grad_accum=1,
            world_size=world,
            precision="fp32",
            grad_clip=1.0,
            lr=1e-3,
            hidden_size=HIDDEN,
        ),
    )
    torch.manual_seed(0)
    init = (
        deepspeed.zero.Init(config_dict_or_path=cfg) if dc.zero_stage(cfg) == 3 else contextlib.nullcontext()
    )
    with init:
        model = nn.Sequential(
            nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1)
        )
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, HIDDEN)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    value = float(loss.detach())
    engine.destroy()
    del engine, model
    gc.collect()
    return value


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--presets-dir", required=True)
    p.add_argument("--only", nargs="*", default=None, help="preset names to run (default: all)")
    p.add_argument(
        "--preset-timeout", type=float, default=300.0, help="seconds per preset before a stack dump"
    )
    args = p.parse_args()
    deepspeed.init_distributed()
    from toolkit.launch.dist import release_deepspeed_shm

    release_deepspeed_shm()  # DeepSpeed's CPU allreduce files would stay in /dev/shm after the launch
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    failed = 0
    for path in sorted(Path(args.presets_dir).glob("*.json")):
        if args.only is not None and path.stem not in args.only:
            continue
        # a hang inside DeepSpeed dumps every thread's stack and exits instead of waiting for the test timeout
        faulthandler.dump_traceback_later(args.preset_timeout, exit=True)
        try:
            loss = run_one(path, world)
            if rank == 0:
                print(f"PRESET {path.stem} ok loss={loss:.4f}", flush=True)
        except Exception:
            failed += 1
            print(f"PRESET {path.stem} FAILED on rank {rank}:\n{traceback.format_exc()}", flush=True)
        finally:
            faulthandler.cancel_dump_traceback_later()
    return 1 if failed else 0


if __name__ == "__main__":
    # the last act is a collective: leave the way toolkit/train.py does (gloo's worker threads can abort
    # interpreter finalization; toolkit/launch/dist.py says why)
    from toolkit.launch.dist import exit_process

    exit_process(main())
