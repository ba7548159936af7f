"""GRPO on the raw path: each optimizer step is one rollout and one update.

A step's window (grad_accum micro-batches of train.micro_batch_size prompts per rank):
1. rollout: every prompt of the window x rl.num_generations completions in one `generate_local` call on the live
   engine (under ZeRO-3 the whole model gathered once where it fits, freed before the backward; every completion
   seeded by (train.seed, step, prompt row, sample): a completion's draw depends on its prompt, not on the rank that
   draws it);
2. rewards: the reward functions on this rank's completions (rewards.py), weighted and summed; advantages per prompt
   group (loss.advantages), so no rank waits for another's groups;
3. update: per micro-batch, its completions packed into one row (the varlen attention sees each sequence apart, as
   packed pairs are), the reference's per-token log-probs where rl.beta > 0 (the base with adapters off under LoRA,
   else the frozen ZeRO-3 engine preference runs use), the policy's through its output head in chunks
   (objectives/logprobs.SelectedHead), the clipped loss (loss.token_loss), backward, engine.step().

Each rollout is trained on rl.num_iterations times (TRL's mu; 1 by default), one optimizer step each: the raw loop
hands the same window to mu steps (data/batches.window_repeats), and the step keeps the rollout (packed micro-batches,
advantages, the reference's log-probs) for them. On the first update the ratio to the rollout's policy is 1 with its
gradient, so `old` is the policy's own log-probs detached, kept for the later updates, where clipping starts to
matter. A resume inside a rollout's updates rolls its prompts out again with the policy it resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from toolkit.config.schema import Config
from toolkit.launch import dist
from toolkit.runtime.data.batches import to_device
from toolkit.runtime.objectives.batch import pack, token_logps_entropy
from toolkit.runtime.objectives.logprobs import IGNORE, SelectedHead
from toolkit.runtime.objectives.reference import adapters_off
from toolkit.runtime.rl import prompts as rl_prompts
from toolkit.runtime.rl.loss import advantages, token_loss
from toolkit.runtime.rl.rewards import Reward, RewardError, score

COMPLETIONS_FILE = "completions.jsonl"
LOGGED_PROMPTS = 2  # prompts (with all their completions) written to completions.jsonl at a time


def _module(engine_or_model: Any) -> Any:
    return getattr(engine_or_model, "module", engine_or_model)


def _at_label(per_state: torch.Tensor) -> torch.Tensor:
    """A per-position value moved to the label it is about: the state at t predicts the label at t + 1 (0 at t = 0)."""
    out = torch.zeros_like(per_state)
    out[:, 1:] = per_state[:, :-1]
    return out


def seed_of(seed: int, step: int, row: int, sample: int) -> int:
    """A completion's sampling seed: its prompt row and sample number at this step, whatever rank draws it (a fixed
    digest, not Python's hash, whose algorithm is the interpreter's to change)."""
    digest = hashlib.blake2b(f"{seed},{step},{row},{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclasses.dataclass
class _Micro:
    """One micro-batch of a rollout, as its updates take it."""

    batch: dict[str, Any]
    counted: torch.Tensor
    """The completion tokens' positions (the labels trained on)."""
    seq_ids: torch.Tensor
    adv: torch.Tensor
    n: int
    ref: torch.Tensor | None
    old: torch.Tensor | None = None
    """The rollout policy's log-probs, kept from the first update where rl.num_iterations > 1."""


@dataclasses.dataclass
class _Rollout:
    cycle: int
    """(step - 1) // rl.num_iterations: the steps that train on it."""
    micro: list[_Micro]
    normalizer: float | None


def rollout_cache(choice: str, device_type: str) -> str:
    """rl.generate_cache resolved: auto is static on CUDA (each rollout repeats the last one's shapes, so the decode
    step transformers compiles for the first serves every later one; about 2x a dynamic cache's decode,
    bench/results/generate/), dynamic elsewhere (no compile off CUDA)."""
    if choice != "auto":
        return choice
    return "static" if device_type == "cuda" else "dynamic"


