"""What a checkpoint holds against what the model expects, before a weight is read: a wrong load stops the run.

transformers fills any tensor a checkpoint lacks from random init, prints "MISSING: those params were newly
initialized" among the console's other lines, and goes on; under ZeRO-3 it does not even look for unexpected keys
or other shapes (`_load_pretrained_model`'s ZeRO-3 branch: "we assume only best-case scenario with deepspeed, i.e.
perfectly matching checkpoints"). A run then trains that layer from random init without an error (issue 81; Gemma
4 under ZeRO-3 LoRA, ms-swift #9078, loss near 30). So the toolkit reads the checkpoint's own index (each
safetensors file's header: names, shapes and dtypes, no tensor data) and the model's expected tensors (the same
class built on the meta device), once, on every rank alike, at every stage, on both paths, QLoRA too:

- a parameter the checkpoint lacks, a tensor that belongs to no module, a shape that differs, or a float tensor
  where the model holds an integer one (or the reverse) stops the run before it loads, in one line naming the first
  few keys and their count;
- what is expected is said and kept in the report, not stopped on: tied weights (saved once), buffers the family
  builds itself, the patterns the class ignores (`_keys_to_ignore_on_load_*`), and, for `model.task=seq_cls`, a new
  score head beside a causal LM's unused one;
- `model.new_weights` (fnmatch patterns) names keys a user trains from new weights on purpose.

Checkpoints whose names transformers converts while loading (legacy layouts, fused experts) cannot be held to the
index by name: there the report says so, and transformers' own report after the load (missing keys at every stage)
is what is checked.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHOWN = 5  # keys named in the one line; the count says the rest


@dataclass
class LoadReport:
    checked: str  # how: "index" (names, shapes, dtypes) or "transformers" (names converted while loading)
    tensors: int = 0  # checkpoint tensors read from the index
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)  # "key: checkpoint [a, b], model [c, d]"
    dtypes: list[str] = field(default_factory=list)
    expected: dict[str, str] = field(default_factory=dict)  # key -> why it is not an error
    allowed: list[str] = field(default_factory=list)  # keys model.new_weights lets train from new weights
    seconds: float = 0.0  # the check's own time (headers read, the model built on the meta device)

    def error(self, where: str) -> str | None:
        """One line naming what is wrong, or None."""
        parts = []
        for what, keys in (("missing from the checkpoint (they would train from random init)", self.missing),
                           ("in the checkpoint but in no module of the model", self.unexpected),
                           ("of another shape", self.shapes), ("of another kind of dtype", self.dtypes)):
            if keys:
                more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
                parts.append(f"{len(keys)} tensor(s) {what}: {', '.join(keys[:SHOWN])}{more}")
        if not parts:
            return None
        return (f"model.name={where}: the checkpoint does not match the model ({'; '.join(parts)}). Point model.name "
                "at the complete checkpoint; or, to train such weights from new init on purpose, list them in "
                "model.new_weights (fnmatch patterns, e.g. ['score.*'])")

    def line(self) -> str:
        """The console's line for a load that passed."""
        how = (f"{self.tensors} tensors matched the model by name, shape and dtype" if self.checked == "index"
               else "names converted by transformers while loading: its report checked")
        extra = [f"{len(self.expected)} expected ({_kinds(self.expected)})"] if self.expected else []
        if self.allowed:
            extra.append(f"{len(self.allowed)} new on purpose (model.new_weights): {', '.join(self.allowed[:SHOWN])}")
        return f"checkpoint: {how}" + (f"; {'; '.join(extra)}" if extra else "") + f" (checked in {self.seconds:.2f} s)"

    def to_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "tensors": self.tensors, "missing": self.missing,
                "unexpected": self.unexpected, "shapes": self.shapes, "dtypes": self.dtypes,
                "expected": self.expected, "new_weights": self.allowed, "seconds": round(self.seconds, 3)}


def _kinds(expected: dict[str, str]) -> str:
    seen: dict[str, int] = {}
    for why in expected.values():
        kind = why.split(":", 1)[0]
        seen[kind] = seen.get(kind, 0) + 1
    return ", ".join(f"{k} {n}" if n > 1 else k for k, n in seen.items())


def checkpoint_index(path: Path) -> dict[str, tuple[list[int], str]] | None:
    """name -> (shape, safetensors dtype) of every tensor of a directory's safetensors checkpoint, from the files'
    headers alone; None without safetensors (`.bin` weights: transformers' report is what is checked)."""
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif single.is_file():
        files = [single.name]
    else:
        return None
    found: dict[str, tuple[list[int], str]] = {}
    for name in files:
        found |= file_index(path / name)
    return found


