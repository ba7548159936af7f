"""The export check's parts (toolkit/runtime/faults/export_check.py) in one process; tests/dist/test_train.py runs
it at the end of real runs, and tests/unit/test_qlora.py through toolkit merge-adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.runtime.faults import export_check


def _tiny(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                         num_attention_heads=2, vocab_size=64,
                                                         tie_word_embeddings=True))
    model.save_pretrained(path)
    return model


def test_a_tied_head_saved_once_is_whole_and_a_dropped_tensor_is_named(tmp_path: Path) -> None:
    model = _tiny(tmp_path / "m")
    want, tied = export_check.expected_model(model)
    assert {"model.embed_tokens.weight", "lm_head.weight"} in tied
    report = export_check.ExportReport("model")
    export_check.compare(report, export_check.checkpoint_index(tmp_path / "m"), want, tied)
    assert report.error(tmp_path / "m") is None and report.tensors == len(want) - 1  # the head: saved as the embedding
    export_check.drop_tensor(tmp_path / "m", "model.norm.weight")
    report = export_check.ExportReport("model")
    export_check.compare(report, export_check.checkpoint_index(tmp_path / "m"), want, tied)
    assert report.missing == ["model.norm.weight"] and "1 tensor(s) of the trained model missing" in report.error(
        tmp_path / "m")


def test_the_reload_in_a_new_process_gives_the_models_logits(tmp_path: Path) -> None:
    """The path a run takes where Liger patched transformers' classes: plain transformers in a new process."""
    model = _tiny(tmp_path / "m")
    inputs = {"input_ids": torch.arange(24).view(2, 12)}
    with torch.no_grad():
        want = model(**inputs).logits
    got = export_check.fresh_reload(tmp_path / "m", "causal_lm", inputs)
    assert export_check.relative_diff(got, want) < 1e-5
    assert export_check.relative_diff(export_check.reload_here(tmp_path / "m", "causal_lm", inputs), want) < 1e-5


@pytest.mark.parametrize("reload", ["fresh_reload", "reload_here"])
def test_an_export_that_does_not_load_is_a_reload_error_in_one_line(tmp_path: Path, reload: str) -> None:
    _tiny(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"hidden_size": 48}))  # weights of 32
    with pytest.raises(export_check.ReloadError) as e:
        getattr(export_check, reload)(tmp_path / "m", "causal_lm", {"input_ids": torch.arange(8).view(1, 8)})
    assert "\n" not in str(e.value) and str(e.value)


def test_names_a_family_converts_while_saving_are_held_by_their_element_count() -> None:
    """transformers writes fused experts back per expert (the layout the checkpoint came in): the fused tensors are
    then missing by name, and whole by their elements; a tensor dropped among them is not."""
    want = {"experts.gate_up_proj": ([2, 8, 4], "F32"), "norm.weight": ([4], "F32")}
    files = {f"experts.{e}.{p}.weight": ([4, 4], "F32") for e in range(2) for p in ("gate_proj", "up_proj")}
    report = export_check.ExportReport("model")
    export_check.compare(report, files | {"norm.weight": ([4], "F32")}, want, converts=True)
    assert report.error(Path("export")) is None and report.converted == 4
    report = export_check.ExportReport("model")
    del files["experts.1.up_proj.weight"]
    export_check.compare(report, files | {"norm.weight": ([4], "F32")}, want, converts=True)
    assert report.missing == ["experts.gate_up_proj"] and len(report.unexpected) == 3
