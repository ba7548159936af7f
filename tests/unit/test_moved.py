"""The check that every trainable parameter moves (toolkit/runtime/faults/moved.py), in one process on a real
optimizer; tests/dist/test_train.py runs it through DeepSpeed at every stage on both paths."""

from __future__ import annotations

import pytest
import torch

from toolkit.runtime.faults import moved


class _Steps:
    """What the check reads of a DeepSpeed engine: the learning rate the next step uses, and skipped steps."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.skipped_steps = opt, 0

    def get_lr(self) -> list[float]:
        return [self.opt.param_groups[0]["lr"]]


def _train(mode: str, zero: str | None, monkeypatch: pytest.MonkeyPatch, lrs=(0.0, 0.1, 0.1)) -> list[str | None]:
    if zero:
        monkeypatch.setenv(moved.FAULT_ENV, zero)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    engine, check, out = _Steps(opt), moved.MoveCheck(model, mode), []
    for step, lr in enumerate(lrs, 1):
        opt.param_groups[0]["lr"] = lr
        check.step_begin(engine)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        out.append(check.step_end(engine, step))
    return out


def test_every_parameter_moves_over_the_first_two_steps_with_a_learning_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    *early, line = _train("error", None, monkeypatch)
    assert early == [None, None] and line.startswith("every trainable parameter moved over steps 2-3 (4 tensors; checked in ")


def test_a_parameter_on_no_gradient_stops_the_run_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(moved.NotTrainingError, match=r"^1 of 4 trainable parameter\(s\) did not move over optimizer "
                                                      r"steps 2-3.*they train on no gradient \(0.weight\)"):
        _train("error", "0.weight", monkeypatch)


def test_warn_goes_on_and_off_checks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    line = _train("warn", "1.bias", monkeypatch)[-1]
    assert line.startswith("warning: 1 of 4 trainable parameter(s) did not move") and "(1.bias)" in line
    assert _train("off", "1.bias", monkeypatch) == [None, None, None]


def test_experts_that_got_no_tokens_are_named_not_stopped_on(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.router = torch.nn.Linear(4, 2)
    model.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    engine, check = _Steps(opt), moved.MoveCheck(model, "error")
    for step in (1, 2):
        check.step_begin(engine)
        x = torch.randn(8, 4)
        (model.experts[0](x).sum() + model.router(x).sum()).backward()  # expert 1 routed no token
        opt.step()
        opt.zero_grad()
        line = check.step_end(engine, step)
    assert line == "note: 2 expert parameter(s) did not move over steps 1-2: their experts got no tokens there " \
                   "(experts.1.weight, experts.1.bias)"
