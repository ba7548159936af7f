"""DeepSpeed JSON as plain dicts: presets (`toolkit gen-config`), loading, and "auto" resolution.

Pure dict code: no torch, no deepspeed import, so the CLI stays fast and tests stay trivial.

Ownership (DESIGN.md "one home per knob"): the training config owns batch sizes, precision,
clipping and optimizer hyper-parameters, so presets carry "auto" for them; the JSON owns stage,
offload, buckets, overlap and gather-on-save.

Consumers: "auto" is not DeepSpeed syntax, whoever hands the dict to DeepSpeed replaces it first, and
each consumer fills its own fixed set of keys (FILLS). A preset says "auto" only where every consumer
it targets fills it and writes numbers elsewhere (`gen_config(targets=...)`).
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from toolkit.config import optimizers as opt

Offload = Literal["none", "cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32", "auto"]
AUTO = "auto"

# name -> (stage, optimizer offload, parameter offload): the standard set `gen-config --all` writes.
PRESETS: dict[str, tuple[int, Offload, Offload]] = {
    "zero0": (0, "none", "none"),
    "zero1": (1, "none", "none"),
    "zero2": (2, "none", "none"),
    "zero3": (3, "none", "none"),
    "zero1_offload": (1, "cpu", "none"),
    "zero2_offload": (2, "cpu", "none"),
    "zero3_offload_optimizer": (3, "cpu", "none"),
    "zero3_offload": (3, "cpu", "cpu"),
    "zero3_offload_nvme": (3, "nvme", "nvme"),
}
DEFAULT_NVME_PATH = "/local_nvme"


class ConfigError(ValueError):
    """A config the toolkit refuses; the message says what to change."""


def run_command(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """A command-line entry point: a refusal or an unreadable file is one `error:` line and exit 1."""
    try:
        return main(argv)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _offload_block(device: Offload, nvme_path: str, *, param: bool) -> dict[str, Any]:
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    block: dict[str, Any] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
    # DeepSpeed's documented defaults for NVMe buffers (ZeRO-Infinity tutorial).
    block |= {"buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000} if param else {"buffer_count": 4}
    return block


def gen_config(
    stage: int,
    offload_optimizer: Offload = "none",
    offload_param: Offload = "none",
    nvme_path: str = DEFAULT_NVME_PATH,
    precision: Precision = "auto",
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    world_size: int | None = None,
    lr: float | None = None,
    targets: Iterable[str] = ("trainer", "raw", "hf-trainer"),
    optimizer: str = "adamw",
    optimizer_states: str = "fp32",
) -> dict[str, Any]:
    """Build a DeepSpeed config dict for the consumers in `targets` (CONSUMERS): "auto" where all of
    them fill the key, a number elsewhere (`for_targets`). Batch numbers stay "auto" unless given.
    optimizer: adamw or muon; optimizer_states: fp32, or bf16 master weights, gradients and moments
    (toolkit/config/optimizers.py says what DeepSpeed does with each)."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if optimizer not in opt.OPTIMIZERS:
        raise ConfigError(f"optimizer must be {' or '.join(opt.OPTIMIZERS)}, got {optimizer!r}")
    if optimizer_states not in opt.STATES:
        raise ConfigError(f"optimizer states must be {' or '.join(opt.STATES)}, got {optimizer_states!r}")
    if optimizer_states == "bf16":
        if stage == 0:
            raise ConfigError("bf16 optimizer states need ZeRO stage 1, 2 or 3 (DeepSpeed keeps them in its ZeRO "
                              "optimizer only)")
        if precision in ("fp16", "fp32"):
            raise ConfigError(f"bf16 optimizer states train in bf16; --precision {precision} contradicts them")
        if optimizer == "muon" and offload_optimizer != "none":
            raise ConfigError("bf16 optimizer states with optimizer offload need DeepSpeedCPUAdam, which Muon is not "
                              "(DeepSpeed's _configure_master_weights refuses it): drop the offload or keep fp32 states")
        precision = "bf16"
    if offload_param != "none" and stage != 3:
        raise ConfigError("parameter offload needs stage 3 (DeepSpeed ignores offload_param below it)")
    if offload_optimizer != "none" and stage == 0:
        raise ConfigError("optimizer offload needs ZeRO stage 1, 2 or 3")
    for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("world_size", world_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")

    cfg: dict[str, Any] = {
        "train_batch_size": AUTO,
        "train_micro_batch_size_per_gpu": micro_batch if micro_batch is not None else AUTO,
        "gradient_accumulation_steps": grad_accum if grad_accum is not None else AUTO,
        "gradient_clipping": AUTO,
    }
    if micro_batch is not None and grad_accum is not None and world_size is not None:
        cfg["train_batch_size"] = micro_batch * grad_accum * world_size

    if precision == "auto":
        cfg["bf16"] = {"enabled": AUTO}
        cfg["fp16"] = {"enabled": AUTO, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    elif precision != "fp32":
        raise ConfigError(f"precision must be bf16, fp16, fp32 or auto, got {precision!r}")

    if optimizer_states == "bf16":  # DeepSpeed's keys (precision_config.py); both, or it needs a CPU Adam
        cfg["bf16"] |= {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}

    # A config optimizer (not a client torch one) so that offload gets DeepSpeedCPUAdam.
    cfg["optimizer"] = {"type": "AdamW",
                        "params": {"lr": AUTO if lr is None else lr, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}}
    if optimizer == "muon":
        # lr (and betas, eps) go to Muon's Adam half; muon_lr and momentum to its matrices
        cfg["optimizer"] = {"type": "Muon", "params": {**cfg["optimizer"]["params"], "muon_lr": AUTO,
                                                      "momentum": opt.MUON_MOMENTUM}}
        if stage >= 1:
            # ZeRO 1-3 clip Muon's orthogonalized update, not the gradient (optimizers.clips_muon_update): off,
            # and a plain HF Trainer must then be given max_grad_norm=0 (it raises on the mismatch otherwise)
            cfg["gradient_clipping"] = 0.0

    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero |= {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": AUTO}
    if stage == 2:
        zero |= {"allgather_partitions": True, "allgather_bucket_size": AUTO, "reduce_scatter": True}
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": AUTO,
            "stage3_param_persistence_threshold": AUTO,
            "stage3_max_live_parameters": AUTO,
            "stage3_max_reuse_distance": AUTO,
            "sub_group_size": 1_000_000_000,
            # Without this, save_model under ZeRO-3 writes empty tensors.
            "stage3_gather_16bit_weights_on_model_save": True,
        }
        if optimizer == "muon":  # stage3.py: "Muon and reduce scatter cannot be used together"
            zero["reduce_scatter"] = False
            # With reduce_scatter off, contiguous gradients send every micro-batch's bucket through a whole
            # all-reduce plus copies (stage3.__avg_scatter_contiguous_grads); without them the gradients take the
            # reduce-scatter path. DeepSpeed 0.19 runs Muon once a step on the gathered partitions
            # (_apply_muon_to_accumulated_grads), so either path gives the same update (tests/dist/test_train.py);
            # this one keeps no contiguous bucket: 0.93 GiB less on llama-1b, at the same speed (bench/results/optimizers/)
            zero["contiguous_gradients"] = False
    if offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_block(offload_optimizer, nvme_path, param=False)
    if offload_param != "none":
        zero["offload_param"] = _offload_block(offload_param, nvme_path, param=True)
    cfg["zero_optimization"] = zero
    if "nvme" in (offload_optimizer, offload_param):
        cfg["aio"] = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1,
                      "single_submit": False, "overlap_events": True}
    cfg["steps_per_print"] = 1_000_000_000  # the toolkit prints its own progress
    cfg["wall_clock_breakdown"] = False
    return for_targets(cfg, targets)


def preset(name: str) -> dict[str, Any]:
    """The shipped preset: for both toolkit paths and a plain HF Trainer script (DEFAULT_TARGETS)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    stage, opt, par = PRESETS[name]
    return gen_config(stage, opt, par)


def dumps(cfg: dict[str, Any]) -> str:
    return json.dumps(cfg, indent=2) + "\n"


def write_config(cfg: dict[str, Any], path: Path, force: bool = False) -> None:
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; give a file path")
    if path.exists() and not force:
        raise ConfigError(f"{path} exists; pass --force to overwrite")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(cfg))


def load_ds_config(path: str | Path) -> dict[str, Any]:
    """Load a DeepSpeed config the way DeepSpeed does: hjson, duplicate keys rejected.

    Errors are ConfigError with one line (file, line and column for syntax errors).
    """
    import hjson  # deepspeed's own dependency and parser

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such file")
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, expected a DeepSpeed JSON file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None

    def no_dups(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for k, v in pairs:
            if k in seen:
                raise ConfigError(f"{p}: duplicate key {k!r}")
            seen[k] = v
        return seen

    try:
        data = hjson.loads(text, object_pairs_hook=no_dups)
    except hjson.HjsonDecodeError as e:
        raise ConfigError(f"{p}:{e.lineno}:{e.colno}: syntax error: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be an object, got {type(data).__name__}")
    return _plain(data)


def _plain(obj: Any) -> Any:
    """hjson returns OrderedDicts; make plain containers so comparisons and json.dumps behave."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def iter_leaves(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            yield from iter_leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, cfg


@dataclass(frozen=True)
class AutoValues:
    """What the training side knows; fills every "auto" in a DeepSpeed dict."""

    micro_batch: int
    grad_accum: int
    world_size: int
    precision: Literal["bf16", "fp16", "fp32"]
    grad_clip: float
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    muon_lr: float = opt.MUON_LR
    """Muon's matrices (optimizer.params.muon_lr); its Adam half takes lr."""
    hidden_size: int | None = None
    warmup_steps: int = 0
    total_steps: int | None = None
    zero_sizes: Literal["speed", "memory"] = "speed"
    """How "auto" bucket/prefetch/live-parameter sizes resolve: SPEED_SIZES, or the memory-lean
    rules from the hidden size (needs hidden_size). "memory" also replaces a size the JSON sets to
    DeepSpeed's default (SPEED_SIZES), which presets write where a plain HF Trainer leaves "auto"."""
    adapter_autocast: bool = False
    """bf16 as torch autocast (DeepSpeed "torch_autocast") instead of DeepSpeed's bf16 mode: see
    `adapter_autocast` below."""

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size


# DeepSpeed's own defaults (deepspeed/runtime/zero/config.py), written out so the raw loop and the
# Trainer run the same numbers. Measured on 2x H200 (bench/results/speed.md): the lean h^2 rules
# cost llama-1b ZeRO-3 35% of its tokens/s and GPT-2 ZeRO-2 a quarter (about 200 small reductions a
# step at h=768), for about 2 GiB per rank; so speed is the default and the lean rules are
# `train.zero_sizes=memory`.
SPEED_SIZES: dict[str, int] = {
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
}


def _auto_table(v: AutoValues) -> dict[str, Any]:
    """dotted key -> value, with the HF Trainer / Accelerate conventions for the bucket sizes."""
    table: dict[str, Any] = {
        "train_batch_size": v.train_batch_size,
        "train_micro_batch_size_per_gpu": v.micro_batch,
        "gradient_accumulation_steps": v.grad_accum,
        "gradient_clipping": v.grad_clip,
        "bf16.enabled": v.precision == "bf16" and not v.adapter_autocast,
        "fp16.enabled": v.precision == "fp16",
        "optimizer.params.lr": v.lr,
        "optimizer.params.betas": list(v.betas),
        "optimizer.params.eps": v.eps,
        "optimizer.params.weight_decay": v.weight_decay,
        "optimizer.params.muon_lr": v.muon_lr,
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_max_lr": v.lr,
        "scheduler.params.warmup_num_steps": v.warmup_steps,
        # Accelerate's configs leave this "auto"; the toolkit always gathers, never saves empty tensors.
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
    }
    if v.total_steps is not None:
        table["scheduler.params.total_num_steps"] = v.total_steps
    if v.zero_sizes == "speed":
        table |= SPEED_SIZES
    elif v.hidden_size is not None:
        h = v.hidden_size
        table |= {
            # The HF/Accelerate "auto" convention: h^2, 0.9 h^2, 10 h.
            "zero_optimization.reduce_bucket_size": h * h,
            "zero_optimization.allgather_bucket_size": h * h,
            "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * h * h),
            "zero_optimization.stage3_param_persistence_threshold": 10 * h,
            # The toolkit's own rule (HF has none): about two transformer layers (~12 h^2 each).
            # The usual 1e9 keeps every parameter of a model under ~1B gathered from forward to
            # backward, which cancels ZeRO-3's partitioning: measured on llama-1b, 2 GPUs, ZeRO-3
            # then peaked above ZeRO-2 (bench/results/two_gpu.md).
            "zero_optimization.stage3_max_live_parameters": 24 * h * h,
            "zero_optimization.stage3_max_reuse_distance": 24 * h * h,
        }
    return table


# ----------------------------------------------------------------------------- consumers
# Who reads the JSON and which "auto" keys each fills (read from transformers 5.x / accelerate 1.x):
# - trainer, raw: toolkit/train.py's paths; `resolve` fills every key of _auto_table before the HF
#   Trainer or DeepSpeed see the dict.
# - hf-trainer: a plain script with TrainingArguments(deepspeed=...). transformers'
#   HfTrainerDeepSpeedConfig.trainer_config_process fills batch sizes, clipping, AdamW lr/betas/eps/
#   weight decay, the scheduler's min/max lr and fp16/bf16; accelerate's DeepSpeedPlugin fills stage,
#   offload devices, NVMe paths and the 16-bit gather with its own defaults; trainer_config_finalize and
#   accelerate's _prepare_deepspeed fill the three hidden-size sizes (the model needs
#   config.hidden_size) and the scheduler's step counts. Any other "auto" raises in accelerate's
#   deepspeed_config_process ("`X` not found in kwargs. Please specify `X` without `auto`").
# - accelerate: `accelerate launch --deepspeed_config_file` and a script that follows accelerate's
#   DeepSpeed guide (model, dataloader, DummyOptim and DummyScheduler in one prepare call): the same,
#   except that DummyOptim carries only lr and weight decay, so betas and eps raise.
# - deepspeed: bare deepspeed.initialize fills nothing; its pydantic models drop a nested "auto" (its
#   default runs instead of what was meant) and a top-level one crashes.
CONSUMERS = ("trainer", "raw", "hf-trainer", "accelerate", "deepspeed")
# What presets target. accelerate is not among them: it fills no betas/eps, and numbers there would
# turn a Trainer script's own adam_beta2=0.95 into a mismatch error (`--consumer accelerate` opts in).
DEFAULT_TARGETS = ("trainer", "raw", "hf-trainer")

_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")
# accelerate's DeepSpeedPlugin fills these from ACCELERATE_DEEPSPEED_* variables or these defaults.
PLUGIN_DEFAULTS: dict[str, Any] = {
    "zero_optimization.stage": 2,
    "zero_optimization.offload_optimizer.device": "none",
    "zero_optimization.offload_param.device": "none",
    "zero_optimization.offload_optimizer.nvme_path": "none",
    "zero_optimization.offload_param.nvme_path": "none",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}
_HF_FILLS = frozenset((
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "fp16.enabled", "bf16.enabled",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps", *_HIDDEN_SIZE_KEYS, *PLUGIN_DEFAULTS,
))
_TOOLKIT_FILLS = frozenset(_auto_table(AutoValues(micro_batch=1, grad_accum=1, world_size=1, precision="fp32",
                                                  grad_clip=1.0, lr=1.0, total_steps=1)))
FILLS: dict[str, frozenset[str]] = {
    "trainer": _TOOLKIT_FILLS,
    "raw": _TOOLKIT_FILLS,
    "hf-trainer": _HF_FILLS,
    "accelerate": _HF_FILLS - {"optimizer.params.betas", "optimizer.params.eps"},
    "deepspeed": frozenset(),
}
# What to write where a target leaves "auto" and the number does not depend on the run: the toolkit's
# training defaults (schema.TrainConfig; the same as TrainingArguments' and torch AdamW's) and
# DeepSpeed's own ZeRO sizes. The run-dependent keys (micro batch, precision, lr) need a flag.
NUMBERS: dict[str, Any] = {
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "optimizer.params.muon_lr": opt.MUON_LR,
    "scheduler.params.warmup_min_lr": 0.0,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
    **SPEED_SIZES,
}
_FLAG_FOR = {"train_micro_batch_size_per_gpu": "--micro-batch", "fp16.enabled": "--precision",
             "bf16.enabled": "--precision", "optimizer.params.lr": "--lr"}


def check_consumers(names: Iterable[str]) -> tuple[str, ...]:
    out = tuple(names)
    bad = [c for c in out if c not in CONSUMERS]
    if bad or not out:
        raise ConfigError(f"unknown consumer {bad[0] if bad else '(none)'!r}; known: {', '.join(CONSUMERS)}")
    return out


def unfilled(ds: dict[str, Any], consumer: str) -> list[str]:
    """The "auto" keys this consumer leaves as they are, in file order (each one fails or misleads)."""
    return [k for k, v in iter_leaves(ds) if v == AUTO and k not in FILLS[consumer]]


def for_targets(cfg: dict[str, Any], targets: Iterable[str]) -> dict[str, Any]:
    """Replace every "auto" that one of `targets` does not fill: a number from NUMBERS, no
    train_batch_size at all (DeepSpeed derives it from micro x accumulation x world size), or an
    error naming the flag that gives the run-dependent value."""
    names = check_consumers(targets)
    out = copy.deepcopy(cfg)
    missing: dict[str, list[str]] = {}
    for key in sorted({k for c in names for k in unfilled(out, c)}):
        if key in NUMBERS:
            _set(out, key, copy.deepcopy(NUMBERS[key]))
        elif key == "train_batch_size":
            del out[key]
        else:
            missing.setdefault(_FLAG_FOR.get(key, key), []).append(key)
    if missing:
        who = " and ".join(c for c in names if any(k in unfilled(cfg, c) for ks in missing.values() for k in ks))
        flags = ", ".join(f"{flag} ({', '.join(ks)})" for flag, ks in sorted(missing.items()))
        raise ConfigError(f'{who} would leave "auto" on values that depend on the run: give {flags}')
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)), abs(float(b)))
    return a == b


