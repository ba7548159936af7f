"""DeepSpeed's own validation: `DeepSpeedConfig` on the resolved dict, one error at a time, and a
trace of the keys it reads (unread keys are silently ignored ones). deepspeed is imported only
inside functions."""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import logging
import os
import sys
from collections.abc import Iterator, KeysView
from typing import Any

from toolkit.config.checks.base import Finding, _err, _warn


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed logs (and prints the accelerator choice) on import and on every config; the check's
    output is its findings only."""
    log = logging.getLogger("DeepSpeed")
    old = log.level
    log.setLevel(logging.CRITICAL)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            yield
        finally:
            log.setLevel(old)


def _import_deepspeed() -> None:
    if "deepspeed" in sys.modules:
        return
    # DS_ACCELERATOR is read once, at import; without CUDA pick CPU so check works on a laptop.
    if not os.environ.get("DS_ACCELERATOR"):
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with _quiet():
        import deepspeed  # noqa: F401
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)


class _Traced(dict):  # type: ignore[type-arg]
    """A dict that records which keys DeepSpeed asks for (get, [], `in`, `in d.keys()`). Iterating
    is not a read (copy.copy and logging iterate everything), but defining __iter__ at all sends
    `**d` down CPython's slow merge path (keys() + __getitem__), so a section unpacked into a
    pydantic model counts as read; pydantic judges its keys itself (extra="forbid")."""

    reads: set[str]
    path: str

    def __getitem__(self, k: Any) -> Any:
        self.reads.add(f"{self.path}{k}")
        return super().__getitem__(k)

    def get(self, k: Any, default: Any = None) -> Any:
        self.reads.add(f"{self.path}{k}")
        return super().get(k, default)

    def __contains__(self, k: Any) -> bool:
        self.reads.add(f"{self.path}{k}")
        return super().__contains__(k)

    def keys(self) -> Any:
        return KeysView(self)  # membership goes through __contains__

    def __iter__(self) -> Iterator[Any]:
        return super().__iter__()


def _traced(obj: Any, reads: set[str], path: str = "") -> Any:
    if not isinstance(obj, dict):
        return obj
    d = _Traced({k: _traced(v, reads, f"{path}{k}.") for k, v in obj.items()})
    d.reads, d.path = reads, path
    return d


def _ds_parse(cfg: dict[str, Any]) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    with _quiet():
        DeepSpeedConfig(cfg)


def _pydantic_findings(e: Exception, prefix: str) -> list[Finding] | None:
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - deepspeed depends on pydantic
        return None
    if not isinstance(e, ValidationError):
        return None
    out = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        key = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            name = str(err["loc"][-1])
            if name in _known_top_level():
                msg = f"'{name}' is a top-level DeepSpeed section, not part of {prefix}; move it to the top level"
            else:
                msg = f"DeepSpeed does not accept this key here ({msg})"
        else:
            msg = f"{msg} (got {err.get('input')!r})" if "input" in err and err["loc"] else msg
        out.append(_err(key, msg))
    return out


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _ds_findings(cfg: dict[str, Any]) -> tuple[list[Finding], dict[str, Any]]:
    """Run DeepSpeedConfig until it accepts; each time it raises, find the top-level key responsible by
    removing keys one at a time (DeepSpeedConfig takes ~2 ms), report it, drop it and go on."""
    cfg = dict(cfg)
    out: list[Finding] = []
    for _ in range(len(cfg) + 1):
        try:
            _ds_parse(cfg)
            return out, cfg
        except Exception as e:  # DeepSpeed raises AssertionError, ValueError, pydantic, its own errors
            culprit = None
            changed = []  # keys whose removal changes the error: a required one (the batch size) changes it too
            for k in cfg:
                try:
                    _ds_parse({kk: v for kk, v in cfg.items() if kk != k})
                except Exception as e2:
                    if not (type(e2) is type(e) and str(e2) == str(e)):
                        changed.append(k)
                    continue
                culprit = k  # without it DeepSpeed accepts the rest: the one to blame
                break
            culprit = culprit or (changed[0] if changed else None)
            if culprit is None:
                key = "train_batch_size" if "batch" in str(e).lower() else "(config)"
                out.append(_err(key, f"DeepSpeed refuses the config: {_one_line(e)}"))
                return out, {}
            out += _pydantic_findings(e, culprit) or [_err(culprit, f"DeepSpeed refuses it: {_one_line(e)}")]
            del cfg[culprit]
    return out, {}


def _unread_findings(cfg: dict[str, Any]) -> list[Finding]:
    """Keys DeepSpeed never reads: silently ignored, usually a typo or another tool's key."""
    reads: set[str] = set()
    try:
        _ds_parse(_traced(cfg, reads))
    except Exception:
        return []
    known = _known_top_level()
    out = []
    for k in cfg:
        if k not in reads and k not in _READ_ELSEWHERE:
            near = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else "; remove it"
            out.append(_warn(k, f"DeepSpeed never reads this top-level key, it is silently ignored{hint}"))
    # Nested sections DeepSpeed reads key by key (aio, activation_checkpointing, ...): flag keys it skipped.
    # A section none of whose keys is read (optimizer.params) is handed on whole and not judged here.
    for k, v in cfg.items():
        if not isinstance(v, dict) or not any(r.startswith(f"{k}.") for r in reads):
            continue
        read_here = {r[len(k) + 1 :] for r in reads if r.startswith(f"{k}.") and "." not in r[len(k) + 1 :]}
        for sub in v:
            if sub not in read_here:
                near = difflib.get_close_matches(sub, sorted(read_here), n=1, cutoff=0.5)
                hint = (
                    f"; did you mean '{near[0]}'?" if near else f"; it reads {', '.join(sorted(read_here))}"
                )
                out.append(
                    _warn(f"{k}.{sub}", f"DeepSpeed never reads this key, it is silently ignored{hint}")
                )
    return out


# Top-level keys read outside DeepSpeedConfig.__init__ (so the trace cannot see them) or only on
# paths the trace does not take.
_READ_ELSEWHERE = {
    "sequence_parallel_size",  # DeepSpeedConfig reads it only when torch.distributed is initialized
    "zero_allow_untested_optimizer",  # read by get_* helpers; listed so a trace change cannot flag it
    "zero_force_ds_cpu_optimizer",
}


@functools.cache
def _known_top_level() -> frozenset[str]:
    """Top-level keys DeepSpeed knows, traced from DeepSpeedConfig itself: every get_* helper and
    sub-config asks for its key even when absent, so one parse of a minimal config lists them all
    (deepspeed/runtime/constants.py also holds nested names like "enabled", "type", "sum", so it is
    no good as a top-level list). Plus the hand list of keys read elsewhere."""
    reads: set[str] = set()
    with contextlib.suppress(Exception):
        _ds_parse(_traced({"train_micro_batch_size_per_gpu": 1}, reads))
    return frozenset({r for r in reads if "." not in r} | _READ_ELSEWHERE)
