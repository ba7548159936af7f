"""Preference losses against the papers' formulas written here, and chunked selected-token log-probs against a whole
log-softmax (values and gradients)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from toolkit.runtime.objectives.logprobs import IGNORE, selected_logprobs
from toolkit.runtime.objectives.losses import PairLogps, pair_loss


def _logps(seed: int) -> PairLogps:
    g = torch.Generator().manual_seed(seed)
    tokens_c, tokens_r = torch.tensor([3.0, 7.0, 5.0]), torch.tensor([4.0, 2.0, 9.0])
    return PairLogps(-torch.rand(3, generator=g) * tokens_c, -torch.rand(3, generator=g) * tokens_r, tokens_c, tokens_r)


def test_each_objective_matches_its_papers_formula() -> None:
    pol, ref = _logps(0), _logps(1)
    beta, ls, gamma = 0.1, 0.1, 0.5
    for i in range(3):
        pc, pr, rc, rr = (float(x[i]) for x in (pol.chosen, pol.rejected, ref.chosen, ref.rejected))
        nc, nr = float(pol.chosen_tokens[i]), float(pol.rejected_tokens[i])
        u = beta * ((pc - rc) - (pr - rr))
        sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        dpo = -(1 - ls) * math.log(sig(u)) - ls * math.log(sig(-u))
        ipo = ((pc / nc - rc / nc) - (pr / nr - rr / nr) - 1 / (2 * beta)) ** 2
        simpo = -math.log(sig(beta * (pc / nc - pr / nr) - gamma))
        ac, ar = pc / nc, pr / nr
        odds = math.log(math.exp(ac) / (1 - math.exp(ac))) - math.log(math.exp(ar) / (1 - math.exp(ar)))
        mean_tokens = float(pol.chosen_tokens.mean())
        orpo = -pc / mean_tokens - beta * math.log(sig(odds))  # its mean over pairs: TRL's token-level chosen NLL
        got = {o: float(pair_loss(o, pol, ref, beta=beta, label_smoothing=ls if o == "dpo" else 0.0,
                                  simpo_gamma=gamma).loss[i]) for o in ("dpo", "ipo", "simpo", "orpo")}
        assert got == pytest.approx({"dpo": dpo, "ipo": ipo, "simpo": simpo, "orpo": orpo}, rel=1e-5)
    orpo = pair_loss("orpo", pol, None, beta=0.0).loss.mean()  # beta 0: the NLL alone, over every chosen token
    assert float(orpo) == pytest.approx(-float(pol.chosen.sum() / pol.chosen_tokens.sum()), rel=1e-6)


def test_dpo_starts_at_ln2_when_policy_is_reference() -> None:
    pol = _logps(3)
    out = pair_loss("dpo", pol, pol, beta=0.1)
    assert out.loss.tolist() == pytest.approx([math.log(2)] * 3)
    assert out.margins.abs().max() == 0
    with pytest.raises(ValueError, match="reference"):
        pair_loss("dpo", pol, None, beta=0.1)
    with pytest.raises(ValueError, match="one of"):
        pair_loss("cpo", pol, None, beta=0.1)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_logprobs_equal_a_whole_log_softmax_with_gradients(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (10,), generator=g)
    labels[[0, 4]] = IGNORE
    whole = F.log_softmax(hidden @ weight.t(), -1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    whole = whole.masked_fill(labels == IGNORE, 0)
    upstream = torch.randn(10, generator=g, dtype=torch.float64)
    dh, dw = torch.autograd.grad((whole * upstream).sum(), (hidden, weight))
    entropy = torch.zeros(10, dtype=torch.float32)
    got = selected_logprobs(hidden, weight, labels, chunk, entropy)
    assert torch.allclose(got.double(), whole, atol=1e-5)
    gh, gw = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    assert torch.allclose(gh, dh, atol=1e-6) and torch.allclose(gw, dw, atol=1e-5)
    logp = F.log_softmax(hidden.detach() @ weight.detach().t(), -1)
    assert torch.allclose(entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-5)  # every position's, ignored too


def test_the_first_loss_check_stops_another_model_and_lets_bf16_rounding_train(capsys: pytest.CaptureFixture) -> None:
    """fp32: policy = reference to 1e-3; bf16: the rounding measured between a ZeRO-2 policy and its ZeRO-3 reference
    (0.7021 on one H200) trains on with a line; a reference 0.09 off (Liger in the policy only) stops."""
    from types import SimpleNamespace

    from toolkit.runtime.loops.shared import first_loss_check

    def spec(precision: str) -> Any:
        cfg = SimpleNamespace(train=SimpleNamespace(objective="dpo"), pref=SimpleNamespace(beta=0.1, desirable_weight=1.0,
                                                                                  undesirable_weight=1.0))
        return SimpleNamespace(cfg=cfg, precision=precision)

    first_loss_check(spec("fp32"), math.log(2) + 5e-4)
    with pytest.raises(RuntimeError, match=r"not 0\.693147"):
        first_loss_check(spec("fp32"), 0.7021)
    first_loss_check(spec("bf16"), 0.7021)
    assert "bf16 rounding" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="other kernels"):
        first_loss_check(spec("bf16"), 0.784)


def test_the_reward_models_loss_is_bradley_terry_with_optional_centering() -> None:
    from toolkit.runtime.objectives.losses import reward_loss

    c, r = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.0])
    out = reward_loss(c, r)
    want = torch.tensor([math.log1p(math.exp(-(a - b))) for a, b in zip(c.tolist(), r.tolist(), strict=True)])
    torch.testing.assert_close(out.loss, want)
    assert out.accuracy.tolist() == [1.0, 0.0, 0.0] and out.margins.tolist() == [1.0, -1.0, 0.0]
    centred = reward_loss(c, r, center_rewards_coefficient=0.01).loss
    torch.testing.assert_close(centred, want + 0.01 * (c + r) ** 2)
    with pytest.raises(ValueError, match="reward_loss"):
        pair_loss("reward", PairLogps(c, r, c, r), None, beta=0.1)


def test_kto_matches_its_papers_formula_with_the_kl_estimate_and_the_weights() -> None:
    from toolkit.runtime.objectives.losses import kto_loss

    pol, ref = _logps(2), _logps(3)
    good = torch.tensor([True, False, True])
    beta, wd, wu = 0.1, 1.0, 1.5
    kl = max(0.0, float((pol.rejected - ref.rejected).mean()))  # mismatched completions' mean log-ratio, at least 0
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = []
    for i in range(3):
        r = float(pol.chosen[i] - ref.chosen[i])
        want.append(wd * (1 - sig(beta * (r - kl))) if good[i] else wu * (1 - sig(beta * (kl - r))))
    got = kto_loss(pol, ref, good, torch.tensor(kl), beta=beta, desirable_weight=wd, undesirable_weight=wu)
    assert got.loss.tolist() == pytest.approx(want, rel=1e-5)
    assert got.chosen_rewards.tolist() == pytest.approx((beta * (pol.chosen - ref.chosen)).tolist(), rel=1e-6)
    same = kto_loss(pol, pol, good, torch.tensor(0.0), beta=beta)  # policy = reference: 1 - sigmoid(0) a row
    assert same.loss.tolist() == pytest.approx([0.5] * 3)
    with pytest.raises(ValueError, match="kto_loss"):
        pair_loss("kto", pol, ref, beta=beta)


def test_kto_metrics_weigh_each_side_by_its_labels_and_a_batch_without_rows_has_kl_0() -> None:
    from types import SimpleNamespace

    from toolkit.runtime.objectives.step import PreferenceStep

    step = PreferenceStep.__new__(PreferenceStep)  # the metrics alone: no model
    step.objective, step.pref = "kto", SimpleNamespace(beta=0.1)
    step.summed = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected", "kl")
    pol, ref = _logps(4), _logps(5)
    kl = step._kl(pol, ref, torch.zeros(3))  # stand-in rows only (evaluation past the end): nothing counted
    assert float(kl) == 0.0 and not math.isnan(float(kl))
    from toolkit.runtime.objectives.losses import kto_loss

    good = torch.tensor([True, False, True])
    out = kto_loss(pol, ref, good, kl, beta=0.1)
    values, weights = step._per_pair(out, pol, {"good": good, "kl": kl})
    got = step._means((values * weights).sum(1), weights.sum(1))
    reward = 0.1 * (pol.chosen - ref.chosen)
    assert got["rewards/chosen"] == pytest.approx(float(reward[[0, 2]].mean()), rel=1e-6)
    assert got["rewards/rejected"] == pytest.approx(float(reward[1]), rel=1e-6)
    assert got["rewards/margins"] == pytest.approx(got["rewards/chosen"] - got["rewards/rejected"])
    on_side = [float(reward[0]) > 0, float(reward[1]) < 0, float(reward[2]) > 0]
    assert got["rewards/accuracies"] == pytest.approx(sum(on_side) / 3)
    per_token = pol.chosen / pol.chosen_tokens
    assert got["logps/rejected"] == pytest.approx(float(per_token[1]), rel=1e-6) and got["kl"] == 0.0
