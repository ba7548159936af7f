"""`toolkit check`: will this DeepSpeed config run? DeepSpeed's own validation plus the toolkit's rules.

Order of work (each step feeds the next):
  1. fill "auto" the way training will (`ds_config.resolve` with placeholder values); keys it cannot
     fill are errors;
  2. DeepSpeed's own parser (`DeepSpeedConfig`, its pydantic models) on the resolved dict, one error
     at a time (DeepSpeed stops at the first), plus a trace of which keys it reads at all;
  3. the rule table below: things DeepSpeed only finds at `initialize` time, on N ranks, or never.

deepspeed is imported lazily inside functions: `import toolkit.checks` stays free of side effects so
the training entry point can call `check_config` before any process-group work.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib.util
import io
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, KeysView
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from toolkit import ds_config as dc

Level = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    level: Level
    key: str  # dotted path in the DeepSpeed JSON, e.g. "zero_optimization.offload_optimizer.device"
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.key}: {self.message}"


@dataclass(frozen=True)
class Ctx:
    """What every rule sees: the file as written, the same with "auto" filled, and the launch facts."""

    raw: dict[str, Any]
    resolved: dict[str, Any]
    world_size: int
    optimizer: str | None
    path: str
    micro_batch: int | None
    grad_accum: int | None

    @property
    def stage(self) -> int:
        return dc.zero_stage(self.raw)

    @property
    def zero(self) -> dict[str, Any]:
        z = self.raw.get("zero_optimization")
        return z if isinstance(z, dict) else {}

    def offload(self, which: str) -> tuple[str, dict[str, Any]]:
        """(device, block) of zero_optimization.offload_{optimizer,param}; device "none" when absent."""
        block = self.zero.get(which)
        if not isinstance(block, dict):
            return "none", {}
        return str(block.get("device", "none")).lower(), block


def _err(key: str, msg: str) -> Finding:
    return Finding("error", key, msg)


def _warn(key: str, msg: str) -> Finding:
    return Finding("warning", key, msg)


def _num(v: Any) -> int | None:
    """An explicit positive integer from JSON (not "auto", not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        return None
    return int(v)


# ---------------------------------------------------------------- batch arithmetic


@dataclass(frozen=True)
class _Batch:
    micro: int
    accum: int
    findings: tuple[Finding, ...]


def _batch(ds: dict[str, Any], world: int, micro_arg: int | None, accum_arg: int | None) -> _Batch:
    """DeepSpeed's inference rules (DeepSpeedConfig._set_batch_related_parameters) at the REAL world
    size: DeepSpeedConfig itself only knows torch.distributed's world size, which is 1 before launch."""
    tb, mb, ga = (
        _num(ds.get(k))
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    out: list[Finding] = []
    for key, have, arg, flag in (
        ("train_micro_batch_size_per_gpu", mb, micro_arg, "--micro-batch"),
        ("gradient_accumulation_steps", ga, accum_arg, "--grad-accum"),
    ):
        if have is not None and arg is not None and have != arg:
            out.append(
                _err(
                    key,
                    f"file says {have} but the training config gives {arg} ({flag}); "
                    f'set it to "auto" so the training config owns it',
                )
            )
    mb = mb if mb is not None else micro_arg
    ga = ga if ga is not None else accum_arg
    if tb is None:
        if "train_batch_size" not in ds and "train_micro_batch_size_per_gpu" not in ds:
            out.append(
                _err(
                    "train_batch_size",
                    "neither train_batch_size nor "
                    'train_micro_batch_size_per_gpu is set; DeepSpeed needs one ("auto" is fine)',
                )
            )
        return _Batch(mb or 1, ga or 1, tuple(out))
    if mb is not None and ga is not None:
        if tb != mb * ga * world:
            out.append(
                _err(
                    "train_batch_size",
                    f"{tb} != micro {mb} * grad_accum {ga} * world_size {world} "
                    f'= {mb * ga * world}; set it to "auto" or to {mb * ga * world}',
                )
            )
        return _Batch(mb, ga, tuple(out))
    ga = ga or 1  # DeepSpeed: only train_batch_size (and maybe micro) given -> accumulation 1 or derived
    if mb is None:
        mb, rest = divmod(tb, world * ga)
        if rest or mb == 0:
            out.append(
                _err(
                    "train_batch_size",
                    f"{tb} is not divisible by world_size {world} * grad_accum "
                    f"{ga}; DeepSpeed's batch assertion fails on {world} ranks",
                )
            )
        return _Batch(max(mb, 1), ga, tuple(out))
    ga, rest = divmod(tb, mb * world)
    if rest or ga == 0:
        out.append(
            _err(
                "train_batch_size",
                f"{tb} is not divisible by micro {mb} * world_size {world}; "
                f"DeepSpeed's batch assertion fails on {world} ranks",
            )
        )
    return _Batch(mb, max(ga, 1), tuple(out))


def rule_batch(c: Ctx) -> list[Finding]:
    return list(_batch(c.raw, c.world_size, c.micro_batch, c.grad_accum).findings)


# ---------------------------------------------------------------- optimizer x offload

# deepspeed/runtime/engine.py _configure_basic_optimizer: with offload these config types become
# DeepSpeedCPUAdam (adam, adamw), DeepSpeedCPUAdagrad, DeepSpeedCPULion; lamb becomes FusedLamb (GPU only).
_CPU_CONFIG_OPTIMIZERS = {"adam", "adamw", "adagrad", "lion"}
_ONE_BIT = {"onebitadam", "zerooneadam", "onebitlamb"}
# engine._configure_optimizer: a client optimizer under offload must be an instance of one of these
# two, else ZeRORuntimeException unless zero_force_ds_cpu_optimizer is false. DeepSpeedCPUAdagrad is
# NOT in that isinstance check (it does not subclass DeepSpeedCPUAdam), so as a client it is refused too.
_CPU_CLIENT_OPTIMIZERS = {"deepspeedcpuadam", "deepspeedcpulion"}


def _opt_type(c: Ctx) -> str | None:
    opt = c.raw.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("type"), str):
        return opt["type"]
    return None


def _one_bit_available() -> bool:
    try:
        return importlib.util.find_spec("deepspeed.runtime.fp16.onebit") is not None
    except ModuleNotFoundError:
        return False


def rule_optimizer(c: Ctx) -> list[Finding]:
    out: list[Finding] = []
    dev, _ = c.offload("offload_optimizer")
    offloaded = dev in ("cpu", "nvme")
    typ = _opt_type(c)
    if typ is not None:
        low = typ.lower()
        if low in _ONE_BIT:
            why = (
                []
                if _one_bit_available()
                else [
                    "this DeepSpeed has no 1-bit optimizers (removed), "
                    "so initialize fails with 'not a supported DeepSpeed Optimizer'"
                ]
            )
            if c.stage > 0:
                why.append(f"1-bit optimizers do not support ZeRO stage {c.stage}")
            if why:
                out.append(_err("optimizer.type", f"{typ}: " + "; ".join(why) + "; use Adam/AdamW"))
            return out
        if not _is_supported_optimizer_name(typ):
            out.append(
                _err(
                    "optimizer.type",
                    f"{typ!r} is neither a DeepSpeed optimizer "
                    f"({', '.join(_ds_optimizers())}) nor a torch.optim class",
                )
            )
            return out
        if offloaded and low == "lamb":
            out.append(
                _err(
                    "optimizer.type",
                    "LAMB has no CPU implementation (DeepSpeed builds FusedLamb, GPU "
                    "only); use Adam/AdamW with offload_optimizer, or drop the offload",
                )
            )
        elif offloaded and low in ("adam", "adamw"):
            params = c.raw["optimizer"].get("params")
            if isinstance(params, dict) and params.get("torch_adam") is True:
                out.append(
                    _warn(
                        "optimizer.params.torch_adam",
                        "true under offload_optimizer runs torch's Adam "
                        "on the CPU instead of DeepSpeedCPUAdam (several times slower); remove it",
                    )
                )
        elif offloaded and low not in _CPU_CONFIG_OPTIMIZERS:
            out.append(
                _warn(
                    "optimizer.type",
                    f"{typ} has no DeepSpeed CPU version: under offload it runs as "
                    "a plain torch optimizer on the CPU (slow); Adam/AdamW/Adagrad/Lion have one",
                )
            )
        if c.optimizer:
            out.append(
                _warn(
                    "optimizer",
                    f"the config has an optimizer section and --optimizer {c.optimizer} "
                    "was given; the Trainer uses the section, raw deepspeed.initialize the client one",
                )
            )
        return out
    if not offloaded:
        return out
    force = c.raw.get("zero_force_ds_cpu_optimizer", True) is not False
    key = "zero_optimization.offload_optimizer"
    if c.path == "trainer" and force:
        # HF Trainer goes through Accelerate, which swaps a client torch/bnb Adam, AdamW, Adagrad or
        # Lion (and the Trainer's own default AdamW) for DeepSpeed's CPU version under offload
        # (accelerate.utils.deepspeed.map_pytorch_optim_to_deepspeed): those run. Anything else is
        # silently replaced by DeepSpeedCPUAdam, its fallback.
        name = (c.optimizer or "torch.adamw").rsplit(".", 1)[-1].lower()
        if not any(k in name for k in ("adam", "adagrad", "lion")):
            out.append(
                _warn(
                    key,
                    f"under offload Accelerate replaces client optimizer {c.optimizer} with "
                    "DeepSpeedCPUAdam; use Adam/AdamW/Adagrad/Lion or an optimizer section",
                )
            )
        return out
    if c.optimizer:
        name = c.optimizer.rsplit(".", 1)[-1].lower()
        if name in _CPU_CLIENT_OPTIMIZERS:
            return out
        msg = (
            f"client optimizer {c.optimizer} is not DeepSpeedCPUAdam/DeepSpeedCPULion; DeepSpeed "
            "{verb} (engine._configure_optimizer). Add an optimizer section (e.g. from `toolkit gen-config`) "
            "or pass DeepSpeedCPUAdam"
        )
        if force:
            out.append(_err(key, msg.format(verb="raises ZeRORuntimeException at initialize")))
        else:
            out.append(
                _warn(
                    key,
                    msg.format(
                        verb="allows it only because zero_force_ds_cpu_optimizer is "
                        "false: the step runs as torch code on the CPU (slow)"
                    ),
                )
            )
    elif c.path == "trainer" and force:
        out.append(
            _err(
                key,
                "no optimizer section: HF Trainer then creates torch AdamW, which DeepSpeed refuses "
                "under offload; add an optimizer section, e.g. from `toolkit gen-config`",
            )
        )
    elif c.path == "trainer":
        out.append(
            _warn(
                key,
                "no optimizer section: HF Trainer creates torch AdamW, allowed only because "
                "zero_force_ds_cpu_optimizer is false; its step runs as torch code on the CPU (slow). "
                "Add an optimizer section, e.g. from `toolkit gen-config`",
            )
        )
    else:
        out.append(
            _warn(
                key,
                "no optimizer section: the raw loop's client optimizer must be DeepSpeedCPUAdam "
                "(or DeepSpeedCPULion), else initialize raises",
            )
        )
    return out


@functools.cache
def _ds_optimizers() -> tuple[str, ...]:
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return tuple(DEEPSPEED_OPTIMIZERS)


def _is_supported_optimizer_name(name: str) -> bool:
    # engine._is_supported_optimizer, after DeepSpeedConfig lower-cases the DeepSpeed names
    import torch

    return name.lower() in _ds_optimizers() or getattr(torch.optim, name, None) is not None


# ---------------------------------------------------------------- stage x offload, nvme


def rule_offload(c: Ctx) -> list[Finding]:
    out: list[Finding] = []
    pdev, _ = c.offload("offload_param")
    odev, oblock = c.offload("offload_optimizer")
    if pdev != "none" and c.stage != 3:
        out.append(
            _warn(
                "zero_optimization.offload_param",
                f"ignored at stage {c.stage}: parameter offload needs stage 3; remove it or set stage 3",
            )
        )
    if odev != "none" and c.stage == 0:
        out.append(_err("zero_optimization.offload_optimizer", "needs ZeRO stage 1, 2 or 3 (stage is 0)"))
    ratio = oblock.get("ratio", 1.0)
    if isinstance(ratio, (int, float)) and ratio < 1 and c.stage != 3:
        out.append(
            _err(
                "zero_optimization.offload_optimizer.ratio",
                f"{ratio} < 1 (partial offload) needs stage 3, stage is {c.stage}; set ratio 1 or stage 3",
            )
        )
    for which, dev in (("offload_optimizer", odev), ("offload_param", pdev)):
        if dev != "nvme" or (which == "offload_param" and c.stage != 3):
            continue
        key = f"zero_optimization.{which}.nvme_path"
        nvme = c.zero[which].get("nvme_path")
        if not nvme:
            out.append(_err(key, "device is nvme but nvme_path is not set"))
        elif not Path(nvme).is_dir():
            out.append(
                _err(
                    key, f"{nvme} does not exist on this machine; create it or pass --nvme-path to gen-config"
                )
            )
        elif not os.access(nvme, os.W_OK | os.X_OK):
            out.append(
                _err(key, f"{nvme} is not writable; fix its permissions or pass --nvme-path to gen-config")
            )
    return out


def rule_precision(c: Ctx) -> list[Finding]:
    on = {k: isinstance(c.raw.get(k), dict) and c.raw[k].get("enabled") is True for k in ("fp16", "bf16")}
    if all(on.values()):
        return [
            _err(
                "fp16.enabled",
                "fp16 and bf16 are both enabled; DeepSpeed refuses this. Enable one, "
                'or set both to "auto" and let the training config choose',
            )
        ]
    autocast = isinstance(c.raw.get("torch_autocast"), dict) and c.raw["torch_autocast"].get("enabled") is True
    mode = next((k for k, v in on.items() if v), None)
    if autocast and mode:
        return [
            _warn(
                "torch_autocast.enabled",
                f"torch_autocast together with {mode}.enabled: DeepSpeed casts the whole model to {mode} "
                "and autocasts as well; pick one (torch_autocast keeps fp32 weights, e.g. LoRA adapters)",
            )
        ]
    return []


# ---------------------------------------------------------------- keys: stage-3-only, deprecated, unknown

# Not marked in the pydantic model, but engine.py passes sub_group_size only to the stage-3 optimizer.
_STAGE3_EXTRA = {"sub_group_size"}


def rule_stage3_keys(c: Ctx) -> list[Finding]:
    if c.stage == 3:
        return []
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    stage3 = set(_STAGE3_EXTRA)
    for name, f in DeepSpeedZeroConfig.model_fields.items():
        if f.alias and f.alias.startswith("stage3_"):
            stage3 |= {name, f.alias}
        elif name.startswith("stage3_"):
            stage3.add(name)
    return [
        _warn(f"zero_optimization.{k}", f"stage-3-only setting, ignored at stage {c.stage}")
        for k in c.zero
        if k in stage3
    ]


def _walk_models(model: Any, prefix: str) -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, field info, owning model) for a pydantic model and its nested models."""
    import typing

    for name, f in model.model_fields.items():
        yield f"{prefix}.{f.alias or name}", f, model
        for t in (f.annotation, *typing.get_args(f.annotation)):
            if isinstance(t, type) and hasattr(t, "model_fields"):
                yield from _walk_models(t, f"{prefix}.{f.alias or name}")


def rule_deprecated(c: Ctx) -> list[Finding]:
    # DeepSpeed marks them with json_schema_extra={"deprecated": True, "new_param": ...}
    # (deepspeed/runtime/config_utils.py) and only logs a warning; only the ZeRO model has training ones.
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    out = []
    for key, f, _ in _walk_models(DeepSpeedZeroConfig, "zero_optimization"):
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if not extra.get("deprecated"):
            continue
        present, value = dc._get(c.raw, key)
        if present:
            new = extra.get("new_param")
            out.append(
                _warn(
                    key,
                    "deprecated"
                    + (f"; use zero_optimization.{new} instead" if new else "")
                    + (
                        ' (e.g. {"device": "cpu"})'
                        if new in ("offload_optimizer", "offload_param") and value
                        else ""
                    ),
                )
            )
    return out


RULES: tuple[Callable[[Ctx], list[Finding]], ...] = (
    rule_batch,
    rule_optimizer,
    rule_offload,
    rule_precision,
    rule_stage3_keys,
    rule_deprecated,
)


# ---------------------------------------------------------------- DeepSpeed's own validation


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed logs (and prints the accelerator choice) on import and on every config; the check's
    output is its findings only."""
    log = logging.getLogger("DeepSpeed")
    old = log.level
    log.setLevel(logging.CRITICAL)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            yield
        finally:
            log.setLevel(old)


