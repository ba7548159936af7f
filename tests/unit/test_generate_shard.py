"""shard_prompts: equal counts on every rank (so equal generate calls), padding dropped, order kept."""

from __future__ import annotations

import pytest

from toolkit.runtime.generate import eval_prompts, shard_prompts, unshard


def _round_trip(prompts: list[str], world: int) -> list[str]:
    # Each rank "generates" by upper-casing; gathering must undo the sharding exactly.
    gathered = [[(i, p.upper()) for i, p in shard_prompts(prompts, r, world)] for r in range(world)]
    return unshard(gathered, len(prompts))


def test_three_prompts_two_ranks() -> None:
    prompts = ["a", "b", "c"]
    shards = [shard_prompts(prompts, r, 2) for r in range(2)]
    assert shards[0] == [(0, "a"), (2, "c")]
    assert shards[1] == [(1, "b"), (None, "c")]  # a padding copy: same call count as rank 0
    assert _round_trip(prompts, 2) == ["A", "B", "C"]


def test_one_prompt_four_ranks() -> None:
    shards = [shard_prompts(["x"], r, 4) for r in range(4)]
    assert shards == [[(0, "x")], [(None, "x")], [(None, "x")], [(None, "x")]]
    assert _round_trip(["x"], 4) == ["X"]


def test_zero_prompts() -> None:
    assert all(shard_prompts([], r, 3) == [] for r in range(3))
    assert _round_trip([], 3) == []


@pytest.mark.parametrize("n,world", [(1, 1), (4, 2), (5, 3), (7, 8), (10, 4)])
def test_equal_counts_and_order(n: int, world: int) -> None:
    prompts = [f"p{i}" for i in range(n)]
    counts = {len(shard_prompts(prompts, r, world)) for r in range(world)}
    assert len(counts) == 1
    assert _round_trip(prompts, world) == [p.upper() for p in prompts]


def test_bad_rank() -> None:
    with pytest.raises(ValueError):
        shard_prompts(["a"], 2, 2)


def test_missing_result_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no result"):
        unshard([[(0, "A")]], 2)


def test_eval_prompts_are_the_masked_prefix() -> None:
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": [9, 10, 11, 12], "labels": [9, 10, 11, 12]},  # plain text: first half
    ]
    assert eval_prompts(rows, 5) == [[5, 6], [9, 10]]
    assert eval_prompts(rows, 1) == [[5, 6]]


class _FakeModel:
    """Stands in for an HF model: records the kwargs its generate receives."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def generate(self, **kwargs: object) -> str:
        self.calls.append(kwargs)
        return "out"


def test_guard_generate_forces_sync_under_zero3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import toolkit.runtime.generate as g

    monkeypatch.setattr(g, "_world", lambda: 2)
    model = g.guard_generate(_FakeModel(), zero3=True)
    assert g.guard_generate(model, zero3=True) is model  # idempotent: wrapped once
    model.generate(synced_gpus=False)  # the call that would hang: overridden, with a warning
    model.generate()  # left to transformers' default otherwise; set explicitly here
    assert [c["synced_gpus"] for c in model.calls] == [True, True]
    assert "synced_gpus=True" in capsys.readouterr().err

    plain = g.guard_generate(_FakeModel(), zero3=False)  # ZeRO-0/1/2: syncing only costs time
    plain.generate(synced_gpus=False)
    assert plain.calls == [{"synced_gpus": False}]
