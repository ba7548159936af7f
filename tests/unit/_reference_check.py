"""Run as a subprocess by test_pairs.py: one CPU rank builds the policy plainly and the reference as a frozen ZeRO-3
engine from a ZeRO-2 policy JSON, then prints what the test checks as JSON. No ports: a FileStore."""

import json
import os
import sys
from pathlib import Path

os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as tdist

tdist.init_process_group("gloo", store=tdist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
import deepspeed  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

from toolkit.config.schema import load_config  # noqa: E402
from toolkit.runtime.model import build_model, model_config  # noqa: E402
from toolkit.runtime.objectives.reference import build_engine, reference_config  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
cfg = load_config(None, ["model.name=tiny"])
mc = model_config(cfg)
policy_ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
ids = torch.randint(4, mc.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    want = build_model(cfg, mc).eval()(input_ids=ids).logits
ref_ds = reference_config(policy_ds)
keep = HfDeepSpeedConfig(ref_ds)
engine = build_engine(build_model(cfg, mc), ref_ds)
with torch.no_grad():
    got = engine(input_ids=ids).logits
print("RESULT", json.dumps({
    "maxdiff": float((got - want).abs().max()),
    "optimizer": type(engine.optimizer).__name__,
    "partitioned": all(hasattr(p, "ds_status") for p in engine.module.parameters()),
    "trainable": sum(p.requires_grad for p in engine.module.parameters()),
}))