def _import_deepspeed() -> None:
    if "deepspeed" in sys.modules:
        return
    # DS_ACCELERATOR is read once, at import; without CUDA pick CPU so check works on a laptop.
    if not os.environ.get("DS_ACCELERATOR"):
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with _quiet():
        import deepspeed  # noqa: F401
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)


class _Traced(dict):  # type: ignore[type-arg]
    """A dict that records which keys DeepSpeed asks for (get, [], `in`, `in d.keys()`). Iterating
    is not a read (copy.copy and logging iterate everything), but defining __iter__ at all sends
    `**d` down CPython's slow merge path (keys() + __getitem__), so a section unpacked into a
    pydantic model counts as read; pydantic judges its keys itself (extra="forbid")."""

    reads: set[str]
    path: str

    def __getitem__(self, k: Any) -> Any:
        self.reads.add(f"{self.path}{k}")
        return super().__getitem__(k)

    def get(self, k: Any, default: Any = None) -> Any:
        self.reads.add(f"{self.path}{k}")
        return super().get(k, default)

    def __contains__(self, k: Any) -> bool:
        self.reads.add(f"{self.path}{k}")
        return super().__contains__(k)

    def keys(self) -> Any:
        return KeysView(self)  # membership goes through __contains__

    def __iter__(self) -> Iterator[Any]:
        return super().__iter__()


