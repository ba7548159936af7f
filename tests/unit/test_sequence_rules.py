"""Sequence parallelism's rules and batch slicing (toolkit/runtime/sequence/), on CPU without a process group.
The training runs at SP=2 against SP=1 are tests/dist/test_sequence_parallel.py's."""

from __future__ import annotations

import pytest
import torch

from toolkit.config.checks.sequence import problems
from toolkit.runtime.data.batches import Collator
from toolkit.runtime.sequence.ulysses import SequenceParallel, loss_multiplier


def test_a_run_that_fits_has_no_problem() -> None:
    assert problems(2, 4, 3, heads=32, kv_heads=8, seq_len=8192, attn="sdpa", task="causal_lm", micro=1) == []
    assert problems(1, 3, 0, heads=3, kv_heads=3, seq_len=7, attn="eager") == []  # off: no rule
    assert problems(16, 16, 3, heads=32, kv_heads=8) == []  # kv heads replicated: 16 is a multiple of 8


@pytest.mark.parametrize(("kw", "line"), [
    ({"world": 3}, "does not divide the 3 ranks"),
    ({"zero_stage": 0}, "needs ZeRO stage 1, 2 or 3"),
    ({"heads": 14}, "does not divide the model's 14 attention heads"),
    ({"kv_heads": 6}, "the model's 6 key/value heads: one must divide the other"),
    ({"seq_len": 1001}, "data.seq_len=1001 is not a multiple"),
    ({"attn": "eager"}, "needs sdpa (or flash) attention"),
    ({"task": "seq_cls"}, "is for causal LMs"),
    ({"micro": "auto"}, "needs a number for train.micro_batch_size"),
])
def test_each_rule_is_one_line(kw: dict, line: str) -> None:
    args = {"world": 4, "zero_stage": 2, "heads": 32, "kv_heads": 8, "seq_len": 4096, "attn": "sdpa",
            "task": "causal_lm", "micro": 1} | kw
    found = problems(4, **args)
    assert len(found) == 1 and line in found[0], found


def _sp(rank: int) -> SequenceParallel:
    return SequenceParallel(size=2, rank=rank, dp_rank=0, dp_world=1, mpu=None)


def test_slices_keep_every_target_and_the_global_positions() -> None:
    rows = [{"input_ids": list(range(10, 17)), "labels": [-100, -100, 12, 13, 14, 15, 16]},
            {"input_ids": [20, 21, 22], "labels": [20, 21, 22]}]
    batch = Collator(pad_id=0, multiple_of=2)(rows)  # 7 -> 8 positions
    assert batch["input_ids"].shape == (2, 8)
    parts = [_sp(r).shard(batch) for r in (0, 1)]
    assert all(p["input_ids"].shape == (2, 4) and "attention_mask" not in p for p in parts)
    joined = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "shift_labels", "position_ids")}
    assert torch.equal(joined["input_ids"], batch["input_ids"])
    # labels shifted before slicing: the target of position 3 (rank 0's last) is token 4 (rank 1's first)
    assert joined["shift_labels"][0].tolist() == [-100, 12, 13, 14, 15, 16, -100, -100]
    assert joined["shift_labels"][1].tolist() == [21, 22, -100, -100, -100, -100, -100, -100]
    assert parts[1]["position_ids"][0].tolist() == [4, 5, 6, 7]
    assert parts[0]["labels"] is parts[0]["shift_labels"]
    # unpacked rows: each row one document for the attention, the whole row's boundaries on every rank
    assert parts[1]["cu_seq_lens_q"].tolist() == [0, 8, 16] and parts[1]["whole_rows"] == 2


def test_packed_rows_keep_their_document_boundaries_whole() -> None:
    rows = [{"input_ids": [5] * 6, "labels": [5] * 6, "seq_lens": [2, 4]}]
    batch = Collator(pad_id=0, boundaries=True, whole_rows=True, multiple_of=4)(rows)  # 6 -> 8: a pad segment
    part = _sp(1).shard(batch)
    assert part["cu_seq_lens_q"].tolist() == [0, 2, 6, 8] and part["max_length_q"] == 4
    assert part["position_ids"].tolist() == [[2, 3, 0, 0]]


def test_a_slice_without_targets_counts_none() -> None:
    from toolkit.runtime.loops.evaluate import target_count

    batch = Collator(pad_id=0)([{"input_ids": list(range(8)), "labels": [-100] * 5 + [5, 6, 7]}])
    assert int(target_count(_sp(0).shard(batch))) == 0
    assert int(target_count(_sp(1).shard(batch))) == 3 == int(target_count(batch))


