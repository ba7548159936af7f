"""The tested versions (constraints.txt, tests/versions.py): CI and the README's commands install the same set."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import versions  # noqa: E402


def _installs(text: str, fenced: bool = True) -> list[str]:
    """Every `pip install ... -e ...` command of a file (the project's own installs, not a single tool's); of a
    Markdown page, those in its code blocks."""
    if fenced:
        text = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S))
    return [m.group(0) for m in re.finditer(r"pip install [^\n&|]*-e [^\n&|]*", text)]


def test_the_readme_ci_and_the_testing_page_install_with_the_constraints() -> None:
    """Issue 83: `pip install -e ".[dev]"` kept whatever satisfied the bounds, so CI tested the versions its machine
    held and a new user got newer ones. Both Quickstart commands, .ci/run and docs/testing.md install with the pins."""
    readme = (ROOT / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):readme.index("## The commands")]
    found = {"README Quickstart": _installs(quickstart), ".ci/run": _installs((ROOT / ".ci/run").read_text(), fenced=False),
             "docs/testing.md": _installs((ROOT / "docs/testing.md").read_text())}
    assert len(found["README Quickstart"]) == 2 and len(found[".ci/run"]) == 1, found
    for where, commands in found.items():
        for cmd in commands:
            assert "-c constraints.txt" in cmd, (where, cmd)
    assert "python3 tests/versions.py" in (ROOT / ".ci/run").read_text()  # and CI checks what got installed


def test_every_dependency_is_pinned_once_within_its_bound() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = versions.pins()
    for line in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(line)
        name = versions._norm(req.name)
        assert name in pinned, f"{req.name} is not in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), (line, pinned[name])
    names = [versions._norm(x.split("==")[0]) for x in (ROOT / "constraints.txt").read_text().splitlines()
             if x and not x.startswith("#")]
    assert len(names) == len(set(names)) and "ds-toolkit" not in names


def test_a_package_off_its_pin_is_named(tmp_path: Path) -> None:
    pins = tmp_path / "constraints.txt"
    here = versions.metadata.version("packaging")
    pins.write_text(f"# a comment\npytest==0.0.1\nnot-a-package-here==1.0\npackaging=={here}\n")
    assert versions.differences(versions.pins(pins)) == [
        "not-a-package-here: not installed, pinned 1.0",
        f"pytest: installed {versions.metadata.version('pytest')}, pinned 0.0.1"]