def _traced(obj: Any, reads: set[str], path: str = "") -> Any:
    if not isinstance(obj, dict):
        return obj
    d = _Traced({k: _traced(v, reads, f"{path}{k}.") for k, v in obj.items()})
    d.reads, d.path = reads, path
    return d


def _ds_parse(cfg: dict[str, Any]) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    with _quiet():
        DeepSpeedConfig(cfg)


def _pydantic_findings(e: Exception, prefix: str) -> list[Finding] | None:
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - deepspeed depends on pydantic
        return None
    if not isinstance(e, ValidationError):
        return None
    out = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        key = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            name = str(err["loc"][-1])
            if name in _known_top_level():
                msg = f"'{name}' is a top-level DeepSpeed section, not part of {prefix}; move it to the top level"
            else:
                msg = f"DeepSpeed does not accept this key here ({msg})"
        else:
            msg = f"{msg} (got {err.get('input')!r})" if "input" in err and err["loc"] else msg
        out.append(_err(key, msg))
    return out


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _ds_findings(cfg: dict[str, Any]) -> tuple[list[Finding], dict[str, Any]]:
    """Run DeepSpeedConfig until it accepts; each time it raises, find the top-level key responsible by
    removing keys one at a time (DeepSpeedConfig takes ~2 ms), report it, drop it and go on."""
    cfg = dict(cfg)
    out: list[Finding] = []
    for _ in range(len(cfg) + 1):
        try:
            _ds_parse(cfg)
            return out, cfg
        except Exception as e:  # DeepSpeed raises AssertionError, ValueError, pydantic, its own errors
            culprit = None
            for k in cfg:
                try:
                    _ds_parse({kk: v for kk, v in cfg.items() if kk != k})
                except Exception as e2:
                    if type(e2) is type(e) and str(e2) == str(e):
                        continue
                culprit = k
                break
            if culprit is None:
                key = "train_batch_size" if "batch" in str(e).lower() else "(config)"
                out.append(_err(key, f"DeepSpeed refuses the config: {_one_line(e)}"))
                return out, {}
            out += _pydantic_findings(e, culprit) or [_err(culprit, f"DeepSpeed refuses it: {_one_line(e)}")]
            del cfg[culprit]
    return out, {}


