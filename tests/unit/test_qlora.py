"""QLoRA (model.load_in_4bit, toolkit/runtime/quant; docs/qlora.md): the settings refused in one line, and the base's
Linears swapped for bitsandbytes' 4-bit ones holding the same weights (on the CPU). The 2-rank runs at ZeRO-0, 2 and 3
are in tests/dist/test_train.py's shared launch."""

from __future__ import annotations

import json

import pytest
import torch

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import load_config


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.load_in_4bit=true"], "trains LoRA adapters on a frozen 4-bit base (QLoRA): set lora.enabled=true"),
    (["model.load_in_4bit=true", "lora.enabled=true", "model.bnb_4bit_quant_type=int4"],
     "model.bnb_4bit_quant_type must be nf4 or fp4"),
    (["model.load_in_4bit=true", "lora.enabled=true", "train.precision=fp16"],
     "DeepSpeed's fp16 mode would cast them"),
])
def test_bad_qlora_settings_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_base_becomes_4bit_linears_with_the_same_weights_and_the_head_stays() -> None:
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.runtime.quant import quantize_4bit

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    assert quantize_4bit(model, dtype=torch.float32, quant_type="nf4", device="cpu") == 14
    q = model.model.layers[0].mlp.down_proj
    assert isinstance(q, bnb.nn.Linear4bit) and q.weight.dtype == torch.float32  # packed, stored as fp32
    assert q.weight.numel() * 4 == before.numel() // 2  # 4 bits a weight
    w = dequantize_4bit(q.weight.data, q.weight.quant_state)
    # NF4's rounding (16 levels a block of 64), not other weights: a fresh draw would be off by about 1.4x the mean
    assert (w - before).abs().mean() < 0.15 * before.abs().mean()
    assert type(model.lm_head) is torch.nn.Linear
    x = torch.randint(0, 128, (1, 8))
    assert torch.isfinite(model(input_ids=x).logits).all()


