"""Hub ids (`org/name`) resolved to a local snapshot once per node, pinned to a commit, before any rank loads.

transformers resolves ids on its own in every process: N ranks each ask the hub for every file (rate limits count
per IP), a cached id still waits on the network when the flag is not set, and a repository with custom code prompts
with `input()` on every rank. So the toolkit resolves an id itself, with huggingface_hub's own client (its cache
layout, locks, HF_HOME / HF_HUB_CACHE / HF_TOKEN / HF_ENDPOINT / HF_HUB_OFFLINE), and every from_pretrained then
reads the local snapshot directory with `local_files_only=True`:

- `config` (toolkit plan, toolkit check): config.json alone, never weights;
- `model` (a run, generate, merge-adapter): the files a run reads (configs, safetensors and their index, tokenizer,
  processor and chat template; the repository's Python only with `model.trust_remote_code=true`);
- `tokenizer` (model.tokenizer naming another repository): the same without weights.

One process per node resolves (the first local rank: LOCAL_RANK 0); the others wait for its answer in a file beside
the cache (`<HF_HUB_CACHE>/.toolkit/`), polling, not in a collective that a long download could time out, and read
the same commit. A revision (a branch, a tag or a sha) is turned into its sha first, then the snapshot of that sha
is fetched; offline (HF_HUB_OFFLINE=1) the cache alone answers. Every failure is one line: offline and not cached,
gated (401/403: HF_TOKEN), not found, revision not found, rate limited, unreachable, `.bin` weights only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.jinja", "*.txt", "tokenizer*"]
DATA_FILES = ["*.jsonl", "*.json", "*.parquet", "*.txt", "*.md"]
CODE_FILES = ["*.py"]
POLL_S = 0.2


@dataclass(frozen=True)
class Resolution:
    id: str
    revision: str | None  # as asked (None: the default branch)
    sha: str
    path: str  # the local snapshot directory
    offline: bool  # answered from the cache alone
    files: str  # "config" or "model"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_resolved: dict[tuple[str, str | None, str], Resolution] = {}


def is_hub_id(name: str) -> bool:
    """`org/name` that is not a local path (a local directory of that name wins, as in transformers and datasets)."""
    return bool(HUB_ID.match(name)) and not Path(name).exists() and ".." not in name


def resolved() -> list[Resolution]:
    """What this process resolved (the record's `hub` entries)."""
    return list(_resolved.values())


def resolve(repo: str, revision: str | None = None, *, files: str = "model", trust_remote_code: bool = False,
            what: str = "model.name") -> Resolution:
    """The local snapshot of `repo` at `revision`, fetched once per node (see the module docstring). ConfigError
    in one line for every failure."""
    for kind in ("model", files):  # a full snapshot serves a config or a tokenizer too
        got = _resolved.get((repo, revision, kind))
        if got is not None:
            return got
    if _local_rank() == 0:
        res = _write_answer(repo, revision, files, lambda: _fetch(repo, revision, files, trust_remote_code, what))
    else:
        res = _await_answer(repo, revision, files, what)
    _resolved[(repo, revision, files)] = res
    return res


# ----------------------------------------------------------------------------- one process per node


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _answers() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ".toolkit"


def _launch_key(repo: str, revision: str | None, files: str) -> str:
    """The same on every local rank of one launch, another for the next: the ranks' parent (the launcher's per-node
    process: DeepSpeed's launch.py, torchrun's agent, orted, slurmstepd) and its start time."""
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        started = "?"
    raw = f"{socket.gethostname()}|{parent}|{started}|{repo}|{revision}|{files}"
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _write_answer(repo: str, revision: str | None, files: str, fetch: Any) -> Resolution:
    folder = _answers()
    key = _launch_key(repo, revision, files)
    answer = folder / f"{key}.json"
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.pid").write_text(str(os.getpid()))  # the waiters watch this process
    try:
        res = fetch()
    except ConfigError as e:
        _atomic(answer, {"error": str(e)})
        raise
    except BaseException as e:
        _atomic(answer, {"error": f"{repo}: resolving it failed: {type(e).__name__}: {e}"})
        raise
    _atomic(answer, res.to_dict())
    return res


def _atomic(path: Path, obj: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)


def _await_answer(repo: str, revision: str | None, files: str, what: str) -> Resolution:
    """Poll for the first local rank's answer (no deadline: a download takes what it takes) while it lives."""
    folder = _answers()
    key = _launch_key(repo, revision, files)
    answer, pid_file = folder / f"{key}.json", folder / f"{key}.pid"
    t0 = time.monotonic()
    while not answer.is_file():
        if pid_file.is_file() and time.monotonic() - t0 > 5:
            with contextlib.suppress(ValueError):
                pid = int(pid_file.read_text() or 0)
                if pid and not Path(f"/proc/{pid}").exists() and not answer.is_file():
                    raise ConfigError(f"{what}={repo}: the process resolving it on this node (pid {pid}) ended "
                                      "without an answer")
        time.sleep(POLL_S)
    rec = json.loads(answer.read_text())
    if "error" in rec:
        raise ConfigError(rec["error"])
    return Resolution(**rec)


# ----------------------------------------------------------------------------- the hub itself


def _fetch(repo: str, revision: str | None, files: str, trust_remote_code: bool, what: str) -> Resolution:
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE)
    patterns = {"config": ["config.json"], "tokenizer": [p for p in MODEL_FILES if p != "*.safetensors"],
                "dataset": DATA_FILES}.get(files, MODEL_FILES) + (CODE_FILES if trust_remote_code else [])
    kind = "dataset" if files == "dataset" else "model"
    with _errors(repo, revision, offline, what):
        # huggingface_hub turns the revision into its commit (one request), fetches that commit's files and
        # writes the revision's ref into the cache (an offline rerun finds it): the snapshot's folder is the sha
        path = _cached(repo, revision, patterns, kind) if offline else _download(repo, revision, patterns, kind)
    path = Path(path)
    if files == "model":
        _check_weights(path, repo, what)
    return Resolution(repo, revision, path.name, str(path), offline, files)


