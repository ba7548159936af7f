"""What HF's own code does with a DeepSpeed config's "auto" values, without a GPU or a launch: run
by tests/dist/test_hf_consumers.py as `python _hf_auto_probe.py OUT.json CONFIG...`. Imports nothing
from the toolkit: it is the reference `toolkit check --consumer hf-trainer|accelerate` is held to.

One process, world size 1 (gloo), for every config and each consumer:
- hf-trainer: `TrainingArguments(deepspeed=cfg)` + `Trainer.train()`, the real code path
  (trainer_config_process, accelerate's DeepSpeedPlugin, trainer_config_finalize, accelerate's
  _prepare_deepspeed), up to the call of deepspeed.initialize, which is replaced by one that records
  the dict it was handed and stops. No engine is built: nothing here depends on the hardware.
- accelerate: what `accelerate launch --deepspeed_config_file cfg` sets up (ACCELERATE_USE_DEEPSPEED,
  ACCELERATE_DEEPSPEED_CONFIG_FILE), and a script that follows accelerate's DeepSpeed guide: one
  prepare(model, optimizer, dataloader, scheduler) with DummyOptim/DummyScheduler where the config has
  an optimizer/scheduler section.
Mismatch checks between explicit values and the arguments are switched off (must_match=False): they
answer another question, and when they raise, the "auto" processing after them never runs.

Writes {consumer: {config: {"reached": bool, "auto_left": [keys], "error": str | None}}}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

VOCAB, SEQ = 64, 8


class Reached(Exception):
    """deepspeed.initialize was called: every "auto" step before it has run."""


def fake_initialize(*args: object, config_params: dict | None = None, config: dict | None = None,
                    **kwargs: object) -> None:
    raise Reached(json.dumps(config_params if config_params is not None else config, default=str))


def auto_left(cfg: object, prefix: str = "") -> list[str]:
    if isinstance(cfg, dict):
        return [k for key, v in cfg.items() for k in auto_left(v, f"{prefix}.{key}" if prefix else key)]
    return [prefix] if cfg == "auto" else []


def model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2))


def rows() -> list[dict[str, torch.Tensor]]:
    ids = torch.arange(SEQ) % VOCAB
    return [{"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids}] * 8


def hf_trainer(cfg: dict, out: Path) -> None:
    # The model first: built outside zero.Init, since no engine will be made from it.
    m = model()
    args = TrainingArguments(output_dir=str(out), deepspeed=cfg, per_device_train_batch_size=2, max_steps=2,
                             warmup_steps=1, learning_rate=1e-4, report_to="none", use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    Trainer(model=m, args=args, train_dataset=rows()).train()


def accelerate_script(path: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler

    os.environ |= {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": path,
                   "ACCELERATE_MIXED_PRECISION": "no"}
    try:
        acc = Accelerator()  # cpu=True would turn DeepSpeed off; DS_ACCELERATOR=cpu keeps it on the CPU
        cfg = acc.state.deepspeed_plugin.deepspeed_config
        m = model()
        opt = (DummyOptim(m.parameters(), lr=1e-4) if "optimizer" in cfg
               else torch.optim.AdamW(m.parameters(), lr=1e-4))
        sched = DummyScheduler(opt, total_num_steps=10, warmup_num_steps=1) if "scheduler" in cfg else None
        loader = torch.utils.data.DataLoader(rows(), batch_size=2)
        acc.prepare(m, opt, loader, *([sched] if sched is not None else []))
    finally:
        for k in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_MIXED_PRECISION"):
            os.environ.pop(k, None)


def main() -> int:
    out_file, configs = Path(sys.argv[1]), sys.argv[2:]
    os.environ |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29577")}
    deepspeed.initialize = fake_initialize
    deepspeed.tp_model_init = lambda model, **kw: model  # tensor-parallel configs: not what is probed here
    original = HfTrainerDeepSpeedConfig.fill_match

    def fill_match(self: HfTrainerDeepSpeedConfig, key: str, hf_val: object, hf_key: str | None = None,
                   must_match: bool = True) -> None:
        original(self, key, hf_val, hf_key, must_match=False)

    HfTrainerDeepSpeedConfig.fill_match = fill_match  # type: ignore[method-assign]
    results: dict[str, dict[str, dict[str, object]]] = {"hf-trainer": {}, "accelerate": {}}
    for path in configs:
        cfg = json.loads(Path(path).read_text())
        if cfg.get("tensor_parallel", {}).get("autotp_size", 1) > 1:
            # AutoTP needs that many ranks before any "auto" is looked at; it fills none of them.
            del cfg["tensor_parallel"]
            path = str(out_file.parent / f"no_tp__{Path(path).name}")
            Path(path).write_text(json.dumps(cfg))
        runs = (("hf-trainer", lambda c=cfg: hf_trainer(c, out_file.parent / "probe-out")),
                ("accelerate", lambda p=path: accelerate_script(p)))
        for consumer, run in runs:
            AcceleratorState._reset_state(reset_partial_state=True)
            rec: dict[str, object] = {"reached": False, "auto_left": [], "error": None}
            try:
                run()
                rec["error"] = "deepspeed.initialize was never called"
            except Reached as r:
                rec["reached"] = True
                rec["auto_left"] = auto_left(json.loads(str(r)))
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            results[consumer][path] = rec
    out_file.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
