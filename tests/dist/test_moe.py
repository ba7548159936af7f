"""Mixture-of-Experts models (toolkit/runtime/moe/) on 2 CPU ranks through the real `deepspeed` launcher, fp32: the
tiny Qwen3-MoE, Mixtral and OLMoE presets (8 experts, top-2, transformers' grouped_mm experts) train at ZeRO-2 and
ZeRO-3 with ZeRO-0's losses, each rank on its own rows; and a local Qwen3-MoE directory with 16 experts, top-1, on
8-token rows, so that every forward leaves at least 8 experts without a token. A hang fails the launch's timeout.
All runs share one launch (tests/dist/_multi_train.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import ROOT, Runs, launch, reload_logits

pytestmark = pytest.mark.dist

COMMON = ["train.precision=fp32", "train.warmup_steps=1", "memory.every=0", "train.export=false",
          "train.max_steps=3", "train.micro_batch_size=2", "data.num_samples=24"]
STAGES = ("zero0", "zero2", "zero3")
FAMILIES = {"tiny-qwen3-moe": ("raw", "trainer"), "tiny-mixtral": ("raw",), "tiny-olmoe": ("raw",)}
AUTOEP = (("raw", "zero3"), ("trainer", "zero2"))


def _sparse_dir(out: Path) -> Path:
    """16 experts, top-1: a forward over 8 tokens routes to at most 8 of them."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
                         num_experts_per_tok=1, norm_topk_prob=True, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return out


def _runs(tmp: Path) -> list[dict]:
    runs: list[dict] = []
    for model, paths in FAMILIES.items():
        for path in paths:
            for stage in STAGES:
                runs.append({"name": f"{model}-{path}-{stage}",
                             "argv": ["--ds", str(ROOT / "ds_configs" / f"{stage}.json"), *COMMON, f"model.name={model}",
                                      f"train.path={path}", f"train.run_dir={tmp / f'{model}-{path}-{stage}'}"]})
    # ZeRO-3 saves: an HF export that must reload to the engine's logits, and a resume on the same curve
    for path in ("raw", "trainer"):
        runs.append({"name": f"export-{path}", "argv": [
            "--ds", str(ROOT / "ds_configs" / "zero3.json"), *COMMON, "model.name=tiny-qwen3-moe", f"train.path={path}",
            "train.export=true", "train.save_probe=true", "eval.generate=true", "eval.max_new_tokens=8",
            f"train.run_dir={tmp / f'export-{path}'}"]})
    resume = ["--ds", str(ROOT / "ds_configs" / "zero3.json"), *COMMON, "model.name=tiny-qwen3-moe", "train.path=raw",
              f"train.run_dir={tmp / 'resume'}"]
    runs += [{"name": "resume", "argv": [*resume, "train.stop_after=2"]},
             {"name": "resume", "argv": [*resume, "train.resume=latest"]}]
    runs += _aux_runs(tmp, world=2)
    sparse = _sparse_dir(tmp / "sparse-moe")
    for stage in STAGES:
        runs.append({"name": f"sparse-{stage}",
                     "argv": ["--ds", str(ROOT / "ds_configs" / f"{stage}.json"), *COMMON, f"model.name={sparse}",
                              "train.path=raw", "data.seq_len=8", "train.micro_batch_size=1",
                              f"train.run_dir={tmp / f'sparse-{stage}'}"]})
    # DeepSpeed's AutoEP, each rank 4 of the 8 experts: last, as its expert-parallel groups stay in the process
    for path, stage in AUTOEP:
        ds = json.loads((ROOT / "ds_configs" / f"{stage}.json").read_text())
        ds["expert_parallel"] = {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}
        (tmp / f"autoep-{stage}.json").write_text(json.dumps(ds))
        runs.append({"name": f"autoep-{path}-{stage}",
                     "argv": ["--ds", str(tmp / f"autoep-{stage}.json"), *COMMON, "model.name=tiny-qwen3-moe",
                              f"train.path={path}", f"train.run_dir={tmp / f'autoep-{path}-{stage}'}",
                              # 3 prompts on 2 ranks: AutoEP's all-to-all in every forward needs them in lockstep
                              "eval.generate=true", "eval.max_new_tokens=6"]})
    return runs


