"""Generation in one process: dealing prompts, the batched path's tokens against one prompt at a time, seeded
sampling independent of the batch, the gather decision, prompt files and the exact-match score.

The multi-rank behaviour (ZeRO-3 gathers, synced_gpus, no hangs) is in tests/dist/test_generate.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import EvalConfig, load_config
from toolkit.plan.generation import DecodeShape, batch_that_fits, bytes_per_sequence, kv_bytes_per_token
from toolkit.runtime.generation import gather, guard
from toolkit.runtime.generation.batched import generate_local
from toolkit.runtime.generation.prompts import Prompt, exact_match, from_rows, load_prompts
from toolkit.runtime.generation.sample import MASK64, RowSampler, splitmix64, top_p_filter
from toolkit.runtime.generation.shard import deal, unshard


def _round_trip(prompts: list[str], world: int) -> list[str]:
    # Each rank "generates" by upper-casing; gathering must undo the dealing exactly.
    gathered = [[(i, p.upper()) for i, p in deal(prompts, r, world)] for r in range(world)]
    return unshard(gathered, len(prompts))


@pytest.mark.parametrize("n,world", [(0, 3), (1, 4), (3, 2), (5, 3), (7, 8), (10, 4)])
def test_deal_is_strided_and_round_trips(n: int, world: int) -> None:
    prompts = [f"p{i}" for i in range(n)]
    assert deal(prompts, 0, world) == [(i, prompts[i]) for i in range(0, n, world)]
    counts = [len(deal(prompts, r, world)) for r in range(world)]
    assert max(counts, default=0) - min(counts, default=0) <= 1 and sum(counts) == n
    assert _round_trip(prompts, world) == [p.upper() for p in prompts]


def test_deal_errors() -> None:
    with pytest.raises(ValueError):
        deal(["a"], 2, 2)
    with pytest.raises(RuntimeError, match="no result"):
        unshard([[(0, "A")]], 2)


def test_prompts_from_rows_are_the_masked_prefix() -> None:
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": [9, 10, 11, 12], "labels": [9, 10, 11, 12]},  # plain text: first half
    ]
    assert [p.ids for p in from_rows(rows, 5)] == [[5, 6], [9, 10]]
    assert [p.ids for p in from_rows(rows, 1)] == [[5, 6]]


class _FakeModel:
    """Stands in for an HF model: records the kwargs its generate receives."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def generate(self, **kwargs: object) -> str:
        self.calls.append(kwargs)
        return "out"


def test_guard_generate_forces_sync_under_zero3(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(guard, "world", lambda: 2)
    model = guard.guard_generate(_FakeModel(), zero3=True)
    assert guard.guard_generate(model, zero3=True) is model  # idempotent: wrapped once
    model.generate(synced_gpus=False)  # the call that would hang: overridden, with a warning
    model.generate()
    assert [c["synced_gpus"] for c in model.calls] == [True, True]
    assert "synced_gpus=True" in capsys.readouterr().err
    guard.unguarded(model)(synced_gpus=False)  # the whole-model path's own call is left alone
    assert model.calls[-1] == {"synced_gpus": False}

    plain = guard.guard_generate(_FakeModel(), zero3=False)  # ZeRO-0/1/2: syncing only costs time
    plain.generate(synced_gpus=False)
    assert plain.calls == [{"synced_gpus": False}]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any, list[list[int]]]:
    from toolkit.runtime.model import build_model, model_config

    cfg = load_config(None, [])
    mc = model_config(cfg)
    model = build_model(cfg, mc).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(4, mc.vocab_size) for _ in range(rng.randint(2, 24))] for _ in range(9)]
    return model, mc, prompts


def _one_at_a_time(model: Any, prompts: list[list[int]], new: int, eos: int | None) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, pad_token_id=0, eos_token_id=eos)
            tokens = res[0, len(p):].tolist()
            out.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return out


