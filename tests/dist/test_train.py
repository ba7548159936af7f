"""Training on 2 CPU ranks through the real `deepspeed` launcher: both paths x ZeRO 0-3 x offload,
parity, gradient accumulation, first loss, resume, export and LoRA adapters, TensorBoard files and
what the console shows; Muon and bf16 optimizer states (their configs from gen-config).

All runs share one launch (tests/dist/_multi_train.py) to stay inside CI's time; each run is a
complete `toolkit/train.py` job with its own run directory, read back here.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import Runs, launch, reload_logits, run_logs, write_chat
from conftest import write_tokenizer

from tests.dist._jsonl import lines
from toolkit.config import ds_config as dc

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
COMMON = [f"train.max_steps={STEPS}", "train.precision=fp32", "train.warmup_steps=2", "memory.every=0",
          "data.num_samples=128"]
STAGES = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload_opt", "zero3_offload"]
PATHS = ["raw", "trainer"]
PREFIX = {"raw": "global_step", "trainer": "checkpoint-"}  # checkpoint directory names per path


def _ds_files(tmp: Path) -> dict[str, str]:
    files = {name: str(ROOT / "ds_configs" / f"{name}.json") for name in dc.PRESETS}
    opt_only = tmp / "zero3_offload_opt.json"  # optimizer offload alone at stage 3
    dc.write_config(dc.gen_config(3, offload_optimizer="cpu"), opt_only, force=True)
    files["zero3_offload_opt"] = str(opt_only)
    # a granularity threshold above every layer's: DeepSpeed makes the whole model the ZeRO-3 leaf
    leaf = dc.preset("zero3")
    leaf["zero_optimization"]["stage3_module_granularity_threshold"] = 10**9
    dc.write_config(leaf, tmp / "zero3_leaf_model.json", force=True)
    files["zero3_leaf_model"] = str(tmp / "zero3_leaf_model.json")
    return files


def _runs(tmp: Path) -> list[dict]:
    ds = _ds_files(tmp)
    runs = []

    def add(name: str, stage: str, *extra: str, **spec: object) -> None:
        argv = ["--ds", ds[stage], *COMMON, f"train.run_dir={tmp / name}", *extra]
        runs.append({"name": name, "argv": argv, **spec})

    for path in PATHS:
        for stage in STAGES:
            probe = ["train.save_probe=true"] if stage == "zero3" else ["train.export=false"]
            # parameters offloaded to the CPU: generation gathers the whole model from there
            gen = ["eval.generate=true", "eval.max_new_tokens=6"] if stage == "zero3_offload" else []
            add(f"{path}-{stage}", stage, f"train.path={path}", *probe, *gen)
        # gradient accumulation: 1 x 4 must match 4 x 1
        add(f"{path}-mb1ga4", "zero2", f"train.path={path}", "train.micro_batch_size=1", "train.grad_accum=4",
            "train.export=false", "train.profile_steps=[2,3]")  # the profiler must not change the losses
        add(f"{path}-mb4ga1", "zero2", f"train.path={path}", "train.micro_batch_size=4", "train.grad_accum=1",
            "train.export=false", "metrics.tensorboard=false")
        # resume: stop after 3 with a checkpoint, then continue in a new run on the same run_dir
        add(f"{path}-resume", "zero2", f"train.path={path}", "train.stop_after=3", "train.export=false")
        # ... with a newer checkpoint cut off mid-write beside it: latest never names it
        add(f"{path}-resume", "zero2", f"train.path={path}", "train.resume=latest", "train.export=false",
            partial=f"checkpoints/{PREFIX[path]}5")
        # the same command again without resume: refused, the first run's records untouched
        add(f"{path}-mb4ga1", "zero2", f"train.path={path}", "train.micro_batch_size=4", "train.grad_accum=1",
            "train.export=false", "metrics.tensorboard=false", expect_rc=1)
        # a learning rate that blows the gradient norm up to inf at step 3: stopped there
        add(f"{path}-nan", "zero2", f"train.path={path}", "train.lr=1e6", "train.export=false", expect_rc=1)
        # a checkpoint every 2 steps, the newest 2 kept
        add(f"{path}-keep", "zero2", f"train.path={path}", "train.save_every=2", "train.keep_checkpoints=2",
            "train.export=false")
        # LoRA under ZeRO-3: the adapter must reproduce the engine's logits
        add(f"{path}-lora", "zero3", f"train.path={path}", "lora.enabled=true", "train.save_probe=true")
        # LoRA under bf16 below ZeRO-3: fp32 adapters, bf16 base, DeepSpeed torch_autocast
        add(f"{path}-lora-bf16", "zero2", f"train.path={path}", "lora.enabled=true", "train.precision=bf16")
        # the whole model as a ZeRO-3 leaf would train on no gradient: refused before step 1
        add(f"{path}-leaf-model", "zero3_leaf_model", f"train.path={path}", "train.export=false", expect_rc=1)
        # sequence classification
        add(f"{path}-cls", "zero2", f"train.path={path}", "model.name=tiny-bert", "model.task=seq_cls",
            "train.export=false")
    tok = write_tokenizer(tmp / "tokenizer")
    data = tmp / "sft.jsonl"
    with data.open("w") as f:
        for i in range(64):
            q = " ".join(["what did the cat do"] + ["the dog"] * (i % 3))
            f.write(json.dumps({"prompt": q, "response": "the cat sat on the mat " * (1 + i % 2)}) + "\n")
    add("raw-file", "zero2", "train.path=raw", f"data.source={data}", f"model.tokenizer={tok}",
        "train.micro_batch_size=2", "train.export=false")
    add("raw-file-epoch", "zero2", "train.path=raw", f"data.source={data}", f"model.tokenizer={tok}",
        "data.packing=false", "train.micro_batch_size=2", "train.max_steps=0", "train.export=false")
    # packed by default (data.packing=auto), resumed mid-epoch: the same curve as without the stop
    packed = ["train.path=raw", f"data.source={data}", f"model.tokenizer={tok}", "data.seq_len=48",
              "train.micro_batch_size=2", "train.export=false"]
    add("raw-packed", "zero2", *packed)
    add("raw-packed-resume", "zero2", *packed, "train.stop_after=3")
    add("raw-packed-resume", "zero2", *packed, "train.resume=latest")
    add("trainer-file-packed", "zero2", "train.path=trainer", f"data.source={data}", f"model.tokenizer={tok}",
        "data.packing=true", "data.seq_len=16", "train.micro_batch_size=2", "train.export=false")
    # chat rows (loss on the assistant turns), packed, with a held-out eval loss every 2 steps, at ZeRO-3
    chat = write_chat(tmp / "chat.jsonl")
    for path in PATHS:
        for attn in ("sdpa", "varlen"):  # the block-diagonal mask, and the toolkit's attention (CPU reference)
            add(f"{path}-chat" + ("-varlen" if attn == "varlen" else ""), "zero3", f"train.path={path}",
                f"data.source={chat}", f"model.tokenizer={tok}", "data.packing=true", "data.seq_len=48",
                "data.eval_fraction=0.25", "train.eval_every=2", "train.micro_batch_size=2", "train.export=false",
                f"model.attn_implementation={attn}", "eval.generate=true", "eval.num_prompts=2")
    # the toolkit's attention with gradient checkpointing and LoRA, against the mask
    for attn in ("sdpa", "varlen"):
        add(f"raw-chat-gc-lora-{attn}", "zero2", "train.path=raw", f"data.source={chat}", f"model.tokenizer={tok}",
            "data.seq_len=48", "train.micro_batch_size=2", "train.export=false", "model.gradient_checkpointing=true",
            "lora.enabled=true", "lora.target_modules=[q_proj,v_proj]", f"model.attn_implementation={attn}")
    add("raw-lora-bf16-zero0", "zero0", "train.path=raw", "lora.enabled=true", "train.precision=bf16",
        "train.export=false")
    add("raw-lora-bf16-offload", "zero2_offload", "train.path=raw", "lora.enabled=true", "train.precision=bf16",
        "train.export=false")
    add("raw-lora-bf16-zero3", "zero3", "train.path=raw", "lora.enabled=true", "train.precision=bf16",
        "train.export=false")
    add("raw-zero3-gc", "zero3", "train.path=raw", "model.gradient_checkpointing=true",
        "model.attn_implementation=eager", "train.export=false")
    # families past the Llama shape, from local directories at the default model.attn_implementation=sdpa: Gemma 2
    # and Reformer, which transformers cannot build with sdpa (the run takes eager), and HRM's layers run in cycles
    for family, stage, seq in (("gemma2", "zero3", 64), ("reformer", "zero2", 64), ("hrm_text", "zero2", 32)):
        add(f"raw-{family}", stage, "train.path=raw", f"model.name={_family_dir(tmp / family, family, tok)}",
            f"data.seq_len={seq}", "train.micro_batch_size=2", "train.max_steps=3", "train.export=false")
    # what a family keeps in fp32 (its routers' e_score_correction_bias) stays fp32 under bf16, both paths; cast to
    # bf16 after the engine started (a test hook), the run stops in one line (issue 81)
    deepseek = _family_dir(tmp / "deepseek_v3", "deepseek_v3", tok)
    for name, stage, path, env in (("fp32-kept-z3", "zero3", "raw", {}), ("fp32-kept-z2-trainer", "zero2", "trainer", {}),
                                   ("fp32-cast-z3-trainer", "zero3", "trainer", {"TOOLKIT_FAULT_CAST_FP32_KEPT": "1"}),
                                   ("fp32-cast-z2", "zero2", "raw", {"TOOLKIT_FAULT_CAST_FP32_KEPT": "1"})):
        add(name, stage, f"train.path={path}", f"model.name={deepseek}", "train.precision=bf16", "data.seq_len=32",
            "train.micro_batch_size=2", "train.max_steps=2", "train.export=false", env=env,
            expect_rc=1 if env else 0)
    # a fault in the launch itself: rank 1 killed as the run starts (tests/dist/_multi_train.py kill_rank). That run
    # fails alone; the one after it goes on in a new launch (test_a_run_that_fails_fails_only_the_tests_that_read_it)
    killed = {"name": KILLED, "argv": ["--ds", ds["zero2"], *COMMON, f"train.run_dir={tmp / KILLED}", "train.path=raw",
                                       "train.export=false"], "kill_rank": 1}
    # muon-z2-clipped (refused before any collective) stays last: its rank 0 prints the refusal while rank 1 may
    # already print the next run's marker, so a run after it could take its line in run_logs' split
    *optimizers, clipped = _optimizer_runs(tmp)
    # a parameter whose gradient never arrives (its gradient zeroed by a test hook): named after the first two steps
    # with a learning rate, and stopped on, or warned about with train.check_moved=warn (issue 81)
    for name, stage, path, extra in (("unmoved-z3", "zero3", "raw", []), ("unmoved-z2-trainer", "zero2", "trainer", []),
                                     ("unmoved-z0-lora", "zero0", "raw", ["lora.enabled=true"]),
                                     ("unmoved-z2-warn", "zero2", "raw", [])):
        zeroed = UNMOVED_LORA if "lora" in name else DROPPED
        mode = "train.check_moved=warn" if "warn" in name else "train.check_moved=error"
        add(name, stage, f"train.path={path}", "train.export=false", mode, *extra,
            env={"TOOLKIT_FAULT_ZERO_GRAD": zeroed}, expect_rc=0 if "warn" in name else 1)
    # an export with a tensor dropped from its written files (a test hook): the check names it, nothing marked done
    add("export-dropped-z3", "zero3", "train.path=raw", env={"TOOLKIT_FAULT_EXPORT_DROP": DROPPED}, expect_rc=1)
    add("export-dropped-lora-trainer", "zero2", "train.path=trainer", "lora.enabled=true",
        env={"TOOLKIT_FAULT_EXPORT_DROP": "*layers.1.self_attn.v_proj.lora_A.weight"}, expect_rc=1)
    return runs + _bad_checkpoint_runs(tmp, ds) + _qlora_runs(tmp) + optimizers + [killed, clipped]


UNMOVED_LORA = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.default.weight"  # B moves without it


# A model directory whose checkpoint does not match the model (issue 81): each refused before any weight is read, at
# every stage and on both paths, QLoRA too; name -> (fault, stage, path, extra)
BAD_CHECKPOINTS = {
    "ckpt-removed-z3": ("removed", "zero3", "raw", []),
    "ckpt-removed-z0-trainer": ("removed", "zero0", "trainer", []),
    "ckpt-shape-z2": ("shape", "zero2", "raw", []),
    "ckpt-stray-z3-trainer": ("stray", "zero3", "trainer", []),
    "ckpt-removed-qlora-z3": ("removed", "zero3", "raw", ["model.load_in_4bit=true", "lora.enabled=true"]),
    "ckpt-removed-allowed-z3": ("removed", "zero3", "raw", ["model.new_weights=[model.layers.1.mlp.*]"]),
}
DROPPED = "model.layers.1.mlp.down_proj.weight"


def _bad_checkpoint_runs(tmp: Path, ds: dict[str, str]) -> list[dict]:
    from safetensors.torch import load_file, save_file

    base, out = _qlora_base(tmp), []
    for fault in ("removed", "shape", "stray"):
        bad = tmp / f"ckpt-{fault}"
        shutil.copytree(base, bad)
        tensors = load_file(str(bad / "model.safetensors"))
        if fault == "removed":
            del tensors[DROPPED]
        elif fault == "shape":
            tensors[DROPPED] = tensors[DROPPED][:, :8].contiguous()
        else:
            tensors["model.layers.1.mlp.extra.weight"] = tensors[DROPPED][:4, :4].contiguous()
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    for name, (fault, stage, path, extra) in BAD_CHECKPOINTS.items():
        out.append({"name": name, "argv": ["--ds", ds[stage], *COMMON, f"train.run_dir={tmp / name}", f"train.path={path}",
                                           f"model.name={tmp / f'ckpt-{fault}'}", "train.export=false", *extra],
                    "expect_rc": 0 if "allowed" in name else 1})
    return out


KILLED = "injected-rank-killed"


FAMILY_CONFIGS = {
    "gemma2": dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, max_position_embeddings=256, sliding_window=32),
    # rows of 64 tokens: the product of its axial positions, the only length its causal LM trains at
    "reformer": dict(feed_forward_size=128, num_attention_heads=2, attention_head_size=32, axial_pos_shape=[8, 8],
                     axial_pos_embds_dim=[32, 32], max_position_embeddings=64, is_decoder=True,
                     attn_layers=["local", "lsh"], local_attn_chunk_length=16, lsh_attn_chunk_length=16),
    "hrm_text": dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                     max_position_embeddings=256),
    "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256),
}


def _family_dir(out: Path, model_type: str, tokenizer: Path) -> Path:
    """A tiny model of `model_type` at random init, saved with the test tokenizer's files beside it."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = CONFIG_MAPPING[model_type](vocab_size=1000, hidden_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     **FAMILY_CONFIGS[model_type])
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    return out


