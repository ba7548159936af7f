"""Data files tokenized once into a memory-mapped cache (toolkit/runtime/data/corpus.py), their formats, packing
that keeps samples apart, the held-out split and the eval batches (toolkit/runtime/loops/evaluate.py). One process,
no process group: the builder is this process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import write_tokenizer

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.runtime.data import corpus
from toolkit.runtime.data.batches import Collator, Rows, build_rows, rank_batches, split_eval


@pytest.fixture()
def tok(chat_tokenizer: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_tokenizer)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(i: int) -> dict:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what did the cat do"},
                         {"role": "assistant", "content": "the cat sat on the mat"},
                         {"role": "user", "content": "where is it"},
                         {"role": "assistant", "content": "on the log " * (1 + i % 3)}]}


def _cfg(tmp: Path, source: Path, *extra: str):
    # rows one by one (packing, the default for causal-LM files, is asked for where a test packs)
    return load_config(None, [f"data.source={source}", f"data.cache_dir={tmp / 'cache'}", "data.seq_len=64",
                              "data.packing=false", *extra])


def _words(tok, ids: list[int]) -> str:
    return " ".join(tok.convert_ids_to_tokens([i for i in ids if i != -100]))


def test_messages_train_on_the_assistant_turns_only(tmp_path: Path, tok) -> None:
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i) for i in range(8)])
    rows, held = build_rows(_cfg(tmp_path, src), 1000, 0, tok)
    assert held is None and len(rows) == 8
    r = rows[1]
    assert _words(tok, r["input_ids"]).startswith("<s> system : be brief </s> <s> user : what did the cat do </s>")
    # exactly the two assistant replies and their end-of-turn tokens: no role markers, no user text
    assert _words(tok, r["labels"]) == "the cat sat on the mat </s> on the log on the log </s>"


def test_the_cache_is_built_once_and_keyed_by_what_changes_the_tokens(tmp_path: Path, tok, capsys,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    src = _jsonl(tmp_path / "chat.jsonl", [_chat(i) for i in range(8)])
    built = []
    real = corpus.build
    monkeypatch.setattr(corpus, "build", lambda *a, **k: built.append(1) or real(*a, **k))
    first, _ = build_rows(_cfg(tmp_path, src), 1000, 0, tok)
    again, _ = build_rows(_cfg(tmp_path, src), 1000, 0, tok)
    assert len(built) == 1 and "reusing the tokenized cache" in capsys.readouterr().out
    assert [again[i] for i in range(8)] == [first[i] for i in range(8)]
    build_rows(_cfg(tmp_path, src, "data.seq_len=32"), 1000, 0, tok)  # another seq_len: another cache
    build_rows(_cfg(tmp_path, src, "data.packing=true"), 1000, 0, tok)
    assert len(built) == 3
    src.write_text(src.read_text() + json.dumps(_chat(9)) + "\n")  # the file changed: rebuilt
    assert len(build_rows(_cfg(tmp_path, src), 1000, 0, tok)[0]) == 9 and len(built) == 4
    other = write_tokenizer(tmp_path / "tok2", chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    from transformers import AutoTokenizer

    build_rows(_cfg(tmp_path, src), 1000, 0, AutoTokenizer.from_pretrained(other))  # another template
    assert len(built) == 5


def test_bad_rows_and_settings_get_one_line_with_counts(tmp_path: Path, tok, capsys) -> None:
    bad = [_chat(0), {"messages": [{"role": "wizard", "content": "hello"}]}, {"messages": [{"role": "robot", "content": "a"}]},
           {"messages": "hello"}]
    with pytest.raises(ConfigError, match=r"2 rows have a role outside system, user, assistant, tool; 1 rows are not"):
        build_rows(_cfg(tmp_path, _jsonl(tmp_path / "bad.jsonl", bad)), 1000, 0, tok)
    plain = write_tokenizer(tmp_path / "plain", chat_template=None)
    from transformers import AutoTokenizer

    with pytest.raises(ConfigError, match=r"data.format=messages needs a chat template"):
        build_rows(_cfg(tmp_path, _jsonl(tmp_path / "ok.jsonl", [_chat(0)])), 1000, 0,
                   AutoTokenizer.from_pretrained(plain))
    # too long: prompt/response truncated (said, with the count), a prompt that fills seq_len dropped (said)
    rows = [{"prompt": "what did the cat do", "response": "the cat sat on the mat " * 3},
            {"prompt": "the dog " * 10, "response": "yes"}, {"prompt": "a", "response": "no"}]
    got, _ = build_rows(_cfg(tmp_path, _jsonl(tmp_path / "pr.jsonl", rows), "data.seq_len=12"), 1000, 0, tok)
    err = capsys.readouterr().err
    assert "1 of 3 rows are longer than data.seq_len=12 and were truncated to 12 tokens" in err
    assert "1 of 3 rows were dropped: nothing to learn within data.seq_len=12" in err
    assert len(got) == 2 and all(len(r["input_ids"]) <= 12 for r in got)
    # text: long documents are split into seq_len samples, every token trained on
    txt = tmp_path / "doc.txt"
    txt.write_text("the cat sat on the mat " * 5 + "\n" + "yes no\n")
    got, _ = build_rows(_cfg(tmp_path, txt, "data.seq_len=8"), 1000, 0, tok)
    assert [len(r["input_ids"]) for r in got] == [8, 8, 8, 7, 3]  # 30 words + EOS, then 2 words + EOS
    assert "1 of 2 rows are longer than data.seq_len=8 and were split into samples of at most 8 tokens" in \
        capsys.readouterr().err


def test_columns_that_do_not_fit_the_format_are_refused_before_launch(tmp_path: Path) -> None:
    from toolkit.runtime.data.batches import check_data_file

    src = _jsonl(tmp_path / "x.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(ConfigError, match=r"data.format=messages needs 'messages'"):
        check_data_file(_cfg(tmp_path, src, "data.format=messages"))
    with pytest.raises(ConfigError, match=r"data.eval_source: .* is not a file"):
        check_data_file(_cfg(tmp_path, src, "data.format=text", "data.text_field=question",
                             f"data.eval_source={tmp_path / 'missing.jsonl'}"))
    with pytest.raises(ConfigError, match="not both"):
        _cfg(tmp_path, src, f"data.eval_source={src}", "data.eval_fraction=0.1")


def _tiny_causal(kind: str, attn: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    if attn == "varlen":  # the toolkit's attention (toolkit/runtime/attention/): on CPU its per-document reference
        from toolkit.runtime.attention.interface import NAME, register, watch_boundaries

        register()
        watch_boundaries(model)
        attn = NAME
    model.config._attn_implementation = attn
    model.config.use_cache = False  # as runtime/model.py sets it under packing
    return model.eval()


def _per_sample_losses(logits: torch.Tensor, labels: torch.Tensor, starts: list[tuple[int, int, int]]) -> list[float]:
    """Token-mean loss of each sample (row, start, length) of a batch, with HF's one-position shift."""
    out = []
    for row, s, n in starts:
        lg, lb = logits[row, s:s + n - 1], labels[row, s + 1:s + n]
        out.append(float(torch.nn.functional.cross_entropy(lg.double(), lb, ignore_index=-100)))
    return out


