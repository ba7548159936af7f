"""NonFiniteGuard without DeepSpeed: which step it names, and the fp16 overflow run."""

from __future__ import annotations

import pytest
import torch

from toolkit.runtime.faults.guards import NonFiniteError, NonFiniteGuard


def test_names_the_first_bad_step_only_when_checked() -> None:
    g = NonFiniteGuard(torch.device("cpu"), rank=1, fp16=False, max_skipped_steps=3)
    g.observe(1, torch.tensor(2.0), torch.tensor(1.0), [0, 1], skipped_steps=0)
    g.check()
    g.observe(2, torch.tensor(2.0), torch.tensor(float("inf")), [2, 3], skipped_steps=0)
    g.observe(3, torch.tensor(float("nan")), torch.tensor(1.0), [4, 5], skipped_steps=0)  # no sync, no raise yet
    with pytest.raises(NonFiniteError, match=r"rank 1: .* at step 2 \(this rank's samples in that step: \[2, 3\]\)"):
        g.check()


def test_fp16_tolerates_overflow_skips_until_a_run_of_them() -> None:
    g = NonFiniteGuard(torch.device("cpu"), rank=0, fp16=True, max_skipped_steps=2)
    inf = torch.tensor(float("inf"))
    g.observe(1, torch.tensor(2.0), inf, [0], skipped_steps=1)  # one overflow: DeepSpeed's to handle
    g.observe(2, torch.tensor(2.0), torch.tensor(1.0), [1], skipped_steps=1)  # trained: the run resets
    g.check()
    g.observe(3, torch.tensor(2.0), inf, [2], skipped_steps=2)
    g.observe(4, torch.tensor(2.0), inf, [3], skipped_steps=3)
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row up to step 5.*bf16"):
        g.observe(5, torch.tensor(2.0), inf, [4], skipped_steps=4)
