"""Preference training (train.objective) on 2 CPU ranks, the raw path, in one shared launch: DPO's first loss is ln 2
in every reference mode (the run checks it and stops otherwise), ZeRO-3 trains as ZeRO-0, the reference modes of a
full fine-tune give the same losses, the preference accuracy rises, every objective runs, and a pair file of
strings trains with its rows counted; KTO's unpaired rows likewise (its first loss 0.5, ZeRO-3 = ZeRO-0 = the
Trainer with the precomputed reference, a file with LoRA)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _launch import ROOT, Runs, launch
from conftest import write_tokenizer

pytestmark = pytest.mark.dist

COMMON = ["train.precision=fp32", "memory.every=0", "data.num_samples=48", "data.seq_len=24",
          "train.max_steps=10", "train.lr=1e-3", "train.log_every=1", "train.warmup_steps=1", "train.export=false"]


def _ds(stage: str) -> str:
    return str(ROOT / "ds_configs" / f"{stage}.json")


def _runs(tmp: Path) -> list[dict]:
    runs: list[dict] = []

    def add(name: str, stage: str, *extra: str) -> None:
        path = [] if any(x.startswith("train.path=") for x in extra) else ["train.path=raw"]
        runs.append({"name": name, "argv": ["--ds", _ds(stage), *COMMON, *path, f"train.run_dir={tmp / name}", *extra]})

    add("dpo-lora-zero3", "zero3", "train.objective=dpo", "lora.enabled=true")
    add("dpo-zero0", "zero0", "train.objective=dpo")
    add("dpo-zero3", "zero3", "train.objective=dpo")
    add("dpo-trainer-zero3", "zero3", "train.objective=dpo", "train.path=trainer")
    add("dpo-trainer-zero2-precomputed-accum", "zero2", "train.objective=dpo", "train.path=trainer",
        "pref.reference=precomputed", "train.micro_batch_size=2", "train.grad_accum=2")
    add("dpo-zero2-ref-offload", "zero2", "train.objective=dpo", "pref.reference_offload=true")
    add("dpo-zero0-padded", "zero0", "train.objective=dpo", "data.packing=false")
    # precomputed: stopped at step 5 with a checkpoint, resumed from this run's stored values; another run (another
    # learning rate) then finds them in the cache
    add("dpo-zero3-precomputed", "zero3", "train.objective=dpo", "pref.reference=precomputed", "train.stop_after=5")
    add("dpo-zero3-precomputed", "zero3", "train.objective=dpo", "pref.reference=precomputed", "train.resume=latest")
    # the cache's key holds the ZeRO stage (its forward rounds otherwise in bf16): the same stage finds the values
    add("dpo-precomputed-cached", "zero3", "train.objective=dpo", "pref.reference=precomputed", "train.max_steps=2",
        "train.lr=5e-4")
    for ref in ("engine", "precomputed"):  # held-out pairs: a quarter of them, evaluated at step 2 and at the end
        add(f"dpo-eval-{ref}", "zero2", "train.objective=dpo", f"pref.reference={ref}", "data.eval_fraction=0.25",
            "train.max_steps=4", "train.eval_every=2")
    add("ipo-zero2", "zero2", "train.objective=ipo", "train.max_steps=2")
    add("simpo-zero2", "zero2", "train.objective=simpo", "pref.beta=2.0")  # the paper's scale (2 to 10)
    add("orpo-zero2", "zero2", "train.objective=orpo")
    # a Bradley-Terry reward model: a sequence classifier scoring chosen above rejected; raw ZeRO-0, Trainer ZeRO-3
    add("reward-zero0", "zero0", "train.objective=reward", "model.task=seq_cls", "data.eval_fraction=0.25",
        "train.eval_every=5")
    add("reward-trainer-zero3", "zero3", "train.objective=reward", "model.task=seq_cls", "train.path=trainer",
        "data.eval_fraction=0.25", "train.eval_every=5")
    # KTO: unpaired rows (half desirable); its KL estimate an all-reduce each micro-batch
    add("kto-zero0", "zero0", "train.objective=kto")
    add("kto-zero3", "zero3", "train.objective=kto")
    add("kto-trainer-zero2-precomputed", "zero2", "train.objective=kto", "train.path=trainer",
        "pref.reference=precomputed")
    add("kto-eval-weights", "zero2", "train.objective=kto", "pref.undesirable_weight=1.5", "data.eval_fraction=0.25",
        "train.max_steps=4", "train.eval_every=2")
    tok = write_tokenizer(tmp / "tokenizer")
    kto = tmp / "kto.jsonl"
    with kto.open("w") as f:
        for i in range(20):
            f.write(json.dumps({"prompt": "what did the cat do " + "the dog " * (i % 3),
                                "completion": "sat on the mat" if i % 2 else "ran on the log" if i % 7 else "",
                                "label": bool(i % 2)}) + "\n")
    add("kto-file-lora", "zero2", "train.objective=kto", f"data.source={kto}", f"model.tokenizer={tok}",
        "train.micro_batch_size=2", "train.max_steps=3", "lora.enabled=true")
    pairs = tmp / "pairs.jsonl"
    with pairs.open("w") as f:
        for i in range(20):
            f.write(json.dumps({"prompt": "what did the cat do " + "the dog " * (i % 3), "chosen": "sat on the mat",
                                "rejected": "ran on the log" if i % 5 else "sat on the mat"}) + "\n")
    for packing in ("auto", "false"):  # pairs of different lengths: packed into one row, or padded side by side
        add(f"dpo-file-{packing}", "zero2", "train.objective=dpo", f"data.source={pairs}", f"model.tokenizer={tok}",
            "train.micro_batch_size=2", "train.max_steps=3", "lora.enabled=true", f"data.packing={packing}")
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = Runs(tmp_path_factory.mktemp("pref"))
    launch(tmp, _runs(tmp), timeout=900)
    return tmp


def _lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", ["dpo-lora-zero3", "dpo-zero0", "dpo-zero3", "dpo-zero2-ref-offload", "dpo-file-auto",
                                  "dpo-zero3-precomputed", "dpo-precomputed-cached", "dpo-trainer-zero3",
                                  "dpo-trainer-zero2-precomputed-accum"])
def test_dpo_starts_at_ln2_in_every_reference_mode(runs: Path, name: str) -> None:
    lines = _lines(runs / name)
    assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-5), lines[0]
    assert json.loads((runs / name / "status.json").read_text())["status"] == "completed"
    record = json.loads((runs / name / "resolved.json").read_text())
    assert record["objective"] == "dpo"
    want = "precomputed" if "precomputed" in name else "adapter" if "lora" in name or "file" in name else "engine"
    assert record["reference"] == want


@pytest.mark.timeout(60)
def test_zero3_the_offloaded_and_the_precomputed_reference_train_as_zero0(runs: Path) -> None:
    base = [r["loss"] for r in _lines(runs / "dpo-zero0")]
    assert len(base) == 10
    # the precomputed run stopped at step 5 and resumed: its log holds both halves
    # the Trainer path: the same losses and metrics; and with 2 micro-batches of 2 pairs a step, those of 4 pairs
    for name in ("dpo-zero3", "dpo-zero2-ref-offload", "dpo-zero3-precomputed", "dpo-trainer-zero3",
                 "dpo-trainer-zero2-precomputed-accum"):
        losses = {r["step"]: r["loss"] for r in _lines(runs / name)}
        assert [losses[s] for s in range(1, 11)] == pytest.approx(base, abs=1e-4), name
    margins = [r["rewards/margins"] for r in _lines(runs / "dpo-zero0")]
    assert [r["rewards/margins"] for r in _lines(runs / "dpo-trainer-zero3")] == pytest.approx(margins, abs=1e-5)


@pytest.mark.timeout(60)
def test_the_precomputed_reference_is_kept_for_a_resume_and_reused_from_the_cache(runs: Path) -> None:
    log = (runs / "launch.log").read_text()
    stored = runs / "dpo-zero3-precomputed" / "reference_logps.pt"
    assert stored.is_file()
    assert "reference log-probs of 48 pairs: computed in" in log
    assert f"reference log-probs of 48 pairs: {stored} (this run's)" in log  # the resume did not recompute
    assert "reference log-probs of 48 pairs: the cache (" in log  # the run with another learning rate


@pytest.mark.timeout(60)
def test_packed_pairs_train_as_padded_ones(runs: Path) -> None:
    for packed, padded in (("dpo-zero0", "dpo-zero0-padded"), ("dpo-file-auto", "dpo-file-false")):
        a, b = _lines(runs / packed), _lines(runs / padded)
        assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-5), packed
        assert [r["rewards/margins"] for r in a] == pytest.approx([r["rewards/margins"] for r in b], abs=1e-5)
    record = json.loads((runs / "dpo-file-auto" / "resolved.json").read_text())
    assert record["packing"] is True


@pytest.mark.timeout(60)
def test_the_preference_accuracy_rises(runs: Path) -> None:
    lines = _lines(runs / "dpo-zero0")
    assert lines[0]["rewards/accuracies"] == 0.0  # policy = reference: no pair is won yet
    assert min(r["rewards/accuracies"] for r in lines[-3:]) >= 0.75, [r["rewards/accuracies"] for r in lines]
    assert lines[-1]["rewards/margins"] > 0 and lines[-1]["loss"] < math.log(2)


@pytest.mark.timeout(60)
def test_every_objective_runs(runs: Path) -> None:
    ipo = _lines(runs / "ipo-zero2")
    assert ipo[0]["loss"] == pytest.approx(1 / (4 * 0.1**2), rel=1e-5)  # (0 - 1/(2 beta))^2 at the start
    for name in ("simpo-zero2", "orpo-zero2"):  # reference-free: they learn from the start
        losses = [r["loss"] for r in _lines(runs / name)]
        assert len(losses) == 10 and sum(losses[-3:]) < sum(losses[:3]), (name, losses)


@pytest.mark.timeout(60)
def test_a_pair_file_says_what_became_of_its_rows(runs: Path) -> None:
    log = (runs / "launch.log").read_text()
    assert "data.source: 20 preference pairs from" in log and "16 kept, 4 dropped: chosen and rejected are the same" \
        in log, log[-4000:]
    assert "(tokenized before: " in log  # the second run of the file read its tokens from the cache


@pytest.mark.timeout(60)
def test_the_reward_metrics_reach_tensorboard(runs: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs / "dpo-zero0" / "tb"))
    acc.Reload()
    accuracy = [e.value for e in acc.Scalars("pref/rewards/accuracies")]
    assert accuracy == pytest.approx([r["rewards/accuracies"] for r in _lines(runs / "dpo-zero0")], abs=1e-6)
    assert {"pref/rewards/margins", "pref/logps/chosen", "train/loss"} <= set(acc.Tags()["scalars"])


@pytest.mark.timeout(60)
def test_held_out_pairs_are_evaluated_against_either_reference(runs: Path) -> None:
    evals = {}
    for ref in ("engine", "precomputed"):
        lines = [json.loads(x) for x in (runs / f"dpo-eval-{ref}" / "metrics.jsonl").read_text().splitlines()]
        evals[ref] = [r for r in lines if "eval_loss" in r]
        assert [r["step"] for r in evals[ref]] == [2, 4]
        assert all(r["eval_pairs"] == 12 for r in evals[ref])  # 48 x 0.25, whatever the ranks
    for a, b in zip(evals["engine"], evals["precomputed"], strict=True):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=1e-5)
        assert a["eval_rewards/margins"] == pytest.approx(b["eval_rewards/margins"], abs=1e-5)
    assert evals["engine"][-1]["eval_loss"] < math.log(2)  # the learnable pairs: held-out ones are won too
    assert "12 held-out pairs: computed in" in (runs / "launch.log").read_text()


@pytest.mark.timeout(60)
def test_a_reward_model_learns_to_score_chosen_above_rejected_on_both_paths(runs: Path) -> None:
    raw, trainer = _lines(runs / "reward-zero0"), _lines(runs / "reward-trainer-zero3")
    assert [r["loss"] for r in trainer] == pytest.approx([r["loss"] for r in raw], abs=1e-4)
    assert min(r["rewards/accuracies"] for r in raw[-3:]) >= 0.75, [r["rewards/accuracies"] for r in raw]
    assert raw[-1]["loss"] < raw[0]["loss"] and raw[-1]["rewards/margins"] > 0
    assert "logps/chosen" not in raw[0]  # scores, not log-probs
    held = [json.loads(x) for x in (runs / "reward-zero0" / "metrics.jsonl").read_text().splitlines()
            if "eval_loss" in x]
    # evaluated at 5 and 10 on the held-out quarter (12 pairs; 36 training pairs are memorized before they generalize)
    assert [r["step"] for r in held] == [5, 10] and all(r["eval_pairs"] == 12 for r in held)
    record = json.loads((runs / "reward-zero0" / "resolved.json").read_text())
    assert record["objective"] == "reward" and record["reference"] is None and record["packing"] is False


@pytest.mark.timeout(60)
def test_kto_starts_at_one_half_trains_alike_at_every_stage_and_path_and_reads_unpaired_files(runs: Path) -> None:
    base = _lines(runs / "kto-zero0")
    assert base[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference: 1 - sigmoid(0) every row
    assert base[0]["kl"] == 0.0 and base[-1]["loss"] < 0.45, [r["loss"] for r in base]
    # the mismatched completions follow the chain too (another prompt's): the KL estimate grows as the chain is learnt
    assert sum(r["rewards/accuracies"] for r in base[-3:]) / 3 >= 0.75, [r["rewards/accuracies"] for r in base]
    assert base[-1]["rewards/chosen"] > 0 > base[-1]["rewards/rejected"] and base[-1]["kl"] > 0
    for name in ("kto-zero3", "kto-trainer-zero2-precomputed"):
        assert [r["loss"] for r in _lines(runs / name)] == pytest.approx([r["loss"] for r in base], abs=1e-4), name
    record = json.loads((runs / "kto-trainer-zero2-precomputed" / "resolved.json").read_text())
    assert record["objective"] == "kto" and record["reference"] == "precomputed"
    lines = [json.loads(x) for x in (runs / "kto-eval-weights" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "eval_loss" in r] == [2, 4]
    assert all(r["eval_pairs"] == 12 and "eval_kl" in r for r in lines if "eval_loss" in r)
    log = (runs / "launch.log").read_text()
    assert "data.source: 20 preference unpaired rows from" in log
    assert "18 kept, 2 dropped: an empty completion; 10 desirable, 8 undesirable" in log, log[-3000:]
    assert _lines(runs / "kto-file-lora")[0]["loss"] == pytest.approx(0.5, abs=1e-6)
