"""The row loop that bench/preference.py and bench/grpo.py share: each row in its own `deepspeed` launch, no row
started past the budget, a failed row recorded with its log's tail, the rows printed and written as each ends."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def launcher(args: argparse.Namespace) -> list[str]:
    """`deepspeed` with --include (a GPU of the host) or --num_gpus, and a master port of its own."""
    where = ["--include", args.include] if args.include else ["--num_gpus", str(args.gpus)]
    return ["deepspeed", *where, "--master_port", str(args.port + int(time.time()) % 100)]


def run_rows(args: argparse.Namespace, out: Path, command: Callable[[str, int], list[str]],
             read: Callable[[str, int], dict[str, Any]], base: dict[str, Any], result: str,
             quiet: tuple[str, ...] = ("log_tail",)) -> list[dict[str, Any]]:
    """Every row of args.rows (NAME-zSTAGE): `command(name, stage)` launched, `read(name, stage)` for its figures;
    `base` goes into every row, `quiet` keys stay out of the printed line; `out / result` holds the rows."""
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for name in args.rows.split(","):
        if time.perf_counter() - t_start > args.budget_s:
            rows.append({"row": name, "error": "not run: budget spent"})
            continue
        stage = int(name.rsplit("-z", 1)[1])
        cmd = command(name, stage)
        t0 = time.perf_counter()
        with (out / f"{name}.log").open("w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"}).returncode
        row: dict[str, Any] = {"row": name, "stage": stage, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
                               **base}
        try:
            row |= read(name, stage)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["log_tail"] = (out / f"{name}.log").read_text()[-3000:]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in quiet}), flush=True)
        (out / result).write_text(json.dumps(rows, indent=1))
    return rows
