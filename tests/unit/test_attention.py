"""Attention for packed rows (toolkit/runtime/attention/), packing by default, length-grouped batches and
padding waste: the decisions and the plumbing, on CPU. The CUDA kernel is tests/gpu/test_gpu_varlen.py's;
the training runs through both paths are tests/dist/test_train.py's."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config, packing
from toolkit.runtime.attention import plan
from toolkit.runtime.attention.interface import NAME, PACKED, register, watch_boundaries
from toolkit.runtime.data.batches import (
    Collator,
    EpochOrder,
    ShardedBatches,
    document_boundaries,
    row_split,
    to_device,
)


def test_packing_auto_is_on_for_causal_lm_files_only() -> None:
    assert packing(load_config(None, ["data.source=x.jsonl"])) == (True, "data.packing=auto: on for causal-LM file data")
    assert packing(load_config(None, []))[0] is False  # synthetic rows are full length
    assert packing(load_config(None, ["data.source=x.jsonl", "model.task=seq_cls"]))[0] is False
    assert packing(load_config(None, ["data.source=x.jsonl", "data.packing=false"])) == (False, "data.packing=false")
    assert packing(load_config(None, ["data.packing=true"]))[0] is True
    with pytest.raises(ConfigError, match=r"data\.packing must be auto, true or false"):
        load_config(None, ["data.packing=sometimes"])
    with pytest.raises(ConfigError, match=r"data\.packing needs model\.task=causal_lm"):
        load_config(None, ["data.packing=true", "model.task=seq_cls"])


@pytest.mark.parametrize(("attn", "task", "packed", "cuda", "want", "boundaries"), [
    ("sdpa", "causal_lm", True, True, NAME, True),  # the default on a GPU: varlen for packed rows
    ("sdpa", "causal_lm", True, False, "sdpa", False),  # CPU: the block-diagonal mask
    ("sdpa", "causal_lm", False, True, "sdpa", False),  # nothing packed: plain sdpa
    ("varlen", "causal_lm", True, False, NAME, True),  # asked for: the reference on CPU
    ("eager", "causal_lm", True, True, "eager", False),
    ("flash_attention_2", "causal_lm", True, True, "flash_attention_2", True),  # flash-attn reads the boundaries
    ("sdpa", "seq_cls", False, True, "sdpa", False),
    ("varlen", "seq_cls", False, True, "sdpa", False),  # varlen is for causal LMs: sdpa, not an unknown name
])
def test_the_attention_plan(attn: str, task: str, packed: bool, cuda: bool, want: str, boundaries: bool) -> None:
    p = plan(attn, task, packed, cuda, varlen_ok=cuda)
    assert (p.implementation, p.boundaries) == (want, boundaries)
    assert p.note.startswith("attention: ")


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_model_without_sdpa_takes_eager_and_the_plan_says_why(attn: str, packed: bool) -> None:
    """transformers refuses to build Gemma 2, gpt-oss, Reformer and 29 more causal LMs with sdpa (softcapping, sinks,
    their own attention), and the toolkit's own attention computes sdpa's: either setting runs them eager (packed rows
    through the block-diagonal mask); flash_attention_2 stays as asked."""
    from transformers import CONFIG_MAPPING

    from toolkit.config.attention import has_sdpa
    from toolkit.plan.shapes import family_defaults

    assert not has_sdpa(CONFIG_MAPPING["gemma2"]()) and not has_sdpa(family_defaults("reformer"))
    assert has_sdpa(CONFIG_MAPPING["llama"]()) and has_sdpa(CONFIG_MAPPING["hrm_text"]())
    p = plan(attn, "causal_lm", packed, True, varlen_ok=True, sdpa=False)
    assert (p.implementation, p.boundaries) == ("eager", False) and "no sdpa path" in p.note
    assert ("block-diagonal mask" in p.note) == packed
    flash = plan("flash_attention_2", "causal_lm", packed, True, varlen_ok=True, sdpa=False)
    assert flash.implementation == "flash_attention_2"
    # sequence parallelism runs the toolkit's attention, sdpa's computation: refused for such a model
    with pytest.raises(ConfigError, match=r"train\.sequence_parallel runs the toolkit.s attention"):
        plan(attn, "causal_lm", packed, True, varlen_ok=True, sequence_parallel=2, sdpa=False)


def test_document_boundaries_make_the_padding_one_more_segment() -> None:
    kw = document_boundaries([[3, 4], [5]], width=8)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 7, 8, 13, 16] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["max_length_q"] == kw["max_length_k"] == 5 and isinstance(kw["max_length_q"], int)
    batch = Collator(pad_id=0, boundaries=True)([{"input_ids": [5] * 7, "labels": [5] * 7, "seq_lens": [3, 4]},
                                                 {"input_ids": [6] * 5, "labels": [6] * 5, "seq_lens": [5]}])
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 7, 12, 14]  # width 7: row 2 is 5 tokens and 2 pads
    moved = to_device(batch, torch.device("cpu"))
    assert moved["max_length_q"] == 5 and moved["input_ids"].shape == (2, 7)


def test_rows_of_one_document_come_first_and_are_counted_for_the_causal_kernel() -> None:
    assert row_split([[3, 4], [5]], width=8) == {}  # 5 of 8 is not a whole row: varlen skips its padding
    split = row_split([[8], [7], [3, 4], [2, 2]], width=8)
    assert split["whole_rows"] == 2 and isinstance(split["whole_rows"], int)  # a host value: no device sync
    assert split["packed_cu_seq_lens"].tolist() == [0, 3, 7, 8, 10, 12, 16] and split["packed_max_length"] == 4
    assert row_split([[8], [7]], width=8) == {"whole_rows": 2}  # every row whole: no varlen part
    with pytest.raises(ValueError, match="must come first"):
        row_split([[3, 4], [8]], width=8)
    rows = [{"input_ids": [5] * 6, "labels": [5] * 6, "seq_lens": [2, 4]},
            {"input_ids": [6] * 8, "labels": [6] * 8, "seq_lens": [8]},
            {"input_ids": [7] * 5, "labels": [7] * 5, "seq_lens": [5]}]
    plain = Collator(pad_id=0, boundaries=True)(rows)
    assert "whole_rows" not in plain and plain["input_ids"][:, 0].tolist() == [5, 6, 7]  # only for the toolkit's attention
    batch = Collator(pad_id=0, boundaries=True, whole_rows=True)(rows)
    assert batch["whole_rows"] == 1 and batch["input_ids"][:, 0].tolist() == [6, 5, 7]  # the whole row first, the rest in order
    assert batch["labels"][:, 0].tolist() == [6, 5, 7] and batch["position_ids"][1].tolist()[:6] == [0, 1, 0, 1, 2, 3]
    assert batch["cu_seq_lens_q"].tolist() == [0, 8, 10, 14, 16, 21, 24]  # the boundaries follow the new order


@pytest.mark.parametrize("lens", [[[16], [15], [5, 11], [3, 3, 10]], [[16], [14]]], ids=["mixed", "all-whole"])
def test_whole_rows_through_the_causal_kernel_equal_documents_alone(lens: list[list[int]]) -> None:
    """Rows split between sdpa's causal kernel and the varlen kernel (the CPU reference here) give every
    document's output and gradients as the per-document reference over the whole batch does."""
    from toolkit.runtime.attention.interface import attention_forward
    from toolkit.runtime.attention.kernels import reference_varlen

    g = torch.Generator().manual_seed(0)
    b, s, d = len(lens), 16, 8
    q = torch.randn(b, 4, s, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, 2, s, d, generator=g, requires_grad=True) for _ in "kv")
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    kw = document_boundaries(lens, s) | row_split(lens, s)
    out, _ = attention_forward(module, q, k, v, None, scaling=0.3, **kw)
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    want = reference_varlen(*flat, kw["cu_seq_lens_q"], 0.3).view(b, s, 4, d)
    real = torch.zeros(b, s, dtype=torch.bool)  # padding outputs differ (nothing reads them)
    for i, row in enumerate(lens):
        real[i, : sum(row)] = True
    torch.testing.assert_close(out[real], want[real], rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out[real].sum(), (q, k, v))
    wants = torch.autograd.grad(want[real].sum(), (q, k, v))
    for a, w in zip(grads, wants, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)


