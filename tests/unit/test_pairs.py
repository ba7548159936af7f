"""Preference pairs: the row shapes users bring, the prompt masked, truncation and drops counted, bad rows named; and
pairs through one forward, side by side or packed, giving the same log-probs."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.runtime.objectives import pairs as P
from toolkit.runtime.objectives.batch import PRIVATE, PairCollator, logits_token_logps, sequence_sums
from toolkit.runtime.objectives.logprobs import SelectedHead
from toolkit.runtime.objectives.losses import pair_loss


@pytest.fixture(scope="module")
def tok(chat_tokenizer: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_tokenizer, local_files_only=True)


def _words(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids)


def test_string_pairs_mask_the_prompt_and_end_with_eos(tok: Any) -> None:
    pair = P.tokenize({"prompt": "what did the cat do", "chosen": "sat on the mat", "rejected": "ran"}, tok, 64, "r")
    assert pair.status == P.OK
    chosen, rejected = pair.rows()
    assert chosen["input_ids"] == pair.prompt + pair.chosen and pair.chosen[-1] == tok.eos_token_id
    assert chosen["labels"] == [-100] * len(pair.prompt) + pair.chosen
    assert _words(tok, rejected["input_ids"][len(pair.prompt):]) == "ran </s>"


def test_conversations_sharing_their_prompt_and_split_ones_give_the_same_pair(tok: Any) -> None:
    user = [{"role": "user", "content": "what did the cat do"}]
    good, bad = {"role": "assistant", "content": "sat on the mat"}, {"role": "assistant", "content": "no"}
    shared = P.tokenize({"chosen": [*user, good], "rejected": [*user, bad]}, tok, 64, "r")
    split = P.tokenize({"prompt": user, "chosen": [good], "rejected": [bad]}, tok, 64, "r")
    assert shared == split and shared.status == P.OK
    assert _words(tok, shared.prompt) == tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True).strip()
    assert _words(tok, shared.chosen) == "sat on the mat </s>"


def test_truncation_keeps_the_prompts_end_and_cuts_both_completions_alike() -> None:
    prompt, chosen, rejected = list(range(100, 140)), list(range(10)), list(range(20, 26))
    pair = P.truncate(prompt, chosen, rejected, 24)
    assert pair.status == P.TRUNCATED
    assert pair.prompt == prompt[-14:]  # the room the longer completion leaves, and it is at least half the length
    assert pair.chosen == chosen and pair.rejected == rejected
    pair = P.truncate(prompt, list(range(30)), rejected, 24)
    assert pair.prompt == prompt[-12:] and pair.chosen == list(range(12)) and pair.rejected == rejected
    assert P.truncate([1, 2], [3], [4], 24).status == P.OK


def test_empty_or_identical_completions_are_dropped_and_counted(tok: Any) -> None:
    rows = [{"prompt": "a", "chosen": "yes", "rejected": "no"}, {"prompt": "a", "chosen": "", "rejected": "no"},
            {"prompt": "a", "chosen": "yes", "rejected": "yes"}, {"prompt": "a " * 40, "chosen": "yes", "rejected": "no"},
            # the same first 12 words: the same once cut to the room truncation leaves
            {"prompt": "a " * 40, "chosen": "the cat " * 6 + "sat", "rejected": "the cat " * 6 + "ran"}]
    got = [P.tokenize(r, tok, 16, f"r{i}") for i, r in enumerate(rows)]
    assert [p.status for p in got] == [P.OK, P.EMPTY, P.IDENTICAL, P.TRUNCATED, P.IDENTICAL]
    assert P.counts(got) == {"kept": 1, "truncated": 1, "dropped: an empty completion": 1,
                             "dropped: chosen and rejected are the same": 2}


@pytest.mark.parametrize("row,msg", [
    ({"prompt": "a", "chosen": "b"}, 'no "rejected" field'),
    ({"prompt": 3, "chosen": "b", "rejected": "c"}, '"prompt" must be a non-empty string'),
    ({"prompt": "", "chosen": "b", "rejected": "c"}, '"prompt" must be a non-empty string'),
    ({"prompt": "a", "chosen": 5, "rejected": "c"}, '"chosen" must be a string or a list'),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
     'last turn of "chosen"'),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "c"}]}, "must share every turn"),
])
def test_a_bad_row_names_itself_and_its_field(tok: Any, row: dict[str, Any], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg) as e:
        P.tokenize(row, tok, 64, "pairs.jsonl:7")
    assert str(e.value).startswith("pairs.jsonl:7: ")


@pytest.fixture(scope="module")
def model() -> Any:
    from toolkit.config.schema import load_config
    from toolkit.runtime.model import build_model, model_config

    cfg = load_config(None, [])
    return build_model(cfg, model_config(cfg)).eval()


def _pairs(n: int, vocab: int) -> list[P.Pair]:
    rng = random.Random(0)
    ids = lambda k: [rng.randrange(4, vocab) for _ in range(k)]  # noqa: E731
    return [P.Pair(ids(rng.randint(2, 9)), ids(rng.randint(1, 7)), ids(rng.randint(1, 7))) for _ in range(n)]


def _logps(model: Any, batch: dict[str, Any], chunk: int | None) -> Any:
    """Each pair's log-probs: through the chunked head (chunk), or from the whole logits (None)."""
    inputs = {k: v for k, v in batch.items() if k not in (*PRIVATE, "labels")}
    with torch.no_grad():
        if chunk is None:
            tok = logits_token_logps(model(**inputs, use_cache=False).logits, batch["labels"])[0]
        else:
            head = SelectedHead.of(model, chunk)
            with head.targets(batch["labels"]):  # a cache turns transformers' packed detection off
                tok = model(**inputs, use_cache=False).logits
            head.remove()
    return sequence_sums(tok, batch["labels"], batch["seq_ids"], batch["sequences"])


