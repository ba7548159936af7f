"""Which parameters each half of Muon steps, as DeepSpeed split them: written once the engine exists.

deepspeed.initialize tags every parameter with use_muon (2-D layer shape, no "embed" or "lm_head" in its name;
deepspeed/__init__.py set_optimizer_flags); the ZeRO optimizer then holds flat partitions, so the split is read
from the model's tags, not from the optimizer's groups. Rank 0 prints it and writes run_dir/optimizer_groups.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.launch import dist

RECORD = "optimizer_groups.json"


def split(model: Any) -> dict[str, Any] | None:
    """{"muon": {...}, "adam": {...}}: tensors, parameters and a few names of each half; None when not Muon."""
    halves: dict[str, dict[str, Any]] = {"muon": {"tensors": 0, "params": 0, "names": []},
                                         "adam": {"tensors": 0, "params": 0, "names": []}}
    tagged = False
    for name, p in model.named_parameters():
        if not p.requires_grad or not hasattr(p, "use_muon"):
            continue
        tagged = True
        half = halves["muon" if p.use_muon else "adam"]
        half["tensors"] += 1
        half["params"] += int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3: the whole layer's count
        half["names"].append(name)
    if not tagged:
        return None
    for half in halves.values():
        names = half.pop("names")
        half["examples"] = names[:3] + ([f"... {len(names) - 4} more", names[-1]] if len(names) > 4 else names[3:])
    return halves


def record(run_dir: Path, model: Any) -> None:
    """Every rank calls it (the split is the same everywhere); rank 0 prints and writes it."""
    got = split(model)
    if got is None or dist.rank() != 0:
        return
    m, a = got["muon"], got["adam"]
    print(f"optimizer groups: Muon steps {m['tensors']} matrices ({m['params']:,} parameters), its Adam "
          f"{a['tensors']} tensors ({a['params']:,}: embeddings, head, norms, biases) -> {RECORD}", flush=True)
    (Path(run_dir) / RECORD).write_text(json.dumps(got, indent=1) + "\n")
