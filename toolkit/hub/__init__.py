"""Hub ids (`org/name`) wherever a model is named: resolved once per node to a pinned local snapshot (snapshot.py)."""

from __future__ import annotations

from pathlib import Path

from toolkit.hub.snapshot import Resolution, has_custom_code, is_hub_id, resolve, resolved

__all__ = ["Resolution", "has_custom_code", "is_hub_id", "local_dir", "resolve", "resolved"]


def local_dir(name: str, revision: str | None = None, *, files: str = "model", trust_remote_code: bool = False,
              what: str = "model.name") -> Path | None:
    """The directory `name` names: a local directory as it is, a hub id's snapshot (resolved once per process and
    node; files="config": config.json alone), or None for neither."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if is_hub_id(name):
        return Path(resolve(name, revision, files=files, trust_remote_code=trust_remote_code, what=what).path)
    return None
