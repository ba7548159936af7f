"""The rule table and the flow of `toolkit check` (see the package docstring): "auto" resolution,
DeepSpeed's parse, then RULES; `check_config`, `check_file`, `run_check`."""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from toolkit.config import ds_config as dc
from toolkit.config import optimizers as opt
from toolkit.config.checks.base import Ctx, Finding, _err, _num
from toolkit.config.checks.batch import _batch, rule_batch
from toolkit.config.checks.consumer import rule_consumer_auto
from toolkit.config.checks.deepspeed_parse import _ds_findings, _import_deepspeed, _unread_findings
from toolkit.config.checks.expert_parallel import rule_expert_parallel
from toolkit.config.checks.keys import rule_deprecated, rule_stage3_keys
from toolkit.config.checks.leaf import rule_leaf_threshold
from toolkit.config.checks.muon import rule_low_precision_states, rule_muon
from toolkit.config.checks.offload import rule_offload, rule_precision
from toolkit.config.checks.optimizer import rule_optimizer

# The one rule table: each rule sees the same Ctx; their findings come out in this order within a level.
RULES: tuple[Callable[[Ctx], list[Finding]], ...] = (
    rule_consumer_auto,
    rule_batch,
    rule_optimizer,
    rule_muon,
    rule_low_precision_states,
    rule_offload,
    rule_precision,
    rule_stage3_keys,
    rule_deprecated,
    rule_leaf_threshold,
    rule_expert_parallel,
)


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
    consumer: str = "trainer",
    micro_batch: int | None = None,
    grad_accum: int | None = None,
) -> list[Finding]:
    """Every problem the toolkit can see before launch for this consumer (ds_config.CONSUMERS: the
    toolkit's two paths, a plain HF Trainer script, accelerate, bare deepspeed.initialize); errors
    first. Empty list: it will run."""
    dc.check_consumers([consumer])
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
        grad_clip=given("gradient_clipping", opt.default_grad_clip(ds)),
        lr=given("optimizer.params.lr", 1e-4),
        betas=given("optimizer.params.betas", (0.9, 0.999)),
        eps=given("optimizer.params.eps", 1e-8),
        weight_decay=given("optimizer.params.weight_decay", 0.0),
        hidden_size=1024,
        total_steps=1000,
    )
    # Where accelerate's DeepSpeedPlugin fills "auto" (stage, offload devices) the run gets its value.
    filled = dict(ds)
    if consumer in ("hf-trainer", "accelerate"):
        filled = copy.deepcopy(ds)
        for key, value in dc.PLUGIN_DEFAULTS.items():
            if dc._get(ds, key) == (True, dc.AUTO):
                dc._set(filled, key, value)
    resolve_findings, resolved = _resolve(filled, values)
    # precision "mismatches" from resolve can only mean both enabled: rule_precision says it better
    resolve_findings = [f for f in resolve_findings if not f.key.startswith(("fp16.", "bf16."))]

    ctx = Ctx(ds, resolved, world_size, optimizer, consumer, micro_batch, grad_accum)
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
    consumer: str = "trainer",
    micro_batch: int | None = None,
    grad_accum: int | None = None,
) -> list[Finding]:
    """Load as DeepSpeed does (hjson, duplicate keys refused) and check; ConfigError if unreadable."""
    return check_config(dc.load_ds_config(file), world_size, optimizer, consumer, micro_batch, grad_accum)


def sequence_parallel_findings(ds: dict, sp: int, world: int, heads: tuple[int, int] | None,
                               seq_len: int | None) -> list[Finding]:
    """`toolkit check --sequence-parallel N`: the run's sequence-parallel rules; heads: (attention, key/value)."""
    from toolkit.config.checks.sequence import problems

    q, kv = heads or (None, None)
    return [Finding("error", "train.sequence_parallel", m)
            for m in problems(sp, world, dc.zero_stage(ds), q, kv, seq_len)]


def run_check(args: argparse.Namespace) -> int:
    try:
        findings = check_file(
            args.file, args.world_size, args.optimizer, args.consumer, args.micro_batch, args.grad_accum
        )
        if getattr(args, "sequence_parallel", 1) > 1:
            findings = sequence_parallel_findings(dc.load_ds_config(args.file), args.sequence_parallel,
                                                  args.world_size, getattr(args, "heads", None),
                                                  args.seq_len) + findings
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
