"""GRPO's parts on one process: the loss against the formula written out per sequence, the advantages, the reward
entries and their one-line errors, the prompt file's rows, and the settings refused before launch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.runtime.rl import prompts, rewards
from toolkit.runtime.rl.loss import advantages, token_loss


def _reference_loss(seqs: list[dict], eps: float, eps_high: float, beta: float, loss_type: str, max_len: int,
                    normalizer: float) -> float:
    """GRPO per the paper and TRL's docs, a sequence and a token at a time, in plain Python floats."""
    per_seq, total, tokens = [], 0.0, 0
    for s in seqs:
        terms = []
        for lp, old, ref in zip(s["lp"], s["old"], s["ref"], strict=True):
            ratio = math.exp(lp - old)
            clipped = min(max(ratio, 1 - eps), 1 + eps_high)
            term = -min(ratio * s["adv"], clipped * s["adv"])
            term += beta * (math.exp(ref - lp) - (ref - lp) - 1)
            terms.append(term)
        per_seq.append(sum(terms) / len(terms))
        total += sum(terms)
        tokens += len(terms)
    return {"grpo": sum(per_seq) / len(seqs), "bnpo": total / tokens, "dr_grpo": total / (len(seqs) * max_len),
            "dapo": total / normalizer}[loss_type]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_loss_matches_the_formula_per_sequence(loss_type: str) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 1, 4]
    seqs = [{"lp": (torch.randn(n, generator=g) - 2).tolist(), "adv": float(torch.randn(1, generator=g))}
            for n in lengths]
    for s in seqs:  # an old policy off by up to 0.4 nats a token: some ratios are clipped
        s["old"] = [x + float(d) for x, d in zip(s["lp"], torch.rand(len(s["lp"]), generator=g) * 0.8 - 0.4,
                                                 strict=True)]
        s["ref"] = [x + float(d) for x, d in zip(s["lp"], torch.randn(len(s["lp"]), generator=g) * 0.3, strict=True)]
    flat = {k: torch.tensor([x for s in seqs for x in s[k]], dtype=torch.float64) for k in ("lp", "old", "ref")}
    seq = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    adv = torch.tensor([s["adv"] for s in seqs], dtype=torch.float64)
    logps = flat["lp"].clone().requires_grad_(True)
    out = token_loss(logps, flat["old"], flat["ref"], seq, adv, n_seqs=4, epsilon=0.2, epsilon_high=0.28, beta=0.05,
                     loss_type=loss_type, max_completion_length=8, normalizer=6.5)
    want = _reference_loss(seqs, 0.2, 0.28, 0.05, loss_type, 8, 6.5)
    assert float(out.loss.detach()) == pytest.approx(want, rel=1e-10)
    assert out.tokens == sum(lengths) and float(out.clipped) > 0
    out.loss.backward()
    assert torch.isfinite(logps.grad).all()


def test_with_the_rollout_s_own_policy_the_gradient_is_the_advantage_s() -> None:
    """One pass over a rollout: old = logps detached, the ratio is 1 and the loss's gradient is -A per token (bnpo:
    over the tokens), whatever epsilon."""
    logps = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    out = token_loss(logps, logps.detach(), None, torch.tensor([0, 0, 1]), torch.tensor([0.5, -1.0]), n_seqs=2,
                     epsilon=0.2, epsilon_high=0.2, beta=0.0, loss_type="bnpo", max_completion_length=4)
    out.loss.backward()
    assert logps.grad.tolist() == pytest.approx([-0.5 / 3, -0.5 / 3, 1.0 / 3])
    assert float(out.clipped) == 0


def test_advantages_are_normalized_within_each_prompt_s_group() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv, std = advantages(r, 4, "group")
    first = (r[:4] - 0.5) / (r[:4].std() + 1e-4)
    assert adv[:4].tolist() == pytest.approx(first.tolist())
    assert adv[4:].tolist() == [0.0] * 4 and std[1] == 0  # equal rewards: no signal, no NaN
    assert advantages(r, 4, "none")[0][:4].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert advantages(r, 4, "batch", batch_std=2.0)[0][:4].tolist() == pytest.approx(
        [0.5 / 2.0001, -0.5 / 2.0001, -0.5 / 2.0001, 0.5 / 2.0001])


def test_reward_entries_files_and_built_ins(tmp_path: Path) -> None:
    f = tmp_path / "mine.py"
    f.write_text("def a(completions, **kw):\n    return [1.0] * len(completions)\n"
                 "def b(completions, **kw):\n    return [None] * len(completions)\n")
    got = rewards.load(f"{f}:a,b,exact_match,length=4", [1, 2, 3, 4], 8)
    assert [r.name for r in got] == ["mine:a", "mine:b", "exact_match", "length"]
    assert [r.weight for r in got] == [1, 2, 3, 4]
    values, err = rewards.score(got, ["p", "p"], [" yes ", "no"], [[1, 2], [1, 2, 3, 4, 5, 6]],
                                {"answer": ["yes", "yes"]}, [1, 1])
    assert err is None
    assert values[0] == [1.0, 1.0] and all(math.isnan(v) for v in values[1])
    assert values[2] == [1.0, 0.0] and values[3] == [0.0, -0.5]
    fmt = rewards.load(["format=^<a>.*</a>$"], [], 8)[0]
    assert fmt.fn(completions=["<a>x,\ny</a>", "x"]) == [1.0, 0.0]


