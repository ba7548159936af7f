"""Hub dataset ids in data.source / data.eval_source: the dataset repository's snapshot (fetched once per node and
pinned like a model, snapshot.py), then the file of the split, read as a local file is (runtime/data/corpus.py).

The file follows the hub's naming of splits (`train.jsonl`, `data/train-00000-of-00001.parquet`, `train/x.jsonl`):
its name starts with the split or it lies in a folder named so. Its path holds the commit, so a new commit of the
dataset is tokenized again and an old one reuses its cache. A split in several files is not read yet.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.config.ds_config import ConfigError
from toolkit.hub.snapshot import is_hub_id, resolve

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


def split_file(root: Path, split: str, what: str, repo: str) -> Path:
    """The one data file of `split` in a dataset snapshot."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    def of_split(p: Path) -> bool:
        rel = p.relative_to(root)
        return rel.name.startswith((f"{split}.", f"{split}-", f"{split}_")) or split in rel.parts[:-1]
    picked = [p for p in files if of_split(p)]
    if not picked and len(files) == 1 and split == "train":
        picked = files  # one file and no split in its name: the train split, as datasets reads it
    if len(picked) == 1:
        return picked[0]
    names = ", ".join(str(p.relative_to(root)) for p in (picked or files)[:5])
    if not picked:
        raise ConfigError(f"{what}={repo}: no file of split {split!r} among its data files ({names or 'none'}); set "
                          "data.split")
    raise ConfigError(f"{what}={repo}: split {split!r} is in {len(picked)} files ({names}); one file per split is "
                      "read so far: download it and join the files into one .jsonl or .parquet")


def local_source(source: str | None, split: str, revision: str | None, what: str) -> str | None:
    """`source` as corpus reads it: a hub dataset id becomes its split's file in the pinned snapshot; anything else
    is returned as it is."""
    if source is None or source == "synthetic" or not is_hub_id(source) or Path(source).suffix in SUFFIXES:
        return source  # a file name (data/train.jsonl that is not there) stays a file: its own error says so
    snap = resolve(source, revision, files="dataset", what=what)
    return str(split_file(Path(snap.path), split, what, source))