def _aux_runs(tmp: Path, world: int) -> list[dict]:
    """The load-balancing loss at a large weight (0.5), one row per micro-batch: on 2 ranks with accumulation 1
    and 2, on 1 rank with 2 and 4. Each pair (2 x 1 and 1 x 2, 2 x 2 and 1 x 4) trains on the same micro-batches
    per step, so the gradients must be the same."""
    out = []
    for path in ("raw", "trainer"):
        for ga in ((1, 2) if world == 2 else (2, 4)):
            name = f"aux-{path}-w{world}-ga{ga}"
            out.append({"name": name, "argv": [
                "--ds", str(ROOT / "ds_configs" / "zero2.json"), *COMMON, "model.name=tiny-qwen3-moe", f"train.path={path}",
                "moe.aux_loss_coef=0.5", "train.micro_batch_size=1", f"train.grad_accum={ga}", "data.num_samples=16",
                f"train.run_dir={tmp / name}"]})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = Runs(tmp_path_factory.mktemp("moe"))
    launch(tmp, _runs(tmp), 2, "launch", timeout=600)
    launch(tmp, _aux_runs(tmp, world=1), 1, "launch1", timeout=600)
    return tmp


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)]


@pytest.mark.timeout(700)  # the first test pays the shared launch (pytest-timeout counts fixture setup)
def test_every_moe_run_completes(runs: Path) -> None:
    for run in json.loads((runs / "launch.json").read_text()) + json.loads((runs / "launch1.json").read_text()):
        assert json.loads((runs / run["name"] / "status.json").read_text())["status"] == "completed", run["name"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [f"{m}-{p}" for m, paths in FAMILIES.items() for p in paths] + ["sparse"])
def test_zero2_and_zero3_train_moe_models_as_zero0(runs: Path, case: str) -> None:
    ref = _losses(runs / f"{case}-zero0")
    assert len(ref) == 3 and ref[-1] < ref[0]
    for stage in ("zero2", "zero3"):
        got = _losses(runs / f"{case}-{stage}")
        assert got == pytest.approx(ref, rel=1e-5), (stage, got, ref)


@pytest.mark.timeout(60)
def test_the_run_says_its_experts_and_leaves(runs: Path) -> None:
    log = (runs / "launch.log").read_text()
    assert "load-balancing loss x 0.001 (moe.aux_loss_coef=auto)" in log  # Qwen3-MoE's own coefficient
    assert "load-balancing loss x 0.01 (moe.aux_loss_coef=auto)" in log  # OLMoE's
    assert ("experts: 8 per layer in 2 layers (Qwen3MoeSparseMoeBlock), top-2, backend grouped_mm" in log)
    # DeepSpeed's default leaves (Mixtral, Qwen2/3-MoE blocks) at ZeRO-3; OLMoE's fused experts need none
    assert "ZeRO-3 leaves: 2 x Qwen3MoeSparseMoeBlock" in log and "ZeRO-3 leaves: 2 x MixtralSparseMoeBlock" in log
    assert "experts: 8 per layer in 2 layers (OlmoeSparseMoeBlock)" in log and "ZeRO-3 leaves: none" in log
    assert "experts: 16 per layer in 2 layers (Qwen3MoeSparseMoeBlock), top-1" in log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,stage", AUTOEP)