def test_the_loss_multiplier_makes_up_for_zero3s_reduce_scatter() -> None:
    sp = SequenceParallel(size=2, rank=0, dp_rank=0, dp_world=3, mpu=None)
    assert loss_multiplier(sp, {"zero_optimization": {"stage": 2}}) == 3
    assert loss_multiplier(sp, {"zero_optimization": {"stage": 3}}) == 6  # reduce_scatter defaults on
    assert loss_multiplier(sp, {"zero_optimization": {"stage": 3, "reduce_scatter": False}}) == 3


def test_toolkit_check_says_the_sequence_parallel_rules(capsys: pytest.CaptureFixture[str]) -> None:
    from toolkit.cli import main

    assert main(["check", "ds_configs/zero0.json", "--world-size", "3", "--sequence-parallel", "2", "--model", "tiny",
                 "--seq-len", "63"]) == 1
    out = capsys.readouterr().out
    assert "does not divide the 3 ranks" in out and "ZeRO stage 1, 2 or 3" in out and "seq_len=63" in out
    assert main(["check", "ds_configs/zero2.json", "--world-size", "2", "--sequence-parallel", "2", "--model", "tiny",
                 "--seq-len", "64"]) == 0


def test_tiled_mlps_give_the_plain_loss_and_gradients() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.runtime.sequence.tiling import tile_mlps
    from toolkit.runtime.speed.compile import decoder_layers

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    out = []
    for tiles in (0, 4):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        if tiles:
            assert tile_mlps(decoder_layers(model), tiles) == 2
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-6, atol=1e-7)
    for a, b in zip(out[1][1], out[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tiling_auto_turns_on_where_a_rank_holds_a_long_slice() -> None:
    from toolkit.plan.speedups import tiled_mlp_on as decide

    assert decide("auto", 65_536, 1)[0] and not decide("auto", 65_536, 2)[0] and decide("auto", 262_144, 4)[0]
    assert decide("true", 64, 1) == (True, "model.tiled_mlp=true") and not decide("false", 10**6, 1)[0]
    assert "32,768 tokens of a row per rank" in decide("auto", 65_536, 2)[1]


def test_an_mlp_with_dropout_is_not_tiled() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.runtime.sequence.tiling import tile_mlps
    from toolkit.runtime.speed.compile import decoder_layers

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(ValueError, match="has dropout"):
        tile_mlps(decoder_layers(model))


def test_the_trainer_paths_order_gives_a_group_the_micro_batch_the_raw_loop_deals_to_it() -> None:
    """Accelerate deals batch i to rank i % world; GroupOrder repeats each micro-batch once per rank of a group, so
    ranks 2g and 2g+1 (group g) get the micro-batch ShardedBatches deals to data-parallel rank g."""
    from toolkit.runtime.data.batches import EpochOrder, ShardedBatches
    from toolkit.runtime.sequence.ulysses import GroupOrder

    order, micro, sp, groups = EpochOrder(24, seed=3, shuffle=True), 2, 2, 3
    stream = list(GroupOrder(order, micro, sp))
    assert len(stream) == len(GroupOrder(order, micro, sp)) == 24 * sp
    batches = [stream[i:i + micro] for i in range(0, len(stream), micro)]
    world = sp * groups
    for rank in range(world):
        mine = batches[rank::world]
        assert mine == list(ShardedBatches(order, micro, rank // sp, groups)), rank


def test_the_trainer_paths_collator_cuts_this_ranks_slice_and_counts_the_whole_batch() -> None:
    from toolkit.runtime.sequence.ulysses import TOKENS_KEY, ShardingCollator

    rows = [{"input_ids": [5, 6, 7, 8, 9, 10], "labels": [5, 6, 7, 8, 9, 10]}, {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    collate = Collator(pad_id=0, task="causal_lm", drop_full_mask=True, multiple_of=2)
    whole = collate(rows)
    for rank in (0, 1):
        out = ShardingCollator(collate, _sp(rank))(rows)
        assert int(out.pop(TOKENS_KEY)) == 9  # the whole batch's real tokens, on every rank of the group
        ref = _sp(rank).shard(whole)
        assert out.keys() == ref.keys() and all(torch.equal(out[k], ref[k]) for k in ref if torch.is_tensor(ref[k]))
