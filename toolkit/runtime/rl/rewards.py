"""Reward functions: `rl.rewards` names them, `rl.reward_weights` weighs them.

An entry is `path/to/file.py:fn` (a plain Python function in the user's file), a bare `fn` after it (another
function of the same file: `rewards.py:fn,fn2`), or a built-in:
- `exact_match` (or `exact_match=FIELD`): 1.0 where the completion, stripped, equals the row's `answer` (FIELD);
- `format=REGEX`: 1.0 where the completion matches REGEX from its start (re.match, DOTALL), as the format rewards
  of DeepSeek-R1-style recipes;
- `length` (or `length=N`): a penalty, -len / rl.max_completion_length (or -max(0, len - N) / N).

Each function is called as TRL calls its reward functions: fn(prompts=..., completions=..., completion_ids=...,
**fields), one list entry per completion (each row's fields repeated for its completions), and returns one float per
completion (None where it does not apply: it then adds nothing, as TRL's nansum; a completion no function scores
gets no reward and advantage 0). For a chat prompt a completion is an assistant message, as TRL passes it. Every
rank scores its own completions; a function that raises or returns the wrong thing ends the run on every rank with
one line naming it and the prompt's line (rl/step.py gathers the errors, so no rank waits in a collective for one
that stopped).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError

BUILTINS = ("exact_match", "format", "length")


class RewardError(RuntimeError):
    """A reward function that failed during the run: one line, the same on every rank."""


@dataclass(frozen=True)
class Reward:
    name: str
    fn: Callable[..., Any]
    weight: float


def _split(spec: list[str] | str) -> list[str]:
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in items:
        # a format regex may hold commas: only split entries that are not one
        out += [item] if str(item).startswith("format=") else [s.strip() for s in str(item).split(",") if s.strip()]
    return out


def _from_file(path: Path, name: str) -> Callable[..., Any]:
    if not path.is_file():
        raise ConfigError(f"rl.rewards: {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"toolkit_rewards_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as e:
        raise ConfigError(f"rl.rewards: importing {path} raised {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.rewards: {path} has no function {name!r}")
    return fn


def _builtin(entry: str, max_completion_length: int) -> Callable[..., Any]:
    name, _, arg = entry.partition("=")
    if name == "exact_match":
        field = arg or "answer"

        def exact_match(completions: list[Any], **fields: Any) -> list[float | None]:
            completions = [c[0]["content"] if isinstance(c, list) else c for c in completions]  # chat: the message
            if field not in fields:
                raise KeyError(f"the rows have no field {field!r} (exact_match compares the completion with it)")
            return [None if want is None else float(str(c).strip() == str(want).strip())
                    for c, want in zip(completions, fields[field], strict=True)]
        return exact_match
    if name == "format":
        if not arg:
            raise ConfigError("rl.rewards: format=REGEX needs its regular expression")
        try:
            pattern = re.compile(arg, re.DOTALL)
        except re.error as e:
            raise ConfigError(f"rl.rewards: format={arg!r} is not a regular expression ({e})") from e

        def format_match(completions: list[Any], **_: Any) -> list[float]:
            texts = [c[0]["content"] if isinstance(c, list) else str(c) for c in completions]
            return [float(pattern.match(t) is not None) for t in texts]
        return format_match
    if name == "length":
        try:
            target = int(arg) if arg else 0
        except ValueError as e:
            raise ConfigError(f"rl.rewards: length={arg!r} takes a number of tokens") from e
        if arg and target <= 0:
            raise ConfigError("rl.rewards: length=N takes N > 0")

        def length(completion_ids: list[list[int]], **_: Any) -> list[float]:
            if target:
                return [-max(0, len(c) - target) / target for c in completion_ids]
            return [-len(c) / max_completion_length for c in completion_ids]
        return length
    raise ConfigError(f"rl.rewards: unknown entry {entry!r}: give path/to/file.py:function or one of "
                      f"{', '.join(BUILTINS)}")


def load(spec: list[str] | str, weights: list[float], max_completion_length: int) -> list[Reward]:
    """The run's reward functions with their weights (ConfigError, one line, for anything wrong)."""
    entries = _split(spec)
    if not entries:
        raise ConfigError("train.objective=grpo needs rl.rewards: path/to/rewards.py:fn (or a built-in: "
                          f"{', '.join(BUILTINS)})")
    if weights and len(weights) != len(entries):
        raise ConfigError(f"rl.reward_weights has {len(weights)} weights for {len(entries)} reward functions "
                          f"({', '.join(entries)})")
    out: list[Reward] = []
    current: Path | None = None
    for k, entry in enumerate(entries):
        weight = float(weights[k]) if weights else 1.0
        if ".py:" in entry:
            file, _, name = entry.rpartition(":")
            current = Path(file)
            reward = Reward(f"{current.stem}:{name}", _from_file(current, name), weight)
        elif entry.partition("=")[0] in BUILTINS:
            reward = Reward(entry.partition("=")[0], _builtin(entry, max_completion_length), weight)
        elif current is not None and entry.isidentifier():
            reward = Reward(f"{current.stem}:{entry}", _from_file(current, entry), weight)
        else:
            raise ConfigError(f"rl.rewards: unknown entry {entry!r}: give path/to/file.py:function or one of "
                              f"{', '.join(BUILTINS)}")
        taken = {r.name for r in out}
        if reward.name in taken:  # two of a kind (format=A,format=B): each its own metric
            reward = Reward(next(f"{reward.name}#{i}" for i in range(2, len(entries) + 2)
                                 if f"{reward.name}#{i}" not in taken), reward.fn, weight)
        out.append(reward)
    return out