def _unread_findings(cfg: dict[str, Any]) -> list[Finding]:
    """Keys DeepSpeed never reads: silently ignored, usually a typo or another tool's key."""
    reads: set[str] = set()
    try:
        _ds_parse(_traced(cfg, reads))
    except Exception:
        return []
    known = _known_top_level()
    out = []
    for k in cfg:
        if k not in reads and k not in _READ_ELSEWHERE:
            near = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else "; remove it"
            out.append(_warn(k, f"DeepSpeed never reads this top-level key, it is silently ignored{hint}"))
    # Nested sections DeepSpeed reads key by key (aio, activation_checkpointing, ...): flag keys it skipped.
    # A section none of whose keys is read (optimizer.params) is handed on whole and not judged here.
    for k, v in cfg.items():
        if not isinstance(v, dict) or not any(r.startswith(f"{k}.") for r in reads):
            continue
        read_here = {r[len(k) + 1 :] for r in reads if r.startswith(f"{k}.") and "." not in r[len(k) + 1 :]}
        for sub in v:
            if sub not in read_here:
                near = difflib.get_close_matches(sub, sorted(read_here), n=1, cutoff=0.5)
                hint = (
                    f"; did you mean '{near[0]}'?" if near else f"; it reads {', '.join(sorted(read_here))}"
                )
                out.append(
                    _warn(f"{k}.{sub}", f"DeepSpeed never reads this key, it is silently ignored{hint}")
                )
    return out


