"""Every command that README.md and docs/*.md show still parses, and the cheap ones still run.

Commands are collected from the markdown itself, so a command added to the docs is tested too:
fenced code blocks (a `$ ` prompt is stripped, `\\` continuations are joined, `# comments` dropped)
and inline backticks. A line is split into commands at `&&`, `||`, `;` and `|`. Lines that start
with `usage:` are synopses and are not commands. What is checked, per kind, with no GPU:

- `toolkit SUB ...`: the real parser (`toolkit.cli.build_parser`) must accept the argv as written
  (argparse exits 2 on an error). `gen-config`, `plan`, and `check` on a file that exists in the
  repository also run (`python -m toolkit ...`, CUDA hidden) and must exit 0; they are pure or
  arithmetic. `report` and `env` are parsed only: they need a run directory or probe hosts and builds.
  A bare `toolkit SUB` in prose names the command and is checked against the sub-command list.
- A command that ends in `...` (`python toolkit/generate.py ...`) is a mention with its arguments
  elided: only a `toolkit` sub-command before the `...` is checked. `...` anywhere else fails: write
  the example with concrete values, or as a `usage:` line.
- `./launch.sh ...`: run with `--dry-run` (before any `--`) in CPU mode (`DS_ACCELERATOR=cpu`); it
  must exit 0 and print its command. A `--hostfile` that does not exist gets a copy of
  hostfile.example, a `--plan` directory that no docs command wrote gets a small plan, a `--config`
  that does not exist gets an empty YAML, and `--launcher slurm` gets a two-node Slurm environment.
- `deepspeed toolkit/train.py ...` / `python toolkit/train.py ...`: train.py's own argument parser,
  then the `key=value` overrides (and the `--config` YAML where it exists) through the real config
  loader; the DeepSpeed JSON it would use must exist. The launcher's own arguments before the
  script are not checked (that would import deepspeed).
- `... toolkit/generate.py ...`: generate.py's argument parser; a `--ds` file must exist.
- ```` ```yaml ```` blocks are training configs and must load with the real config loader.

Every command runs in one temporary directory, so a command that writes (`toolkit plan ... -o
plans/8b`) prepares the one that reads it (`./launch.sh --plan plans/8b`). Relative links between
the pages must resolve, and README.md must link every docs page.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from toolkit.cli import build_parser
from toolkit.config.schema import load_config

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch.sh"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SEPARATORS = {"&&", "||", ";", "|"}
# User placeholders a docs example may use instead of a concrete value, and what the test puts there.
PLACEHOLDERS = {"<run_dir>": "runs/x", "<plan_dir>": "plans/x", "<hostfile>": "hostfile"}
# Sub-commands that are run, not only parsed: pure, or arithmetic on shapes; no GPU, no network.
RUN_SUBCOMMANDS = {"gen-config", "plan", "check"}
TIMEOUT_S = 120


@dataclass(frozen=True)
class Command:
    file: Path
    line: int
    argv: tuple[str, ...]
    kind: str  # toolkit, launch, train, generate
    elided: bool = False  # the docs wrote `...` for the rest of the arguments

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(REPO)}:{self.line}"

    def __str__(self) -> str:
        program = {"toolkit": "toolkit", "launch": "./launch.sh"}.get(self.kind, f"toolkit/{self.kind}.py")
        return f"{self.where}: {shlex.join((program, *self.argv))}" + (" ..." if self.elided else "")


def _segments(text: str) -> list[list[str]]:
    """Shell words of one command line, split into commands at &&, ||, ; and |."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # unbalanced quotes: prose, not a command
        return []
    out: list[list[str]] = [[]]
    for w in words:
        if w in SEPARATORS:
            out.append([])
        elif w.endswith(";") and len(w) > 1:
            out[-1].append(w[:-1])
            out.append([])
        else:
            out[-1].append(w)
    return [[PLACEHOLDERS.get(w, w) for w in seg] for seg in out if seg]


def _kind(words: list[str]) -> tuple[str, list[str]] | None:
    """(kind, argv after the program) for a command this test covers, else None."""
    if words[0] == "toolkit" and len(words) > 1:
        return "toolkit", words[1:]
    if words[:3] in (["python", "-m", "toolkit"], ["python3", "-m", "toolkit"]) and len(words) > 3:
        return "toolkit", words[3:]
    if words[0] == "./launch.sh" and len(words) > 1:
        return "launch", words[1:]
    if words[0] in ("deepspeed", "python", "python3"):
        for i, w in enumerate(words):
            if w.endswith("toolkit/train.py"):
                return "train", words[i + 1 :]
            if w.endswith("toolkit/generate.py"):
                return "generate", words[i + 1 :]
    return None