@pytest.mark.parametrize(("kind", "attn"), [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"),
                                            ("llama", "varlen"), ("gpt2", "varlen")])
def test_packed_samples_lose_exactly_what_they_lose_alone(kind: str, attn: str) -> None:
    """CPU fp32: the same samples packed into blocks and run one by one give the same per-sample losses."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for n in (7, 12, 5, 9, 11, 3):
        ids = torch.randint(4, 64, (n,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})
    batch = {"input_ids": [s["input_ids"] for s in samples], "labels": [s["labels"] for s in samples]}
    blocks = corpus.pack_batch(batch, 24)
    # best fit, longest first: 12 + 11 in one block, 9 + 7 + 5 + 3 filling the other
    assert [sum(x) for x in blocks["seq_lens"]] == [23, 24] and blocks["seq_lens"][1] == [7, 5, 9, 3]
    rows = [{k: blocks[k][i] for k in blocks} for i in range(len(blocks["input_ids"]))]
    model = _tiny_causal(kind, attn)
    packed = Collator(pad_id=0, boundaries=attn == "varlen")(rows)
    assert "attention_mask" not in packed and packed["position_ids"][0, -1] == 0  # the pad after block 1
    if attn == "varlen":  # the pad is a segment of its own
        assert packed["cu_seq_lens_q"].tolist() == [0, 12, 23, 24, 31, 36, 45, 48] and packed["max_length_q"] == 12
    with torch.no_grad():
        inputs = {k: v for k, v in packed.items() if k != "labels"}
        logits = model(**inputs).logits
        where = []
        for row, lens in enumerate(blocks["seq_lens"]):
            s = 0
            for n in lens:
                where.append((row, s, n))
                s += n
        got = _per_sample_losses(logits, packed["labels"], where)
        alone = []
        in_blocks = [next(smp for smp in samples if smp["input_ids"] == rows[r]["input_ids"][s:s + n])
                     for r, s, n in where]  # the samples in the order the blocks hold them
        for smp in in_blocks:
            ids = torch.tensor([smp["input_ids"]])
            lab = torch.tensor([smp["labels"]])
            alone += _per_sample_losses(model(input_ids=ids).logits, lab, [(0, 0, ids.shape[1])])
    # the first label of a packed sample is -100 (it would be predicted across the boundary); the shift
    # never uses a sample's first label anyway, so the losses compare exactly
    assert len(got) == len(alone) == 6
    for a, b in zip(got, alone, strict=True):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (got, alone)
    # the opposite control: the same blocks as one causal stream (positions running on) differ
    with torch.no_grad():
        stream = model(input_ids=packed["input_ids"]).logits
    assert max(abs(a - b) for a, b in zip(_per_sample_losses(stream, packed["labels"], where), alone, strict=True)) > 1e-3


def test_token_counter_leaves_the_padding_of_packed_blocks_out() -> None:
    from toolkit.observe.metrics import TokenCounter

    rows = [{"input_ids": [5] * 7, "labels": [5] * 7, "seq_lens": [3, 4]},
            {"input_ids": [5] * 4, "labels": [5] * 4, "seq_lens": [2, 2]}]
    c = TokenCounter()
    c.add(Collator(pad_id=0)(rows))
    assert c.tokens == 11 and c.samples == 2


def test_held_out_split_is_seeded_disjoint_and_complete() -> None:
    rows = Rows([{"i": i} for i in range(100)])
    train, held = split_eval(rows, 0.1, seed=3)
    got_t, got_h = [r["i"] for r in train], [r["i"] for r in held]
    assert len(got_h) == 10 and sorted(got_t + got_h) == list(range(100)) and got_t == sorted(got_t)
    assert [r["i"] for r in split_eval(rows, 0.1, seed=3)[1]] == got_h
    assert [r["i"] for r in split_eval(rows.limited(50), 0.2, seed=3)[1]] != []
    with pytest.raises(ConfigError, match="leaves no training rows"):
        split_eval(Rows([{"i": 0}]), 0.5, seed=0)


@pytest.mark.parametrize(("n", "micro", "world"), [(10, 2, 2), (3, 4, 2), (1, 1, 3), (17, 3, 4)])
def test_every_rank_runs_the_same_number_of_eval_batches_and_every_row_once(n: int, micro: int, world: int) -> None:
    per_rank = [rank_batches(n, micro, r, world) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    seen = sorted(i for b in per_rank for batch in b for i in batch if i >= 0)
    assert seen == list(range(n))
