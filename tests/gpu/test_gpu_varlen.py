"""GPU tier (one GPU): variable-length attention on packed rows (toolkit/runtime/attention/).

- Per-document losses of a packed batch through torch's varlen kernel equal the same documents run alone
  through sdpa, within bf16 rounding; eager and with each decoder layer compiled (batches of other shapes,
  so the compiled layer meets dynamic document counts and lengths).
  Rows that hold one document go through sdpa's causal kernel (every row, none, or some of a batch).
- Gradients match the block-diagonal masked sdpa path (today's CPU path) within bf16 rounding.
- Unpacked rows of a sliding-window model (Gemma 3) through the kernel's window match sdpa with transformers' mask.
Bounds: bf16 through different kernels: per-document loss within 1e-2 absolute (losses near ln(vocab) = 6.9).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

pytestmark = pytest.mark.gpu(1)


def _model(attn: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.runtime.attention.interface import NAME, register, watch_boundaries
    from toolkit.runtime.attention.kernels import prepare

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, use_cache=False)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    if attn == "varlen":
        register()
        prepare(torch.device("cuda"))  # as a run does: the varlen kernel's kv-head mode, probed once
        watch_boundaries(model)
        attn = NAME
    model.config._attn_implementation = attn
    return model


def _batch(seed: int, rows: int = 4, width: int = 512) -> tuple[list[dict], dict]:
    from toolkit.runtime.data.batches import Collator

    rng = random.Random(seed)
    docs, blocks = [], []
    for r in range(rows):
        lens, left = [], width - rng.randrange(0, 40)
        if seed % 3 == 0 or (seed % 3 == 2 and r == 0):  # rows of one document: sdpa's causal kernel
            lens, left = [left], 0
        while left > 8:
            n = min(left, rng.randint(8, 160))
            lens.append(n)
            left -= n
        ids = [rng.randrange(4, 1024) for _ in range(sum(lens))]
        blocks.append({"input_ids": ids, "labels": ids, "seq_lens": lens})
        s = 0
        for n in lens:
            docs.append(ids[s:s + n])
            s += n
    b = Collator(pad_id=0, boundaries=True, whole_rows=True)(blocks)
    return docs, {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in b.items()}


def _doc_losses(logits: torch.Tensor, batch: dict) -> list[float]:
    out, cu = [], batch["cu_seq_lens_q"].tolist()
    flat_logits, flat_ids, pos = logits.flatten(0, 1).float(), batch["input_ids"].flatten(), batch["position_ids"].flatten()
    for a, b in itertools.pairwise(cu):
        if pos[b - 1] == 0:
            continue  # a padding segment (every position 0); documents have at least 8 tokens
        out.append(float(torch.nn.functional.cross_entropy(flat_logits[a:b - 1], flat_ids[a + 1:b])))
    return out


@pytest.mark.parametrize("compiled", [False, True])
def test_packed_documents_lose_what_they_lose_alone(compiled: bool) -> None:
    model = _model("varlen")
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    alone_model = _model("sdpa")
    with torch.no_grad():
        for seed in range(3):  # other document counts and lengths each batch (every row whole, none, one): dynamic
            docs, batch = _batch(seed)
            packed = _doc_losses(model(**{k: v for k, v in batch.items() if k != "labels"}).logits, batch)
            alone = [float(torch.nn.functional.cross_entropy(
                alone_model(input_ids=torch.tensor([d], device="cuda")).logits[0, :-1].float(),
                torch.tensor(d[1:], device="cuda"))) for d in docs]
            assert len(packed) == len(alone) >= 4
            worst = max(abs(a - b) for a, b in zip(packed, alone, strict=True))
            assert worst < 1e-2, (seed, worst)


def test_gradients_match_the_masked_sdpa_path() -> None:
    _, batch = _batch(8)  # one row whole (causal kernel), three packed (varlen)
    grads = {}
    for attn in ("varlen", "sdpa"):
        model = _model(attn)
        inputs = dict(batch) if attn == "varlen" else {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        model(**inputs).loss.backward()
        grads[attn] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    rel = (grads["varlen"] - grads["sdpa"]).norm() / grads["sdpa"].norm()
    assert rel < 2e-2, float(rel)


def test_unpacked_rows_of_a_sliding_window_model_match_sdpa_with_its_mask() -> None:
    """Gemma 3's sliding-window layers on unpacked rows: the varlen kernel with the window (each unpadded row one
    document, runtime/attention.plan) against transformers' sdpa with its sliding mask (window 128, rows of 1,024):
    the loss within 1e-2, logits and gradients within bf16 rounding (1e-2 and 2e-2 relative)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from toolkit.runtime.attention.interface import NAME, PACKED, register, watch_boundaries
    from toolkit.runtime.attention.kernels import prepare
    from toolkit.runtime.data.batches import Collator

    def build(attn: str) -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = Gemma3TextConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=128,
                               layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
                               use_cache=False)
        model = Gemma3ForCausalLM(cfg).to("cuda", torch.bfloat16)
        if attn == NAME:
            register()
            prepare(torch.device("cuda"))
            watch_boundaries(model)
        model.config._attn_implementation = attn
        return model

    rng = random.Random(0)
    rows = [{"input_ids": (ids := [rng.randrange(4, 1024) for _ in range(1024)]), "labels": ids} for _ in range(4)]
    batch = Collator(pad_id=0, drop_full_mask=True, boundaries=True, whole_rows=True)(rows)
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    window, plain = build(NAME), build("sdpa")
    got = window(**batch)
    assert window.config._attn_implementation == PACKED
    want = plain(input_ids=batch["input_ids"], labels=batch["labels"])
    assert abs(float(got.loss) - float(want.loss)) < 1e-2
    assert (got.logits.float() - want.logits.float()).norm() / want.logits.float().norm() < 1e-2
    got.loss.backward()
    want.loss.backward()
    g = torch.cat([p.grad.float().flatten() for p in window.parameters()])
    w = torch.cat([p.grad.float().flatten() for p in plain.parameters()])
    assert (g - w).norm() / w.norm() < 2e-2