# Muon and bf16 optimizer states (docs/optimizers.md), configs from gen-config: name -> (stage, optimizer, states,
# path, extra)
OPTIMIZER_COMMON = ["train.precision=fp32", "memory.every=0", "metrics.tensorboard=false", "train.micro_batch_size=2",
                    "train.max_steps=4", "train.export=false"]
OPTIMIZER_RUNS = {
    # accumulation 2: ZeRO-3's Muon (contiguous_gradients off) reduces each micro-batch, then runs once a step
    "muon-z0": (0, "muon", "fp32", "raw", ["train.grad_accum=2"]),
    "muon-z2": (2, "muon", "fp32", "raw", ["train.grad_accum=2"]),
    "muon-z3": (3, "muon", "fp32", "raw", ["train.grad_accum=2"]),
    "muon-z3-trainer": (3, "muon", "fp32", "trainer", ["train.grad_accum=2"]),
    "muon-z2-lora": (2, "muon", "fp32", "raw", ["lora.enabled=true"]),
    "muon-z2-dpo": (2, "muon", "fp32", "raw", ["train.objective=dpo", "lora.enabled=true", "data.seq_len=24"]),
    "bf16-states-z2": (2, "adamw", "bf16", "raw", ["train.precision=bf16"]),
    "bf16-states-z3-trainer": (3, "adamw", "bf16", "trainer", ["train.precision=bf16"]),
    "bf16-states-z2-nearest": (2, "adamw", "bf16", "raw", ["train.precision=bf16", "train.bf16_rounding=nearest"]),
    "muon-z2-clipped": (2, "muon", "fp32", "raw", ["train.grad_clip=1.0"]),
}