def _tiny() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(cfg).eval()
    register()
    model.config._attn_implementation = NAME
    watch_boundaries(model)
    return model


def test_a_forward_with_boundaries_builds_no_mask_and_one_without_gets_the_real_one() -> None:
    """Packed forwards run under PACKED (no mask function: transformers skips its packed-sequence search and
    its host sync); a packed batch without boundaries (another collator) still gets the block-diagonal mask."""
    import transformers.masking_utils as mu

    model = _tiny()
    rows = [{"input_ids": [5, 6, 7, 8, 9, 10], "labels": [5, 6, 7, 8, 9, 10], "seq_lens": [2, 4]}]
    with_b = Collator(pad_id=0, boundaries=True)(rows)
    without = Collator(pad_id=0)(rows)
    real = mu.find_packed_sequence_indices
    with mock.patch.object(mu, "find_packed_sequence_indices", side_effect=real) as search, torch.no_grad():
        a = model(**{k: v for k, v in with_b.items() if k != "labels"}).logits
        assert search.call_count == 0 and model.config._attn_implementation == PACKED
        b = model(input_ids=without["input_ids"], position_ids=without["position_ids"]).logits
        assert search.call_count == 1 and model.config._attn_implementation == NAME
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the second document alone: packing kept it apart either way
        alone = model(input_ids=torch.tensor([[7, 8, 9, 10]])).logits
    torch.testing.assert_close(a[:, 2:], alone, rtol=1e-5, atol=1e-6)