def test_packed_pairs_give_the_log_probs_of_the_same_pairs_side_by_side(model: Any) -> None:
    pairs = _pairs(6, model.config.vocab_size)
    rows = [P.as_row(p) for p in pairs]
    side = PairCollator(pad_id=0)(rows)
    packed = PairCollator(pad_id=0, packed=True)(rows)
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed  # one row, no padding
    assert packed["input_ids"].numel() == sum(len(p.prompt) * 2 + len(p.chosen) + len(p.rejected) for p in pairs)
    flat = _logps(model, side, chunk=5)
    got = _logps(model, packed, chunk=7)
    whole = _logps(model, side, chunk=None)  # the whole logits, for models whose head is not a plain matrix
    for a, b, c in ((flat.chosen, got.chosen, whole.chosen), (flat.rejected, got.rejected, whole.rejected)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    assert flat.chosen_tokens.tolist() == [len(p.chosen) for p in pairs] == got.chosen_tokens.tolist()
    # against a plain log-softmax over the whole logits, one pair at a time
    for i, p in enumerate(pairs):
        ids = torch.tensor([p.prompt + p.rejected])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        want = logits[torch.arange(len(p.prompt) - 1, ids.shape[1] - 1), torch.tensor(p.rejected)].sum()
        assert float(got.rejected[i]) == pytest.approx(float(want), abs=1e-4)
    # the policy as its own reference: every objective with a reference starts at ln 2 (DPO) and 1/(2 beta)^2 (IPO)
    dpo = pair_loss("dpo", got, got, beta=0.1).loss
    assert torch.allclose(dpo, torch.full_like(dpo, math.log(2)))
    assert torch.allclose(pair_loss("ipo", got, got, beta=0.1).loss, torch.full_like(dpo, 25.0))


def test_the_chunked_head_gives_the_gradients_of_the_whole_logits(model: Any) -> None:
    """The backward through the chunked head (the hidden states' and the head's gradients) is the plain one's."""
    rows = [P.as_row(p) for p in _pairs(3, model.config.vocab_size)]
    batch = PairCollator(pad_id=0, packed=True)(rows)
    inputs = {k: v for k, v in batch.items() if k not in (*PRIVATE, "labels")}
    grads = []
    for chunked in (True, False):
        model.zero_grad()
        if chunked:
            head = SelectedHead.of(model, 4)
            with head.targets(batch["labels"]):
                tok = model(**inputs, use_cache=False).logits
        else:
            tok = logits_token_logps(model(**inputs, use_cache=False).logits, batch["labels"])[0]
        s = sequence_sums(tok, batch["labels"], batch["seq_ids"], batch["sequences"])
        (s.chosen - 0.5 * s.rejected).sum().backward()
        grads.append([q.grad.clone() for q in (model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight)])
    SelectedHead.of(model).remove()
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_softcapped_head_takes_the_whole_logits(model: Any) -> None:
    model.config.final_logit_softcapping = 30.0
    try:
        assert SelectedHead.of(model) is None
    finally:
        model.config.final_logit_softcapping = None


def test_reference_config_is_zero3_without_an_optimizer_at_any_policy_stage() -> None:
    from toolkit.runtime.objectives.reference import mode_of, reference_config

    policy = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 8,
              "gradient_accumulation_steps": 1, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"},
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"},
                                                              "reduce_bucket_size": 5e8}}
    ref = reference_config(policy, offload=True)
    assert ref == {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 8,
                   "gradient_accumulation_steps": 1,
                   "zero_optimization": {"reduce_bucket_size": 5e8, "stage": 3,
                                         "offload_param": {"device": "cpu", "pin_memory": True}}}
    assert mode_of("auto", lora=True)[0] == "adapter" and mode_of("auto", lora=False)[0] == "engine"
    with pytest.raises(ConfigError, match=r"needs lora\.enabled=true"):
        mode_of("adapter", lora=False)
    with pytest.raises(ConfigError, match="must be one of"):
        mode_of("replica", lora=False)