def _optimizer_runs(tmp: Path) -> list[dict]:
    out = []
    for name, (stage, optimizer, states, path, extra) in OPTIMIZER_RUNS.items():
        ds = tmp / f"{name}.json"
        dc.write_config(dc.gen_config(stage, optimizer=optimizer, optimizer_states=states, targets=("trainer", "raw")),
                        ds)
        argv = ["--ds", str(ds), *OPTIMIZER_COMMON, f"train.path={path}", f"train.run_dir={tmp / name}", *extra]
        out.append({"name": name, "argv": argv, "expect_rc": 1 if name == "muon-z2-clipped" else 0})
    return out


# QLoRA (model.load_in_4bit, docs/qlora.md): a 4-bit NF4 base (bitsandbytes on the CPU, fp32 storage) under LoRA
QLORA_RUNS = {"qlora-z0": ("zero0", "raw"), "qlora-z3": ("zero3", "raw"), "qlora-z2-trainer": ("zero2", "trainer"),
              "qlora-z3-dpo": ("zero3", "raw"), "qlora-z3-kto": ("zero3", "raw"), "qlora-z2-ipo": ("zero2", "raw"),
              "qlora-z2-simpo": ("zero2", "raw"), "qlora-z2-orpo": ("zero2", "raw")}
PREFERENCE = ("dpo", "kto", "ipo", "simpo", "orpo")


def _qlora_base(tmp: Path) -> Path:
    """The tiny preset's model saved with weights and a tokenizer: QLoRA runs start from a directory, as users' do, so
    the adapter can be merged back into it (toolkit merge-adapter)."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.plan.shapes import preset_config

    base = tmp / "qlora-base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(preset_config("tiny")).save_pretrained(base)
    write_tokenizer(base)
    return base


def _qlora_runs(tmp: Path) -> list[dict]:
    ds, base = _ds_files(tmp), _qlora_base(tmp)

    def run(name: str, stage: str, path: str, *extra: str) -> dict:
        return {"name": name, "argv": ["--ds", ds[stage], *OPTIMIZER_COMMON, f"train.path={path}",
                                       f"train.run_dir={tmp / name}", f"model.name={base}", "model.load_in_4bit=true",
                                       "lora.enabled=true", *extra]}

    runs = [run(name, stage, path, *(["train.export=true"] if name == "qlora-z3" else []),
                *([f"train.objective={name.rsplit('-', 1)[1]}", "data.seq_len=24"]
                  if name.endswith(PREFERENCE) else []))
            for name, (stage, path) in QLORA_RUNS.items()]
    # resumed after 2 of 4 steps on both paths: the 4-bit base is rebuilt, the adapters and their states come back
    resumes = [run(name, stage, path, extra) for name, stage, path in
               (("qlora-z3-resume", "zero3", "raw"), ("qlora-z2-trainer-resume", "zero2", "trainer"))
               for extra in ("train.stop_after=2", "train.resume=latest")]
    # a preset at random init is quantized while it is built (quant.build_4bit), not from a directory
    preset = run("qlora-z2-preset", "zero2", "raw")
    preset["argv"] = [a for a in preset["argv"] if not a.startswith("model.name=")]
    return [*runs, *resumes, preset]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = Runs(tmp_path_factory.mktemp("train"))
    ports = launch(tmp, _runs(tmp), timeout=1500)
    (tmp / "master_ports").write_text(" ".join(map(str, ports)))
    return tmp


def test_no_deepspeed_shared_memory_left(runs: Path) -> None:
    # DeepSpeed's CPU allreduce makes a 66 MB /dev/shm file per rank and never unlinks it; init_distributed does
    for port in (runs / "master_ports").read_text().split():  # one a launch: a run that fails relaunches the rest
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]  # eval and generation lines carry none


def metrics(run_dir: Path) -> list[dict]:
    """The training and eval lines (not eval.generate's: a line per generation, read where a test wants it)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "gen_tokens_per_s" not in r]


def assert_close(a: list[float | None], b: list[float | None], rel: float) -> None:
    assert len(a) == len(b) >= 5
    if all(x is None for x in a + b):
        return  # ZeRO-0 in fp32: DeepSpeed clips but records no global grad norm, on either path
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= rel * abs(y), (a, b)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_and_offload_completes(runs: Path, path: str, stage: str) -> None:
    d = runs / f"{path}-{stage}"
    assert json.loads((d / "status.json").read_text())["status"] == "completed"
    assert len(losses(d)) == STEPS
    resolved = json.loads((d / "ds_config.json").read_text())
    assert "auto" not in json.dumps(resolved), "the run must record a fully resolved DeepSpeed config"
    assert resolved["train_batch_size"] == 4 * 1 * 2
    # random init starts near ln(vocab): uninitialized ZeRO-3 weights would start far above it
    assert abs(losses(d)[0] - math.log(1000)) <= 0.1 * math.log(1000)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["gemma2", "reformer", "hrm_text"])
