"""The MLP of each decoder layer over the sequence in tiles (DeepSpeed's `TiledMLP`, from its ALST pieces).

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

from toolkit.plan.speedups import tiled_mlp_on as decide  # noqa: F401  (the runtime's and the planner's decision)


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