@pytest.mark.timeout(300)
def test_the_reference_engine_is_a_frozen_zero3_copy_with_the_policys_logits(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    p = subprocess.run([sys.executable, str(here / "_reference_check.py"), str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=280)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert got["maxdiff"] < 1e-5 and got["partitioned"] and got["trainable"] == 0, got
    assert got["optimizer"] == "DeepSpeedZeRoOffload", got  # DeepSpeed's inference engine: no optimizer states


def test_lora_adapters_off_give_the_base_models_logits(model: Any) -> None:
    from toolkit.config.schema import load_config
    from toolkit.runtime.model import apply_lora, build_model, model_config
    from toolkit.runtime.objectives.reference import adapters_off

    cfg = load_config(None, ["lora.enabled=true"])
    plain = load_config(None, [])
    base = build_model(plain, model_config(plain)).eval()
    ids = torch.randint(4, base.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = base(input_ids=ids).logits
        policy = apply_lora(cfg, base)
        for p in policy.parameters():  # adapters that changed the output (LoRA's B starts at zero)
            if p.requires_grad:
                p.add_(0.05)
        assert not torch.allclose(policy(input_ids=ids).logits, want)
        with adapters_off(policy):
            got = policy(input_ids=ids).logits
    torch.testing.assert_close(got, want)


def test_a_pair_file_is_tokenized_once_into_the_cache(tmp_path: Path, tok: Any) -> None:
    """The second read comes from the cache, the same rows; another max_length is another entry."""
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": "what did the cat do", "chosen": "sat on the mat",
                                       "rejected": "ran on the log" if i % 3 else "sat on the mat"}) + "\n"
                           for i in range(10)))
    first, said = P.load_cached(src, tok, 24, "data.source", tmp_path / "cache")
    again, said_again = P.load_cached(src, tok, 24, "data.source", tmp_path / "cache")
    assert again == first and len(first) == 6
    assert "tokenized before" not in said and said_again.startswith(said + " (tokenized before: ")
    _, other = P.load_cached(src, tok, 12, "data.source", tmp_path / "cache")
    assert "tokenized before" not in other and len(list((tmp_path / "cache" / "pairs").glob("*.pt"))) == 2