def test_families_without_sdpa_or_with_layers_in_cycles_train_at_the_defaults(runs: Path, family: str) -> None:
    """Gemma 2 (softcapping) and Reformer (its own LSH and local attention) have no sdpa path in transformers, which
    refuses to build them with it: at the default model.attn_implementation=sdpa the run takes eager and says why
    (before, Gemma 2's run ended at the build). HRM (two stacks run in cycles) keeps sdpa. Each trains from ln(vocab)."""
    d = runs / f"raw-{family}"
    assert json.loads((d / "status.json").read_text())["status"] == "completed"
    attention = json.loads((d / "resolved.json").read_text())["attention"]
    if family == "hrm_text":
        assert attention["implementation"] == "sdpa"
    else:
        assert attention["implementation"] == "eager" and "no sdpa path" in attention["note"]
    assert len(losses(d)) == 3 and abs(losses(d)[0] - math.log(1000)) <= 0.15 * math.log(1000)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_zero3_with_offloaded_parameters_generates_from_the_whole_model(runs: Path, path: str) -> None:
    d = runs / f"{path}-zero3_offload"
    rows = [json.loads(line) for line in (d / "generations.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and all(1 <= len(r["generated_ids"]) <= 6 for r in rows)
    (line,) = [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "gen_tokens_per_s" in r]
    assert line["gen_path"] == "whole-model gather" and line["gen_prompts"] == 3 and line["step"] == STEPS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["trainer-chat-varlen", "raw-lora-bf16-zero3", "raw-chat-gc-lora-varlen",
                                  "trainer-zero3_offload"])
def test_toolkit_check_explain_prints_the_record_the_run_wrote(runs: Path, name: str) -> None:
    """`toolkit check DS --explain --json` for a run's config and world size resolves, without launching, exactly the
    record the run wrote to resolved.json (and the block it printed first is the same record's lines)."""
    argv = next(r["argv"] for r in _runs_argv(runs) if r["name"] == name)
    ds, overrides = argv[1], argv[2:]
    out = subprocess.run([sys.executable, "-m", "toolkit", "check", ds, "--explain", "--json", "--world-size", "2",
                          *overrides], capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env=os.environ | {"DS_ACCELERATOR": "cpu", "TOOLKIT_CACHE": str(runs / "cache")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    printed = json.loads(out.stdout[out.stdout.index("{"):])
    assert printed == json.loads((runs / name / "resolved.json").read_text())
    assert f"  torch.compile: off ({printed['compile_why']})" in (runs / "launch.log").read_text()


def _runs_argv(runs: Path) -> list[dict]:
    return json.loads((runs / "launch.json").read_text())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_zero_stages_agree_in_fp32(runs: Path, path: str) -> None:
    ref = losses(runs / f"{path}-zero0")
    assert ref[-1] < ref[0], "the embedded data must be learnable"
    for stage in STAGES[1:]:
        # Offload swaps the optimizer kernel (DeepSpeedCPUAdam vs the fused one): same math in fp32.
        assert_close(losses(runs / f"{path}-{stage}"), ref, 1e-4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [*STAGES, "mb1ga4", "lora", "cls"])
def test_raw_and_trainer_paths_agree(runs: Path, name: str) -> None:
    raw, tr = metrics(runs / f"raw-{name}"), metrics(runs / f"trainer-{name}")
    assert_close([m["loss"] for m in raw], [m["loss"] for m in tr], 1e-4)
    assert_close([m["grad_norm"] for m in raw], [m["grad_norm"] for m in tr], 1e-3)
    assert_close([m["lr"] + 1e-12 for m in raw], [m["lr"] + 1e-12 for m in tr], 1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_a_leaf_module_holding_the_embeddings_is_refused_before_training(runs: Path, path: str) -> None:
    status = json.loads((runs / f"{path}-leaf-model" / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 0, status
    assert "leaf module LlamaForCausalLM holds the input embeddings" in status["error"], status
    logged = runs / f"{path}-leaf-model" / "metrics.jsonl"
    assert not logged.exists() or not logged.read_text().strip(), "no step may run"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_gradient_accumulation_matches_bigger_micro_batch(runs: Path, path: str) -> None:
    a, b = metrics(runs / f"{path}-mb1ga4"), metrics(runs / f"{path}-mb4ga1")
    assert_close([m["loss"] for m in a], [m["loss"] for m in b], 1e-4)
    assert_close([m["grad_norm"] for m in a], [m["grad_norm"] for m in b], 1e-3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_profile_steps_writes_a_trace_and_summary_per_rank(runs: Path, path: str) -> None:
    prof = runs / f"{path}-mb1ga4" / "profile"
    for rank in (0, 1):
        summary = json.loads((prof / f"rank{rank}.summary.json").read_text())
        assert summary["steps"] == [2, 3] and summary["rank"] == rank and summary["wall_s"] > 0
        assert summary["top_host_ops"], "the window must have recorded operators"
        assert json.loads((prof / f"rank{rank}.trace.json").read_text())["traceEvents"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_resume_continues_the_same_curve(runs: Path, path: str) -> None:
    full = metrics(runs / f"{path}-zero2")
    resumed = metrics(runs / f"{path}-resume")  # steps 1-3, then 4-6 after resume, in one file
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert_close([m["loss"] for m in resumed], [m["loss"] for m in full], 1e-5)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", PATHS)
def test_a_rerun_into_the_same_dir_is_refused_and_appends_nothing(runs: Path, path: str) -> None:
    d = runs / f"{path}-mb4ga1"
    assert [m["step"] for m in metrics(d)] == list(range(1, STEPS + 1))  # one run's lines, once
    assert json.loads((d / "status.json").read_text())["status"] == "completed"
    assert "already holds a run" in (runs / "launch.log").read_text()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", PATHS)
def test_checkpoints_are_complete_and_the_newest_n_kept(runs: Path, path: str) -> None:
    from toolkit.runtime.faults.checkpoint import COMPLETE, complete_checkpoints

    root = runs / f"{path}-keep" / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root, PREFIX[path])] == [4, 6]
    assert sorted(d.name for d in root.iterdir() if d.is_dir()) == [f"{PREFIX[path]}4", f"{PREFIX[path]}6"]
    if path == "raw":
        assert (root / "latest").read_text() == "global_step6"
    # the resume above ran beside a newer, partial checkpoint and continued from the complete one
    partial = runs / f"{path}-resume" / "checkpoints" / f"{PREFIX[path]}5"
    assert partial.is_dir() and not (partial / COMPLETE).exists()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", PATHS)
def test_nan_or_inf_stops_the_run_at_that_step_naming_it(runs: Path, path: str) -> None:
    from toolkit.runtime.data.batches import EpochOrder

    d = runs / f"{path}-nan"
    status = json.loads((d / "status.json").read_text())
    assert status["status"] == "failed" and "NonFiniteError" in status["error"], status
    assert "at step 3" in status["error"] or "up to step 3" in status["error"], status
    assert [m["step"] for m in metrics(d)] == [1, 2, 3]  # nothing trained past it
    if path == "raw":  # rank 0's samples of step 3 (micro 4, 2 ranks, batch i to rank i % 2)
        order = EpochOrder(128, 1234, True).order(0).tolist()
        assert f"samples in that step: {order[16:20]}" in status["error"], (order[16:20], status)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", PATHS)
def test_zero3_export_reloads_with_the_engines_logits(runs: Path, path: str) -> None:
    d = runs / f"{path}-zero3"
    assert not (d / "export.tmp").exists()
    from safetensors import safe_open

    with safe_open(str(d / "export" / "model.safetensors"), "pt") as f:
        assert all(f.get_slice(k).get_shape() and 0 not in f.get_slice(k).get_shape() for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    # trained without a KV cache (runtime/model.py), exported with one for inference
    assert json.loads((d / "export" / "config.json").read_text())["use_cache"] is True
    generation = d / "export" / "generation_config.json"
    assert not generation.is_file() or json.loads(generation.read_text()).get("use_cache", True) is True
    reload_logits(d, "export")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", PATHS)
def test_lora_adapter_reloads_with_the_engines_logits(runs: Path, path: str) -> None:
    d = runs / f"{path}-lora"
    assert (d / "adapter" / "adapter_config.json").is_file()
    assert not (d / "export").exists()
    reload_logits(d, "adapter")


@pytest.mark.timeout(60)
def test_lora_bf16_keeps_fp32_adapters_under_autocast(runs: Path) -> None:
    from safetensors import safe_open

    for name in ("raw-lora-bf16", "trainer-lora-bf16", "raw-lora-bf16-zero0", "raw-lora-bf16-offload"):
        ds = json.loads((runs / name / "ds_config.json").read_text())
        assert ds["bf16"]["enabled"] is False and ds["torch_autocast"]["enabled"] is True, name
        assert json.loads((runs / name / "versions.json").read_text())["adapter_autocast"] is True
        assert json.loads((runs / name / "status.json").read_text())["status"] == "completed", name
    for path in PATHS:
        with safe_open(str(runs / f"{path}-lora-bf16" / "adapter" / "adapter_model.safetensors"), "pt") as f:
            assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F32"}  # noqa: SIM118
    # both paths compute the same thing; bf16 stays near the fp32 LoRA run (same seed, same adapters)
    bf16 = losses(runs / "raw-lora-bf16")
    assert_close(bf16, losses(runs / "trainer-lora-bf16"), 1e-3)
    assert_close(bf16, losses(runs / "raw-lora"), 2e-2)
    from toolkit.observe.report import read_header

    assert read_header(runs / "raw-lora-bf16", 2, [])["precision"] == "torch autocast bfloat16"
    # ZeRO-3 keeps DeepSpeed's bf16 mode: zero.Init would otherwise build the frozen base in fp32
    ds3 = json.loads((runs / "raw-lora-bf16-zero3" / "ds_config.json").read_text())
    assert ds3["bf16"]["enabled"] is True and "torch_autocast" not in ds3


@pytest.mark.timeout(60)
def test_file_data_packing_and_checkpointing_runs(runs: Path) -> None:
    for name in ("raw-file", "trainer-file-packed", "raw-zero3-gc"):
        assert json.loads((runs / name / "status.json").read_text())["status"] == "completed", name
    # checkpointing recomputes the same math
    assert_close(losses(runs / "raw-zero3-gc"), losses(runs / "raw-zero3"), 1e-4)
    # max_steps=0 is one epoch of the rows actually loaded: 64 samples / (micro 2 x 2 ranks)
    assert [m["step"] for m in metrics(runs / "raw-file-epoch")] == list(range(1, 17))
    # the SFT file data is learnable too
    file_losses = losses(runs / "raw-file")
    assert file_losses[-1] < file_losses[0]


@pytest.mark.timeout(60)
def test_file_data_packs_by_default_and_resumes_mid_epoch_on_the_same_curve(runs: Path) -> None:
    ran = json.loads((runs / "raw-packed" / "versions.json").read_text())
    assert ran["packing"] is True and ran["attention"] == "sdpa", ran  # CPU: the block-diagonal mask
    assert "data.packing=auto: on for causal-LM file data" in (runs / "launch.log").read_text()
    full, resumed = metrics(runs / "raw-packed"), metrics(runs / "raw-packed-resume")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert_close([m["loss"] for m in resumed], [m["loss"] for m in full], 1e-5)
    assert all(0 <= m["padding_waste"] < 0.3 for m in full), full
    assert "train/padding_waste" in _tb_scalars(runs / "raw-packed" / "tb")
    report = subprocess.run([sys.executable, "-m", "toolkit", "report", str(runs / "raw-packed")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert re.search(r"padding \(pad / computed positions\)\s+\|?\s*\d+\.\d%", report.stdout), report.stdout
    # not packed: batches grouped by length, the padding they leave on record
    unpacked = json.loads((runs / "raw-file-epoch" / "versions.json").read_text())
    assert unpacked["packing"] is False
    assert all(m["padding_waste"] is not None for m in metrics(runs / "raw-file-epoch"))


@pytest.mark.timeout(60)
def test_packed_rows_through_the_toolkits_attention_train_as_through_the_mask(runs: Path) -> None:
    """ZeRO-3, 2 ranks, fp32, both paths: variable-length attention (its CPU reference, fed the collator's
    document boundaries) gives the block-diagonal mask's losses and eval losses."""
    for path in PATHS:
        ran = json.loads((runs / f"{path}-chat-varlen" / "versions.json").read_text())
        assert ran["attention"] == "toolkit_sdpa" and ran["packing"] is True, ran
        lines, ref = metrics(runs / f"{path}-chat-varlen"), metrics(runs / f"{path}-chat")
        assert_close([m["loss"] for m in lines if "loss" in m], [m["loss"] for m in ref if "loss" in m], 1e-5)
        evals, ref_evals = ([m["eval_loss"] for m in x if "eval_loss" in m] for x in (lines, ref))
        assert len(evals) == len(ref_evals) == 3 and evals == pytest.approx(ref_evals, rel=1e-5), (evals, ref_evals)
        # generation after training (padded prompts: sdpa with its mask under the toolkit's name): the same text
        gen = [json.loads(x) for x in (runs / f"{path}-chat-varlen" / "generations.jsonl").read_text().splitlines()]
        ref_gen = [json.loads(x) for x in (runs / f"{path}-chat" / "generations.jsonl").read_text().splitlines()]
        assert len(gen) == 2 and gen == ref_gen, (gen, ref_gen)
    assert_close(losses(runs / "raw-chat-gc-lora-varlen"), losses(runs / "raw-chat-gc-lora-sdpa"), 1e-5)


@pytest.mark.timeout(120)
def test_chat_data_is_cached_once_and_the_eval_loss_is_the_same_on_both_paths(runs: Path) -> None:
    evals = {}
    for path in PATHS:
        lines = metrics(runs / f"{path}-chat")
        train = [m for m in lines if "loss" in m]
        evals[path] = [m for m in lines if "eval_loss" in m]
        assert len(train) == STEPS and all(m["tokens_per_s"] > 0 for m in train)
        assert [m["step"] for m in evals[path]] == [2, 4, 6], evals[path]  # every 2 steps, the last at the end
        assert evals[path][-1]["eval_loss"] < evals[path][0]["eval_loss"], evals[path]
        assert evals[path][0]["eval_tokens"] > 0
        tb = _tb_scalars(runs / f"{path}-chat" / "tb")
        assert [s for s, _ in tb["eval/loss"]] == [2, 4, 6] and "eval/perplexity" in tb
    # ZeRO-3, 2 ranks: the same held-out rows, the same weights, the same numbers on both paths
    for a, b in zip(evals["raw"], evals["trainer"], strict=True):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-4 * b["eval_loss"], (evals["raw"], evals["trainer"])
    log = (runs / "launch.log").read_text()
    # one process tokenized chat.jsonl; the other runs (same file, tokenizer and settings) reused it
    assert len(re.findall(r"data.source: tokenizing \S*chat.jsonl", log)) == 1, log[-3000:]
    # 4 packed runs at seq 48 share one cache; the 2 gc-lora runs (seq 48, packed) share it too
    assert len(re.findall(r"data.source: reusing the tokenized cache \S*chat-", log)) == 5
    report = subprocess.run([sys.executable, "-m", "toolkit", "report", str(runs / "raw-chat")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    md = (runs / "raw-chat" / "report.md").read_text()
    assert re.search(rf"final eval loss \(perplexity\) *\| *{evals['raw'][-1]['eval_loss']:.4f} ", md), md


@pytest.mark.timeout(60)
def test_run_dir_records_what_ran(runs: Path) -> None:
    d = runs / "raw-zero3"
    versions = json.loads((d / "versions.json").read_text())
    assert {"python", "torch", "deepspeed", "transformers", "peft", "datasets"} <= set(versions)
    assert "train:" in (d / "config.yaml").read_text()
    assert sorted(p.name for p in (d / "memory").glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]


def _tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Read back with TensorBoard's own reader, as `tensorboard --logdir` would."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_tensorboard_events_on_both_paths(runs: Path, path: str) -> None:
    d = runs / f"{path}-zero2"
    train = _tb_scalars(d / "tb")
    # the same tags on both paths; no train/mfu on CPU (no GPU peak to divide by)
    assert set(train) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/samples_per_s",
                          "train/step_time_s", "train/padding_waste"}
    m = metrics(d)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert [s for s, _ in train[f"train/{key}"]] == [r["step"] for r in m]
        assert [v for _, v in train[f"train/{key}"]] == pytest.approx([r[key] for r in m], rel=1e-6), key
    for rank in (0, 1):  # every rank writes its own memory series into tb/rank{N}/
        mem = _tb_scalars(d / "tb" / f"rank{rank}")
        assert set(mem) == {"memory/host_rss_gib"}  # GPU fields are null on CPU: not written
        snaps = [json.loads(line) for line in (d / "memory" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [s for s, _ in mem["memory/host_rss_gib"]] == [s["step"] for s in snaps] == [0, 0, 1, STEPS]
    # resumed: one curve, steps 1..6 once each
    assert [s for s, _ in _tb_scalars(runs / f"{path}-resume" / "tb")["train/loss"]] == list(range(1, STEPS + 1))
    assert not (runs / f"{path}-mb4ga1" / "tb").exists()  # metrics.tensorboard=false


@pytest.mark.timeout(60)
def test_console_of_a_cpu_run(runs: Path) -> None:
    """What a newcomer reads: what the silent start is, one memory line per phase, no third-party
    deprecations (kept in the per-rank log), and a closing summary with the next command."""
    log = (runs / "launch.log").read_text()
    for path in PATHS:
        d = runs / f"{path}-zero2"
        m = metrics(d)
        # one print on rank 0, so the block is contiguous even with rank 1 writing to the same file
        summary = (rf"done: {STEPS} of {STEPS} steps in [\d.]+ s\n"
                   rf"  loss        {m[0]['loss']:.4f} \(step 1\) -> {m[-1]['loss']:.4f} \(step {STEPS}\)\n"
                   r"  tokens/s    [\d,]+ \(all ranks, median after step 1\)\n"
                   r"  padding     0\.0% of computed positions \(over the logged steps; [^)]*\)\n"
                   r"  peak host   rank 0 [\d.]+, rank 1 [\d.]+ GiB RSS \(CPU run: no GPU memory\)\n"
                   rf"  run dir     {re.escape(str(d))}\n"
                   rf"  next        toolkit report {re.escape(str(d))}   \|   tensorboard --logdir "
                   rf"{re.escape(str(d / 'tb'))}\n")
        assert re.search(summary, log), f"no closing summary for {d.name}"
        assert f"starting the DeepSpeed engine (ZeRO-2, {path} path, 2 ranks)" in log
    # unpacked file rows in length groups pad: the summary's share is the mean of the windows metrics.jsonl holds
    windows, before = [], 0
    for r in metrics(runs / "raw-file-epoch"):
        windows.append((r["padding_waste"], r["step"] - before))
        before = r["step"]
    assert max(w for w, _ in windows) > 0
    share = sum(w * n for w, n in windows) / sum(n for _, n in windows)
    assert f"  padding     {100 * share:.1f}% of computed positions (over the logged steps" in log
    assert re.search(r"engine ready in [\d.]+ s; training steps 1\.\.6", log)
    assert re.search(r"memory @ engine_ready \(step 0\): host RSS rank 0 [\d.]+, rank 1 [\d.]+ GiB", log)
    assert "alloc  reserved" not in log  # no memory tables of dashes on CPU
    assert "stopped after step 3 of 6 (train.stop_after)" in log  # the resume runs' first half
    # torch's all_gather_into_tensor deprecation, raised inside DeepSpeed: in the rank logs, not the console
    assert "FutureWarning" not in log
    assert any("FutureWarning" in p.read_text() for p in runs.glob("*/logs/rank*.log"))


# ---------------------------------------------------------------- Muon and bf16 optimizer states

def _opt_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in lines(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.timeout(60)
def test_muon_trains_alike_at_every_stage_and_path_and_its_loss_falls(runs: Path) -> None:
    tmp, logs = runs, run_logs(runs / "launch.log")
    want = _opt_losses(tmp / "muon-z0")
    assert len(want) == 4 and want[-1] < want[0], want
    for name in ("muon-z2", "muon-z3", "muon-z3-trainer"):
        # fp32, no clipping (Muon's default): ZeRO's partitioned Muon is the whole-matrix one
        assert _opt_losses(tmp / name) == pytest.approx(want, abs=1e-4), (name, _opt_losses(tmp / name), want)
        assert "optimizer: Muon: 2-D hidden matrices at lr 0.02" in logs[name], logs[name][-3000:]
    assert "no gradient clipping (DeepSpeed would clip Muon's update at ZeRO-3)" in logs["muon-z3"]
    # DeepSpeed's split, as recorded: the tiny llama's 2 layers x 7 projections to Muon, the rest to Adam
    split = json.loads((tmp / "muon-z3" / "optimizer_groups.json").read_text())
    assert split["muon"]["tensors"] == 14 and split["adam"]["tensors"] > 0, split
    assert not any("embed" in n or "lm_head" in n for n in split["muon"]["examples"]), split
    assert json.loads((tmp / "muon-z2" / "optimizer_groups.json").read_text()) == split


@pytest.mark.timeout(60)
def test_lora_and_dpo_run_under_muon(runs: Path) -> None:
    tmp = runs
    lora = json.loads((tmp / "muon-z2-lora" / "optimizer_groups.json").read_text())
    # only the adapters train: their 2-D A and B matrices are Muon's (2 layers x q, v x A, B), nothing is Adam's
    assert lora["muon"]["tensors"] == 8 and lora["adam"]["tensors"] == 0, lora
    assert all("lora_" in n for n in lora["muon"]["examples"] if "more" not in n), lora
    assert all(math.isfinite(x) for x in _opt_losses(tmp / "muon-z2-lora"))
    dpo = _opt_losses(tmp / "muon-z2-dpo")
    assert dpo[0] == pytest.approx(math.log(2), abs=1e-4) and all(math.isfinite(x) for x in dpo), dpo


@pytest.mark.timeout(60)
def test_bf16_master_weights_and_states_train_on_both_paths(runs: Path) -> None:
    tmp, logs = runs, run_logs(runs / "launch.log")
    for name in ("bf16-states-z2", "bf16-states-z3-trainer", "bf16-states-z2-nearest"):
        got = _opt_losses(tmp / name)
        assert len(got) == 4 and all(math.isfinite(x) for x in got) and got[-1] < got[0], (name, got)
        # the masters are the weights (runtime/low_precision.py share_masters) at ZeRO-2 and ZeRO-3 alike
        assert "masters share the weights' storage" in logs[name], logs[name][-3000:]
    # auto: torchao's AdamW rounds stochastically into the bf16 masters; nearest keeps DeepSpeed's FusedAdam
    for name in ("bf16-states-z2", "bf16-states-z3-trainer"):
        assert ("AdamW at lr 0.001 (torchao's, rounding stochastically into the bf16 masters); bf16 master weights, "
                "gradients and states") in logs[name], logs[name][-3000:]
    assert "(rounding to nearest: train.bf16_rounding=nearest)" in logs["bf16-states-z2-nearest"]
    # the same start, then apart only by rounding
    sr, rn = _opt_losses(tmp / "bf16-states-z2"), _opt_losses(tmp / "bf16-states-z2-nearest")
    assert sr[0] == pytest.approx(rn[0], abs=1e-6) and sr[1:] == pytest.approx(rn[1:], abs=0.05), (sr, rn)


@pytest.mark.timeout(60)
def test_a_clip_under_muon_at_zero2_is_refused_in_one_line(runs: Path) -> None:
    tmp, logs = runs, run_logs(runs / "launch.log")
    log = logs["muon-z2-clipped"]
    errors = [x for x in log.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "train.grad_clip=1.0 with Muon at ZeRO-2" in errors[0], log[-3000:]
    assert not (tmp / "muon-z2-clipped" / "metrics.jsonl").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(BAD_CHECKPOINTS))
def test_a_checkpoint_that_does_not_match_its_model_stops_before_loading(runs: Path, name: str) -> None:
    """Issue 81: with one tensor removed, transformers printed "MISSING: those params were newly initialized" among
    the console's lines and the run trained that layer from random init. Now a removed tensor, one of another shape
    and one that belongs to no module each stop the run before any weight is read, in one line naming them, at every
    stage and on both paths, QLoRA too; model.new_weights lets the removed one train from new weights on purpose."""
    fault = BAD_CHECKPOINTS[name][0]
    d = runs / name
    status = json.loads((d / "status.json").read_text())
    if "allowed" in name:
        assert status["status"] == "completed", status
        report = json.loads((d / "load_report.json").read_text())
        assert report["new_weights"] == [DROPPED] and report["missing"] == [], report
        assert "1 new on purpose (model.new_weights): " + DROPPED in run_logs(runs / "launch.log")[name]
        return
    want = {"removed": f"1 tensor(s) missing from the checkpoint (they would train from random init): {DROPPED}",
            "shape": f"1 tensor(s) of another shape: {DROPPED}: checkpoint [64, 8], model [64, 128]",
            "stray": "1 tensor(s) in the checkpoint but in no module of the model: model.layers.1.mlp.extra.weight"}
    # a refused run's rank 0 prints its line while rank 1 may print the next run's marker: read the line from the
    # run's status, and find it printed, once a run, among the launch's error lines
    error = status["error"]
    assert status["status"] == "failed" and status["phase"] == "build" and "\n" not in error, status
    assert error.startswith(f"model.name={runs / f'ckpt-{fault}'}: the checkpoint does not match") and want[fault] in error
    assert f"error: {error}" in (runs / "launch.log").read_text()
    assert not (d / "metrics.jsonl").exists() and not (d / "checkpoints").exists()  # nothing half written


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["raw-zero3", "trainer-zero3", "raw-lora", "trainer-lora-bf16", "qlora-z3",
                                  "export-dropped-z3", "export-dropped-lora-trainer"])
def test_an_export_is_held_to_the_trained_model_before_it_is_marked_done(runs: Path, name: str) -> None:
    """Issue 81: an export's files hold every tensor of the trained model (a LoRA adapter's under PEFT's names) with
    its shape and dtype, and reloaded in plain transformers (PEFT onto the base for an adapter) give the engine's
    logits; a QLoRA adapter is held by its keys, and says why not by logits. A tensor dropped from the written files
    (a test hook) stops the run in one line naming it, and the files stay in <dir>.tmp, not marked done."""
    d = runs / name
    kind = "adapter" if "lora" in name else "export"
    status = json.loads((d / "status.json").read_text())
    if "dropped" in name:
        dropped = DROPPED if kind == "export" else "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
        assert status["status"] == "failed" and status["phase"] == "final", status
        assert f"train.export: the files written for {d / kind} do not hold the trained model (1 tensor(s) of the " \
               f"trained model missing from the files: {dropped})" in status["error"] and "\n" not in status["error"]
        assert not (d / kind).exists() and json.loads((d / f"{kind}.tmp" / "export_check.json").read_text())[
            "missing"] == [dropped]
        return
    assert status["status"] == "completed", status
    report = json.loads((d / kind / "export_check.json").read_text())
    assert report["missing"] == report["unexpected"] == report["shapes"] == report["dtypes"] == [], report
    if name.startswith("qlora"):
        assert report["logits"]["skipped"].startswith("a QLoRA adapter's base is a 4-bit model"), report
    else:  # fp32 runs agree to rounding; bf16 adapters under autocast within bf16's noise
        assert report["logits"]["max_rel_diff"] <= (1e-4 if "bf16" not in name else 5e-2), report
        assert "export checked: " in run_logs(runs / "launch.log")[name]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["fp32-kept-z3", "fp32-kept-z2-trainer", "fp32-cast-z3-trainer", "fp32-cast-z2"])
def test_what_a_family_keeps_in_fp32_stays_fp32_under_bf16(runs: Path, name: str) -> None:
    """Issue 81: DeepSeek-V3's routers' e_score_correction_bias (its _keep_in_fp32_modules_strict) in bf16 holds a few
    distinct values and sends tokens to other experts. Under bf16 at ZeRO-2 and ZeRO-3 on both paths it is fp32 once
    the engine exists, recorded with the router weights DeepSpeed trains in bf16 (fp32 masters); cast to bf16 after
    the engine started (a test hook), the run stops before its first step in one line naming it."""
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    status = json.loads((runs / name / "status.json").read_text())
    record = json.loads((runs / name / "fp32_kept.json").read_text())
    assert record["params_in_training_dtype"] == ["model.layers.1.mlp.gate.weight"], record
    if "cast" in name:
        line = f"1 buffer(s) the family keeps in fp32 are not fp32 once the engine started: {bias} (bfloat16)"
        assert status["status"] == "failed" and status["step"] == 0 and line in status["error"], status
        assert "\n" not in status["error"] and record["not_fp32"] == [f"{bias} (bfloat16)"]
        assert not (runs / name / "metrics.jsonl").exists()
    else:
        assert status["status"] == "completed" and record["fp32_buffers"] == [bias] and record["not_fp32"] == []
        assert "fp32-kept tensors (the family's _keep_in_fp32_modules lists): 1 buffer(s) kept in fp32 " \
            f"({bias})" in run_logs(runs / "launch.log")[name]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["unmoved-z3", "unmoved-z2-trainer", "unmoved-z0-lora", "unmoved-z2-warn"])
def test_a_trainable_parameter_that_does_not_move_is_named(runs: Path, name: str) -> None:
    """Issue 81: a parameter that trains on no gradient (a ZeRO-3 hook that never fires, a freeze by mistake) ended
    in no error. Its gradient zeroed by a test hook, it is named once the first two steps with a learning rate are
    done (warmup starts at 0: steps 2-3 here), on every rank alike, and the run stops, or warns where it is told to."""
    zeroed = UNMOVED_LORA if "lora" in name else DROPPED
    status = json.loads((runs / name / "status.json").read_text())
    line = f"trainable parameter(s) did not move over optimizer steps 2-3, the first two with a learning rate: they " \
           f"train on no gradient ({zeroed})"
    text = (runs / "launch.log").read_text()
    if "warn" in name:
        assert status["status"] == "completed" and re.search(r"^warning: 1 of \d+ " + re.escape(line), text, re.M)
    else:
        assert status["status"] == "failed" and status["step"] == 3 and line in status["error"], status
        assert re.search(r"^error: 1 of \d+ " + re.escape(line), text, re.M)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["raw-zero3", "trainer-zero2_offload", "raw-lora", "trainer-lora-bf16", "qlora-z3",
                                  "muon-z3"])
def test_every_trainable_parameter_moved_in_the_runs_that_train(runs: Path, name: str) -> None:
    """Full fine-tuning, LoRA (A moves at the second step: B starts at zero), bf16 under autocast, QLoRA and Muon, at
    ZeRO-0 to 3 and with offload: the check passes and says so."""
    log = run_logs(runs / "launch.log")[name]
    assert re.search(r"every trainable parameter moved over steps \d+-\d+ \(\d+ tensors; checked in [\d.]+ ms\)", log), log[-3000:]


@pytest.mark.timeout(60)
def test_a_matching_checkpoint_is_said_in_one_line(runs: Path) -> None:
    log = run_logs(runs / "launch.log")["qlora-z3"]
    assert "checkpoint: " in log and "tensors matched the model by name, shape and dtype" in log, log[-3000:]
    report = json.loads((runs / "qlora-z3" / "load_report.json").read_text())
    assert report["checked"] == "index" and not (report["missing"] or report["unexpected"] or report["shapes"])


# ---------------------------------------------------------------- QLoRA

@pytest.mark.timeout(60)
def test_qlora_trains_alike_at_zero0_and_zero3_and_saves_its_adapter(runs: Path) -> None:
    """A 4-bit base under LoRA: ZeRO-3 shards the packed weights and trains as ZeRO-0 does (the same losses); the
    trainer path at ZeRO-2 too; the adapter written at ZeRO-3 holds the trained values (never empty)."""
    tmp, logs = runs, run_logs(runs / "launch.log")
    want = _opt_losses(tmp / "qlora-z0")
    assert len(want) == 4 and all(math.isfinite(x) for x in want), want
    for name in ("qlora-z3", "qlora-z2-trainer"):
        assert _opt_losses(tmp / name) == pytest.approx(want, abs=1e-4), (name, _opt_losses(tmp / name), want)
    for name in QLORA_RUNS:  # (DPO's loss is checked below)
        # the tiny llama: 2 layers x 7 projections quantized, its head left in the float dtype
        assert "model.load_in_4bit: 14 Linear layers in 4-bit nf4" in logs[name], logs[name][-3000:]
    from safetensors.torch import load_file

    # DPO against the adapter-off reference: the 4-bit base itself, so the first step's loss is ln 2
    dpo = _opt_losses(tmp / "qlora-z3-dpo")
    assert len(dpo) == 4 and dpo[0] == pytest.approx(math.log(2), abs=1e-4), dpo
    assert "reference: adapter" in logs["qlora-z3-dpo"]
    # the rest of the family on the 4-bit base: KTO and IPO against the adapter-off reference start where the
    # reference equals the policy (KTO 0.5, IPO (1 / (2 beta))^2 at beta 0.1), SimPO and ORPO need none
    kto, ipo = _opt_losses(tmp / "qlora-z3-kto"), _opt_losses(tmp / "qlora-z2-ipo")
    assert len(kto) == 4 and kto[0] == pytest.approx(0.5, abs=1e-4), kto
    assert len(ipo) == 4 and ipo[0] == pytest.approx(25.0, rel=1e-4), ipo
    assert "reference: adapter" in logs["qlora-z3-kto"] and "reference: adapter" in logs["qlora-z2-ipo"]
    for name in ("qlora-z2-simpo", "qlora-z2-orpo"):
        losses = _opt_losses(tmp / name)
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses), (name, losses)
    adapter = load_file(str(tmp / "qlora-z3" / "adapter" / "adapter_model.safetensors"))
    b = [v for k, v in adapter.items() if "lora_B" in k]
    assert len(b) == 4 and all(v.numel() and v.abs().sum() > 0 for v in b), {k: v.shape for k, v in adapter.items()}
    # resumed after step 2 at ZeRO-3: steps 1-4 once each, on the uninterrupted run's curve
    for name, whole in (("qlora-z3-resume", "qlora-z3"), ("qlora-z2-trainer-resume", "qlora-z2-trainer")):
        resumed = [r for r in lines(tmp / name / "metrics.jsonl") if "loss" in r]
        assert [r["step"] for r in resumed] == [1, 2, 3, 4], name
        assert [r["loss"] for r in resumed] == pytest.approx(_opt_losses(tmp / whole), abs=1e-4), name
    preset = _opt_losses(tmp / "qlora-z2-preset")
    assert len(preset) == 4 and all(math.isfinite(x) for x in preset), preset
    assert "model.load_in_4bit: 14 Linear layers in 4-bit nf4" in logs["qlora-z2-preset"], logs["qlora-z2-preset"][-2000:]


@pytest.mark.timeout(120)
def test_a_qlora_adapter_trained_at_zero3_merges_into_its_base(runs: Path, tmp_path: Path) -> None:
    """Issue 61 item 3 on a real run: the adapter the ZeRO-3 run exported, merged by `toolkit merge-adapter` into the
    base it started from (rounded through nf4, read from the run's config.yaml): the merged float model gives the
    logits of the 4-bit base with the adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.runtime.quant import quantize_4bit

    base, adapter = runs / "qlora-base", runs / "qlora-z3" / "adapter"
    out = subprocess.run([sys.executable, "-m", "toolkit", "merge-adapter", str(adapter), "--base", str(base),
                          "--out", str(tmp_path / "merged"), "--dtype", "fp32"], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0 and "dequantized base (14 Linears through nf4)" in out.stdout, out.stdout + out.stderr
    four_bit = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    quantize_4bit(four_bit, dtype=torch.float32, quant_type="nf4", device="cpu")
    trained = PeftModel.from_pretrained(four_bit, adapter)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, trained(ids).logits, atol=1e-4)


@pytest.mark.timeout(120)
def test_a_run_that_fails_fails_only_the_tests_that_read_it(runs: Path, tmp_path: Path) -> None:
    """Issue 83: one run's failure (a NaN stop on one rank, ended by the watchdog) ended the shared launch and errored
    all 69 tests of this file. Here a rank is killed as a run starts: that run alone is failed, the runs after it go
    on in a new launch, and of three tests, the one that reads it fails naming it while the two that read the runs
    before and after it pass."""
    failed = json.loads((runs / "failed_runs.json").read_text())
    assert list(failed) == [KILLED] and "its processes ended" in failed[KILLED], failed
    assert len((runs / "master_ports").read_text().split()) == 2  # the runs after it: a second launch
    probe = tmp_path / "test_reads.py"
    probe.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / "tests" / "dist")!r})
from _launch import Runs
RUNS = Runs({str(runs)!r})

def test_reads_the_killed_run():
    assert (RUNS / {KILLED!r} / "config.yaml").exists()

def test_reads_the_run_before_it():
    assert (RUNS / "bf16-states-z2-nearest" / "status.json").exists()

def test_reads_the_run_after_it():  # refused on purpose, as it should be: no run folder, and not failed
    assert not (RUNS / "muon-z2-clipped" / "metrics.jsonl").exists()
""")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--rootdir", str(tmp_path), str(probe)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=100)
    assert "1 failed, 2 passed" in out.stdout, out.stdout[-3000:]
    assert "FAILED test_reads.py::test_reads_the_killed_run" in out.stdout, out.stdout[-3000:]
    assert f"run {KILLED} of the shared launch failed: its processes ended" in out.stdout, out.stdout[-3000:]