def _download(repo: str, revision: str | None, patterns: list[str], kind: str = "model") -> str:
    from huggingface_hub import snapshot_download

    if patterns == ["config.json"]:
        from huggingface_hub import hf_hub_download

        return str(Path(hf_hub_download(repo, "config.json", revision=revision)).parent)
    return snapshot_download(repo, repo_type=kind, revision=revision, allow_patterns=patterns)


def _cached(repo: str, revision: str | None, patterns: list[str], kind: str = "model") -> str:
    """Offline: the snapshot the cache maps `revision` to (a ref file, or the sha itself)."""
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    if patterns == ["config.json"]:
        found = try_to_load_from_cache(repo, "config.json", revision=revision)
        if not isinstance(found, str):
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError(f"{repo}: config.json is not in the cache")
        return str(Path(found).parent)
    return snapshot_download(repo, repo_type=kind, revision=revision, allow_patterns=patterns,
                             local_files_only=True)


def _check_weights(path: Path, repo: str, what: str) -> None:
    names = {p.name for p in path.iterdir()}
    if not (path / "config.json").is_file():
        raise ConfigError(f"{what}={repo}: the repository has no config.json at {path.name}; is it a transformers "
                          "model?")
    if not any(n.endswith(".safetensors") for n in names):
        from huggingface_hub import HfApi, constants

        bins = []
        if not constants.HF_HUB_OFFLINE:
            with contextlib.suppress(Exception):
                bins = [f for f in HfApi().list_repo_files(repo, revision=path.name) if f.endswith((".bin", ".pt"))]
        if bins:
            raise ConfigError(f"{what}={repo}: the repository has .bin weights only ({', '.join(bins[:3])}), which "
                              "every rank would unpickle whole into host memory: convert them to safetensors "
                              "(transformers' save_pretrained writes them) and point model.name at that directory")


@contextlib.contextmanager
def _errors(repo: str, revision: str | None, offline: bool, what: str) -> Any:
    """huggingface_hub's errors as one line each."""
    import httpx
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{what}={repo}" + (f" (model.revision={revision})" if revision else "")
    cache = constants.HF_HUB_CACHE
    try:
        yield
    except GatedRepoError as e:
        code = e.response.status_code if e.response is not None else 401
        raise ConfigError(f"{at}: the repository is gated ({code}): set HF_TOKEN (or run `hf auth login`) for an "
                          "account that has accepted its terms on the hub") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{at}: revision {revision!r} not found (a branch, a tag or a commit sha of the "
                          "repository)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{at}: repository not found on {constants.ENDPOINT} (a private one needs HF_TOKEN)"
                          ) from None
    except LocalEntryNotFoundError as e:
        code = _status(e)  # a download that failed where no cached copy exists is reported as a missing cache entry
        if code == 429:
            raise ConfigError(_RATE_LIMITED.format(at=at)) from None
        if offline:
            fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
            raise ConfigError(f"{at}: offline (HF_HUB_OFFLINE=1) and not in the cache {cache}: fetch it ahead on a "
                              f"machine with access (`{fetch}`, with the same HF_HOME), or unset HF_HUB_OFFLINE"
                              ) from None
        raise ConfigError(f"{at}: cannot reach {constants.ENDPOINT} and the cache {cache} does not hold it: check "
                          "the network, or fetch it ahead and set HF_HUB_OFFLINE=1") from None
    except HfHubHTTPError as e:
        code = e.response.status_code if e.response is not None else "?"
        if code == 429:
            raise ConfigError(_RATE_LIMITED.format(at=at)) from None
        raise ConfigError(f"{at}: the hub answered {code}: {str(e).splitlines()[0]}") from None
    except (OSError, httpx.TransportError) as e:  # the connection itself
        raise ConfigError(f"{at}: cannot reach {constants.ENDPOINT} ({type(e).__name__}) and the cache {cache} does "
                          "not hold it: check the network, or fetch it ahead and set HF_HUB_OFFLINE=1") from None


_RATE_LIMITED = ("{at}: the hub rate-limits this machine (429): wait and retry, set HF_TOKEN (limits are higher for "
                 "an account), or fetch ahead and set HF_HUB_OFFLINE=1")


def _status(e: BaseException) -> int | None:
    """The HTTP status behind an error, through its chain of causes."""
    seen = 0
    while e is not None and seen < 8:
        response = getattr(e, "response", None)
        if response is not None and getattr(response, "status_code", None):
            return int(response.status_code)
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def has_custom_code(path: Path) -> bool:
    """Whether the model's config asks for the repository's own Python (`auto_map`)."""
    with contextlib.suppress(OSError, ValueError):
        return bool(json.loads((path / "config.json").read_text()).get("auto_map"))
    return False
