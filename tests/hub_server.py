"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the real clients (huggingface_hub, transformers, datasets)
through HF_ENDPOINT: the revision, tree and resolve routes, served from files a test writes, each request logged.

    hub = Hub(tmp_path / "hub")                 # repositories live in folders under it
    sha = hub.add("acme/tiny", folder)          # a model repo at a new commit of folder's files (branch main)
    hub.tag("acme/tiny", "v1", sha)
    hub.fail["acme/gated"] = 403                # answer every request for the repo with 401, 403, 404 or 429
    with hub.serving():                         # sets HF_ENDPOINT for this process; hub.url for child processes
        ...
    hub.requests                                # [(method, path), ...]

Xet is not served: the clients must run with HF_HUB_DISABLE_XET=1 (env_for sets it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

ERROR_CODES = {401: "GatedRepo", 403: "GatedRepo", 404: "RepoNotFound"}


class Hub:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.repos: dict[tuple[str, str], dict[str, dict[str, str]]] = {}  # (kind, id) -> ref -> {path: sha256}
        self.commits: dict[str, Path] = {}  # sha -> folder of that commit's files
        self.fail: dict[str, int] = {}  # repo id -> status code answered to every request
        self.requests: list[tuple[str, str]] = []
        self.url = ""
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ repositories

    def add(self, repo: str, folder: Path, kind: str = "model", branch: str = "main") -> str:
        """A new commit of `folder`'s files on `branch`; returns its sha."""
        digest = hashlib.sha1()
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(str(f.relative_to(folder)).encode() + f.read_bytes())
        sha = digest.hexdigest()
        dest = self.root / sha
        if not dest.exists():
            shutil.copytree(folder, dest)
        self.commits[sha] = dest
        self.repos.setdefault((kind, repo), {})[branch] = sha
        return sha

    def tag(self, repo: str, name: str, sha: str, kind: str = "model") -> None:
        self.repos[(kind, repo)][name] = sha

    def _commit(self, kind: str, repo: str, rev: str) -> str | None:
        refs = self.repos.get((kind, repo))
        if refs is None:
            return None
        if rev in refs:
            return refs[rev]
        return rev if rev in self.commits and rev in refs.values() else None

    # ------------------------------------------------------------------ serving

    @contextlib.contextmanager
    def serving(self) -> Iterator[Hub]:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()

    def env_for(self, home: Path, offline: bool = False) -> dict[str, str]:
        """What a child process needs to use this hub with `home` as its HF_HOME."""
        return {"HF_ENDPOINT": self.url, "HF_HOME": str(home), "HF_HUB_DISABLE_XET": "1",
                "HF_HUB_OFFLINE": "1" if offline else "0", "TRANSFORMERS_OFFLINE": "1" if offline else "0",
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "10"}

    def log(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # the test reads hub.requests
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _send(self, code: int, payload: bytes = b"", headers: dict[str, str] | None = None,
                  body: bool = True) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def _json(self, code: int, obj: object, headers: dict[str, str] | None = None, body: bool = True) -> None:
            self._send(code, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})}, body)

        def _serve(self, body: bool) -> None:
            path = unquote(self.path.split("?", 1)[0])
            hub.log(self.command, path)
            api = path.startswith("/api/")
            parts = path.removeprefix("/api").strip("/").split("/")
            kind = "model"
            if parts[0] in ("models", "datasets"):  # /api/models/..., /api/datasets/..., /datasets/.../resolve
                kind = "dataset" if parts[0] == "datasets" else "model"
                parts = parts[1:]
            if len(parts) < 2:
                return self._json(404, {"error": "not found"}, body=body)
            repo, rest = f"{parts[0]}/{parts[1]}", parts[2:]
            if repo in hub.fail:
                code = hub.fail[repo]
                headers = {"X-Error-Code": ERROR_CODES[code]} if code in ERROR_CODES else {}
                if code == 429:
                    headers["Retry-After"] = "1"
                return self._json(code, {"error": f"{code} for {repo}"}, headers, body)
            if (kind, repo) not in hub.repos:
                return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}, body)
            if api and not rest:  # repo_info without a revision: the default branch
                return self._revision(kind, repo, "main", body)
            if api and rest[:1] == ["revision"]:
                return self._revision(kind, repo, "/".join(rest[1:]), body)
            if api and rest[:1] == ["tree"]:
                return self._tree(kind, repo, rest[1], body)
            if not api and rest[:1] == ["resolve"]:
                return self._file(kind, repo, rest[1], "/".join(rest[2:]), body)
            return self._json(404, {"error": "not found"}, body=body)

        def _files(self, sha: str) -> list[Path]:
            folder = hub.commits[sha]
            return sorted(p for p in folder.rglob("*") if p.is_file())

        def _revision(self, kind: str, repo: str, rev: str, body: bool) -> None:
            sha = hub._commit(kind, repo, rev)
            if sha is None:
                return self._json(404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"}, body)
            folder = hub.commits[sha]
            siblings = [{"rfilename": str(p.relative_to(folder)), "size": p.stat().st_size} for p in self._files(sha)]
            self._json(200, {"id": repo, "sha": sha, "siblings": siblings, "private": False, "gated": False,
                             "disabled": False, "downloads": 0, "likes": 0, "tags": []}, body=body)

        def _tree(self, kind: str, repo: str, rev: str, body: bool) -> None:
            sha = hub._commit(kind, repo, rev)
            if sha is None:
                return self._json(404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"}, body)
            folder = hub.commits[sha]
            self._json(200, [{"type": "file", "path": str(p.relative_to(folder)), "size": p.stat().st_size,
                              "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for p in self._files(sha)], body=body)

        def _file(self, kind: str, repo: str, rev: str, name: str, body: bool) -> None:
            sha = hub._commit(kind, repo, rev)
            if sha is None:
                return self._json(404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"}, body)
            f = hub.commits[sha] / name
            if not f.is_file():
                return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound",
                                                                      "X-Repo-Commit": sha}, body)
            data = f.read_bytes()
            etag = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else hashlib.sha1(data).hexdigest()
            self._send(200, data, {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Content-Type":
                                   "application/octet-stream", "Accept-Ranges": "bytes"}, body)

    return Handler


def use_in_process(monkeypatch: object, env: dict[str, str]) -> None:
    """For a test that calls the clients in its own process: huggingface_hub reads its constants at import, so they
    are patched with `monkeypatch` (undone after the test), as huggingface_hub's and datasets' own tests do."""
    import huggingface_hub.constants as c

    for k, v in env.items():
        monkeypatch.setenv(k, v)  # type: ignore[attr-defined]
    monkeypatch.setattr(c, "ENDPOINT", env["HF_ENDPOINT"])  # type: ignore[attr-defined]
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE",  # type: ignore[attr-defined]
                        env["HF_ENDPOINT"] + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", env["HF_HUB_OFFLINE"] == "1")  # type: ignore[attr-defined]
    monkeypatch.setattr(c, "HF_HOME", env["HF_HOME"])  # type: ignore[attr-defined]
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(Path(env["HF_HOME"]) / "hub"))  # type: ignore[attr-defined]
    monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True)  # type: ignore[attr-defined]
