"""A checkpoint held to its model before loading (toolkit/runtime/faults/load_report.py): a tensor removed, one of
the wrong shape, one that belongs to no module, each stop in one line; tied weights, a new score head and
model.new_weights pass and are said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.runtime.faults import load_report

DROPPED = "model.layers.1.mlp.down_proj.weight"  # issue 81's tensor


def _tiny(out: Path, tie: bool = False) -> tuple[object, object]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    mc = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, tie_word_embeddings=tie)
    AutoModelForCausalLM.from_config(mc).save_pretrained(out)
    return AutoModelForCausalLM, mc


def _rewrite(out: Path, edit) -> None:
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _check(out: Path, auto, mc, task: str = "causal_lm", new: list[str] | None = None) -> load_report.LoadReport:
    return load_report.check(out, auto, mc, {"dtype": torch.float32}, task, new or [])


def test_a_complete_checkpoint_passes_and_says_so(tmp_path: Path) -> None:
    auto, mc = _tiny(tmp_path)
    report = _check(tmp_path, auto, mc)
    assert report.error(str(tmp_path)) is None and report.checked == "index"
    assert report.line().startswith(f"checkpoint: {report.tensors} tensors matched the model by name, shape and dtype "
                                    "(checked in ")


@pytest.mark.parametrize("fault", ["removed", "shape", "stray"])
def test_a_wrong_checkpoint_stops_in_one_line_naming_the_keys(tmp_path: Path, fault: str) -> None:
    auto, mc = _tiny(tmp_path)
    if fault == "removed":
        _rewrite(tmp_path, lambda t: t.pop(DROPPED))
    elif fault == "shape":
        _rewrite(tmp_path, lambda t: t.update({DROPPED: torch.zeros(16, 8)}))
    else:
        _rewrite(tmp_path, lambda t: t.update({"model.layers.1.mlp.extra.weight": torch.zeros(2, 2)}))
    line = _check(tmp_path, auto, mc).error("DIR")
    assert line is not None and "\n" not in line and line.startswith("model.name=DIR: the checkpoint does not match")
    want = {"removed": f"1 tensor(s) missing from the checkpoint (they would train from random init): {DROPPED}",
            "shape": f"1 tensor(s) of another shape: {DROPPED}: checkpoint [16, 8], model [16, 32]",
            "stray": "1 tensor(s) in the checkpoint but in no module of the model: model.layers.1.mlp.extra.weight"}
    assert want[fault] in line, line


def test_many_keys_are_counted_past_the_first_few(tmp_path: Path) -> None:
    auto, mc = _tiny(tmp_path)
    _rewrite(tmp_path, lambda t: [t.pop(k) for k in [k for k in t if ".layers.1." in k]])
    line = _check(tmp_path, auto, mc).error("DIR")
    assert "9 tensor(s) missing" in line and "and 4 more" in line, line


def test_new_weights_on_purpose_pass_and_are_said(tmp_path: Path) -> None:
    auto, mc = _tiny(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop(DROPPED))
    report = _check(tmp_path, auto, mc, new=["model.layers.1.mlp.*"])
    assert report.error("DIR") is None and report.allowed == [DROPPED]
    assert "1 new on purpose (model.new_weights)" in report.line()


def test_tied_weights_and_a_new_score_head_are_expected(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    auto, mc = _tiny(tmp_path / "tied", tie=True)
    report = _check(tmp_path / "tied", auto, mc)
    assert report.error("DIR") is None, report
    # a reward model from a causal LM's directory: its score head is new, the LM head unused
    _, mc = _tiny(tmp_path / "lm")
    mc.num_labels = 1
    report = _check(tmp_path / "lm", AutoModelForSequenceClassification, mc, task="seq_cls")
    assert report.error("DIR") is None, report
    assert report.expected == {"score.weight": "new head: model.task=seq_cls starts its score head from new weights",
                               "lm_head.weight": "unused head: the causal LM's head, which a seq_cls model does not "
                                                 "have"}
    assert json.loads(json.dumps(report.to_dict()))["expected"] == report.expected


def test_without_safetensors_transformers_report_is_what_is_checked(tmp_path: Path) -> None:
    auto, mc = _tiny(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    report = _check(tmp_path, auto, mc)
    assert report.checked == "transformers" and report.error("DIR") is None
    load_report.after_load(report, {"missing_keys": {DROPPED}, "unexpected_keys": set(), "mismatched_keys": set()}, [])
    assert report.missing == [DROPPED] and "1 tensor(s) missing" in report.error("DIR")