def _sliding_model(family: str, window: int | None) -> torch.nn.Module:
    """A tiny model whose first layer attends through a window (none: wider than the rows): Gemma 3 hands the window to
    the attention function, Qwen2-MoE keeps it on the layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=64, sliding_window=window or 64,
                  layer_types=["sliding_attention", "full_attention"], use_cache=False)
    if family == "gemma3_text":
        return Gemma3ForCausalLM(Gemma3TextConfig(head_dim=8, **common)).eval()
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(use_sliding_window=True, moe_intermediate_size=16, num_experts=4,
                                              num_experts_per_tok=2, shared_expert_intermediate_size=16,
                                              **common)).eval()


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2_moe"])
def test_unpacked_rows_of_a_sliding_window_model_go_through_the_window_kernel_and_equal_sdpa(family: str) -> None:
    """Sliding-window layers on unpacked rows longer than the window: transformers' sdpa with its sliding mask against
    the toolkit's attention with each unpadded row one whole document (the window through the varlen kernel; its CPU
    reference here), logits and gradients; the window changes the logits at this length."""
    from toolkit.runtime.attention import sliding_window

    rows = [{"input_ids": [(7 * i + j) % 60 + 2 for j in range(12)], "labels": [0] * 12} for i in range(2)]
    batch = Collator(pad_id=0, drop_full_mask=True, boundaries=True, whole_rows=True)(rows)
    assert "attention_mask" not in batch and batch["whole_rows"] == 2
    assert batch["cu_seq_lens_q"].tolist() == [0, 12, 24]
    plain = _sliding_model(family, 4)
    plain.config._attn_implementation = "sdpa"
    toolkit = _sliding_model(family, 4)
    assert sliding_window(toolkit.config, 12) == 4 and sliding_window(toolkit.config, 4) is None
    register()
    toolkit.config._attn_implementation = NAME
    watch_boundaries(toolkit)
    want = plain(input_ids=batch["input_ids"]).logits
    got = toolkit(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert toolkit.config._attn_implementation == PACKED
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, w in zip(torch.autograd.grad(got.square().sum(), list(toolkit.parameters())),
                    torch.autograd.grad(want.square().sum(), list(plain.parameters())), strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)
    wide = _sliding_model(family, None)
    wide.config._attn_implementation = "sdpa"
    assert not torch.allclose(wide(input_ids=batch["input_ids"]).logits, want, atol=1e-3)


def test_which_models_take_the_window_kernel_on_unpacked_rows() -> None:
    """config/attention.kernel_window: a window the varlen kernel computes as transformers' mask does, and none where
    it cannot (dropout, softcapping, bidirectional attention, sinks or no sdpa path, a layer that keeps no window)."""
    from transformers import CONFIG_MAPPING, Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    from toolkit.runtime.attention import sliding_window

    assert sliding_window(MistralConfig(sliding_window=4096), 8192) == 4096
    assert sliding_window(MistralConfig(sliding_window=4096), 4096) is None  # the window spans the row: causal
    assert sliding_window(Qwen2Config(), 8192) is None  # use_sliding_window off
    assert sliding_window(Gemma3TextConfig(sliding_window=512), 8192) == 512
    for cfg in (Gemma2Config(sliding_window=512), Gemma3TextConfig(sliding_window=512, attention_dropout=0.1),
                Gemma3TextConfig(sliding_window=512, use_bidirectional_attention=True),
                CONFIG_MAPPING["gpt_oss"](sliding_window=128), CONFIG_MAPPING["phimoe"](sliding_window=512)):
        assert sliding_window(cfg, 8192) is None, cfg.model_type
    on = plan("sdpa", "causal_lm", False, True, varlen_ok=True, window=512)
    assert (on.implementation, on.boundaries, on.whole_rows) == (NAME, True, True) and "window 512" in on.note
    for args in (("sdpa", "causal_lm", False, False, False), ("eager", "causal_lm", False, True, True)):
        assert plan(*args, window=512).boundaries is False  # CPU, or eager asked for: sdpa / eager with the mask


def test_length_groups_deal_every_sample_once_and_pad_far_less() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 400, (4000,), generator=g).numpy()
    grouped = EpochOrder(len(lengths), seed=3, shuffle=True, lengths=lengths, group=16 * 2)
    plain = EpochOrder(len(lengths), seed=3, shuffle=True)
    assert sorted(grouped.order(0).tolist()) == list(range(4000))
    assert grouped.order(0).tolist() == grouped.order(0).tolist() != grouped.order(1).tolist()

    def waste(order: EpochOrder) -> float:
        tokens = positions = 0
        for rank in range(2):
            for batch in ShardedBatches(order, 16, rank, 2):
                tokens += int(lengths[batch].sum())
                positions += int(lengths[batch].max()) * len(batch)
        return 1 - tokens / positions

    assert waste(grouped) < 0.05 < 0.3 < waste(plain)


def test_padding_waste_counts_pad_positions_of_packed_and_padded_batches() -> None:
    from toolkit.observe.metrics import TokenCounter

    c = TokenCounter()
    c.add(Collator(pad_id=0)([{"input_ids": [5] * 6, "labels": [5] * 6, "seq_lens": [2, 4]},
                               {"input_ids": [5] * 3, "labels": [5] * 3, "seq_lens": [3]}]))
    c.add(Collator(pad_id=0)([{"input_ids": [5] * 4, "labels": [5] * 4}, {"input_ids": [5] * 2, "labels": [5] * 2}]))
    assert (c.tokens, c.positions) == (9 + 6, 12 + 8)


def test_the_planner_counts_packed_attention_by_document_length() -> None:
    from toolkit.plan import planner as pl
    from toolkit.plan.shapes import load_shape

    s = load_shape("llama-1b")
    full = pl.Workload(s, 8192, 32)
    assert full.attended == 8192
    assert pl.Workload(s, 8192, 32, doc_len=193).attended == pl.VARLEN_FLOOR_TOKENS  # the kernel's floor
    assert pl.Workload(s, 8192, 32, doc_len=5000).attended == 5000
    assert pl.Workload(s, 2048, 32, doc_len=193).attended == 2048  # never above the row
    assert pl.Workload(s, 8192, 32, attn="eager", doc_len=193).attended == 8192  # eager masks: the full row
    # a model without an sdpa path runs eager at sdpa: the full row too (Gemma 2)
    assert pl.Workload(dataclasses.replace(s, sdpa=False), 8192, 32, doc_len=193).attended == 8192


def test_plan_doc_len_speeds_up_long_packed_rows_and_refuses_nonsense(capsys) -> None:
    from toolkit.cli import main

    def tokens(*extra: str) -> float:
        assert main(["plan", "--model", "llama-1b", "--gpus", "1", "--seq", "8192", "--global-batch", "32",
                     "--stage", "2", "--json", *extra]) == 0
        import json

        return json.loads(capsys.readouterr().out)["chosen"]["tokens_per_s_per_gpu"]

    assert tokens("--doc-len", "193") > 1.1 * tokens()
    assert main(["plan", "--model", "llama-1b", "--gpus", "1", "--seq", "2048", "--global-batch", "32",
                 "--doc-len", "1"]) == 1  # a config error, as for any other bad input of plan
    assert "--doc-len must be at least 2 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_a_packed_batch_is_normalized_as_the_padded_batch_of_the_same_samples(attn: str) -> None:
    """The loops divide the summed token loss by the label count of the whole window (num_items_in_batch): the
    same samples packed or padded give the same count and, in fp32, the same loss."""
    from toolkit.runtime.data.corpus import pack_batch
    from toolkit.runtime.loops.raw import _label_count

    model = _tiny()
    if attn == "sdpa":
        model.config._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(2)
    samples = []
    for n in (5, 9, 4, 7, 6):
        ids = torch.randint(4, 64, (n,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    blocks = pack_batch({"input_ids": [x["input_ids"] for x in samples], "labels": [x["labels"] for x in samples]}, 16)
    packed = Collator(pad_id=0, boundaries=attn == "varlen")(
        [{k: blocks[k][i] for k in blocks} for i in range(len(blocks["input_ids"]))])
    padded = Collator(pad_id=0)(samples)
    n_packed, n_padded = (_label_count([b], torch.device("cpu")) for b in (packed, padded))
    assert int(n_packed) == int(n_padded) == sum(len(x["input_ids"]) - 2 for x in samples)  # the unmasked ones
    with torch.no_grad():
        a = model(**packed, num_items_in_batch=n_packed).loss
        b = model(**padded, num_items_in_batch=n_padded).loss
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