class GRPOStep:
    """What a run with train.objective=grpo hands its windows to (raw path); the raw loop calls it as it calls a
    preference step (forward_backward, take, prepare)."""

    def __init__(self, cfg: Config, mode: str | None, policy: Any, reference: Any, *, model_config: Any, zero3: bool,
                 pad_id: int, eos_id: int | None, tokenizer: Any, rewards: list[Reward], run_dir: Path,
                 boundaries: bool) -> None:
        self.rl, self.mode, self.reference, self.seed = cfg.rl, mode, reference, cfg.train.seed
        self.grad_accum = cfg.train.grad_accum
        self.mc, self.zero3, self.pad_id, self.eos_id = model_config, zero3, pad_id, eos_id
        self.tokenizer, self.rewards, self.run_dir, self.boundaries = tokenizer, rewards, Path(run_dir), boundaries
        self.device = dist.device()
        self.heads = {id(policy): SelectedHead.of(policy)}
        if reference is not None:
            self.heads[id(_module(reference))] = SelectedHead.of(_module(reference))
        self.gen = dataclasses.replace(cfg.eval, max_new_tokens=cfg.rl.max_completion_length, do_sample=True,
                                       temperature=cfg.rl.temperature, top_p=cfg.rl.top_p,
                                       generate_cache=rollout_cache(cfg.rl.generate_cache, self.device.type))
        self.collate = rl_prompts.collate
        self.counter: Any = None
        """The run's TokenCounter (loops/run.py sets it): a step counts the sequences it trains on."""
        self._sums: dict[str, float] = defaultdict(float)
        self._max_len = 0
        self._dev = torch.zeros(3, device=self.device)  # KL sum, clipped tokens, entropy sum: read on log steps
        self._held: _Rollout | None = None

    def prepare(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do before the first step (a preference step's precomputed reference has its pass here)."""

    # ------------------------------------------------------------------ rollout

    def _texts(self, ids: list[list[int]], chat: list[bool] | None = None) -> list[Any]:
        """What reward functions get as completions, as TRL passes them: the decoded text, an assistant message for a
        chat prompt (`chat`), the ids where the run has no tokenizer."""
        if self.tokenizer is None:
            return ids
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [[{"role": "assistant", "content": t}] if c else t
                for t, c in zip(texts, chat or [False] * len(texts), strict=True)]

    def _rollout(self, engine: Any, flat: list[dict[str, Any]], step: int
                 ) -> tuple[list[list[int]], torch.Tensor, list[list[float]]]:
        """(completions, advantages, each function's rewards) for this rank's prompts x num_generations."""
        from toolkit.runtime.generation.batched import generate_local, stop_ids

        g = self.rl.num_generations
        prompts = [r["prompt_ids"] for r in flat for _ in range(g)]
        seeds = [seed_of(self.seed, step, r["index"], k) for r in flat for k in range(g)]
        t0 = time.perf_counter()
        completions, stats = generate_local(engine, prompts, self.gen, mc=self.mc, zero3=self.zero3,
                                            pad_id=self.pad_id, eos_id=self.eos_id, seeds=seeds)
        t1 = time.perf_counter()
        stops = stop_ids(_module(engine), self.eos_id)
        fields = {k: [r["fields"][k] for r in flat for _ in range(g)] for k in (flat[0]["fields"] if flat else {})}
        chat = [isinstance(r["prompt"], list) for r in flat for _ in range(g)]
        per_func, err = score(self.rewards, [r["prompt"] for r in flat for _ in range(g)],
                              self._texts(completions, chat), completions, fields,
                              [r["line"] for r in flat for _ in range(g)])
        # every rank learns of any rank's failure in the same collective, so none is left waiting in the next one
        failed = next((e for e in dist.all_gather_object(err) if e), None)
        if failed:
            raise RewardError(failed)
        values = torch.tensor(per_func, dtype=torch.float32).reshape(len(self.rewards), len(completions)).T
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)
        total = torch.nansum(values * weights, dim=1)
        # a completion no function scored (all None) has no reward: out of its group's mean and std, advantage 0 (TRL)
        total[values.isnan().all(dim=1)] = math.nan
        scored = total[~total.isnan()]
        scale = self.rl.scale_rewards
        batch_std = None
        if scale == "batch":  # TRL: the std over the whole step's rewards, every rank's
            n, s, sq = dist.all_reduce_sum([float(scored.numel()), float(scored.sum()), float((scored ** 2).sum())])
            batch_std = math.sqrt(max(sq / max(n, 1) - (s / max(n, 1)) ** 2, 0.0) * n / max(n - 1, 1))
        adv, std = advantages(total, g, scale, batch_std)
        t2 = time.perf_counter()
        lengths = [len(c) for c in completions]
        cut = sum(1 for c in completions if c and c[-1] not in stops and len(c) >= self.rl.max_completion_length)
        s = self._sums
        s["gen_s"] += t1 - t0
        s["reward_s"] += t2 - t1
        s["gen_tokens"] += sum(lengths)
        s["completions"] += len(completions)
        s["scored"] += float(scored.numel())
        s["reward"] += float(scored.sum())
        s["reward_sq"] += float((scored ** 2).sum())
        s["groups"] += len(flat)
        # TRL's frac_reward_zero_std: the completions whose scale (their group's std, or the step's) is zero
        s["zero_std"] += len(flat) * float(batch_std < 1e-6) if batch_std is not None else float((std < 1e-6).sum())
        s["cut"] += cut
        for k, r in enumerate(self.rewards):
            col = values[:, k]
            s[f"rewards/{r.name}/sum"] += float(torch.nansum(col))
            s[f"rewards/{r.name}/n"] += float((~col.isnan()).sum())
        self._max_len = max([self._max_len, *lengths])
        if step == 1 and dist.rank() == 0:  # how the rollouts generate: the gathered model or layer by layer, why
            cache = "dynamic" if stats.path == "layer by layer" else self.gen.generate_cache
            print(f"rollout at step 1: {stats.line()}; {cache} KV cache (rl.generate_cache)", flush=True)
        return completions, adv, per_func

    # ------------------------------------------------------------------ update

    def _per_label(self, model: Any, batch: dict[str, Any], entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each position's log-prob of its own label (0 where none), [rows, positions], at the sampling temperature;
        and each position's entropy where `entropy`."""
        tok, ent = token_logps_entropy(model, batch, self.heads.get(id(_module(model))), self.rl.temperature, entropy)
        return _at_label(tok), None if ent is None else _at_label(ent)

    @torch.no_grad()
    def _reference(self, engine: Any, batch: dict[str, Any]) -> torch.Tensor | None:
        if not self.rl.beta:
            return None
        if self.reference is not None:
            return self._per_label(self.reference, batch)[0]
        with adapters_off(engine) if hasattr(_module(engine), "disable_adapter") else contextlib.nullcontext():
            return self._per_label(engine, batch)[0]

    def _roll(self, engine: Any, batches: list[dict[str, Any]], step: int, cycle: int) -> _Rollout:
        """The rollout of this window's prompts, packed per micro-batch, with the reference's log-probs."""
        g = self.rl.num_generations
        flat = [r for b in batches for r in b["rows"]]
        completions, adv, per_func = self._rollout(engine, flat, step)
        normalizer = None
        if self.rl.loss_type == "dapo":  # the step's completion tokens over all ranks, per rank (num_items_in_batch)
            tokens = float(sum(len(c) for c in completions))
            normalizer = max(dist.all_reduce_sum([tokens])[0], 1.0) / dist.world_size()
        self._log_completions(step, flat, completions, adv, per_func)
        micro, first = [], 0
        for b in batches:
            n = len(b["rows"]) * g
            seqs = [{"input_ids": r["prompt_ids"] + c, "labels": [IGNORE] * len(r["prompt_ids"]) + c}
                    for r, c in zip([r for r in b["rows"] for _ in range(g)], completions[first:first + n],
                                    strict=True)]
            batch = to_device(pack(seqs, self.boundaries), self.device)
            counted = batch["labels"] != IGNORE
            counted[:, 0] = False
            t0 = self._now()
            ref = self._reference(engine, batch)
            self._sums["ref_s"] += self._now() - t0
            micro.append(_Micro(batch, counted, batch["seq_ids"][counted], adv[first:first + n].to(self.device), n,
                                None if ref is None else ref[counted]))
            first += n
        return _Rollout(cycle, micro, normalizer)

    def forward_backward(self, engine: Any, batches: list[dict[str, Any]], loss_sum: torch.Tensor) -> None:
        rl = self.rl
        step = int(getattr(engine, "global_steps", 0)) + 1
        cycle = (step - 1) // rl.num_iterations
        if self._held is None or self._held.cycle != cycle:
            self._held = self._roll(engine, batches, step, cycle)
        held = self._held
        engine.train()
        for m in held.micro:
            if self.counter is not None:
                self.counter.add(m.batch)
            t1 = self._now()
            lp_all, ent = self._per_label(engine, m.batch, entropy=True)
            lp = lp_all[m.counted]
            if m.old is None and rl.num_iterations > 1:  # the rollout policy's, for the later updates
                m.old = lp.detach()
            out = token_loss(lp, lp.detach() if m.old is None else m.old, m.ref, m.seq_ids, m.adv, n_seqs=m.n,
                             epsilon=rl.epsilon, epsilon_high=rl.epsilon_high or rl.epsilon, beta=rl.beta,
                             loss_type=rl.loss_type, max_completion_length=rl.max_completion_length,
                             normalizer=held.normalizer)
            if rl.loss_type == "dapo":  # already the step's token mean over ranks: no 1/grad_accum
                engine.backward(out.loss, scale_wrt_gas=False)
                loss_sum += out.loss.detach()
            else:
                engine.backward(out.loss)
                loss_sum += out.loss.detach() / self.grad_accum
            engine.step()
            entropy = ent[m.counted].sum() if ent is not None else torch.zeros((), device=self.device)
            self._dev += torch.stack([out.kl_sum, out.clipped, entropy])
            self._sums["train_tokens"] += out.tokens
            self._sums["train_s"] += self._now() - t1
        if step % rl.num_iterations == 0:  # its last update: the rollout's memory back
            self._held = None
        self._sums["steps"] += 1

    def _now(self) -> float:
        if self.device.type == "cuda":  # the phases' times, not their launch times
            torch.cuda.synchronize()
        return time.perf_counter()

    # ------------------------------------------------------------------ what a run shows

    def _log_completions(self, step: int, flat: list[dict[str, Any]], completions: list[list[int]],
                         adv: torch.Tensor, per_func: list[list[float]]) -> None:
        every = self.rl.log_completions_every
        if not every or dist.rank() != 0 or not (step == 1 or step % every == 0):
            return
        g = self.rl.num_generations
        texts = self._texts(completions[:LOGGED_PROMPTS * g])
        with (self.run_dir / COMPLETIONS_FILE).open("a") as f:
            for k, text in enumerate(texts):
                row = flat[k // g]
                rewards = {r.name: (None if math.isnan(per_func[j][k]) else per_func[j][k])
                           for j, r in enumerate(self.rewards)}
                f.write(json.dumps({"step": step, "row": row["index"], "prompt": row["prompt"], "completion": text,
                                    "rewards": rewards, "advantage": float(adv[k])}, default=str) + "\n")

    def take(self) -> dict[str, float]:
        """The metrics since the last log line, over every rank (a collective), named as TRL names them."""
        keys = sorted(self._sums)
        got = dist.all_gather_object([{k: self._sums.get(k, 0.0) for k in keys}, self._max_len,
                                      self._dev.tolist()])
        s: dict[str, float] = defaultdict(float)
        for part, _, _ in got:
            for k, v in part.items():
                s[k] += v
        kl_sum = sum(d[0] for _, _, d in got)
        clipped = sum(d[1] for _, _, d in got)
        entropy = sum(d[2] for _, _, d in got)
        steps = max(s["steps"] / len(got), 1.0)
        n, groups, tokens = max(s["completions"], 1.0), max(s["groups"], 1.0), max(s["train_tokens"], 1.0)
        scored = max(s["scored"], 1.0)
        mean = s["reward"] / scored
        # TRL's reward_std: the std over every reward (all ranks) since the last line
        std = math.sqrt(max(s["reward_sq"] / scored - mean ** 2, 0.0) * scored / max(scored - 1, 1))
        rec = {"entropy": entropy / tokens, "clip_ratio": clipped / tokens,
               # the slowest rank's phase times: the others wait for it in the next collective
               "time/generate_s": max(p.get("gen_s", 0.0) for p, _, _ in got) / steps,
               "time/reward_s": max(p.get("reward_s", 0.0) for p, _, _ in got) / steps,
               "time/reference_s": max(p.get("ref_s", 0.0) for p, _, _ in got) / steps,
               "time/train_s": max(p.get("train_s", 0.0) for p, _, _ in got) / steps}
        if s["completions"]:  # a rollout since the last line (with rl.num_iterations > 1 not every step has one)
            rec |= {"reward": mean, "reward_std": std, "frac_reward_zero_std": s["zero_std"] / groups,
                    "completions/mean_length": s["gen_tokens"] / n,
                    "completions/max_length": float(max(m for _, m, _ in got)),
                    "completions/clipped_ratio": s["cut"] / n}
            for r in self.rewards:
                rec[f"rewards/{r.name}/mean"] = s[f"rewards/{r.name}/sum"] / max(s[f"rewards/{r.name}/n"], 1.0)
        if self.rl.beta:
            rec["kl"] = kl_sum / tokens
        self._sums.clear()
        self._max_len = 0
        self._dev.zero_()
        return rec
