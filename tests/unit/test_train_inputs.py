"""Bad input to toolkit/train.py: one clear line before any process-group work, non-zero exit,
and no run directory passed off as a result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def train(tmp: Path, *overrides: str, ds: str = "ds_configs/zero2.json") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "toolkit/train.py", "--ds", ds, f"train.run_dir={tmp / 'run'}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.mark.timeout(200)
def test_missing_model_directory(tmp_path: Path) -> None:
    proc = train(tmp_path, f"model.name={tmp_path / 'nope'}")
    assert_one_line_error(proc, "model.name", "local model directory")
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(200)
def test_ds_config_that_check_rejects(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "Lamb"},
                               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    proc = train(tmp_path, ds=str(bad))
    assert_one_line_error(proc, "will not run", "optimizer")
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(200)
def test_data_file_with_wrong_columns(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    proc = train(tmp_path, f"data.source={data}")
    assert_one_line_error(proc, "data.source", "question", "prompt")


@pytest.mark.timeout(200)
def test_sequence_length_above_model_maximum(tmp_path: Path) -> None:
    proc = train(tmp_path, "data.seq_len=4096")
    assert_one_line_error(proc, "data.seq_len=4096", "512")


@pytest.mark.timeout(200)
def test_unknown_config_key_and_bad_type(tmp_path: Path) -> None:
    assert_one_line_error(train(tmp_path, "train.lr=fast"), "train.lr")
    assert_one_line_error(train(tmp_path, "train.bogus=1"), "train.bogus")


def test_compile_value_is_checked() -> None:
    from toolkit.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train\.compile must be auto, off or torch"):
        load_config(None, ["train.compile=inductor"])
    assert load_config(None, []).train.compile == "auto"
    assert load_config(None, ["train.compile=off"]).train.compile == "off"
    assert load_config(None, ["train.compile=true"]).train.compile == "torch"


@pytest.mark.timeout(200)
def test_generation_prompt_file_is_checked_before_launch(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    proc = train(tmp_path, "eval.generate=true", f"eval.generate_source={prompts}")
    assert_one_line_error(proc, f"{prompts}:2", "expected one of")
    assert not (tmp_path / "run").exists()
    proc = train(tmp_path, f"eval.generate_source={prompts}")  # nothing would read it
    assert_one_line_error(proc, "eval.generate_source is set but eval.generate is false")


@pytest.mark.timeout(200)
def test_preference_runs_refuse_what_they_do_not_support_and_name_a_bad_pair_row(tmp_path: Path) -> None:
    proc = train(tmp_path, "train.objective=dpo", "model.task=seq_cls")
    assert_one_line_error(proc, "train.objective=dpo needs model.task=causal_lm, not seq_cls")
    proc = train(tmp_path, "train.objective=reward")
    assert_one_line_error(proc, "train.objective=reward trains a sequence classifier with one output: add model.task=seq_cls")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                     + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    proc = train(tmp_path, "train.objective=dpo", "train.path=raw", f"data.source={pairs}")
    assert_one_line_error(proc, f"{pairs}:2", 'no "rejected" field')
    proc = train(tmp_path, "train.objective=dpo", "train.path=raw", "pref.reference=adapter")
    assert_one_line_error(proc, "pref.reference=adapter needs lora.enabled=true")
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_launch(tmp_path: Path) -> None:
    """Its ids past the embedding would end the first forward in an IndexError; it is one line before launch."""
    from types import SimpleNamespace

    from conftest import write_tokenizer

    from toolkit.config.ds_config import ConfigError
    from toolkit.config.schema import load_config
    from toolkit.runtime.spec import _check_vocabulary

    tok = write_tokenizer(tmp_path / "tok")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    cfg = load_config(None, [f"model.tokenizer={tok}", f"data.source={pairs}"])
    _check_vocabulary(cfg, SimpleNamespace(vocab_size=1000))  # fits
    with pytest.raises(ConfigError, match=r"has \d+ ids but the model tiny embeds 5"):
        _check_vocabulary(cfg, SimpleNamespace(vocab_size=5))


@pytest.mark.timeout(200)
def test_grpo_runs_refuse_what_they_do_not_support_before_launch(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n" + json.dumps({"answer": "c"}) + "\n")
    proc = train(tmp_path, "train.objective=grpo", "train.path=trainer", f"data.source={prompts}")
    assert_one_line_error(proc, "train.objective=grpo runs on the raw path so far: train.path=raw")
    proc = train(tmp_path, "train.objective=grpo", "train.path=raw", "rl.rewards=exact_match")
    assert_one_line_error(proc, "train.objective=grpo needs a prompt file: data.source=prompts.jsonl")
    proc = train(tmp_path, "train.objective=grpo", "train.path=raw", f"data.source={prompts}",
                 f"rl.rewards={tmp_path / 'missing.py'}:fn")
    assert_one_line_error(proc, "rl.rewards:", "missing.py does not exist")
    proc = train(tmp_path, "train.objective=grpo", "train.path=raw", f"data.source={prompts}", "rl.rewards=exact_match")
    assert_one_line_error(proc, f"{prompts}:2", "expected a prompt")
    assert not (tmp_path / "run").exists()
