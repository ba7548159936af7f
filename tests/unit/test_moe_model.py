"""Mixture-of-Experts models (toolkit/runtime/moe/): what the run says of their experts and which blocks become
ZeRO-3 leaves. The training runs are tests/dist/test_moe.py's."""

from __future__ import annotations

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config
from toolkit.runtime import moe
from toolkit.runtime.model import model_config


def _model(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_config(load_config(None, [f"model.name={name}"])))


class _PerExpertBlock(torch.nn.Module):
    """Remote-code style: one module per expert, only the routed ones run."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))


def test_fused_experts_are_read_from_the_model() -> None:
    e = moe.experts_of(_model("tiny-mixtral"))
    assert e is not None and (e.count, e.top_k, e.layers, e.backend, e.block) == (8, 2, 2, "grouped_mm",
                                                                                  "MixtralSparseMoeBlock")
    assert e.block_params == 8 * 3 * 64 * 32 + 8 * 64  # experts (gate_up + down) and the router
    assert moe.experts_of(_model("tiny")) is None


def test_blocks_with_one_module_per_expert_become_leaves_and_fused_ones_do_not() -> None:
    from deepspeed.utils.z3_leaf_module import z3_leaf_module

    model = torch.nn.Sequential(_PerExpertBlock(), _PerExpertBlock())
    assert moe.set_leaves(model) == ["_PerExpertBlock"]
    assert all(z3_leaf_module(m) for m in model)
    assert moe.set_leaves(_model("tiny-olmoe")) == []  # fused experts run on every rank: nothing to set


def test_deepspeeds_default_leaves_are_reported_with_the_live_budget() -> None:
    ds3 = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1_000_000_000}}
    line = moe.describe(_model("tiny-qwen3-moe"), ds3)
    assert "ZeRO-3 leaves: 2 x Qwen3MoeSparseMoeBlock" in line and "warning" not in line
    small = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 50_000}}
    assert "set it to at least 99,328" in moe.describe(_model("tiny-qwen3-moe"), small)  # 2 x 49,664 per block
    own = {"zero_optimization": {"stage": 3, "leaf_module": {"classes": []}}}  # the config turns the defaults off
    assert "ZeRO-3 leaves: none" in moe.describe(_model("tiny-qwen3-moe"), own)
    assert moe.describe(_model("tiny-qwen3-moe"), {"zero_optimization": {"stage": 2}}).endswith(
        "ZeRO-2: no leaf modules needed")
    autoep = {**ds3, "expert_parallel": {"enabled": True, "autoep_size": 2}}  # the blocks are replaced, not leaves
    assert "ZeRO-3 leaves: none (AutoEP replaces the blocks" in moe.describe(_model("tiny-qwen3-moe"), autoep)


def test_the_planner_counts_total_parameters_for_states_and_active_ones_for_speed() -> None:
    from toolkit.plan import planner as pl
    from toolkit.plan.shapes import load_shape

    # published totals and active parameters: 30.5B / 3.3B, 46.7B / 12.9B, 6.9B / 1.3B
    for name, total, active in (("qwen3-30b-a3b", 30.5, 3.35), ("mixtral-8x7b", 46.7, 12.9), ("olmoe-1b-7b", 6.9, 1.28)):
        s = load_shape(name)
        assert (round(s.total_params / 1e9, 1), round(s.active_params / 1e9, 2 if active < 4 else 1)) == (total, active)
    s = load_shape("qwen3-30b-a3b")
    w, c = pl.Workload(s, 4096, 8), pl.Choice(3, micro_batch=1, grad_accum=1, grad_ckpt=False)
    p = pl.predict(w, c, pl.Hardware(8))
    assert p.persistent["optimizer"] == pytest.approx(12 * s.total_params / 8 / pl.GIB, rel=0.01)  # every expert's
    dense_mlp = pl.layer_activation_bytes(load_shape("llama-1b"), seq_len=4096, attn="sdpa", liger=True, lora=None)
    moe_layer = pl.layer_activation_bytes(s, seq_len=4096, attn="sdpa", liger=True, lora=None)
    assert moe_layer > 2 * 8 * (2 * 2048 + 3 * 768) > 0 and dense_mlp > 0  # top-8 x (2h + 3I) bf16, and the router's
    with pytest.raises(ConfigError, match="float8"):
        pl.predict(pl.Workload(s, 4096, 8, fp8="tensorwise"), c, pl.Hardware(8))


def test_expert_load_is_the_busiest_experts_tokens_over_the_mean() -> None:
    load = moe.ExpertLoad(top_k=1)
    assert load.take() is None  # nothing routed yet
    balanced = torch.eye(4)  # 4 tokens, one to each of 4 experts
    skewed = torch.tensor([[5.0, 0, 0, 0]] * 4)  # every token to expert 0
    load.add((balanced, skewed))
    assert load.take() == [1.0, 4.0] and load.counts is None
    load.add((skewed.unsqueeze(0), skewed.unsqueeze(0)))  # (batch, seq, experts) reads the same
    assert load.take() == [4.0, 4.0]


def test_check_validates_expert_parallel_with_deepspeeds_rules(tmp_path) -> None:
    from toolkit.config import ds_config as dc
    from toolkit.config.checks import check_config

    ds = dc.preset("zero3") | {"expert_parallel": {"enabled": True, "autoep_size": 3, "preset_model": "qwen3_moe"}}
    found = check_config(ds, world_size=2)
    assert any(f.key == "expert_parallel" and "DeepSpeed refuses it" in f.message and "must divide" in f.message
               for f in found), found
    ds["expert_parallel"]["autoep_size"] = 1
    assert any(f.key == "expert_parallel.autoep_size" and f.level == "warning" for f in check_config(ds, world_size=2))


def test_autoep_registry_fix_lets_deepspeeds_string_keys_through(monkeypatch) -> None:
    """deepspeed 0.19.8's AutoEP reads transformers' output-recorder registry as a plain dict keyed by str(cls), with a
    default, and writes entries back by that key; transformers 5.24's registry keys by model and takes no default.
    The check warns a script of one's own; the fix serves string keys as the plain dict and model keys unchanged."""
    import transformers.utils.output_capturing as oc

    from toolkit.config import ds_config as dc
    from toolkit.config.checks.core import check_config
    from toolkit.config.checks.expert_parallel import registry_takes_no_default
    from toolkit.runtime.moe import autoep

    class Registry(dict):  # transformers 5.24's shape: keyed by the model's class, get(model) only
        def __setitem__(self, model, value):  # type: ignore[override]
            super().__setitem__(str(model.__class__), value)

        def get(self, model):  # type: ignore[override]
            return super().get(str(model.__class__)) or {}

    class WithDefault(dict):  # transformers 5.17 and before: a plain dict
        pass

    monkeypatch.setattr(oc, "_CanRecordRegistry", WithDefault)
    assert not registry_takes_no_default() and not autoep.allow_string_keys()
    monkeypatch.setattr(oc, "_CanRecordRegistry", Registry)
    ds = dc.preset("zero3") | {"expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}}
    warned = [f for f in check_config(ds, world_size=2, consumer="hf-trainer") if f.key == "expert_parallel.enabled"]
    assert warned and warned[0].level == "warning" and "allow_string_keys()" in warned[0].message
    for path in ("raw", "trainer"):  # toolkit/train.py's own paths fix it before the engine: nothing to warn
        assert not [f for f in check_config(ds, world_size=2, consumer=path) if f.key == "expert_parallel.enabled"]
    reg, model = Registry(), torch.nn.Linear(1, 1)
    reg[model] = {"router_logits": "model's"}
    with pytest.raises(TypeError):
        reg.get(str(model.__class__), None)  # what deepspeed.initialize meets without the fix
    assert autoep.allow_string_keys() and autoep.allow_string_keys()  # idempotent
    assert not registry_takes_no_default()  # fixed: nothing for the check to warn about in this process
    key = str(model.__class__)
    missing = object()
    assert reg.get("<class 'not.there'>", missing) is missing and reg.get(key, missing) == {"router_logits": "model's"}
    reg[key] = {"router_logits": "deepspeed's"}  # DeepSpeed's restore, by string key
    assert reg.get(model) == {"router_logits": "deepspeed's"} and "<class 'str'>" not in reg
    line = autoep.prepare(ds, 8)
    assert "groups of 2 ranks (4 per rank)" in line and "string keys" in line


def test_autoep_counts_the_layers_it_replaced_and_says_what_to_set_when_none() -> None:
    from toolkit.runtime.moe import autoep

    class AutoEPMoELayer(torch.nn.Module):  # DeepSpeed's class name is what the count reads
        pass

    assert autoep.replaced(torch.nn.Sequential(AutoEPMoELayer(), torch.nn.Linear(1, 1), AutoEPMoELayer())) == 2
    plain = torch.nn.Sequential(torch.nn.Linear(1, 1))
    assert autoep.replaced(plain) == 0
    msg = autoep.nothing_replaced({"expert_parallel": {"enabled": True, "preset_model": "mixtral"}}, plain)
    assert "replaced no MoE layer of Sequential (preset_model=mixtral)" in msg and "--ep-preset" in msg


def test_gen_config_writes_the_autoep_block(tmp_path, capsys) -> None:
    import json

    from toolkit.cli import main

    out = tmp_path / "ep.json"
    assert main(["gen-config", "--stage", "3", "--expert-parallel", "2", "--ep-preset", "qwen3_moe", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["expert_parallel"] == {"enabled": True, "autoep_size": 2,
                                                              "preset_model": "qwen3_moe"}


# ----------------------------------------------------------------------------- model.experts (toolkit/plan/experts.py)

def test_experts_path_auto_takes_liger_where_its_fused_moe_applies_and_grouped_mm_elsewhere() -> None:
    from toolkit.plan import experts

    on = experts.choose("auto", model_type="qwen3_moe", liger_layers=True)  # auto names no implementation:
    assert (on.implementation, on.liger) == (None, False)  # the model's default (grouped_mm); Liger's is opt-in
    assert "experts path: transformers' default (model.experts=auto: " in on.describe()
    olmoe = experts.choose("auto", model_type="olmoe", liger_layers=True)  # Liger has no fused MoE for OLMoE
    assert (olmoe.implementation, olmoe.liger) == (None, False) and "olmoe" in olmoe.reason
    cpu = experts.choose("auto", model_type="mixtral", liger_layers=False, liger_why="no CUDA device")
    assert not cpu.liger and "no CUDA device" in cpu.describe()
    assert experts.choose("eager", model_type="qwen3_moe", liger_layers=True) == experts.ExpertsChoice(
        "eager", False, "model.experts=eager")


def test_experts_path_liger_where_it_cannot_run_is_one_line() -> None:
    from toolkit.plan import experts

    with pytest.raises(ConfigError, match=r"no CUDA device.*use one of grouped_mm, batched_mm, eager"):
        experts.choose("liger", model_type="qwen3_moe", liger_layers=False, liger_why="no CUDA device")
    with pytest.raises(ConfigError, match="no fused MoE for model type 'olmoe'"):
        experts.choose("liger", model_type="olmoe", liger_layers=True)


def test_liger_swiglu_follows_the_experts_path_only_for_families_whose_experts_it_replaces() -> None:
    from toolkit.plan import experts
    from toolkit.plan.liger import LigerChoice

    layers = LigerChoice(kwargs={"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True})
    grouped = experts.choose("grouped_mm", model_type="qwen3_moe", liger_layers=True)
    assert moe.with_experts(layers, grouped, "qwen3_moe").kwargs["swiglu"] is False
    assert "swiglu follows model.experts" in moe.with_experts(layers, grouped, "qwen3_moe").describe()
    fused = experts.choose("liger", model_type="mixtral", liger_layers=True)
    assert moe.with_experts(layers, fused, "mixtral") is layers  # swiglu on already: nothing to say
    assert moe.with_experts(layers, grouped, "olmoe") is layers  # its swiglu patch (if any) is not the experts'


def test_a_family_that_cannot_switch_its_experts_builds_on_auto_and_refuses_a_named_path() -> None:
    """JetMoe's experts take no implementation by name: transformers raises if one is set, so auto leaves it unset
    and a named one is one line before the build."""
    from transformers import AutoModelForCausalLM, JetMoeConfig

    from toolkit.plan.liger import LigerChoice

    mc = JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_key_value_heads=2, kv_channels=8,
                      intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    auto = load_config(None, ["model.experts=auto"])
    path = moe.choose_path(auto, mc, LigerChoice(reason="no CUDA device"))
    assert path is not None and path.implementation is None
    AutoModelForCausalLM.from_config(mc)  # nothing set: builds
    with pytest.raises(ConfigError, match="jetmoe models run one experts implementation only"):
        moe.choose_path(load_config(None, ["model.experts=grouped_mm"]), mc, LigerChoice(reason="x"))


def test_a_run_builds_the_experts_path_it_names_and_refuses_one_for_a_dense_model() -> None:
    from toolkit.plan.liger import LigerChoice

    cfg = load_config(None, ["model.name=tiny-qwen3-moe", "model.experts=eager"])
    mc = model_config(cfg)
    path = moe.choose_path(cfg, mc, LigerChoice(reason="no CUDA device"))
    assert path is not None and (path.implementation, path.liger) == ("eager", False)
    dense = load_config(None, ["model.name=tiny", "model.experts=eager"])
    with pytest.raises(ConfigError, match="applies to Mixture-of-Experts models; llama has no experts"):
        moe.choose_path(dense, model_config(dense), LigerChoice(reason="x"))
    assert moe.choose_path(load_config(None, ["model.name=tiny"]), model_config(load_config(None, [])),
                           LigerChoice(reason="x")) is None
    with pytest.raises(ConfigError, match=r"model\.experts must be one of"):
        load_config(None, ["model.experts=fast"])


def test_num_layers_builds_a_preset_with_fewer_layers_and_is_refused_for_a_directory(tmp_path) -> None:
    mc = model_config(load_config(None, ["model.name=qwen3-30b-a3b", "model.num_layers=3"]))
    assert (mc.num_hidden_layers, mc.hidden_size, mc.num_experts) == (3, 2048, 128)
    assert model_config(load_config(None, ["model.name=gpt2-124m", "model.num_layers=2"])).n_layer == 2
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=r"model\.num_layers applies to presets"):
        model_config(load_config(None, [f"model.name={tmp_path}", "model.num_layers=2"]))
    with pytest.raises(ConfigError, match=r"model\.num_layers must be >= 0"):
        load_config(None, ["model.num_layers=-1"])


def test_mfu_counts_active_parameters_and_the_attention_width() -> None:
    """MFU of an MoE run: a token runs top-k of each layer's experts; Qwen3-MoE's attention is 32 heads of 128 over
    a hidden size of 2048. The same figures as the planner's and bench/speed.py's."""
    from transformers import AutoModelForCausalLM

    from toolkit.observe.metrics import attention_width, count_params
    from toolkit.plan.shapes import load_shape

    mc = model_config(load_config(None, ["model.name=qwen3-30b-a3b", "model.num_layers=3"]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mc)
    assert count_params(model) == (793_000_704, 793_000_704)
    import dataclasses

    assert dataclasses.replace(load_shape("qwen3-30b-a3b"), num_layers=3).active_params == 793_000_704  # the planner's
    assert attention_width(mc) == 4096 and attention_width(model_config(load_config(None, ["model.name=llama-1b"]))) == 2048


def test_the_fused_loss_is_off_for_small_moe_micro_batches_whose_logits_fit() -> None:
    import dataclasses

    from toolkit.plan import planner as pl
    from toolkit.plan.liger import MOE_FUSED_LOSS_OFF_TOKENS, choose, moe_fused_loss
    from toolkit.plan.shapes import load_shape

    setting, why = moe_fused_loss("auto", moe=True, tokens=8192, logits_fit=True)
    assert setting == "false" and "8,192 tokens" in why
    assert moe_fused_loss("auto", moe=True, tokens=MOE_FUSED_LOSS_OFF_TOKENS + 1, logits_fit=True) == ("auto", "")
    assert moe_fused_loss("auto", moe=True, tokens=8192, logits_fit=False) == ("auto", "")
    assert moe_fused_loss("auto", moe=False, tokens=8192, logits_fit=True) == ("auto", "")  # dense: not measured
    assert moe_fused_loss("true", moe=True, tokens=8192, logits_fit=True) == ("true", "")
    line = choose(True, cuda=True, model_type="qwen3_moe", task="causal_lm", stage=2, supported=frozenset({"qwen3_moe"}),
                  fused_loss="false", fused_off_reason=why).describe()
    assert "fused_linear_cross_entropy off: model.liger_fused_loss=auto: a Mixture-of-Experts micro-batch" in line
    # the planner follows the run: micro 2 x 4096 on one 80 GiB GPU plain, micro 8 fused (its logits would not fit)
    s = dataclasses.replace(load_shape("qwen3-30b-a3b"), num_layers=3)
    w = pl.Workload(s, 4096, 32, compile="off")
    two = pl.predict(w, pl.Choice(2, micro_batch=2, grad_accum=16), pl.Hardware(1))
    eight = pl.predict(w, pl.Choice(2, micro_batch=8, grad_accum=4), pl.Hardware(1))
    assert (two.fused_loss, eight.fused_loss) == (False, True)
    assert two.fits and eight.fits


def test_the_run_turns_the_fused_loss_off_where_toolkit_plan_says_its_logits_fit() -> None:
    """moe.fused_loss_setting on a CUDA machine of 80 GiB, the reduced Qwen3-30B-A3B shape at ZeRO-2."""
    import json
    from pathlib import Path

    ds = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / "zero2.json").read_text())
    gpu = 80 * 2**30

    def setting(*over: str) -> tuple[str, str]:
        cfg = load_config(None, ["model.name=qwen3-30b-a3b", "model.num_layers=3", "data.seq_len=4096", *over])
        return moe.fused_loss_setting(cfg, model_config(cfg), ds, 1, False, False, gpu)

    off, why = setting("train.micro_batch_size=2", "train.grad_accum=16")
    assert off == "false" and "8,192 tokens" in why
    assert setting("train.micro_batch_size=8", "train.grad_accum=4") == ("auto", "")  # 32,768 tokens: it stays
    assert setting("train.micro_batch_size=2", "train.grad_accum=16", "model.liger_fused_loss=true") == ("true", "")
    dense = load_config(None, ["model.name=llama-1b", "data.seq_len=2048", "train.micro_batch_size=2"])
    assert moe.fused_loss_setting(dense, model_config(dense), ds, 1, False, False, gpu) == ("auto", "")


def test_the_planner_models_autoep_within_the_measured_rows() -> None:
    """bench/results/speed/s54moe, s56moe (four and two H200s, ZeRO-3, micro 8): each row's peak and speed against
    `toolkit plan`'s for the same run, with and without AutoEP (autoep_size = the GPUs, read from its DeepSpeed block)."""
    import dataclasses
    import json
    from pathlib import Path

    from toolkit.plan import planner as pl
    from toolkit.plan.shapes import load_shape

    root = Path(__file__).resolve().parents[2] / "bench" / "results" / "speed"
    shape = dataclasses.replace(load_shape("qwen3-30b-a3b"), num_layers=3)
    rows = [json.loads(f.read_text()) for run in ("s54moe", "s56moe") for f in sorted((root / run).glob("*-raw-*.json"))]
    assert {(r["gpus"], r["variant"]) for r in rows} >= {(4, "raw-autoep-m8"), (2, "raw-autoep-m8"), (2, "raw-m8")}
    for r in rows:
        n = r["gpus"]
        ds = {"zero_optimization": {"stage": 3}}
        if "autoep" in r["variant"]:
            ds["expert_parallel"] = {"enabled": True, "autoep_size": n}
        w = pl.Workload(shape, 4096, r["global_batch"], compile="off",  # the rows ran Liger's own loss chunks
                        expert_parallel=pl.autoep_size(ds, n, shape), loss_chunks="1")
        assert w.expert_parallel == (n if "autoep" in r["variant"] else 1)
        c = pl.Choice(3, "none", 1.0, r["micro_batch"], r["grad_accum"], False, "speed")
        p = pl.predict(w, c, pl.Hardware(n, 1, 139.0))
        assert abs(p.peak_allocated_gib / r["peak_allocated_gib"] - 1) <= 0.03, (r["variant"], n, p.peak_allocated_gib)
        measured_speed = r["window_tokens_per_s"] / n
        assert abs(p.tokens_per_s_per_gpu / measured_speed - 1) <= 0.10, (r["variant"], n, p.tokens_per_s_per_gpu)


def test_the_planner_refuses_autoep_it_cannot_model() -> None:
    from toolkit.plan import planner as pl
    from toolkit.plan.shapes import load_shape

    moe_shape, dense = load_shape("qwen3-30b-a3b"), load_shape("llama-1b")
    hw, z3 = pl.Hardware(4, 1, 80.0), pl.Choice(3, "none", 1.0, 1, 1, True, "speed")
    for shape, ep, choice, says in ((dense, 4, z3, "needs a Mixture-of-Experts model"),
                                    (moe_shape, 3, z3, "does not divide the model's 128 experts"),
                                    (moe_shape, 8, z3, "does not divide the 4 ranks"),
                                    (moe_shape, 2, z3, "autoep_size equal to the ranks"),
                                    (moe_shape, 4, pl.Choice(2, "none", 1.0, 1, 1, True, "speed"), "at ZeRO-3")):
        with pytest.raises(ConfigError, match=says):
            pl.predict(pl.Workload(shape, 1024, 4, expert_parallel=ep), choice, hw)
    # the search leaves out what it cannot model; below ZeRO-3 a run's own plan is ZeRO's without AutoEP
    w = pl.Workload(moe_shape, 1024, 4, expert_parallel=4)
    assert {c.stage for c in pl.choices(w, hw)} == {3}
    z3_ep = {"zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": True, "autoep_size": 4}}
    assert pl.autoep_size(z3_ep, 4, moe_shape) == 4
    assert pl.autoep_size({**z3_ep, "zero_optimization": {"stage": 2}}, 4, moe_shape) == 1
    assert pl.autoep_size(z3_ep, 4, dense) == 1  # a dense model: planned as it runs, without experts
    assert pl.autoep_size(z3_ep, 8, moe_shape) == 1  # groups smaller than the ranks: not modelled, ZeRO-3's plan
    assert pl.autoep_size({**z3_ep, "expert_parallel": {"enabled": True}}, 4, moe_shape) == 1  # DeepSpeed's default
