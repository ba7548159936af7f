"""ZeRO-3 leaf modules released after their forward, as DeepSpeed's reuse distance means them to be.

DeepSpeed 0.19.8's coordinator (`PartitionedParameterCoordinator.__params_to_release`) keeps a module's parameters
gathered when they come back within `stage3_max_reuse_distance` elements of the trace. It walks the trace's modules
with the leaf flag of the module being released, so for a leaf every traversed module is iterated recursively: the
model itself, which is in the trace, then yields every parameter, and no leaf layer is released in forward. On 2
H200s, llama-1b with its decoder layers as leaves and checkpointing kept all 16 layers gathered at its peak, 1.3 GiB
above the reuse rule (bench/results/speed_model/anatomy-leaves-ckpt-2gpu.json); a 70B model would hold all its
weights. Here each traversed module is iterated by its own leaf flag, which is what the loop means. Installed where
the toolkit makes leaves (decoder layers, expert blocks, the frozen reference), and only over the exact method it
replaces: another DeepSpeed version keeps its own.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

# sha256 of the source of the method this replaces (DeepSpeed 0.19.8)
_REPLACED = "89aab0f80f1a80b3"


def _digest(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def install() -> bool:
    """Replace the method where it is the one described above; returns whether the fix is in place."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    cls = ppc.PartitionedParameterCoordinator
    name = "_PartitionedParameterCoordinator__params_to_release"
    current = getattr(cls, name, None)
    if current is None:
        return False
    if getattr(current, "_toolkit_fix", False):
        return True
    if _digest(current) != _REPLACED:
        return False

    def params_to_release(self: Any, submodule_to_release: Any, step_id: int) -> set[int]:
        if not self.is_complete_trace():
            raise RuntimeError("expected trace to be complete")
        leaf = ppc.z3_leaf_module(submodule_to_release)
        release = {p.ds_id for p in ppc.iter_params(submodule_to_release, recurse=leaf) if not p.ds_persist}
        # parameters the prefetcher skipped as available: their reuse comes later than this step (DeepSpeed's rule)
        fetched_for = self._PartitionedParameterCoordinator__most_recent_step_id_param_fetched_for
        for p in ppc.iter_params(submodule_to_release, recurse=leaf):
            if fetched_for[p] > step_id:
                release.discard(p.ds_id)
        traversed = 0
        for module in self._PartitionedParameterCoordinator__submodule_order[step_id:]:
            if traversed >= self._PartitionedParameterCoordinator__max_reuse_dist_in_numel:
                break
            for p in ppc.iter_params(module, recurse=ppc.z3_leaf_module(module)):  # the module's own flag
                release.discard(p.ds_id)
                traversed += p.ds_numel
        return release

    params_to_release._toolkit_fix = True  # type: ignore[attr-defined]
    setattr(cls, name, params_to_release)
    return True