@pytest.mark.parametrize("batch", [1, 4, "auto"])
def test_left_padded_batches_give_the_tokens_of_one_prompt_at_a_time(
        tiny: tuple[Any, Any, list[list[int]]], batch: int | str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    model, mc, prompts = tiny
    plain = _one_at_a_time(model, prompts, 10, eos=None)
    eos = plain[3][4]  # a token that ends prompt 3 early: rows of a batch then stop at different steps
    expected = _one_at_a_time(model, prompts, 10, eos=eos)
    got, stats = generate_local(model, prompts, EvalConfig(max_new_tokens=10, generate_batch_size=batch), mc=mc,
                                zero3=False, pad_id=0, eos_id=eos)
    assert got == expected
    assert stats.prompts == 9 and stats.new_tokens == sum(map(len, expected)) and stats.path == "whole model"
    assert stats.batch_size == (9 if batch == "auto" else batch)


def test_sampling_depends_on_the_prompt_seed_only(tiny: tuple[Any, Any, list[list[int]]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    model, mc, prompts = tiny
    runs = []
    for batch in (1, 3, 9):
        cfg = EvalConfig(max_new_tokens=8, generate_batch_size=batch, do_sample=True, temperature=1.3, top_p=0.95)
        runs.append(generate_local(model, prompts, cfg, mc=mc, zero3=False, pad_id=0, eos_id=None)[0])
    assert runs[0] == runs[1] == runs[2]
    # Two ranks' halves, seeded with the prompts' global indices as generate_all seeds them: the same tokens.
    cfg = EvalConfig(max_new_tokens=8, generate_batch_size=2, do_sample=True, temperature=1.3, top_p=0.95)
    halves = [generate_local(model, [p for _, p in deal(prompts, r, 2)], cfg, mc=mc, zero3=False, pad_id=0,
                             eos_id=None, seeds=[i for i, _ in deal(prompts, r, 2)])[0] for r in range(2)]
    assert unshard([list(zip([i for i, _ in deal(prompts, r, 2)], halves[r], strict=True)) for r in range(2)],
                   9) == runs[0]
    greedy = generate_local(model, prompts, EvalConfig(max_new_tokens=8), mc=mc, zero3=False, pad_id=0,
                            eos_id=None)[0]
    assert runs[0] != greedy  # it did sample


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.1)).tolist() == [[True, False, False, False]]  # the first always


def test_memory_numbers() -> None:
    s = DecodeShape(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256)
    assert kv_bytes_per_token(s, 2) == 2 * 16 * 8 * 64 * 2  # llama-1b in bf16: 32 KiB per token
    per_seq = bytes_per_sequence(s, 512, 128, 2, cuda=True)
    assert per_seq > 640 * kv_bytes_per_token(s, 2)
    assert bytes_per_sequence(s, 512, 128, 2, cuda=False) > per_seq  # the attention scores off CUDA
    assert batch_that_fits(10 * per_seq + 1, per_seq, 256, 128) == 10
    assert batch_that_fits(10 * per_seq, per_seq, 4, 128) == 4 and batch_that_fits(0, per_seq, 4, 128) == 0


def test_choose_gathers_only_where_it_fits(monkeypatch: pytest.MonkeyPatch,
                                           tiny: tuple[Any, Any, list[list[int]]]) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    _, mc, prompts = tiny
    monkeypatch.setattr(gather, "gathered_bytes", lambda model: 10 * gather.GIB)
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(gather, "free_bytes", lambda: 64 * gather.GIB)
    c = gather.choose(model, mc, prompts, 16, zero3=True, gather="auto", batch_size="auto")
    assert c.gathered and c.path == "whole-model gather" and c.batch_size == len(prompts), c
    monkeypatch.setattr(gather, "free_bytes", lambda: 8 * gather.GIB)
    c = gather.choose(model, mc, prompts, 16, zero3=True, gather="auto", batch_size=4)
    assert not c.gathered and c.path == "layer by layer" and "exceed" in c.reason and c.batch_size == 4, c
    c = gather.choose(model, mc, prompts, 16, zero3=True, gather="true", batch_size=4)
    assert c.gathered and "eval.generate_gather=true" in c.reason
    c = gather.choose(model, mc, prompts, 16, zero3=False, gather="auto", batch_size=2)
    assert not c.gathered and c.path == "whole model"


def test_prompt_files(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"input_ids": [5, 6], "reference": [7, 8]}) + "\n" + json.dumps({"input_ids": [9]})
                    + "\n")
    assert load_prompts(good, None, "eval.generate_source") == [Prompt([5, 6], [7, 8]), Prompt([9])]
    cases = [
        ('{"input_ids": []}', "non-empty list"),
        ('{"prompt": 3}', "non-empty string"),
        ('{"messages": [{"role": "user"}]}', "messages must be"),
        ('{"question": "x"}', "expected one of"),
        ('{"input_ids": [1], "reference": 5}', "reference must be"),
        ('{"prompt": "hello"}', "need a tokenizer"),
        ("[1, 2]", "JSON object"),
    ]
    for line, msg in cases:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(ConfigError, match=msg) as e:
            load_prompts(bad, None, "eval.generate_source")
        assert f"{bad}:1" in str(e.value)
    with pytest.raises(ConfigError, match="is not a file"):
        load_prompts(tmp_path / "none.jsonl", None, "eval.generate_source")


