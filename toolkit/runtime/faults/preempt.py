"""Preemption: SIGTERM (what Slurm and Kubernetes send) finishes the current step, checkpoints, marks the
run `preempted` and exits 0.

The handler only sets a flag: a rank may be inside a collective when the signal lands, and the ranks
must agree on the step to stop at, or their save collectives would not match. They agree where the
loop already synchronizes, on log steps (every step by default), by summing the flags, as Megatron-LM
and Accelerate's `set_trigger`/`check_trigger` do. DeepSpeed's launcher forwards SIGTERM to the ranks
and kills them 30 s later, which bounds the time a step plus a save may take.
"""

from __future__ import annotations

import signal
from types import FrameType

from toolkit.launch import dist


class Preemption:
    def __init__(self) -> None:
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """Collective: True on every rank once any rank was asked to stop."""
        return dist.all_reduce_sum([float(self.requested)])[0] > 0

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