@pytest.mark.parametrize("spec,weights,message", [
    ("", [], "needs rl.rewards"),
    ("nope.py:f", [], "does not exist"),
    ("exact_match,length", [1.0], "2 reward functions"),
    ("bogus", [], "unknown entry 'bogus'"),
    ("format=(", [], "not a regular expression"),
])
def test_bad_reward_entries_end_in_one_line(spec: str, weights: list, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rewards.load(spec, weights, 8)


def test_a_reward_that_fails_is_named_with_its_prompt_s_line(tmp_path: Path) -> None:
    f = tmp_path / "r.py"
    f.write_text("def picky(completions, answer, **kw):\n"
                 "    return [1.0 / (a - 3) for a in answer]\n"
                 "def short(completions, **kw):\n    return [1.0]\n"
                 "def text(completions, **kw):\n    return ['high'] * len(completions)\n")
    args = (["p"] * 3, ["x"] * 3, [[1]] * 3, {"answer": [1, 3, 5]}, [4, 9, 12])
    _, err = rewards.score(rewards.load(f"{f}:picky", [], 8), *args)
    assert err == "rl.rewards: r:picky raised ZeroDivisionError: float division by zero (the prompt on line 9 of data.source)"
    assert "returned 1 values for 3 completions" in rewards.score(rewards.load(f"{f}:short", [], 8), *args)[1]
    assert "returned 'high' for the prompt on line 4" in rewards.score(rewards.load(f"{f}:text", [], 8), *args)[1]


def test_prompt_rows_text_messages_and_ids(tmp_path: Path, chat_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "what did the cat do", "answer": "sat"},
        {"prompt": [{"role": "user", "content": "where is the dog"}], "answer": "mat"},
        {"input_ids": [5, 6, 7, 8, 9, 10], "answer": "log"}]) + "\n")
    rows, cut = prompts.load(f, tok, max_prompt_length=5)
    assert [r["line"] for r in rows] == [1, 2, 3] and [r["fields"] for r in rows] == [
        {"answer": "sat"}, {"answer": "mat"}, {"answer": "log"}]
    assert rows[2]["prompt_ids"] == [6, 7, 8, 9, 10] and cut == 2  # the chat prompt and the ids kept their ends
    assert rows[1]["prompt_ids"][-2:] == tok(" assistant :", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("row,message", [
    ({"answer": 1}, "expected a prompt"),
    ({"prompt": ""}, "non-empty string"),
    ({"messages": "hi"}, "list of chat messages"),
    ({"input_ids": [1, -2]}, "non-negative ints"),
])
def test_bad_prompt_rows_name_their_line(tmp_path: Path, row: dict, message: str) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=f"p.jsonl:2: .*{message}"):
        prompts.check_file(f)


def test_rows_with_other_fields_ids_past_the_vocabulary_and_text_without_a_tokenizer_are_refused(
        tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"input_ids": [1], "answer": 1}) + "\n" + json.dumps({"input_ids": [2]}) + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:2: fields \[\], the first row's \['answer'\]"):
        prompts.load(f, None, 0)
    f.write_text(json.dumps({"input_ids": [1, 64]}) + "\n")
    with pytest.raises(ConfigError, match=r"p\.jsonl:1: input_ids holds 64, past the model.s 64 token ids"):
        prompts.check_file(f, vocab=64)
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match="need a tokenizer"):
        prompts.check_file(f, need_tokenizer=True)


def test_a_completion_no_function_scores_has_no_advantage() -> None:
    r = torch.tensor([1.0, 0.0, float("nan"), 1.0])
    adv, std = advantages(r, 4, "group")
    assert adv[2] == 0 and float(std[0]) == pytest.approx(float(torch.tensor([1.0, 0.0, 1.0]).std()))
    assert float(adv[:2].sum() + adv[3]) == pytest.approx(0.0, abs=1e-6)  # the others centred on their own mean


def test_rewards_take_numpy_numbers_chat_completions_and_distinct_names(tmp_path: Path) -> None:
    import numpy as np

    f = tmp_path / "n.py"
    f.write_text("import numpy as np\ndef npf(completions, **kw):\n    return [np.float32(0.5)] * len(completions)\n")
    got = rewards.load(f"{f}:npf,format=^a,format=^b,exact_match", [], 8)
    assert [r.name for r in got] == ["n:npf", "format", "format#2", "exact_match"]
    chat = [[{"role": "assistant", "content": "a yes"}], [{"role": "assistant", "content": "b"}]]
    values, err = rewards.score(got, ["p", "p"], chat, [[1], [2]], {"answer": ["a yes", "no"]}, [1, 2])
    assert err is None and values == [[0.5, 0.5], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    assert rewards._number(np.float64(1.5)) and rewards._number(torch.tensor(2.0))
    assert not rewards._number(torch.tensor([1.0, 2.0])) and not rewards._number(True)
    with pytest.raises(ConfigError, match="length=N takes N > 0"):
        rewards.load("length=0", [], 8)


@pytest.mark.parametrize("override,message", [
    ("rl.num_generations=1", "num_generations must be >= 2"),
    ("rl.loss_type=ppo", "loss_type must be one of"),
    ("rl.scale_rewards=rank", "scale_rewards must be one of"),
    ("rl.num_iterations=0", "num_iterations must be >= 1"),
    ("rl.generate_cache=paged", "generate_cache must be auto, static or dynamic"),
    ("rl.temperature=0", "temperature must be > 0"),
])
def test_bad_rl_settings_end_in_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.objective=grpo", override])


def test_trl_s_boolean_scale_rewards_carries_over() -> None:
    assert load_config(None, ["rl.scale_rewards=false"]).rl.scale_rewards == "none"
    assert load_config(None, ["rl.scale_rewards=true"]).rl.scale_rewards == "group"