def file_index(file: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, safetensors dtype) of one safetensors file, from its header alone."""
    with file.open("rb") as f:  # the format: 8 bytes little-endian header size, then JSON
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: (v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def expected_tensors(auto: Any, mc: Any, kwargs: dict[str, Any]) -> tuple[dict[str, tuple[list[int], bool]],
                                                                       dict[str, str], Any]:
    """The model's tensors as a checkpoint holds them: name -> (shape, is floating), tied aliases -> the tensor they
    share, and the meta model itself (for its class's rules)."""
    import torch
    from transformers.initialization import no_init_weights

    from toolkit.runtime.quant import without_zero_init

    with without_zero_init(True), torch.device("meta"), no_init_weights():  # ZeRO-3's zero.Init would shard it
        model = auto.from_config(mc, **kwargs)
    model.tie_weights()
    kept = dict(model.named_parameters())
    by_id = {id(p): n for n, p in kept.items()}
    tied = {n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n not in kept}
    state = model.state_dict()
    tensors = {n: (list(p.shape), p.is_floating_point()) for n, p in kept.items()}
    tensors |= {n: (list(b.shape), b.is_floating_point()) for n, b in model.named_buffers() if n in state}
    return tensors, tied, model


def _floating(dtype: str) -> bool:
    return dtype.startswith(("F", "BF", "E"))  # F32, F16, BF16, F8_E4M3, E8M0 ...


def check(path: Path, auto: Any, mc: Any, kwargs: dict[str, Any], task: str, new_weights: list[str]) -> LoadReport:
    """Hold a directory's checkpoint to the model it is loaded into (see the module's docstring)."""
    import time

    t0 = time.perf_counter()
    report = _check(path, auto, mc, kwargs, task, new_weights)
    report.seconds = time.perf_counter() - t0
    return report


def _check(path: Path, auto: Any, mc: Any, kwargs: dict[str, Any], task: str, new_weights: list[str]) -> LoadReport:
    index = checkpoint_index(path)
    if index is None:
        return LoadReport("transformers")
    tensors, tied, model = expected_tensors(auto, mc, kwargs)
    buffers = {n for n, _ in model.named_buffers()}
    shared = set(index) & set(tensors)
    if len(shared) < 0.5 * len(tensors):  # another naming: transformers converts it while loading
        return LoadReport("transformers", tensors=len(index))
    report = LoadReport("index", tensors=len(index))
    ignore_missing = _patterns(getattr(model, "_keys_to_ignore_on_load_missing", None))
    ignore_unexpected = _patterns(getattr(model, "_keys_to_ignore_on_load_unexpected", None),
                                  r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")
    prefix = getattr(model, "base_model_prefix", "") or ""
    for name in sorted(set(tensors) - set(index)):
        if any(fnmatch.fnmatchcase(name, p) for p in new_weights):
            report.allowed.append(name)
        elif name in buffers:
            report.expected[name] = "buffer: the family builds it itself"
        elif any(a in index for a, k in tied.items() if k == name):
            report.expected[name] = "tied: saved under " + next(a for a, k in tied.items() if k == name and a in index)
        elif ignore_missing and ignore_missing.search(name):
            report.expected[name] = "ignored by the class: _keys_to_ignore_on_load_missing"
        elif task == "seq_cls" and prefix and not name.startswith(prefix + "."):
            report.expected[name] = "new head: model.task=seq_cls starts its score head from new weights"
        else:
            report.missing.append(name)
    for name in sorted(set(index) - set(tensors)):
        if name in tied:
            report.expected[name] = f"tied: the same tensor as {tied[name]}"
        elif ignore_unexpected and ignore_unexpected.search(name):
            report.expected[name] = "ignored by the class: _keys_to_ignore_on_load_unexpected"
        elif task == "seq_cls" and name.startswith("lm_head."):
            report.expected[name] = "unused head: the causal LM's head, which a seq_cls model does not have"
        else:
            report.unexpected.append(name)
    if (report.missing or report.unexpected) and converts_names(model):
        # names the family's own conversions may map (per-expert tensors fused into one, renamed layouts): held to
        # transformers' report after the load instead (a fused-experts MoE read from a per-expert checkpoint)
        return LoadReport("transformers", tensors=len(index))
    for name in sorted(shared):
        (ckpt_shape, ckpt_dtype), (shape, floating) = index[name], tensors[name]
        if list(ckpt_shape) != shape:
            report.shapes.append(f"{name}: checkpoint {list(ckpt_shape)}, model {shape}")
        elif _floating(ckpt_dtype) != floating:
            report.dtypes.append(f"{name}: checkpoint {ckpt_dtype}, model {'floating' if floating else 'integer'}")
    return report


def converts_names(model: Any) -> bool:
    """Whether transformers converts checkpoint names for this model while loading (its family's own weight
    conversions, not the legacy renames every model gets)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        return bool(get_model_conversion_mapping(model, add_legacy=False))
    except Exception:  # another transformers: assume it may, and let its report judge
        return True


def _patterns(found: Any, *more: str) -> re.Pattern[str] | None:
    pats = [*(found or ()), *more]
    return re.compile("|".join(f"({p})" for p in pats)) if pats else None


def after_load(report: LoadReport, info: dict[str, Any] | None, new_weights: list[str]) -> None:
    """Where the index could not be held by name: transformers' own report after the load (its missing keys, and
    below ZeRO-3 its unexpected and mismatched ones too) goes into the report."""
    if report.checked != "transformers" or not info:
        return
    for key in sorted(info.get("missing_keys") or ()):
        (report.allowed if any(fnmatch.fnmatchcase(key, p) for p in new_weights) else report.missing).append(key)
    report.unexpected += sorted(info.get("unexpected_keys") or ())
    report.shapes += [f"{k}: checkpoint {list(a)}, model {list(b)}" for k, a, b in sorted(info.get("mismatched_keys") or ())]
