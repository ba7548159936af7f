"""An export that loads: its tensors held to the trained model's, then reloaded in plain transformers (and PEFT)
and run on a fixed batch against the trained engine's logits, before the export is marked done.

A save can end with no error and a directory that does not hold the trained model: a tensor dropped because
transformers took it for a tied alias, a ZeRO-3 gather that missed a shard, names a loader does not know (a GRPO
checkpoint vLLM would not load, ms-swift #9172). So, on rank 0, once the files are written into `<dir>.tmp`:

- keys: every tensor the trained model holds is in the files (a tied group once), with its shape and dtype, and no
  other; for a LoRA adapter, its trainable tensors under PEFT's saved names. A mismatch names the first few and the
  count;
- logits (`train.check_export=auto`, the default, where the model fits the host's free memory; `full` always):
  the export is loaded on the CPU by transformers alone (a LoRA adapter by PEFT onto its base) and run on two rows
  of the run's data cut to PROBE_TOKENS tokens; its logits must equal the engine's, computed on the same rows just
  before the export, within the precision's noise (TOLERANCE).

A failed check stops with one line; the files stay in `<dir>.tmp`, which is never taken for a result. Not checked
by logits, and said so: a QLoRA adapter (its base is a 4-bit model, not a plain transformers one), float8 and
sequence-parallel runs (their forwards are not the plain model's).
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.runtime.faults.checkpoint import atomic_write
from toolkit.runtime.faults.load_report import checkpoint_index, converts_names, file_index

FAULT_ENV = "TOOLKIT_FAULT_EXPORT_DROP"  # tests: this tensor removed from the written files, before the check
PROBE_TOKENS = 64
# max |export - engine| / max |engine| on the probe's logits: fp32 agrees to float rounding; a 16-bit engine (its
# weights, or autocast) and the CPU reload of its 16-bit export differ by their kernels' rounding
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}
SHOWN = 5
MODES = ("auto", "full", "keys", "off")
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
           "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


@dataclass
class ExportReport:
    kind: str  # "model", "adapter" or "merged"
    tensors: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    logits: dict[str, Any] = field(default_factory=dict)  # {"max_rel_diff", "tolerance"} or {"skipped": why}
    converted: int = 0  # file tensors under names the family converts while saving (held by their element count)

    def error(self, where: Path) -> str | None:
        parts = [f"{len(keys)} tensor(s) {what}: {_names(keys)}" for what, keys in (
            ("of the trained model missing from the files", self.missing), ("in the files but not the model's",
                                                                             self.unexpected),
            ("of another shape", self.shapes), ("of another dtype", self.dtypes)) if keys]
        diff, tol = self.logits.get("max_rel_diff"), self.logits.get("tolerance")
        if "reload_error" in self.logits:
            parts.append(f"reloaded in plain transformers, it does not run: {self.logits['reload_error']}")
        elif diff is not None and not diff <= tol:
            parts.append(f"reloaded in plain transformers, its logits differ from the trained engine's by {diff:.3g} "
                         f"of their largest (tolerance {tol:g})")
        if not parts:
            return None
        return (f"train.export: the files written for {where} do not hold the trained model ({'; '.join(parts)}); "
                f"they are left in {where.with_name(where.name + '.tmp')}, not marked done")

    def line(self) -> str:
        how = (f"logits of the reload equal the engine's (max diff {self.logits['max_rel_diff']:.2g} of the largest, "
               f"tolerance {self.logits['tolerance']:g})" if "max_rel_diff" in self.logits
               else f"logits not compared: {self.logits.get('skipped', 'off')}")
        converted = (f" ({self.converted} under the names the family converts while saving, held by their element "
                     "count)" if self.converted else "")
        return f"export checked: {self.tensors} tensors by name, shape and dtype{converted}; {how}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "tensors": self.tensors, "missing": self.missing, "unexpected": self.unexpected,
                "shapes": self.shapes, "dtypes": self.dtypes, "converted": self.converted, "logits": self.logits}


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def _dtype(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    return _DTYPES.get(name, name)


# ----------------------------------------------------------------------------- what the files should hold


def expected_model(module: Any) -> tuple[dict[str, tuple[list[int], str]], list[set[str]]]:
    """name -> (shape, safetensors dtype) of the trained model's state (ZeRO-3 placeholders read by their full
    shape), and its tied groups (names of one tensor, saved once)."""
    shapes: dict[str, tuple[list[int], str]] = {}
    groups: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shapes[name] = (list(getattr(p, "ds_shape", p.shape)), _dtype(p))
        groups.setdefault(id(p), set()).add(name)
    state = set(module.state_dict().keys())  # persistent buffers only
    shapes |= {n: (list(b.shape), _dtype(b)) for n, b in module.named_buffers() if n in state}
    return shapes, [g for g in groups.values() if len(g) > 1]


def expected_adapter(module: Any) -> dict[str, tuple[list[int], str]]:
    """The trainable tensors of a PEFT model under the names PEFT saves them by (the adapter's name taken out:
    `lora_A.default.weight` -> `lora_A.weight`, `score.modules_to_save.default.weight` -> `score.weight`)."""
    adapter = re.escape(getattr(module, "active_adapter", "default") or "default")
    strip = re.compile(rf"\.modules_to_save\.{adapter}\.|\.{adapter}\.")
    return {strip.sub(".", n): (list(getattr(p, "ds_shape", p.shape)), _dtype(p))
            for n, p in module.named_parameters() if p.requires_grad}


def compare(report: ExportReport, files: dict[str, tuple[list[int], str]], want: dict[str, tuple[list[int], str]],
            tied: list[set[str]] = (), converts: bool = False) -> None:
    """Fill the report's key, shape and dtype lists: `files` (the written index) against `want`. converts: the
    family's names are converted while saving (transformers writes fused experts back per expert, the layout the
    checkpoint came in): the tensors that differ by name must then hold as many elements on each side."""
    import math

    report.tensors = len(files)
    aliases = {n for g in tied if g & set(files) for n in g}  # a tied group is whole if one of its names is saved
    report.missing = sorted(n for n in set(want) - set(files) if n not in aliases)
    report.unexpected = sorted(set(files) - set(want))
    if converts and report.missing and report.unexpected:
        held = sum(math.prod(want[n][0]) for n in report.missing)
        written = sum(math.prod(files[n][0]) for n in report.unexpected)
        if held == written:  # the converted tensors, all there; the logits of the reload are the proof
            report.converted = len(report.unexpected)
            report.missing, report.unexpected = [], []
    for name in sorted(set(files) & set(want)):
        (shape, dtype), (want_shape, want_dtype) = files[name], want[name]
        if list(shape) != want_shape:
            report.shapes.append(f"{name}: files {list(shape)}, model {want_shape}")
        elif dtype != want_dtype:
            report.dtypes.append(f"{name}: files {dtype}, model {want_dtype}")


def adapter_index(path: Path) -> dict[str, tuple[list[int], str]]:
    """A PEFT adapter directory's tensors, from its safetensors header."""
    return file_index(path / "adapter_model.safetensors")