# Top-level keys read outside DeepSpeedConfig.__init__ (so the trace cannot see them) or only on
# paths the trace does not take.
_READ_ELSEWHERE = {
    "sequence_parallel_size",  # DeepSpeedConfig reads it only when torch.distributed is initialized
    "zero_allow_untested_optimizer",  # read by get_* helpers; listed so a trace change cannot flag it
    "zero_force_ds_cpu_optimizer",
}


@functools.cache
def _known_top_level() -> frozenset[str]:
    """Top-level keys DeepSpeed knows, traced from DeepSpeedConfig itself: every get_* helper and
    sub-config asks for its key even when absent, so one parse of a minimal config lists them all
    (deepspeed/runtime/constants.py also holds nested names like "enabled", "type", "sum", so it is
    no good as a top-level list). Plus the hand list of keys read elsewhere."""
    reads: set[str] = set()
    with contextlib.suppress(Exception):
        _ds_parse(_traced({"train_micro_batch_size_per_gpu": 1}, reads))
    return frozenset({r for r in reads if "." not in r} | _READ_ELSEWHERE)


# ---------------------------------------------------------------- "auto" resolution

_RESOLVE_LINE = re.compile(r"^\s*([\w.\-]+)=")


def _resolve(ds: dict[str, Any], values: dc.AutoValues) -> tuple[list[Finding], dict[str, Any]]:
    """resolve() raises once with every bad key; report each, drop them and resolve the rest so that
    DeepSpeed still validates everything else."""
    out: list[Finding] = []
    cur = ds
    for _ in range(3):
        try:
            return out, dc.resolve(cur, values)
        except dc.ConfigError as e:
            bad = []
            for line in str(e).splitlines()[1:]:
                m = _RESOLVE_LINE.match(line)
                if m:
                    bad.append(m.group(1))
                    msg = line.strip()[len(m.group(1)) + 1 :]
                    out.append(
                        _err(m.group(1), msg if "auto" in msg and "fill" in msg else f"{m.group(1)}={msg}")
                    )
            if not bad:
                out.append(_err("(config)", str(e).splitlines()[0]))
                return out, {}
            cur = _drop(cur, bad)
    return out, {}


