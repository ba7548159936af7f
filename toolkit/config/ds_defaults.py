"""DeepSpeed's defaults that changed quietly across its versions, as a run gets them: shown in the resolved record.

DeepSpeed 0.19 changed defaults without an error to say so (the PRs below): a run that did not set a key trains
differently on a newer DeepSpeed. The toolkit accepts `deepspeed>=0.19.8` (pyproject.toml); for each key
below the record says the value this run gets, where it comes from (the JSON, a toolkit setting, or the installed
DeepSpeed's default), and what older versions did, so a run compared with one made elsewhere shows the difference.
The installed version's defaults are read from DeepSpeed itself, not copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Changed:
    key: str  # dotted path in the DeepSpeed JSON (or a name where the value is not a JSON key)
    history: str  # what it was before, and the change


CHANGED = (
    Changed("gradient_clipping", "0.0 (no clipping) before DeepSpeed 0.19.3, 1.0 since (#8068)"),
    Changed("process_group_timeout", "30 min before DeepSpeed 0.19 (#8253), 10 min since; env DEEPSPEED_TIMEOUT"),
    Changed("bf16.check_grad_overflow", "no overflow check under bf16 before DeepSpeed 0.19 (#8035), on since: a "
                                        "non-finite gradient skips the step"),
    Changed("zero_optimization.offload_optimizer.pin_memory", "unpinned before DeepSpeed 0.19.5, pinned since "
                                                              "(#8207)"),
)


def _get(ds: dict[str, Any], key: str) -> Any:
    node: Any = ds
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _installed_default(key: str) -> Any:
    """The installed DeepSpeed's own default for `key`."""
    if key == "gradient_clipping":
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

        return GRADIENT_CLIPPING_DEFAULT
    if key == "process_group_timeout":
        from deepspeed.constants import default_pg_timeout

        return int(default_pg_timeout.total_seconds())
    if key == "bf16.check_grad_overflow":
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config

        return DeepSpeedBF16Config().check_grad_overflow
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    return DeepSpeedZeroOffloadOptimizerConfig().pin_memory


def effective(ds: dict[str, Any], collective_timeout_s: int) -> dict[str, dict[str, Any]]:
    """key -> {value, source, history} for the keys of CHANGED that apply to this run (the bf16 check under bf16,
    pinning under optimizer offload)."""
    out: dict[str, dict[str, Any]] = {}
    bf16 = bool(_get(ds, "bf16.enabled"))
    offload = (_get(ds, "zero_optimization.offload_optimizer.device") or "none") != "none"
    for c in CHANGED:
        if (c.key.startswith("bf16.") and not bf16) or (c.key.startswith("zero_optimization.offload") and not offload):
            continue
        if c.key == "process_group_timeout":  # the toolkit opens the process group itself (launch/dist.py)
            value, source = collective_timeout_s, "train.collective_timeout_s"
        else:
            value = _get(ds, c.key)
            source = ("train.grad_clip, into the DeepSpeed config" if c.key == "gradient_clipping" else
                      "the DeepSpeed config") if value is not None else "DeepSpeed's default"
            if value is None:
                value = _installed_default(c.key)
        out[c.key] = {"value": value, "source": source, "history": c.history}
    return out


def describe(found: dict[str, dict[str, Any]]) -> str:
    """One line for the record's block."""
    def show(key: str, v: dict[str, Any]) -> str:
        value = f"{v['value']} s" if key == "process_group_timeout" else v["value"]
        return f"{key} {value} ({v['source']})"

    return "DeepSpeed defaults that changed across versions: " + "; ".join(show(k, v) for k, v in found.items())
