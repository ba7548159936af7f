"""model.tiled_loss (toolkit/runtime/sequence/tiling.py tile_loss) on CPU, fp32, a tiny Llama from its config: the
loss and every gradient equal the plain forward's, whatever the tiles, the normalization (a global target count,
or the batch's own), pre-shifted labels (a sequence-parallel slice) and a factor applied after the loss; no logits."""

from __future__ import annotations

import pytest
import torch

from toolkit.plan.speedups import tiled_loss_on, tiled_loss_tile
from toolkit.runtime.sequence.tiling import tile_loss


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def _grads(model: torch.nn.Module, **batch: object) -> tuple[torch.Tensor, dict[str, torch.Tensor], object]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    (out.loss * 3.0).backward()  # a factor after the loss (the ranks multiplier): every gradient must carry it
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, out.logits


@pytest.mark.parametrize("tile", [5, 16, 1000])
@pytest.mark.parametrize("normalize", ["own", "global", "shifted"])
def test_the_tiled_loss_is_the_plain_one(tile: int, normalize: str) -> None:
    ids = torch.randint(0, 97, (2, 24))
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt without targets
    batch: dict[str, object] = {"input_ids": ids, "labels": labels}
    if normalize == "global":
        batch["num_items_in_batch"] = torch.tensor(75)
    if normalize == "shifted":  # a sequence-parallel slice: labels already shifted, under both names
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        batch |= {"labels": shifted, "shift_labels": shifted, "num_items_in_batch": torch.tensor(40)}
    model = _model()
    plain_loss, plain, _ = _grads(model, **batch)
    assert tile_loss(model, tile) and tile_loss(model, tile)  # patched once
    loss, grads, logits = _grads(model, **batch)
    assert logits is None
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # generation's forward (no labels) is the plain one
        assert model(input_ids=ids).logits.shape == (2, 24, 97)


def test_auto_tiles_long_micro_batches_without_the_fused_loss_only() -> None:
    assert tiled_loss_on("auto", fused_loss=False, tokens=65536)[0]
    assert not tiled_loss_on("auto", fused_loss=False, tokens=8192)[0]
    assert not tiled_loss_on("auto", fused_loss=True, tokens=1 << 20)[0]
    assert not tiled_loss_on("true", fused_loss=False, tokens=1 << 20, moe=True)[0]
    assert tiled_loss_on("true", fused_loss=False, tokens=16)[0]
    assert tiled_loss_tile(128256) == 2092 and tiled_loss_tile(10) == (1 << 30) // 40
