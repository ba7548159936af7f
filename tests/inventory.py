"""What each collected test checks, and what changed since another revision.

    python tests/inventory.py                    # every test: tier, id, the shared launch it reads, what it checks
    python tests/inventory.py --compare 54d86f6  # the same for a git revision (in a temporary worktree), then the
                                                 # tests gone and new, and the tests whose shared launch changed

"What it checks" is the first sentence of the test's docstring, or its name in words; "launch" names the module- or
session-scoped fixtures of tests/dist that the test reads (a shared launch: every test reading it checks that
launch's runs). A test moved into a shared launch keeps its id and its assertions, so a merge shows as a changed
launch, not as a test gone. Collection only: nothing is run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# fixtures of the whole suite that launch nothing
NOT_LAUNCHES = {"_no_leaked_shm_buffers", "chat_tokenizer", "tmp_path_factory", "worker_id", "testrun_uid"}


class _Collector:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        for item in items:
            fn = getattr(item, "function", None)
            doc = (getattr(fn, "__doc__", None) or "").strip()
            what = " ".join(doc.split("\n\n")[0].split(". ")[0].split()) if doc else item.originalname.removeprefix(
                "test_").replace("_", " ")
            defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
            shared = sorted(n for n, d in defs.items() if n not in NOT_LAUNCHES and d and d[-1].scope in
                            ("module", "session"))
            tiers = [m for m in ("unit", "dist", "multinode", "gpu") if item.get_closest_marker(m)]
            self.rows.append({"id": item.nodeid, "tier": tiers[-1] if tiers else "", "launch": shared,
                              "checks": what})


def collect(tree: Path) -> list[dict[str, Any]]:
    """The tests of `tree`, collected in a child process whose `toolkit` is that tree's."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = os.environ | {"PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json", out.name], cwd=tree, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def _collect_here() -> list[dict[str, Any]]:
    import pytest

    c = _Collector()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # pytest's own listing
        rc = pytest.main(["--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", "tests"], plugins=[c])
    if rc not in (0, 5):
        raise SystemExit(f"collection failed ({rc})")
    return c.rows


def _show(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        launch = f" [launch: {', '.join(r['launch'])}]" if r["launch"] else ""
        print(f"{r['tier']:9} {r['id']}{launch}\n          {r['checks']}")


def _key(test_id: str) -> str:
    """A test's id without the line numbers of the page commands it runs (tests/unit/test_docs_commands.py names
    each by page and line: a line added above one is not a test gone)."""
    return re.sub(r"(\.md):\d+:", r"\1:", test_id)


def _keyed(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows by _key, a command shown twice on one page counted twice."""
    out: dict[str, dict[str, Any]] = {}
    seen: dict[str, int] = {}
    for r in rows:
        k = _key(r["id"])
        seen[k] = seen.get(k, 0) + 1
        out[k if seen[k] == 1 else f"{k} #{seen[k]}"] = r
    return out


def compare(rev: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_tree), rev], check=True,
                       capture_output=True)
        try:
            old = _keyed(collect(old_tree))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=True)
    new = _keyed(collect(ROOT))
    gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    moved = sorted(i for i in set(old) & set(new) if old[i]["launch"] != new[i]["launch"])
    print(f"{len(old)} tests at {rev}, {len(new)} now: {len(gone)} gone, {len(added)} new, "
          f"{len(moved)} reading another shared launch")
    for i in gone:
        print(f"gone  {i}\n      {old[i]['checks']}")
    for i in added:
        print(f"new   {i}\n      {new[i]['checks']}")
    for i in moved:
        print(f"moved {i}: launch {old[i]['launch'] or 'its own'} -> {new[i]['launch'] or 'its own'}")
    return 1 if gone else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", metavar="REV", help="a git revision to compare with")
    ap.add_argument("--json", metavar="FILE", help="write the listing as JSON instead")
    args = ap.parse_args()
    if args.compare:
        return compare(args.compare)
    rows = _collect_here()
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    else:
        _show(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