def test_autoep_splits_the_experts_and_trains_as_without_it(runs: Path, path: str, stage: str) -> None:
    """With transformers 5.24 AutoEP needs the toolkit's registry fix (toolkit/runtime/moe/autoep.py); with it the
    experts split over both ranks and the run trains as the same run without expert parallelism."""
    got, ref = _metrics(runs / f"autoep-{path}-{stage}"), _metrics(runs / f"tiny-qwen3-moe-{path}-{stage}")
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in ref], rel=1e-5)
    assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in ref], rel=1e-4)
    log = (runs / "launch.log").read_text()
    assert "each layer's 8 experts split over groups of 2 ranks (4 per rank), preset qwen3_moe" in log
    assert "AutoEP: 2 MoE layers replaced by DeepSpeed's AutoEPMoELayer" in log
    # generation after training: ranks with 2 and 1 prompts, each forward an all-to-all, and no hang
    rows = [json.loads(x) for x in (runs / f"autoep-{path}-{stage}" / "generations.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and all(r["generated_ids"] for r in rows)


def _metrics(run_dir: Path) -> list[dict]:
    return [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["raw", "trainer"])
def test_the_load_balancing_gradient_is_the_same_at_any_world_size_and_accumulation(runs: Path, path: str) -> None:
    """transformers#48690: the Trainer scales the aux term by the world size, and neither path divides it by the
    accumulation steps; here the gradient norms of the same micro-batches agree within 1e-6 across 2 x 1 / 1 x 2 and
    2 x 2 / 1 x 4 (ranks x accumulation), the aux term weighing 0.5."""
    for two, one in (("w2-ga1", "w1-ga2"), ("w2-ga2", "w1-ga4")):
        a, b = _metrics(runs / f"aux-{path}-{two}"), _metrics(runs / f"aux-{path}-{one}")
        assert len(a) == len(b) == 3
        for x, y in zip(a, b, strict=True):
            assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-6), (two, one, a, b)
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
    if path == "raw":  # the load-balancing loss alone, and the experts' load per layer (the same tokens routed)
        two, one = _metrics(runs / "aux-raw-w2-ga1"), _metrics(runs / "aux-raw-w1-ga2")
        assert all(m["moe_aux_loss"] > 1.0 for m in two)
        assert all(len(m["expert_load"]) == 2 and all(1 <= x <= 8 for x in m["expert_load"]) for m in two)
        assert [m["expert_load"] for m in two] == [m["expert_load"] for m in one]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["raw", "trainer"])
def test_a_zero3_moe_export_reloads_with_the_engines_logits(runs: Path, path: str) -> None:
    """transformers writes the fused experts back as one tensor per expert (its default) and fuses them again on
    load: the reloaded model's fp32 logits equal the engine's (probe.pt) within 1e-4."""
    reload_logits(runs / f"export-{path}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["raw", "trainer"])
def test_a_zero3_moe_generates_as_its_export_does(runs: Path, path: str) -> None:
    """The experts under ZeRO-3, gathered whole for generation: greedy tokens equal the reloaded export's, one
    prompt at a time in one process."""
    import torch
    from transformers import AutoModelForCausalLM

    d = runs / f"export-{path}"
    rows = [json.loads(x) for x in (d / "generations.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(d / "export", dtype=torch.float32, local_files_only=True).eval()
    eos = model.generation_config.eos_token_id
    stops = set(eos) if isinstance(eos, list) else {eos}
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"]])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
            ends = [k for k, t in enumerate(out) if t in stops]
            out = out[: ends[0] + 1] if ends else out
            assert r["generated_ids"] == out, (r, out)
    (line,) = [m for m in _metrics_all(d) if "gen_tokens_per_s" in m]
    assert line["gen_path"] == "whole-model gather"


def _metrics_all(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(60)
def test_a_zero3_moe_checkpoint_resumes_on_the_same_curve(runs: Path) -> None:
    d = runs / "resume"
    assert _losses(d) == pytest.approx(_losses(runs / "tiny-qwen3-moe-raw-zero3"), rel=1e-5)
    checked = [json.loads(x) for x in (d / "resumes.jsonl").read_text().splitlines()]
    assert len(checked) == 1 and checked[0]["not_verified"] is None, checked