def test_exact_match_by_ids_and_by_text() -> None:
    prompts = [Prompt([1], [7, 8]), Prompt([2], [9]), Prompt([3])]
    assert exact_match(prompts, [[7, 8, 2], [5, 2], [4]], None, stops={2}) == 0.5  # the stop token is not compared
    assert exact_match([Prompt([1])], [[4]], None, stops=set()) is None

    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return " ".join(map(str, ids)) + " "

    assert exact_match([Prompt([1], "4 5")], [[4, 5]], Tok(), stops=set()) == 1.0


def test_config_checks() -> None:
    for bad, msg in [("eval.generate_batch_size=0", "generate_batch_size"), ("eval.generate_gather=maybe", "auto, true"),
                     ("eval.generate_every=-1", "generate_every")]:
        with pytest.raises(ConfigError, match=msg):
            load_config(None, [bad])


def test_static_cache_gives_the_same_tokens(tiny: tuple[Any, Any, list[list[int]]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """eval.generate_cache=static: prompts left-padded to a multiple of 64 and the last batch filled with copies
    (so the compiled decode step sees few shapes); the tokens are those of the dynamic cache."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    model, mc, prompts = tiny
    dynamic = generate_local(model, prompts, EvalConfig(max_new_tokens=6, generate_batch_size=4), mc=mc, zero3=False,
                             pad_id=0, eos_id=None)[0]
    static = generate_local(model, prompts, EvalConfig(max_new_tokens=6, generate_batch_size=4,
                                                       generate_cache="static"), mc=mc, zero3=False, pad_id=0,
                            eos_id=None)[0]
    assert static == dynamic


def test_the_row_sampler_draws_from_the_distribution_a_row_at_a_time_whatever_its_batch() -> None:
    def reference(z: int) -> int:  # SplitMix64's finalizer on Python ints, modulo 2**64
        z = (z + 0x9E3779B97F4A7C15) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    keys = [0, 1, 7 << 32 | 3, 2**63 - 1, 123456789012345]
    assert [v & MASK64 for v in splitmix64(torch.tensor(keys)).tolist()] == [reference(k) for k in keys]
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampler = RowSampler(list(range(2000)), 1.0, 1.0, "cpu")
    counts = torch.zeros(4)
    for _ in range(5):  # 10,000 draws: each share within 0.02 of its probability
        counts += (sampler(None, probs.log().expand(2000, 4).clone()) == 0).float().sum(0)
    assert torch.allclose(counts / counts.sum(), probs, atol=0.02)
    logits = torch.randn(3, 50)
    alone, batched = RowSampler([9], 0.7, 0.9, "cpu"), RowSampler([4, 9, 5], 0.7, 0.9, "cpu")
    for _ in range(3):  # row 9's tokens, step after step, do not depend on the rows beside it
        assert torch.equal(alone(None, logits[1:2])[0], batched(None, logits)[1])
