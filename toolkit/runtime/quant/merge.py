"""`toolkit merge-adapter`: a trained LoRA adapter merged into a float base, written as one HF model directory.

A separate step after training, on one process (no DeepSpeed, CPU is enough): PEFT's `merge_and_unload` on the
base the adapter was trained on. For a QLoRA run (model.load_in_4bit) the base can be taken two ways:
- `dequantized` (the default for a 4-bit run): the base's Linears rounded through the same 4-bit format the run
  trained against (quant type, double quantization) and back to floats. The merged model then computes what the
  trained 4-bit model did, up to float rounding, since the adapter learned to correct that base;
- `original`: the float weights as they are on disk. The adapter's update lands on weights it never saw; the
  quantization error is gone, and the merged model is not the trained one.
Why not merge into the 4-bit layers: PEFT cannot (it raises on bitsandbytes' 4-bit merge in several versions), and a
merged 4-bit model would have to be quantized again, which moves the adapter's update.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.runtime.faults import export_check
from toolkit.runtime.faults.checkpoint import ExportError

BASES = ("dequantized", "original")


def run_settings(adapter: Path) -> dict[str, Any]:
    """The training run's model settings beside its adapter (RUN_DIR/adapter, RUN_DIR/config.yaml), or {}."""
    cfg = adapter.parent / "config.yaml"
    if not cfg.is_file():
        return {}
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(OmegaConf.load(cfg)).get("model", {})
    return {"load_in_4bit": bool(model.get("load_in_4bit")), "quant_type": model.get("bnb_4bit_quant_type", "nf4")}


def dequantize_linears(model: Any, *, quant_type: str) -> int:
    """Round every Linear but the head through 4 bits and back (toolkit.runtime.quant.quantize_4bit's format), in
    place, in the model's own dtype; returns how many."""
    import bitsandbytes.functional as bf
    import torch

    from toolkit.runtime.quant import quantize_4bit

    dtype = next(model.parameters()).dtype
    n = quantize_4bit(model, dtype=torch.float32, quant_type=quant_type, device="cpu")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ != "Linear4bit":
                continue
            w = bf.dequantize_4bit(child.weight.data, child.weight.quant_state).to(dtype)
            plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                    device="meta", dtype=dtype)
            plain.weight = torch.nn.Parameter(w)
            if child.bias is not None:
                plain.bias = torch.nn.Parameter(child.bias.data.to(dtype))
            setattr(parent, name, plain)
    return n


def merge_adapter(adapter: Path, base: Path, out: Path, *, base_weights: str | None = None,
                  quant_type: str | None = None, dtype: str = "bf16") -> dict[str, Any]:
    """Merge `adapter` (a PEFT adapter directory, as a run's RUN_DIR/adapter) into the model at `base` (an HF
    directory with weights) and save it to `out`. base_weights: dequantized | original (default: dequantized for a
    4-bit run, original otherwise); quant_type: the 4-bit format (default: the run's, else nf4)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not (adapter / "adapter_config.json").is_file():
        raise ConfigError(f"{adapter} is not an adapter directory (no adapter_config.json): a LoRA run writes it to "
                          "RUN_DIR/adapter with train.export=true")
    from toolkit.hub import local_dir

    base = local_dir(str(base), what="--base") or base  # a hub id: its snapshot (toolkit/hub)
    if not base.is_dir() or (not any(base.glob("*.safetensors")) and not any(base.glob("*.bin"))):
        raise ConfigError(f"--base {base}: an HF model directory with weights (the one the run started from); a "
                          "preset built at random init has none to merge into")
    if dtype not in ("bf16", "fp32"):
        raise ConfigError(f"--dtype must be bf16 or fp32, got {dtype!r}")
    run = run_settings(adapter)
    four_bit = run.get("load_in_4bit", False)
    base_weights = base_weights or ("dequantized" if four_bit else "original")
    if base_weights not in BASES:
        raise ConfigError(f"--base-weights must be one of {', '.join(BASES)}, got {base_weights!r}")
    quant_type = quant_type or run.get("quant_type") or "nf4"
    if quant_type not in ("nf4", "fp4"):
        raise ConfigError(f"--quant-type must be nf4 or fp4, got {quant_type!r}")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rounded = dequantize_linears(model, quant_type=quant_type) if base_weights == "dequantized" else 0
    unmerged = PeftModel.from_pretrained(model, adapter)
    probe = export_check.merge_probe(unmerged.config.vocab_size)
    with torch.no_grad():  # what the merged files must compute: the base (as merged into) plus the adapter
        want = unmerged(**probe).logits
    merged = unmerged.merge_and_unload()
    merged = merged.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    expected, tied = export_check.expected_model(merged)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    del merged, unmerged, model
    error = export_check.check_merged(tmp, expected, tied, probe, want, dtype)
    if error:
        raise ExportError(error)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        for src in (adapter / f, base / f):
            if src.is_file():
                shutil.copy2(src, tmp / f)
                break
    record = {"adapter": str(adapter), "base": str(base), "base_weights": base_weights,
              "quant_type": quant_type if base_weights == "dequantized" else None, "rounded_linears": rounded,
              "dtype": dtype}
    (tmp / "merge.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return record