def _commands_in(path: Path) -> tuple[list[Command], list[tuple[int, str]]]:
    """The commands of one markdown file, and its ```yaml blocks as (line, text)."""
    lines = path.read_text().splitlines()
    found: list[tuple[int, str]] = []  # (line number, command text)
    yaml_blocks: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    fence: str | None = None
    block_lang, block_start, block_lines = "", 0, []
    pending, pending_line = "", 0
    for n, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if fence is None:
            m = re.match(r"(`{3,}|~{3,})\s*(\w*)", stripped)
            if m:
                fence, block_lang, block_start, block_lines = m.group(1), m.group(2), n, []
                continue
            prose.append((n, raw))
            continue
        if stripped.startswith(fence):
            if block_lang == "yaml":
                yaml_blocks.append((block_start, "\n".join(block_lines)))
            fence, pending = None, ""
            continue
        block_lines.append(raw)
        text = stripped[2:] if stripped.startswith("$ ") else stripped
        if pending:
            text, n = pending + " " + text, pending_line
        if text.endswith("\\"):
            pending, pending_line = text[:-1], n
            continue
        pending = ""
        if text and not text.startswith(("usage:", "#")):
            found.append((n, text))
    # Inline code in prose may wrap onto the next line, never across a blank line.
    text = "\n".join(line for _, line in prose)
    line_of = [n for n, line in prose for _ in range(len(line) + 1)]
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        if "\n\n" not in m.group(1):
            found.append((line_of[m.start()], m.group(1).replace("\n", " ")))
    commands = []
    for n, text in found:
        for words in _segments(text):
            kind = _kind(words)
            if kind:
                argv, elided = kind[1], kind[1][-1:] == ["..."]
                commands.append(Command(path, n, tuple(argv[:-1] if elided else argv), kind[0], elided))
    return commands, yaml_blocks


def _collect() -> tuple[list[Command], list[tuple[Path, int, str]]]:
    commands: list[Command] = []
    yaml_blocks: list[tuple[Path, int, str]] = []
    for path in DOCS:
        c, y = _commands_in(path)
        commands += c
        yaml_blocks += [(path, n, t) for n, t in y]
    return commands, yaml_blocks


COMMANDS, YAML_BLOCKS = _collect()


def _subcommands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    return set(sub.choices)


