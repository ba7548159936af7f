"""Which Liger kernels a run gets, decided without a GPU (the kernels themselves run in tests/gpu)."""

from __future__ import annotations

import pytest

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.plan.liger import choose

LIGER = frozenset({"llama", "qwen2", "mistral"})


def test_on_by_default_for_supported_causal_lm_below_zero3() -> None:
    c = choose(True, cuda=True, model_type="llama", task="causal_lm", stage=2, supported=LIGER)
    assert c.kwargs == {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True}
    assert c.describe().startswith("liger kernels on: rope, rms_norm, swiglu, fused_linear_cross_entropy")


def test_zero3_gets_the_fused_loss_with_the_head_declared_to_deepspeed() -> None:
    c = choose(True, cuda=True, model_type="qwen2", task="causal_lm", stage=3, supported=LIGER)
    assert c.enabled and c.kwargs["fused_linear_cross_entropy"] and c.external_head


def test_every_reason_for_off_is_named() -> None:
    cases = {
        "model.liger=false": dict(wanted=False, cuda=True, model_type="llama", task="causal_lm", supported=LIGER),
        "no CUDA": dict(wanted=True, cuda=False, model_type="llama", task="causal_lm", supported=LIGER),
        "not installed": dict(wanted=True, cuda=True, model_type="llama", task="causal_lm", supported=None),
        "'gpt2'": dict(wanted=True, cuda=True, model_type="gpt2", task="causal_lm", supported=LIGER),
        "seq_cls": dict(wanted=True, cuda=True, model_type="llama", task="seq_cls", supported=LIGER),
        "train.objective=grpo": dict(wanted=True, cuda=True, model_type="llama", task="causal_lm", supported=LIGER,
                                     objective="grpo"),
    }
    for needle, kw in cases.items():
        c = choose(kw.pop("wanted"), stage=2, **kw)
        assert not c.enabled and needle in c.describe(), (needle, c)


def test_the_fused_loss_switch_and_zero3_external_head() -> None:
    kw = dict(cuda=True, model_type="llama", task="causal_lm", supported=LIGER)
    on3 = choose(True, stage=3, fused_loss="true", **kw)
    assert on3.kwargs["fused_linear_cross_entropy"] and on3.external_head  # the head is declared to ZeRO-3
    on2 = choose(True, stage=2, fused_loss="true", **kw)
    assert on2.kwargs["fused_linear_cross_entropy"] and not on2.external_head  # nothing to gather below ZeRO-3
    off = choose(True, stage=2, fused_loss="false", **kw)
    assert not off.kwargs["fused_linear_cross_entropy"] and "model.liger_fused_loss=false" in off.describe()


def test_under_compile_only_the_fused_loss_stays() -> None:
    # Liger's layer kernels inside a compiled layer crash inductor (issue 25); inductor fuses them itself
    kw = dict(cuda=True, model_type="llama", task="causal_lm", supported=LIGER)
    c = choose(True, stage=3, compiled=True, **kw)
    assert c.kwargs == {"rope": False, "rms_norm": False, "swiglu": False, "fused_linear_cross_entropy": True}
    assert c.external_head and "rope, rms_norm, swiglu off: train.compile" in c.describe()
    off = choose(True, stage=2, compiled=True, fused_loss="false", **kw)
    assert not off.enabled and "train.compile" in off.describe()


def test_the_fused_loss_takes_chunks_of_2048_rows_unless_set() -> None:
    """model.liger_chunk_mem_const=auto: the smallest chunk_mem_const whose chunks hold 2,048 rows (all the tokens if
    fewer); Liger's own (1) gives Gemma 3's head chunks of 128 rows at 16,384 tokens. An integer is taken as it is."""
    from toolkit.plan.liger import LOSS_CHUNK_ROWS, loss_chunk_const, loss_chunk_rows

    gemma = dict(tokens=16384, hidden=1152, vocab=262144)
    assert loss_chunk_rows(16384, 1152, 262144, 1) == 128
    c = loss_chunk_const("auto", **gemma)
    assert c == 16 and loss_chunk_rows(16384, 1152, 262144, c) == LOSS_CHUNK_ROWS
    assert loss_chunk_rows(16384, 1152, 262144, loss_chunk_const("auto", **gemma) // 2) < LOSS_CHUNK_ROWS  # smallest
    assert loss_chunk_const("auto", tokens=65536, hidden=3072, vocab=32064) == 1  # Liger's own already 8,192 rows
    few = loss_chunk_const("auto", tokens=1000, hidden=4096, vocab=128256)
    assert loss_chunk_rows(1000, 4096, 128256, few) == 1000  # one chunk of every token
    assert loss_chunk_const("3", **gemma) == 3
    on = choose(True, cuda=True, model_type="llama", task="causal_lm", stage=2, supported=LIGER)
    assert on.chunk_mem_const == "auto" and "(loss chunks of 2,048 rows where a micro-batch has them)" in on.describe()
    # gpt-oss's forward asks 8 itself: auto takes at least that, an integer replaces it
    assert loss_chunk_const("auto", floor=8, **gemma) == 16 and loss_chunk_const("auto", floor=8, tokens=65536,
                                                                                  hidden=2880, vocab=201088) == 8
    assert loss_chunk_const("1", floor=8, **gemma) == 1
    set1 = choose(True, cuda=True, model_type="llama", task="causal_lm", stage=2, supported=LIGER, chunk_mem_const="1")
    assert "(chunk_mem_const 1)" in set1.describe()


def test_a_chunk_setting_that_is_not_auto_or_a_positive_integer_is_refused() -> None:
    assert load_config(None, ["model.name=tiny", "model.liger_chunk_mem_const=8"]).model.liger_chunk_mem_const == "8"
    for bad in ("0", "big", "-2"):
        with pytest.raises(ConfigError, match=r"model\.liger_chunk_mem_const must be auto or a positive integer"):
            load_config(None, ["model.name=tiny", f"model.liger_chunk_mem_const={bad}"])
