"""The tested versions (constraints.txt): check that what is installed is what CI tests, or move the set on purpose.

    python tests/versions.py            # exit 1, naming each package whose installed version differs from its pin
    python tests/versions.py --update   # re-resolve with pip (what a fresh machine would get today) and rewrite it

`bash .ci/run` and the README's two set-up commands install with `-c constraints.txt`; .ci/run then runs the check,
so a machine that held other versions before (pip keeps whatever satisfies pyproject's bounds) is caught, not tested.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
PROJECT = "ds-toolkit"
# what the README's second command and .ci/run ask pip for; the pins are everything it resolves to
REQUEST = ["torch==2.13.0", "-e", ".[dev]"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """name -> pinned version, from `name==version` lines (comments and blanks skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[_norm(name)] = version.strip()
    return out


def differences(pinned: dict[str, str]) -> list[str]:
    """'name: installed X, pinned Y' for every pin the environment does not hold (a local label such as +cpu aside)."""
    bad = []
    for name, want in sorted(pinned.items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            bad.append(f"{name}: not installed, pinned {want}")
            continue
        if have.split("+", 1)[0] != want:
            bad.append(f"{name}: installed {have}, pinned {want}")
    return bad


def resolve() -> dict[str, str]:
    """What pip would install for REQUEST on this machine today, ignoring what is installed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
                        str(report), *REQUEST], cwd=ROOT, check=True)
        items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"]: i["metadata"]["version"].split("+", 1)[0] for i in items
            if _norm(i["metadata"]["name"]) != PROJECT}


def update() -> None:
    head = [line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("#")]
    body = [f"{n}=={v}" for n, v in sorted(resolve().items(), key=lambda kv: kv[0].lower())]
    CONSTRAINTS.write_text("\n".join(head + body) + "\n")
    print(f"{CONSTRAINTS.name}: {len(body)} pins; install them with pip install torch==2.13.0 -e \".[dev]\" "
          f"-c constraints.txt, then run the suite")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--update", action="store_true", help="re-resolve the pins with pip and rewrite constraints.txt")
    args = ap.parse_args(argv)
    if args.update:
        update()
        return 0
    pinned = pins()
    bad = differences(pinned)
    if bad:
        print(f"error: {len(bad)} installed package(s) differ from {CONSTRAINTS.name}, the versions CI tests: "
              + "; ".join(bad[:10]) + (" ..." if len(bad) > 10 else "")
              + f"; install them with pip install torch==2.13.0 -e \".[dev]\" -c {CONSTRAINTS.name}", file=sys.stderr)
        return 1
    print(f"versions: all {len(pinned)} pins of {CONSTRAINTS.name} installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
