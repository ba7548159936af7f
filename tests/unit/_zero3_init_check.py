"""Run as a subprocess by test_model_init.py: one CPU rank builds a tied-embedding model plainly and
inside zero.Init (ZeRO-3), then prints the largest weight difference. No ports: a FileStore."""

import os
import sys
from pathlib import Path

os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as tdist

tdist.init_process_group("gloo", store=tdist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
import deepspeed  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

from toolkit.config.schema import load_config  # noqa: E402
from toolkit.runtime.model import build_model, model_config  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
cfg = load_config(None, ["model.name=tiny"])
mc = model_config(cfg)
mc.tie_word_embeddings = sys.argv[2] == "tied"
plain = {k: v.clone() for k, v in build_model(cfg, mc).named_parameters()}
keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
z3 = build_model(cfg, mc)
with deepspeed.zero.GatheredParameters(list(z3.parameters())):
    got = {k: v.detach().clone() for k, v in z3.named_parameters()}
assert got.keys() == plain.keys(), (sorted(got), sorted(plain))
print("MAXDIFF", max(float((got[k] - plain[k]).abs().max()) for k in plain))