# ----------------------------------------------------------------------------- the logits of the reload


def probe_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The collated rows, labels dropped, cut to PROBE_TOKENS tokens (a CPU forward of the whole model)."""
    return {k: v[:, :PROBE_TOKENS] for k, v in batch.items() if k != "labels" and v.dim() == 2}


def relative_diff(logits: Any, reference: Any) -> float:
    ref = reference.float()
    return float((logits.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def fits_in_memory(need: int) -> tuple[bool, str]:
    """Whether `need` bytes (the reload: the export, or an adapter's base, in the dtype it is saved in) take at most
    half the host's free memory; with the line that says why not."""
    import psutil

    free = psutil.virtual_memory().available
    return need <= free / 2, f"the model ({need / 2**30:.1f} GiB) is over half the host's free memory " \
                             f"({free / 2**30:.1f} GiB); train.check_export=full compares it anyway"


def reload_logits(path: Path, auto: Any, inputs: dict[str, Any], base: Any = None) -> Any:
    """The export's logits in a plain CPU model: `auto.from_pretrained(path)`, or PEFT's adapter at `path` onto
    `base` (a callable that builds the plain base model)."""
    import torch

    from toolkit.runtime.quant import without_zero_init

    with without_zero_init(True), torch.no_grad():  # one process: no ZeRO-3 partitioning of the reload
        if base is None:
            # in the dtype it was saved in: a bf16 export is read without a copy (safetensors maps it), at half
            # the host memory of fp32, and computes in bf16 as the engine did
            model = auto.from_pretrained(path, dtype="auto", device_map="cpu")
        else:
            from peft import PeftModel

            model = PeftModel.from_pretrained(base(), path)
        model.eval()
        return model(**inputs).logits


def drop_tensor(path: Path, name: str) -> bool:
    """The fault the check is for: `name` removed from the written safetensors files (tests)."""
    from safetensors.torch import load_file, save_file

    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        if name in tensors:
            del tensors[name]
            save_file(tensors, str(file), metadata={"format": "pt"})
            return True
    return False


def inject(path: Path) -> None:
    pattern = os.environ.get(FAULT_ENV)
    if not pattern:
        return
    index = checkpoint_index(path) or adapter_index(path)
    for name in sorted(index):
        if fnmatch.fnmatchcase(name, pattern):
            drop_tensor(path, name)
            return


# ----------------------------------------------------------------------------- the run's check


def skipped_why(cfg: Any, fp8: bool) -> str | None:
    """Why the logits are not compared for this run, or None."""
    if cfg.train.check_export in ("keys", "off"):
        return f"train.check_export={cfg.train.check_export}"
    if cfg.lora.enabled and cfg.model.load_in_4bit:
        return "a QLoRA adapter's base is a 4-bit model, not a plain transformers one (toolkit merge-adapter checks " \
               "its merge)"
    if fp8:
        return "the engine computed in float8"
    if cfg.train.sequence_parallel > 1:
        return "the engine's forward is sharded over the sequence (train.sequence_parallel)"
    return None


def prepare(cfg: Any, engine: Any, batch: dict[str, Any], fp8: bool, precision: str, patched: bool,
            ) -> Callable[[Path], str | None] | None:
    """Every rank, before the export: the engine's logits on the probe (a collective under ZeRO-3), and rank 0's
    check of the written files (None with train.check_export=off). patched: this process patched transformers'
    classes (Liger's kernels), so the reload runs in a new process."""
    import time

    import torch

    from toolkit.launch import dist
    from toolkit.runtime.speed import compile as compiling

    if cfg.train.check_export == "off":
        return None
    why = skipped_why(cfg, fp8)
    reference, inputs = None, probe_inputs(batch)
    t0 = time.perf_counter()
    if why is None:
        engine.eval()
        with torch.no_grad(), compiling.eager():
            out = engine(**{k: v.to(dist.device()) for k, v in inputs.items()})
        engine.train()
        logits = getattr(out, "logits", None)
        reference = logits.float().cpu() if logits is not None else None
        why = None if reference is not None else "the engine's forward returns no logits"
    probe_s = time.perf_counter() - t0
    module = engine.module
    adapter = cfg.lora.enabled
    want, tied = (expected_adapter(module), []) if adapter else expected_model(module)
    converts = not adapter and converts_names(module)
    # what the reload holds: the whole model, 16-bit unless the run trained in fp32
    size = sum(getattr(q, "ds_numel", q.numel()) for q in module.parameters()) * (4 if precision == "fp32" else 2)

    def verify(tmp: Path) -> str | None:
        t0 = time.perf_counter()
        report = ExportReport("adapter" if adapter else "model")
        inject(tmp)
        files = adapter_index(tmp) if adapter else (checkpoint_index(tmp) or {})
        compare(report, files, want, tied, converts)
        if why is not None:
            report.logits = {"skipped": why}
        elif not report.error(tmp.with_suffix("")):
            fits, over = fits_in_memory(size)
            if cfg.train.check_export == "auto" and not fits:
                report.logits = {"skipped": over}
            else:
                report.logits = _compare_logits(cfg, tmp, inputs, reference, precision, patched)
        report.logits["seconds"] = round(time.perf_counter() - t0, 2)  # the files' check and the reload
        report.logits["engine_probe_s"] = round(probe_s, 3)  # the engine's forward on the probe, before the export
        import json

        out = tmp.with_suffix("")
        atomic_write(tmp / "export_check.json", json.dumps(report.to_dict(), indent=1) + "\n")
        error = report.error(out)
        if error is None:
            print(report.line(), flush=True)
        return error

    return verify


def _compare_logits(cfg: Any, tmp: Path, inputs: dict[str, Any], reference: Any, precision: str, patched: bool
                    ) -> dict[str, Any]:
    tolerance = TOLERANCE.get(precision, 1e-4)
    if cfg.lora.enabled and precision != "fp32":
        tolerance = TOLERANCE["bf16"]  # a 16-bit base under the adapters (autocast or DeepSpeed's bf16)
    run_config = tmp.parent / "config.yaml" if cfg.lora.enabled else None  # the run's, written at its start
    try:
        # in this process where its transformers is plain (no Liger): the import and start of a new one cost
        # seconds
        logits = (fresh_reload if patched else reload_here)(tmp, cfg.model.task, inputs, run_config)
    except ReloadError as e:  # an export that does not load is what the check is for
        return {"max_rel_diff": float("inf"), "tolerance": tolerance, "reload_error": str(e)[:300]}
    if logits.shape != reference.shape:
        return {"max_rel_diff": float("inf"), "tolerance": tolerance,
                "reload_error": f"logits of shape {list(logits.shape)}, the engine's {list(reference.shape)}"}
    return {"max_rel_diff": relative_diff(logits, reference), "tolerance": tolerance,
            "probe": f"{reference.shape[0]} rows x {inputs['input_ids'].shape[1]} tokens"}


class ReloadError(Exception):
    """The export did not load or run in plain transformers: the reload's last line."""


def fresh_reload(path: Path, task: str, inputs: dict[str, Any], run_config: Path | None = None) -> Any:
    """The export's logits from a new Python process on the CPU: plain transformers (and PEFT), none of what this
    run patched into its classes (Liger's kernels replace transformers' norms and activations class-wide, and
    run on the GPU only). run_config: an adapter's run, whose base the adapter goes onto."""
    import subprocess
    import sys
    import tempfile

    import torch

    with tempfile.TemporaryDirectory(prefix="export-check-") as work:
        torch.save(inputs, f"{work}/inputs.pt")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                                 "MASTER_ADDR", "MASTER_PORT", FAULT_ENV)}
        cmd = [sys.executable, "-m", "toolkit.runtime.faults.export_check", str(path), "--task", task, "--inputs",
               f"{work}/inputs.pt", "--out", f"{work}/logits.pt", *(["--run-config", str(run_config)] if run_config
                                                                      else [])]
        # offline: a hub id base is in the cache already (the run resolved it), and the check sends no request
        out = subprocess.run(cmd, env=env | {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}, capture_output=True,
                             text=True)
        if out.returncode != 0:
            last = [x for x in out.stderr.splitlines() if x.strip()]
            raise ReloadError(last[-1] if last else f"exit code {out.returncode}")
        return torch.load(f"{work}/logits.pt")