def _drop(ds: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    import copy

    out = copy.deepcopy(ds)
    for key in keys:
        *parents, last = key.split(".")
        node: Any = out
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    return out


# ---------------------------------------------------------------- public API


def check_config(
    ds: dict[str, Any],
    world_size: int = 1,
    optimizer: str | None = None,
    path: str = "trainer",
    micro_batch: int | None = None,
    grad_accum: int | None = None,
) -> list[Finding]:
    """Every problem the toolkit can see before launch; errors first. Empty list: it will run."""
    _import_deepspeed()
    b = _batch(ds, world_size, micro_batch, grad_accum)
    precision = dc.precision_of(ds) or "fp32"

    # Placeholders for what the training config owns. Where the file is explicit, use its value: check
    # cannot know the real lr, so an explicit one must not "disagree" with a made-up placeholder.
    def given(key: str, default: Any) -> Any:
        present, v = dc._get(ds, key)
        ok = present and v != dc.AUTO and not isinstance(v, (bool, dict, str))
        return tuple(v) if ok and isinstance(v, list) else v if ok else default

    values = dc.AutoValues(
        micro_batch=b.micro,
        grad_accum=b.accum,
        world_size=world_size,
        precision=precision if precision in ("bf16", "fp16") else "fp32",  # type: ignore[arg-type]
        grad_clip=given("gradient_clipping", 1.0),
        lr=given("optimizer.params.lr", 1e-4),
        betas=given("optimizer.params.betas", (0.9, 0.999)),
        eps=given("optimizer.params.eps", 1e-8),
        weight_decay=given("optimizer.params.weight_decay", 0.0),
        hidden_size=1024,
        total_steps=1000,
    )
    resolve_findings, resolved = _resolve(ds, values)
    # precision "mismatches" from resolve can only mean both enabled: rule_precision says it better
    resolve_findings = [f for f in resolve_findings if not f.key.startswith(("fp16.", "bf16."))]

    ctx = Ctx(ds, resolved, world_size, optimizer, path, micro_batch, grad_accum)
    rule_findings = [f for rule in RULES for f in rule(ctx)]

    ds_findings: list[Finding] = []
    if resolved:
        for_ds = dict(resolved)
        # DeepSpeedConfig sees world size 1; the batch arithmetic at the real size is rule_batch's job.
        if all(
            _num(for_ds.get(k)) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        ):
            for_ds.pop("train_batch_size", None)
        ds_findings, accepted = _ds_findings(for_ds)
        if accepted:
            ds_findings += _unread_findings(accepted)

    # One finding per problem: the rules' wording wins over resolve's, resolve's over DeepSpeed's raw text.
    rule_errs = [f.key for f in rule_findings if f.level == "error"]

    def covered(key: str) -> bool:
        precision = ("fp16", "bf16", "bfloat16")
        return any(
            k == key
            or k.startswith(key + ".")
            or (k.split(".")[0] in precision and key.split(".")[0] in precision)
            for k in rule_errs
        )

    out: list[Finding] = []
    seen: set[tuple[str, str]] = set()
    for f in (*rule_findings, *resolve_findings, *(f for f in ds_findings if not covered(f.key))):
        if (f.level, f.key) not in seen:
            seen.add((f.level, f.key))
            out.append(f)
    return sorted(out, key=lambda f: f.level != "error")


def check_file(
    file: str | Path,
    world_size: int = 1,
    optimizer: str | None = None,
    path: str = "trainer",
    micro_batch: int | None = None,
    grad_accum: int | None = None,
) -> list[Finding]:
    """Load as DeepSpeed does (hjson, duplicate keys refused) and check; ConfigError if unreadable."""
    return check_config(dc.load_ds_config(file), world_size, optimizer, path, micro_batch, grad_accum)


def run_check(args: argparse.Namespace) -> int:
    try:
        findings = check_file(
            args.file, args.world_size, args.optimizer, args.path, args.micro_batch, args.grad_accum
        )
    except dc.ConfigError as e:
        if args.json:
            print(json.dumps([{"level": "error", "key": "(file)", "message": str(e)}]))
        else:
            print(f"error: {e}", file=sys.stderr)
        return 1
    errors = sum(f.level == "error" for f in findings)
    warnings = len(findings) - errors
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            print(f)
        s = "" if warnings == 1 else "s"
        if errors:
            print(
                f"{args.file} will not run: {errors} error{'' if errors == 1 else 's'}, {warnings} warning{s}",
                file=sys.stderr,
            )
        else:
            print(f"ok: {args.file} will run ({warnings} warning{s})", file=sys.stderr)
    return 1 if errors else 0