def score(rewards: list[Reward], prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
          fields: dict[str, list[Any]], rows: list[int]) -> tuple[list[list[float]], str | None]:
    """Each function's values ([functions][completions], NaN where None), or the first error as one line naming the
    function and the prompt file line (`rows`: each completion's) of the completion it failed on."""
    out: list[list[float]] = []
    for r in rewards:
        try:
            got = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
        except (Exception, SystemExit) as e:  # sys.exit in a reward function too: the other ranks must hear of it
            return out, f"rl.rewards: {r.name} raised {type(e).__name__}: {e}{_culprit(r, prompts, completions, completion_ids, fields, rows)}"
        if not isinstance(got, (list, tuple)) or len(got) != len(completions):
            n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            return out, (f"rl.rewards: {r.name} returned {n} values for {len(completions)} completions: return one "
                         "float (or None) per completion")
        values: list[float] = []
        for k, v in enumerate(got):
            if v is None:
                values.append(math.nan)
            elif _number(v):  # any real number: a Python or NumPy float, a one-element tensor
                values.append(float(v))
            else:
                return out, (f"rl.rewards: {r.name} returned {v!r} for the prompt on line {rows[k]}: return a finite float "
                             "(or None)")
        out.append(values)
    return out, None


def _number(v: Any) -> bool:
    if isinstance(v, (bool, str, bytes)):
        return False
    if not isinstance(v, numbers.Real) and not (hasattr(v, "__float__") and getattr(v, "numel", lambda: 1)() == 1):
        return False
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _culprit(r: Reward, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
             fields: dict[str, list[Any]], rows: list[int]) -> str:
    """Which row a failing function fails on: each completion again alone, the first that raises."""
    for k in range(len(completions)):
        try:
            r.fn(prompts=prompts[k:k + 1], completions=completions[k:k + 1], completion_ids=completion_ids[k:k + 1],
                 **{f: v[k:k + 1] for f, v in fields.items()})
        except (Exception, SystemExit):
            return f" (the prompt on line {rows[k]} of data.source)"
    return f" (the prompts on lines {sorted(set(rows))[:8]} of data.source, together)"
