"""A run's state while it trains, typed: what the two paths, the watchdog and the failure handler read and write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from toolkit.observe.profiling import StepProfiler
from toolkit.runtime.faults.preempt import Preemption

Evaluator = Callable[[Any, int, bool], None]
"""evaluate(engine, step, final): the held-out loss every train.eval_every steps and at the end, generation every
eval.generate_every steps (loops/shared.py)."""


@dataclass
class RunState:
    profiler: StepProfiler
    fixed_batch: dict[str, Any]
    """The resume proof batch: its loss is recorded at every save and checked after every resume."""
    evaluate: Evaluator | None
    sp: Any = None
    """Sequence parallelism's handle (sequence/ulysses.py), None without it."""
    aux_coef: float = 0.0
    """The Mixture-of-Experts load-balancing loss weight (0: none)."""
    pref: Any = None
    """train.objective other than sft: the objectives/step.py PreferenceStep the raw loop hands its windows to."""
    phase: str = "engine_ready"
    """What status.json and the watchdog name if the run fails or hangs: engine_ready, train, save, final."""
    step: int = 0
    preempt: Preemption = field(default_factory=Preemption)
    preempted: bool = False
    """SIGTERM agreed by every rank: the run stopped at a step with a checkpoint."""
    breakdown_done: bool = False
    """The memory breakdown after the first optimizer step is written (observe/breakdown.py)."""
    moved: Any = None
    """The check that every trainable parameter moves (faults/moved.py MoveCheck), made once the engine exists."""
    pending_save: Any = None
    """HF Trainer path: the save begun in on_step_end, ended in on_save (faults/checkpoint.py begin_save)."""