def _parse_toolkit(argv: tuple[str, ...]) -> str | None:
    """None if the real parser accepts argv, else its error text."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(list(argv))
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    env |= {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "PYTHON": sys.executable}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env | extra


class Workdir:
    """One temporary directory every command runs in; each distinct command runs once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[tuple[str, ...], subprocess.CompletedProcess[str]] = {}

    def find(self, name: str) -> Path | None:
        for base in (self.root, REPO):
            if (base / name).exists():
                return base / name
        return None

    def run(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        key = tuple(argv)
        if key not in self._runs:
            self._runs[key] = subprocess.run(
                argv, cwd=self.root, env=env or _env(), capture_output=True, text=True, timeout=TIMEOUT_S
            )
        return self._runs[key]

    def toolkit(self, argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        return self.run([sys.executable, "-m", "toolkit", *argv])


def _option(argv: tuple[str, ...] | list[str], *names: str) -> str | None:
    """The value of the last of `names` in argv (`--x v` or `--x=v`), before any `--`."""
    value = None
    for i, w in enumerate(argv):
        if w == "--":
            break
        for name in names:
            if w == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif w.startswith(name + "="):
                value = w.split("=", 1)[1]
    return value


def _writes(cmd: Command) -> bool:
    return (
        cmd.kind == "toolkit"
        and not cmd.elided
        and cmd.argv[:1] in (("gen-config",), ("plan",))
        and (_option(cmd.argv, "-o", "--output") is not None or "--all" in cmd.argv)
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Workdir:
    wd = Workdir(tmp_path_factory.mktemp("docs-commands"))
    # Commands that write files first, in the order the docs show them, so the commands that read
    # those files find them whichever tests are selected.
    for cmd in COMMANDS:
        if _writes(cmd) and _parse_toolkit(cmd.argv) is None:
            wd.toolkit(cmd.argv)
    return wd


def test_commands_are_collected() -> None:
    kinds = {c.kind for c in COMMANDS}
    assert kinds == {"toolkit", "launch", "train", "generate"}, kinds
    files = {c.file for c in COMMANDS}
    assert REPO / "README.md" in files
    # the Quickstart's first command, after `&&`
    assert any(
        c.kind == "launch" and c.argv == ("--stage", "2") and c.file.name == "README.md" for c in COMMANDS
    )


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind == "toolkit"], ids=str)
def test_toolkit_command(cmd: Command, workdir: Workdir) -> None:
    assert "..." not in cmd.argv, f"{cmd}: `...` inside a command; give concrete values or a usage: line"
    if cmd.elided or (len(cmd.argv) == 1 and not cmd.argv[0].startswith("-")):
        # `toolkit plan` in prose names the command; `toolkit plan ...` elides its arguments
        assert not cmd.argv or cmd.argv[0] in _subcommands(), f"{cmd}: no such toolkit sub-command"
        return
    sub = cmd.argv[0]
    error = _parse_toolkit(cmd.argv)
    assert error is None, f"{cmd}: the toolkit parser refuses it: {error}"
    if sub not in RUN_SUBCOMMANDS:
        return  # report needs a run directory, env probes hosts and op builds: parsed only
    if sub == "check" and workdir.find(build_parser().parse_args(list(cmd.argv)).file) is None:
        return  # a config the reader has (e.g. one of bench/peer_configs_check.md's): parsed only
    r = workdir.toolkit(cmd.argv)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"


def _prepare_launch(argv: tuple[str, ...], wd: Workdir) -> dict[str, str]:
    """Files and environment a dry run of this launch needs; returns the environment."""
    hostfile = _option(argv, "--hostfile")
    if hostfile and wd.find(hostfile) is None:
        (wd.root / hostfile).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "hostfile.example", wd.root / hostfile)
    plan = _option(argv, "--plan")
    if plan and not (wd.root / plan / "plan.json").exists():
        r = wd.toolkit(
            ("plan", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch", "8", "-o", plan)
        )
        assert r.returncode == 0, r.stderr
    config = _option(argv, "--config")
    if config and wd.find(config) is None:
        (wd.root / config).parent.mkdir(parents=True, exist_ok=True)
        (wd.root / config).write_text("{}\n")
    if _option(argv, "--launcher") == "slurm":
        return _env(SLURM_JOB_NODELIST="node[0-1]", SLURM_GPUS_ON_NODE="2")
    return _env()


@pytest.mark.skipif(shutil.which("bash") is None, reason="launch.sh needs bash")
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind == "launch"], ids=str)
def test_launch_command(cmd: Command, workdir: Workdir) -> None:
    assert "..." not in cmd.argv, f"{cmd}: `...` inside a command; give concrete values or a usage: line"
    if cmd.elided:
        return
    argv = list(cmd.argv)
    if "--dry-run" not in argv:
        at = argv.index("--") if "--" in argv else len(argv)
        argv.insert(at, "--dry-run")
    env = _prepare_launch(cmd.argv, workdir)
    r = workdir.run([str(LAUNCH), *argv], env=env)
    assert r.returncode == 0, (
        f"{cmd}: launch.sh --dry-run exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    )
    assert "--help" in argv or "command: " in r.stdout, f"{cmd}: no command printed\n{r.stdout}"


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind == "train"], ids=str)
def test_train_command(cmd: Command, workdir: Workdir) -> None:
    from toolkit.train import parse_args

    assert "..." not in cmd.argv, f"{cmd}: `...` inside a command; give concrete values or a usage: line"
    if cmd.elided:
        return

    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            args = parse_args(list(cmd.argv))
    except SystemExit:
        pytest.fail(f"{cmd}: toolkit/train.py's parser refuses it: {err.getvalue().strip()}")
    config = workdir.find(args.config) if args.config else None
    try:
        cfg = load_config(config, args.overrides)
    except ValueError as e:  # ConfigError
        pytest.fail(f"{cmd}: the config loader refuses it: {e}")
    ds = args.ds or cfg.train.ds_config
    assert workdir.find(ds) is not None, f"{cmd}: DeepSpeed config {ds} does not exist"


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind == "generate"], ids=str)
def test_generate_command(cmd: Command, workdir: Workdir) -> None:
    from toolkit.runtime.generation.command import parse_args

    assert "..." not in cmd.argv, f"{cmd}: `...` inside a command; give concrete values or a usage: line"
    if cmd.elided:
        return

    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            args = parse_args(list(cmd.argv))
    except SystemExit:
        pytest.fail(f"{cmd}: toolkit/generate.py's parser refuses it: {err.getvalue().strip()}")
    assert args.ds is None or workdir.find(args.ds) is not None, (
        f"{cmd}: DeepSpeed config {args.ds} does not exist"
    )


@pytest.mark.parametrize(
    ("path", "line", "text"), YAML_BLOCKS, ids=[f"{p.name}:{n}" for p, n, _ in YAML_BLOCKS]
)
def test_yaml_block_loads(path: Path, line: int, text: str, tmp_path: Path) -> None:
    f = tmp_path / "block.yaml"
    f.write_text(text + "\n")
    try:
        load_config(f)
    except ValueError as e:  # ConfigError
        pytest.fail(f"{path.relative_to(REPO)}:{line}: the yaml block is not a valid training config: {e}")


def test_links_resolve() -> None:
    bad = []
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                if not (path.parent / target.split("#", 1)[0]).exists():
                    bad.append(f"{path.relative_to(REPO)}:{n}: {target}")
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in DOCS[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, f"README.md's Docs list lacks {missing}"