def _get(cfg: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[last] = value


def resolve(ds: dict[str, Any], values: AutoValues) -> dict[str, Any]:
    """Return a copy of `ds` with no "auto" left.

    Raw DeepSpeed drops nested "auto" silently and crashes on top-level "auto", so the raw loop must
    resolve exactly as the HF Trainer does. Explicit values that disagree with the training config
    are collected and reported together (like Accelerate's DeepSpeed glue), not one at a time.
    """
    out = copy.deepcopy(ds)
    table = _auto_table(values)
    mismatches: list[str] = []
    for key, want in table.items():
        present, have = _get(out, key)
        if not present:
            continue
        if have == AUTO:
            _set(out, key, want)
        elif values.zero_sizes == "memory" and key in SPEED_SIZES and _same(have, SPEED_SIZES[key]):
            # DeepSpeed's own default written out, as presets do where a plain HF Trainer cannot fill
            # "auto": it states no choice of its own, so the explicit request for lean sizes wins.
            _set(out, key, want)
        elif key.startswith("bf16") or key.startswith("fp16"):
            # precision enabled flags: an explicit True that the training config contradicts
            if bool(have) != bool(want):
                mismatches.append(f"{key}={have!r} but the training config says precision={values.precision}")
        elif key.startswith("scheduler.") or key.startswith("zero_optimization."):
            continue  # explicit values here are the JSON's to own
        elif not _same(have, want):
            mismatches.append(f"{key}={have!r} but the training config gives {want!r}")
    if values.adapter_autocast:
        # An empty lower_precision_safe_modules keeps gradient reduction in fp32: DeepSpeed's default
        # marks every nn.Linear, PEFT's lora_A/lora_B included, to all-reduce its grads in bf16.
        out.setdefault("torch_autocast", {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []})
    leftover = [k for k, v in iter_leaves(out) if v == AUTO]
    if leftover:
        # "auto" on a key no one knows how to fill: say so instead of letting DeepSpeed drop it.
        mismatches += [f"{k}='auto' has no value the toolkit can fill; set it explicitly" for k in leftover]
    if mismatches:
        raise ConfigError("DeepSpeed config disagrees with the training config:\n  " + "\n  ".join(mismatches))
    return out


def adapter_autocast(ds: dict[str, Any], precision: str, lora: bool) -> bool:
    """Train LoRA under bf16 the way PEFT and the HF Trainer do: fp32 adapters, bf16 frozen base,
    matmuls under torch autocast (DeepSpeed's "torch_autocast"), fp32 gradient reduction.

    DeepSpeed's own bf16 mode casts the adapters to bf16 and keeps fp32 masters beside them; at
    ZeRO-0 that second copy put the seeds' "all together" LoRA run above plain HF Trainer
    (bench/results/seeds_tables.md). The numerics then match PEFT's too: norms and softmax run in
    fp32 under autocast (which costs some activation memory with eager attention). Only where the
    JSON leaves bf16 to the toolkit
    ("auto") and below ZeRO-3: under ZeRO-3 transformers builds the model inside zero.Init, which
    takes its dtype from the bf16 flag and would hold the frozen base in fp32.
    """
    _, bf16 = _get(ds, "bf16.enabled")
    return lora and precision == "bf16" and bf16 == AUTO and "torch_autocast" not in ds and zero_stage(ds) < 3


def precision_of(ds: dict[str, Any]) -> str | None:
    """The precision an explicit config pins, or None when it leaves it to the training config."""
    _, bf = _get(ds, "bf16.enabled")
    _, fp = _get(ds, "fp16.enabled")
    if bf is True:
        return "bf16"
    if fp is True:
        return "fp16"
    if bf == AUTO or fp == AUTO:
        return None
    return "fp32"


def offload(ds: dict[str, Any], which: str) -> tuple[str, dict[str, Any]]:
    """(device, block) of zero_optimization.offload_{optimizer,param}; device "none" when absent."""
    zero = ds.get("zero_optimization")
    block = zero.get(which) if isinstance(zero, dict) else None
    if not isinstance(block, dict):
        return "none", {}
    return str(block.get("device", "none")).lower(), block


def zero_stage(ds: dict[str, Any]) -> int:
    """The stage as DeepSpeed reads it: 3, 3.0 and "3" are all stage 3 (its pydantic model coerces)."""
    _, stage = _get(ds, "zero_optimization.stage")
    if isinstance(stage, str) and stage.strip().isdigit():
        return int(stage)
    return int(stage) if isinstance(stage, (int, float)) and not isinstance(stage, bool) else 0
