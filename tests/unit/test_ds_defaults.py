"""DeepSpeed's quietly changed defaults in the resolved record (toolkit/config/ds_defaults.py), and the keys
DeepSpeed 0.19.8 removed: never written by gen-config, named by check (issue 81 item 5)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from toolkit.config import ds_config as dc
from toolkit.config import ds_defaults


def test_the_record_says_each_changed_default_as_the_run_gets_it() -> None:
    ds = dc.gen_config(2, offload_optimizer="cpu", precision="bf16")
    ds["bf16"] = {"enabled": True}  # check_grad_overflow left to DeepSpeed
    ds["gradient_clipping"] = 1.0
    found = ds_defaults.effective(ds, 1800)
    assert found["gradient_clipping"]["value"] == 1.0 and "#8068" in found["gradient_clipping"]["history"]
    assert found["process_group_timeout"] == {"value": 1800, "source": "train.collective_timeout_s",
                                              "history": ds_defaults.CHANGED[1].history}
    assert found["bf16.check_grad_overflow"] == {"value": True, "source": "DeepSpeed's default",
                                                 "history": ds_defaults.CHANGED[2].history}
    assert found["zero_optimization.offload_optimizer.pin_memory"]["value"] is True
    line = ds_defaults.describe(found)
    assert "process_group_timeout 1800 s (train.collective_timeout_s)" in line
    assert "bf16.check_grad_overflow True (DeepSpeed's default)" in line


def test_keys_that_do_not_apply_are_left_out() -> None:
    found = ds_defaults.effective(dc.gen_config(3, precision="fp32"), 600)
    assert set(found) == {"gradient_clipping", "process_group_timeout"}


REMOVED = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
           "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop")
REMOVED_ZERO = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")


def test_gen_config_never_writes_a_key_deepspeed_removed() -> None:
    """Every stage, offload, precision, optimizer and state dtype gen-config takes, through DeepSpeed 0.19.8's own
    rejection of removed keys (and the list above, the keys it rejects)."""
    from deepspeed.runtime.config import _reject_removed_config_keys

    made = 0
    for stage, off, prec, optim, states in itertools.product((0, 1, 2, 3), ("none", "cpu", "nvme"),
                                                              ("auto", "bf16", "fp16", "fp32"), ("adamw", "muon"),
                                                              ("fp32", "bf16")):
        try:
            ds = dc.gen_config(stage, offload_optimizer=off, offload_param=off if stage == 3 else "none",
                               precision=prec, optimizer=optim, optimizer_states=states)
        except dc.ConfigError:  # a combination gen-config refuses in one line
            continue
        made += 1
        _reject_removed_config_keys(ds)
        assert not set(ds) & set(REMOVED) and not set(ds.get("zero_optimization", {})) & set(REMOVED_ZERO)
    assert made > 50


@pytest.mark.parametrize("key", ["amp", "progressive_layer_drop", "zero_optimization.zeropp_loco_param"])
def test_check_names_a_removed_key_in_a_users_json(tmp_path: Path, key: str, capsys: pytest.CaptureFixture) -> None:
    from toolkit.cli import main

    ds = dc.preset("zero3")
    if key.startswith("zero_optimization."):
        ds["zero_optimization"][key.split(".")[1]] = {}
    else:
        ds[key] = {"enabled": True}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    main(["check", str(tmp_path / "ds.json")])
    out = capsys.readouterr()
    errors = [x for x in (out.out + out.err).splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "has been removed" in errors[0] and key.split(".")[-1] in errors[0], errors
