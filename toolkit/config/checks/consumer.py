"""`"auto"` against the consumer that reads the file: an error for every `"auto"` it leaves unfilled,
naming the key, the consumer and the value to write. Which consumer fills what: ds_config.FILLS."""

from __future__ import annotations

import json
from typing import Any

from toolkit.config import ds_config as dc
from toolkit.config.checks.base import Ctx, Finding, _err

LABELS = {
    "trainer": "toolkit/train.py (train.path=trainer)",
    "raw": "toolkit/train.py (train.path=raw)",
    "hf-trainer": "a plain HF Trainer script",
    "accelerate": "accelerate (--deepspeed_config_file)",
    "deepspeed": "bare deepspeed.initialize",
}
# Why it is an error, in the consumer's own terms.
_WHY = {
    "trainer": " (the toolkit fills batch, precision, optimizer, scheduler and ZeRO size keys only)",
    "hf-trainer": ' (accelerate raises "not found in kwargs. Please specify ... without auto")',
    "accelerate": ' (it raises "not found in kwargs")',
    "deepspeed": ': DeepSpeed drops a nested "auto" for its own default and crashes on a top-level one',
}
_WHY["raw"] = _WHY["trainer"]
# Keys whose value depends on the run: where it comes from.
_FROM_RUN = {
    "train_micro_batch_size_per_gpu": "the micro batch per GPU of the run",
    "train_batch_size": "micro x accumulation x data-parallel world size, or delete the key (DeepSpeed "
                        "derives it)",
    "fp16.enabled": "true or false, as the run's precision is",
    "bf16.enabled": "true or false, as the run's precision is",
    "optimizer.params.lr": "the learning rate",
    "scheduler.params.warmup_max_lr": "the learning rate",
    "scheduler.params.warmup_num_steps": "the warmup steps (at least 1)",
    "scheduler.params.total_num_steps": "the run's optimizer steps",
    "zero_optimization.stage": "0, 1, 2 or 3",
}


def value_to_write(key: str) -> str:
    """What belongs where the consumer leaves "auto": the toolkit's resolved number where it does not
    depend on the run, else where the value comes from, else DeepSpeed's own default for the key."""
    if key in dc.NUMBERS:
        return _json(dc.NUMBERS[key])
    if key in _FROM_RUN:
        return _FROM_RUN[key]
    default = _deepspeed_default(key)
    return f"{_json(default)} (DeepSpeed's default)" if default is not None else "an explicit value"


def _deepspeed_default(key: str) -> Any:
    """The default of a zero_optimization key in DeepSpeed's pydantic model, None where there is none."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from toolkit.config.checks.keys import _walk_models

    for dotted, field, _ in _walk_models(DeepSpeedZeroConfig, "zero_optimization"):
        if dotted == key and isinstance(field.default, (int, float, str)) and not isinstance(field.default, bool):
            return field.default
    return None


def _json(v: Any) -> str:
    return json.dumps(v)


def _why(consumer: str, key: str) -> str:
    if consumer == "accelerate" and key in ("optimizer.params.betas", "optimizer.params.eps"):
        return ' (its DummyOptim carries only lr and weight decay; accelerate raises "not found in kwargs")'
    return _WHY[consumer]


def rule_consumer_auto(c: Ctx) -> list[Finding]:
    return [
        _err(key, f'"auto" is not filled by {LABELS[c.consumer]}{_why(c.consumer, key)}; write {value_to_write(key)}')
        for key in dc.unfilled(c.raw, c.consumer)
    ]