def test_stored_reference_values_are_found_by_key_or_on_a_resume_by_model_and_pairs(tmp_path: Path) -> None:
    """Another rank count trims another number of rows and changes the key; a resume still finds each pair's value
    (the first n of the same pairs, the same model), a fresh run does not; a corrupt file is no file."""
    from toolkit.runtime.objectives import precompute as pc

    rows = [P.as_row(p) for p in _pairs(6, 50)]
    hashes = pc.row_hashes(rows)
    saved = {"key": "k-2ranks", "model_key": "m", "rows": hashes, "held": [], "logps": torch.arange(12.0).view(6, 2)}
    assert pc._matches(saved, "k-2ranks", "m", hashes, [], resumed=False) is saved
    four = pc._matches(saved, "k-4ranks", "m", hashes[:4], [], resumed=True)
    assert four is not None and four["logps"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pc._matches(saved, "k-4ranks", "m", hashes[:4], [], resumed=False) is None  # a fresh run computes
    assert pc._matches(saved, "k-4ranks", "other model", hashes[:4], [], resumed=True) is None
    assert pc._matches(saved, "k-4ranks", "m", hashes[1:5], [], resumed=True) is None  # other pairs
    bad = tmp_path / "reference_logps.pt"
    bad.write_bytes(b"not a torch file")
    assert pc._load(bad) is None
    pc.save_atomic(bad, saved)
    assert pc._load(bad)["key"] == "k-2ranks"


def test_kto_rows_take_the_next_rows_completion_as_their_mismatched_one(tmp_path: Path, tok: Any) -> None:
    rows = [{"prompt": "what did the cat do", "completion": "sat on the mat", "label": True},
            {"prompt": "what did the dog do", "completion": "ran on the log", "label": False},
            {"prompt": "and the bird", "completion": "", "label": True},  # empty: dropped, never a partner
            {"prompt": [{"role": "user", "content": "hi"}],
             "completion": [{"role": "assistant", "content": "hello"}], "label": False}]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    P.check_file(path, "data.source", kto=True)
    got, note = P.load_file(path, tok, 64, "data.source", kto=True)
    assert [r["label"] for r in got] == [1, 0, 0]
    assert got[0]["rejected"] == got[1]["chosen"] and got[1]["rejected"] == got[0]["chosen"]  # strings with strings
    assert got[2]["rejected"] == got[2]["chosen"]  # the only conversation: its own completion
    assert "4 preference unpaired rows" in note and "1 dropped: an empty completion" in note
    assert "1 desirable, 2 undesirable" in note
    batch = PairCollator(pad_id=0, packed=True)(got[:2])
    assert batch["kto_labels"] == [1, 0] and "kto_labels" in PRIVATE
    cached, _ = P.load_cached(path, tok, 64, "data.source", tmp_path / "cache", kto=True)
    again, note = P.load_cached(path, tok, 64, "data.source", tmp_path / "cache", kto=True)
    assert again == cached == got and "tokenized before" in note


@pytest.mark.parametrize(("row", "msg"), [
    ({"prompt": "p", "completion": "c"}, 'no "label" field'),
    ({"prompt": "p", "completion": "c", "label": 1}, '"label" must be true or false'),
    ({"prompt": "p", "chosen": "c", "label": True}, 'no "completion" field'),
    ({"prompt": "", "completion": "c", "label": True}, '"prompt" must be a non-empty string'),
    ({"prompt": "p", "completion": [{"role": "user", "content": "c"}], "label": True}, "assistant's turn"),
])
def test_a_bad_kto_row_names_itself_and_its_field(tmp_path: Path, row: dict[str, Any], msg: str) -> None:
    path = tmp_path / "kto.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c", "label": True}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=msg) as e:
        P.check_file(path, "data.source", kto=True)
    assert "kto.jsonl:2" in str(e.value)


def test_synthetic_kto_rows_alternate_desirable_and_not() -> None:
    rows = P.synthetic_kto(5, 16, 64, 0)
    assert [r["label"] for r in rows] == [1, 0, 1, 0, 1]
    # each mismatched completion is another prompt's: the next row but one (the next shares the prompt)
    assert [r["rejected"] for r in rows] == [rows[k]["chosen"] for k in (2, 2, 4, 4, 0)]


def test_partners_skip_empty_rows_other_shapes_and_the_same_prompt_and_scale() -> None:
    assert P.partners(["s", "s", "s", "m"], ["a", "a", "b", "c"], [True, True, False, True]) == [1, 0, 0, 3]
    # a's answers side by side: the next row with another prompt
    assert P.partners(["s"] * 4, ["a", "a", "b", "b"], [True] * 4) == [2, 2, 0, 0]
    # a file of 200,000 rows: one pass (the quadratic search this replaced took minutes at this size)
    assert len(P.partners(["s"] * 200_000, [str(i // 2) for i in range(200_000)], [True] * 200_000)) == 200_000
