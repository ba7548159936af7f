"""Which models compile their decoder layers as ZeRO-3 leaf modules (toolkit/runtime/speed/compile.py leaves_safe):
a leaf's gradients are reduced in its full backward hook, which torch calls early when no input of the module
needs a gradient, so only models whose input embeddings train qualify."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_full_fine_tune_layers_can_be_leaves() -> None:
    from toolkit.runtime.speed.compile import leaves_safe

    assert leaves_safe(_tiny())


def test_frozen_embeddings_and_lora_keep_hooks_per_submodule() -> None:
    from peft import LoraConfig, get_peft_model

    from toolkit.runtime.speed.compile import leaves_safe

    frozen = _tiny()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert not leaves_safe(frozen)
    lora = get_peft_model(_tiny(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not leaves_safe(lora)


def test_plain_linear_is_set_unless_the_user_chose() -> None:
    from toolkit.runtime.speed.compile import plain_linear

    ds: dict = {"zero_optimization": {"stage": 3}}
    assert plain_linear(ds) is None and ds["zero_optimization"]["memory_efficient_linear"] is False
    mine = {"zero_optimization": {"stage": 3, "memory_efficient_linear": True}}
    note = plain_linear(mine)
    assert note and "memory_efficient_linear=true" in note and mine["zero_optimization"]["memory_efficient_linear"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, hidden_states):
        return self.lin(hidden_states)


class _Model(torch.nn.Module):
    """Embeddings that train and a list of one block class: what leaves are made of; `by_keyword` passes the
    hidden states to each block by name, as some models (mllama) do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(_Block() for _ in range(2))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, ids, by_keyword: bool = False):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(hidden_states=h) if by_keyword else layer(h)
        return h.sum()


def test_leaves_stop_a_model_that_passes_hidden_states_by_keyword() -> None:
    from toolkit.runtime.speed.compile import leaves_safe, mark_leaves

    model = _Model()
    assert leaves_safe(model)  # the embeddings train: the premise holds, the call does not
    mark_leaves(model, list(model.layers))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(ids, by_keyword=True)  # no gradients: nothing to lose, and the check waits for a training forward
    with pytest.raises(RuntimeError, match=r"_Block receives hidden_states by keyword.*train\.zero3_leaves=false"):
        model(ids, by_keyword=True)


def test_leaves_check_once_and_leave_positional_models_alone() -> None:
    from toolkit.runtime.speed.compile import mark_leaves

    model = _Model()
    mark_leaves(model, list(model.layers))
    model(torch.tensor([[1, 2, 3]])).backward()
    assert model.layers[0].lin.weight.grad is not None
    assert not model.layers[0]._forward_pre_hooks  # one-shot: gone after the first training forward
