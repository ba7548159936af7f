"""The MLP of each decoder layer over the sequence in tiles (DeepSpeed's `TiledMLP`, from its ALST pieces), and the
loss over the sequence in tiles (tile_loss, below).

A decoder MLP's (tokens x intermediate) activations are the largest tensors of a layer once a rank holds
tens of thousands of tokens (about 28 KiB per token for an 8B Llama, against 8 KiB for its hidden state:
../shared/notes/long_context.md section 6). TiledMLP runs the MLP one tile of tokens at a time without
keeping those activations, and runs each tile again in backward: one more MLP forward per step, for memory
that no longer grows with the tile count. The MLP is per-token, so the result is the same to rounding.

Written here: choosing the MLPs and patching each instance (DeepSpeed's docstring patches the class, which
would reach every model in the process). The tile count is computed on the host from the input's shape;
DeepSpeed's example all-reduces it across ranks, a host sync per MLP call, needed only where ranks' tile
counts must agree, which they need not here (no collective runs per tile).
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch


def tile_mlps(layers: list[Any], shards: int = 0) -> int:
    """Patch each decoder layer's `mlp` (after Liger has swapped it, before compile and DeepSpeed); returns how
    many. shards: tiles per call, 0 for ceil(tokens / hidden size). An MLP with dropout is refused: its
    backward recompute would draw other masks. Mixture-of-Experts blocks are left as they are."""
    done = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or getattr(mlp, "_toolkit_tiled", False):
            continue
        if hasattr(mlp, "experts"):  # a MoE block: its router's outputs (aux loss) are per call, not per tile
            continue
        dropout = [m for m in mlp.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if dropout:
            raise ValueError(f"model.tiled_mlp: {type(mlp).__name__} has dropout (p={dropout[0].p}), which the "
                             "tiles' recompute in backward would redraw; set it to 0 or model.tiled_mlp=false")
        mlp.forward = types.MethodType(_tiled_forward(mlp.forward, shards), mlp)
        mlp._toolkit_tiled = True
        done += 1
    return done


def _tiled_forward(plain: Any, shards: int) -> Any:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def run(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        n = shards or math.ceil(x.shape[-2] / x.shape[-1])
        if n <= 1:
            return plain(x)
        # compute_params: ZeRO reduces these gradients once, after the last tile's backward
        return TiledMLP.apply(lambda _self, tile: plain(tile), self, x, n, list(self.parameters()))

    return run


def tile_loss(model: torch.nn.Module, tile_tokens: int) -> bool:
    """model.tiled_loss: the causal LM's forward computes its loss tile by tile when given labels (training and
    eval), never the whole (tokens x vocabulary) logits; it returns no logits then. False where the model is not
    one this can do (no decoder / output embeddings); generation (no labels) runs the plain forward.

    Written here rather than through DeepSpeed's TiledFusedLogitsLoss: that runs each tile's backward inside the
    forward and scales only the input's gradient by the incoming one, so the head's gradient it accumulated would
    miss every factor applied to the loss after it (the token-mean division, the ranks multiplier, a loss scale).
    Here each tile is a checkpoint (its logits recomputed in backward: one more head matmul per tile), so autograd
    carries every factor, and ZeRO-3 gathers the head as for a checkpointed layer."""
    lm = _causal_lm(model)
    if lm is None or getattr(lm, "_toolkit_tiled_loss", False):
        return lm is not None
    lm.forward = types.MethodType(_tiled_loss_forward(lm.forward, tile_tokens), lm)
    lm._toolkit_tiled_loss = True
    return True


def _causal_lm(model: torch.nn.Module) -> Any:
    """The module whose forward turns hidden states into the loss (under PEFT, the wrapped model)."""
    for m in model.modules():
        if hasattr(m, "get_decoder") and hasattr(m, "get_output_embeddings") and hasattr(m, "loss_function"):
            try:
                if m.get_decoder() is not None and m.get_output_embeddings() is not None:
                    return m
            except (AttributeError, NotImplementedError):
                continue
    return None


def _tiled_loss_forward(plain: Any, tile_tokens: int) -> Any:
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from toolkit.runtime.data.corpus import IGNORE_INDEX

    def tile_sum(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(x).float()
        return torch.nn.functional.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")

    def run(self: torch.nn.Module, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        shift = kwargs.pop("shift_labels", None)
        if labels is None and shift is None:
            return plain(input_ids=input_ids, **kwargs)
        n_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        out = self.get_decoder()(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state
        if shift is None:  # as transformers' causal-LM loss: tokens < n predict n
            shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        x = hidden.reshape(-1, hidden.shape[-1])
        y = shift.reshape(-1).to(x.device)
        head = self.get_output_embeddings()
        total = sum(checkpoint(tile_sum, head, x[i:i + tile_tokens], y[i:i + tile_tokens], use_reentrant=False)
                    for i in range(0, x.shape[0], tile_tokens))
        n = n_items if n_items is not None else (y != IGNORE_INDEX).sum()
        loss = total / (n.to(total.device) if torch.is_tensor(n) else n)
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
                                      hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))

    return run