def _tiny_base(path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def test_merge_adapter_into_the_dequantized_base_computes_what_the_4bit_model_did(tmp_path) -> None:
    """Issue 61 item 3: `toolkit merge-adapter` merges a QLoRA adapter into its base rounded through the run's 4-bit
    format (read from RUN_DIR/config.yaml), so the merged float model gives the trained 4-bit model's logits;
    `--base-weights original` merges into the float weights as they are (the base plus the adapter's update)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.cli import main
    from toolkit.runtime.quant import quantize_4bit

    _tiny_base(tmp_path / "base")
    four_bit = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert quantize_4bit(four_bit, dtype=torch.float32, quant_type="nf4", device="cpu") == 14
    torch.manual_seed(1)  # adapters that change the output (lora_B is zero at PEFT's default init)
    trained = get_peft_model(four_bit, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = trained(ids).logits
    run = tmp_path / "run"
    trained.save_pretrained(run / "adapter")
    (run / "config.yaml").write_text("model:\n  load_in_4bit: true\n  bnb_4bit_quant_type: nf4\n")

    assert main(["merge-adapter", str(run / "adapter"), "--base", str(tmp_path / "base"), "--out",
                 str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(ids).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert json.loads((tmp_path / "merged" / "merge.json").read_text())["base_weights"] == "dequantized"

    assert main(["merge-adapter", str(run / "adapter"), "--base", str(tmp_path / "base"), "--out",
                 str(tmp_path / "original"), "--dtype", "fp32", "--base-weights", "original"]) == 0
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "original", dtype=torch.float32)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                      run / "adapter")
    with torch.no_grad():
        assert torch.allclose(original(ids).logits, plain(ids).logits, atol=1e-4)
        assert not torch.allclose(original(ids).logits, want, atol=1e-3)  # the 4-bit rounding is gone from it


def test_merge_adapter_refuses_what_it_cannot_merge_in_one_line(tmp_path, capsys) -> None:
    from toolkit.cli import main

    _tiny_base(tmp_path / "base")
    assert main(["merge-adapter", str(tmp_path), "--base", str(tmp_path / "base"), "--out", str(tmp_path / "o")]) == 1
    assert "not an adapter directory" in capsys.readouterr().err
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    assert main(["merge-adapter", str(tmp_path / "adapter"), "--base", "tiny", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "random init has none to merge into" in err and err.count("\n") == 1


def test_mfu_counts_a_4bit_base_by_its_weights_not_its_packed_storage(tmp_path) -> None:
    """bitsandbytes packs two 4-bit weights a byte into float elements: the FLOPs a token costs are the float model's
    (a QLoRA run on an H200 reported half its bf16 LoRA's MFU at 0.96x its tokens/s before this)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.observe.metrics import count_params
    from toolkit.runtime.quant import quantize_4bit

    _tiny_base(tmp_path / "base")
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    four_bit = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    quantize_4bit(four_bit, dtype=torch.float32, quant_type="nf4", device="cpu")
    four_bit = get_peft_model(four_bit, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert count_params(four_bit) == count_params(plain)
    assert sum(p.numel() for p in four_bit.parameters()) < count_params(four_bit)[0]


@pytest.mark.parametrize("tied", [False, True])
def test_a_preset_quantized_while_built_has_the_weights_of_the_whole_model_build(tied: bool) -> None:
    """quant.build_4bit (the bounded build: the float model never whole on the host) gives the weights the whole-model
    build and quantize_4bit give: the same init stream in the same order, tied embeddings included, rotary tables
    filled; and the fp32 Linears are gone once quantized."""
    import gc
    import weakref
    from unittest import mock

    from transformers import AutoModelForCausalLM, LlamaConfig

    from toolkit.runtime import quant
    from toolkit.runtime.model import _random_init

    mc = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    kwargs = dict(attn_implementation="sdpa", dtype=torch.float32)
    four = dict(dtype=torch.float32, quant_type="nf4", device="cpu")
    floats: list[weakref.ref] = []
    to_4bit = quant._linear_4bit

    def noting(child, **kw):  # each float Linear weight as it is quantized
        floats.append(weakref.ref(child.weight))
        return to_4bit(child, **kw)

    with mock.patch.object(quant, "_linear_4bit", noting):
        built, n = quant.build_4bit(AutoModelForCausalLM, mc, 1234, kwargs, **four)
    assert n == 21 == len(floats)
    gc.collect()
    assert not [r for r in floats if r() is not None]  # nothing keeps a float Linear weight once it is 4-bit
    whole = _random_init(AutoModelForCausalLM, mc, 1234, kwargs)
    assert quant.quantize_4bit(whole, **four) == 21
    a, b = whole.state_dict(), built.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # bit for bit: packed 4-bit weights read as fp32 hold NaN patterns
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
    assert dict(whole.named_buffers()).keys() == dict(built.named_buffers()).keys()
    for k, v in whole.named_buffers():
        assert torch.equal(v, dict(built.named_buffers())[k]), k
    assert (built.lm_head.weight is built.model.embed_tokens.weight) == tied
    x = torch.randint(0, 128, (2, 16))
    assert torch.equal(whole(input_ids=x).logits, built(input_ids=x).logits)


@pytest.mark.parametrize("tied, saved", [(False, torch.bfloat16), (True, torch.float32)])
def test_a_directory_read_module_by_module_has_the_weights_of_the_whole_load(tmp_path, tied, saved) -> None:
    """A directory with a 4-bit base is read module by module (config.checkpoint.checkpoint_files, build_4bit's weights): the
    same packed weights, quantization states, float weights and logits as transformers' whole load then
    quantize_4bit, from a bf16 or fp32 checkpoint, tied or not. A checkpoint whose names are not the model's is
    loaded whole instead (None)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from toolkit.config.checkpoint import checkpoint_files, model_keys
    from toolkit.runtime import quant

    mc = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(mc, dtype=saved).save_pretrained(tmp_path / "m")
    kwargs = dict(attn_implementation="sdpa", dtype=torch.float32)
    four = dict(dtype=torch.float32, quant_type="nf4", device="cpu")
    files = checkpoint_files(str(tmp_path / "m"), model_keys(AutoModelForCausalLM, mc, kwargs))
    assert files is not None
    read, n = quant.build_4bit(AutoModelForCausalLM, mc, 99, kwargs, **four, weights=files)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True, **kwargs)
    assert quant.quantize_4bit(whole, **four) == n == 14
    a, b = whole.state_dict(), read.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
    x = torch.randint(0, 128, (2, 16))
    assert torch.equal(whole(input_ids=x).logits, read(input_ids=x).logits)
    # a name the model does not have (a legacy layout): not readable module by module
    state = load_file(tmp_path / "m" / "model.safetensors")
    first = next(iter(state))
    state["legacy." + first] = state.pop(first)
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_files(str(tmp_path / "m"), model_keys(AutoModelForCausalLM, mc, kwargs)) is None


def test_a_merge_is_held_to_the_base_plus_adapter_before_it_is_marked_done(tmp_path, capsys, monkeypatch) -> None:
    """Issue 81 item 4: the merged files hold every tensor of the merged model with its shape and dtype, and
    reloaded in plain transformers give the unmerged base + adapter's logits (bf16: within its noise); a tensor
    dropped from the written files (a test hook) ends in one line, the files left in <out>.tmp."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.cli import main
    from toolkit.runtime.faults import export_check

    _tiny_base(tmp_path / "base")
    torch.manual_seed(1)
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                             LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    trained.save_pretrained(tmp_path / "run" / "adapter")
    args = ["merge-adapter", str(tmp_path / "run" / "adapter"), "--base", str(tmp_path / "base"), "--out"]
    assert main([*args, str(tmp_path / "merged"), "--dtype", "bf16"]) == 0
    report = json.loads((tmp_path / "merged" / "export_check.json").read_text())
    assert report["missing"] == report["shapes"] == report["dtypes"] == [] and report["tensors"] == 21, report
    assert 0 < report["logits"]["max_rel_diff"] <= export_check.TOLERANCE["bf16"], report  # bf16 rounding, not 0

    monkeypatch.setenv(export_check.FAULT_ENV, "model.layers.1.mlp.down_proj.weight")
    capsys.readouterr()
    assert main([*args, str(tmp_path / "dropped")]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]  # after transformers' bars
    assert len(err) == 1 and "toolkit merge-adapter: the files written for" in err[0], err
    err = err[0]
    assert "1 tensor(s) of the trained model missing from the files: model.layers.1.mlp.down_proj.weight" in err
    assert not (tmp_path / "dropped").exists() and (tmp_path / "dropped.tmp" / "export_check.json").is_file()