def _auto(task: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if task == "seq_cls" else AutoModelForCausalLM


def _base(auto: Any, run_config: Path | None) -> Callable[[], Any] | None:
    """For an adapter: what builds the base it trained on (its directory, or the preset's seeded random init)."""
    if run_config is None:
        return None

    def base() -> Any:
        import torch

        from toolkit.config.schema import load_config
        from toolkit.runtime.model import _random_init, is_preset, model_config

        cfg = load_config(str(run_config), ["lora.enabled=false"])
        mc = model_config(cfg)
        if is_preset(cfg.model.name):
            return _random_init(auto, mc, cfg.train.seed, {"dtype": torch.float32})
        return auto.from_pretrained(cfg.model.name, config=mc, dtype="auto", local_files_only=True)

    return base


def reload_here(path: Path, task: str, inputs: dict[str, Any], run_config: Path | None = None) -> Any:
    """fresh_reload's work in this process (whose transformers classes nothing patched)."""
    auto = _auto(task)
    try:
        return reload_logits(path, auto, inputs, _base(auto, run_config))
    except Exception as e:  # any failure to load or run is the finding
        raise ReloadError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _reload_main(argv: list[str] | None = None) -> int:
    """python -m toolkit.runtime.faults.export_check EXPORT --task T --inputs IN --out OUT [--run-config YAML]"""
    import argparse

    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("path", type=Path)
    ap.add_argument("--task", default="causal_lm")
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--run-config", type=Path, help="an adapter's run config: its base is rebuilt from it")
    args = ap.parse_args(argv)
    auto = _auto(args.task)
    torch.save(reload_logits(args.path, auto, torch.load(args.inputs), _base(auto, args.run_config)), args.out)
    return 0


# ----------------------------------------------------------------------------- toolkit merge-adapter


def merge_probe(vocab_size: int) -> dict[str, Any]:
    """Two fixed rows of token ids for the merged model's check."""
    import torch

    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, vocab_size, (2, 32), generator=g)}


def check_merged(tmp: Path, expected: dict[str, tuple[list[int], str]], tied: list[set[str]], probe: dict[str, Any],
                 want: Any, dtype: str) -> str | None:
    """The merged files (in `tmp`) against the merged model's tensors, then reloaded in plain transformers against
    the unmerged base + adapter's logits; the line of what differs, or None (export_check.json written either way)."""
    import json

    from transformers import AutoModelForCausalLM

    report = ExportReport("merged")
    inject(tmp)
    compare(report, checkpoint_index(tmp) or {}, expected, tied)
    if not report.error(tmp.with_suffix("")):
        tolerance = TOLERANCE[dtype]
        try:
            got = reload_logits(tmp, AutoModelForCausalLM, probe)
            report.logits = {"max_rel_diff": relative_diff(got, want), "tolerance": tolerance, "probe": "2 rows x 32"}
        except Exception as e:  # a merge that does not load is what the check is for
            report.logits = {"max_rel_diff": float("inf"), "tolerance": tolerance,
                             "reload_error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    (tmp / "export_check.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    error = report.error(tmp.with_suffix(""))
    return error.replace("train.export:", "toolkit merge-adapter:", 1) if error else None


if __name__ == "__main__":
    raise SystemExit(_reload_main())
