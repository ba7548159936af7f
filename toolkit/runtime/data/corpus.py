"""Local data files, tokenized once into a cache that every rank memory-maps.

A file is read and tokenized by `datasets` (`.map`, batched, in `data.num_proc` processes) into an Arrow
dataset under `data.cache_dir/<key>/`. The key hashes everything that changes the tokens: the file's
identity (resolved path, size, modification time), the tokenizer (its full serialization, chat template
and special ids), the format, the fields, `data.seq_len`, packing and the task. One process builds it
while the others wait; then every rank opens its Arrow files with `datasets.Dataset.from_file`, which
memory-maps them, so host memory per rank does not grow with the corpus, and a later launch (or a resume)
reuses it at once.

Who builds: global rank 0 when every rank sees the cache directory (a shared filesystem, or one node),
else the first rank of each node. It is decided, not assumed: rank 0 writes a probe file into the cache
directory and every rank reports whether it sees it (`_builders_are_per_node`).

Formats (`data.format`, "auto" picks from the columns):
- prompt_response: the prompt is masked from the loss (-100), the response and EOS are trained on;
- text: plain text trained on everywhere; a document longer than seq_len is split into seq_len samples;
- messages: rows of `[{"role", "content"}, ...]` rendered with the tokenizer's own chat template; the
  loss is on the assistant turns only (each turn's span is found by rendering the conversation up to it,
  so any template works; transformers' `return_assistant_tokens_mask` needs `{% generation %}` markers
  that most templates lack).
Bad rows get one line each kind, with counts: an unknown role or a malformed conversation stops the run
before training; samples longer than seq_len are truncated (said, with the count), and those left with
nothing to learn are dropped (said, with the count).

Packing (`data.packing`, on by default for causal-LM files) fills seq_len blocks with whole samples, never
splitting one (best-fit decreasing within each map batch of 4,000 rows), and records each sample's length:
the collator turns that into position ids that restart at 0 per sample and, on CUDA, document boundaries
for variable-length attention (toolkit/runtime/attention/), so packed samples neither attend to each
other nor share positions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import Config, packing
from toolkit.launch import dist

IGNORE_INDEX = -100
CACHE_VERSION = 2  # bump when the stored layout or the tokenization rules change
ROLES = ("system", "user", "assistant", "tool")
DONE = "toolkit_cache.json"  # written last into a built cache: its presence means complete
KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
# Rows per Arrow record batch in the cache. Opening a cache reads every batch's header, and each read faults
# in 64 KiB of the mapped file (the kernel's fault-around), which counts in the rank's RSS: datasets' default
# of 1,000 rows made that 64 MiB per million rows; 20,000 makes it about 3 MiB.
WRITER_BATCH = 20_000

# per-row status from the tokenizing map; 0 and 1 train, the others are counted and reported
OK, TRUNCATED, NOTHING_TO_LEARN, UNKNOWN_ROLE, MALFORMED, TEMPLATE_UNSTABLE = range(6)


def default_cache_dir() -> Path:
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "toolkit")) / "data"


def resolve_format(cfg: Config, path: Path, columns: set[str]) -> str:
    """data.format, with "auto" decided from the columns (a .txt file is text)."""
    d = cfg.data
    if d.format != "auto":
        return d.format
    if path.suffix == ".txt":
        return "text"
    if d.messages_field in columns:
        return "messages"
    if d.prompt_field in columns and d.response_field in columns:
        return "prompt_response"
    return "text"


def tokenizer_identity(tokenizer: Any) -> str:
    """Everything about the tokenizer that changes the tokens: its full serialization (vocabulary, merges,
    normalizer, pre-tokenizer), special ids and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    extra = {"class": type(tokenizer).__name__, "eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id,
             "template": getattr(tokenizer, "chat_template", None), "added": str(tokenizer.added_tokens_encoder)}
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def cache_key(cfg: Config, path: Path, fmt: str, tokenizer: Any) -> dict[str, Any]:
    st = path.stat()
    d = cfg.data
    return {"version": CACHE_VERSION, "file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer": tokenizer_identity(tokenizer), "format": fmt, "task": cfg.model.task, "seq_len": d.seq_len,
            "packing": packing(cfg)[0], "fields": [d.prompt_field, d.response_field, d.text_field, d.label_field,
                                             d.messages_field]}


def key_name(key: dict[str, Any]) -> str:
    return f"{Path(key['file']).stem[:40]}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}"


# ----------------------------------------------------------------------------- tokenizing (runs in map workers)


@dataclass
class Tokenize:
    """The batched map function; a plain picklable object so `num_proc` workers can run it."""

    tokenizer: Any
    fmt: str
    task: str
    seq_len: int
    prompt_field: str
    response_field: str
    text_field: str
    label_field: str
    messages_field: str

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self.task == "seq_cls":
            return self._seq_cls(batch)
        return {"prompt_response": self._prompt_response, "text": self._text,
                "messages": self._messages}[self.fmt](batch)

    def _eos(self) -> list[int]:
        return [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []

    def _finish(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int], int]:
        status = OK
        if len(ids) > self.seq_len:
            ids, labels, status = ids[: self.seq_len], labels[: self.seq_len], TRUNCATED
        # the loss predicts labels[1:] from the positions before them: at least one target must remain
        if len(ids) < 2 or all(x == IGNORE_INDEX for x in labels[1:]):
            status = NOTHING_TO_LEARN
        return ids, labels, status

    def _prompt_response(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        tok = self.tokenizer
        prompts = tok([str(x) for x in batch[self.prompt_field]], add_special_tokens=True)["input_ids"]
        resps = tok([str(x) for x in batch[self.response_field]], add_special_tokens=False)["input_ids"]
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "status": []}
        eos = self._eos()
        for p, r in zip(prompts, resps, strict=True):
            ids, labels, status = self._finish(p + r + eos, [IGNORE_INDEX] * len(p) + r + eos)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["status"].append(status)
        return out

    def _text(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """Plain text; a long document becomes several seq_len samples (a batched map may return more rows)."""
        docs = self.tokenizer([str(x) for x in batch[self.text_field]], add_special_tokens=True)["input_ids"]
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "status": []}
        eos, n = self._eos(), self.seq_len
        for doc in docs:
            doc = doc + eos
            split = len(doc) > n
            for i in range(0, len(doc), n):
                piece = doc[i:i + n]
                if len(piece) < 2:
                    continue  # a one-token tail has nothing to predict
                out["input_ids"].append(piece)
                out["labels"].append(list(piece))
                out["status"].append(TRUNCATED if split and i == 0 else OK)  # counts split documents once
        return out

    def _seq_cls(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        enc = self.tokenizer([str(x) for x in batch[self.text_field]], add_special_tokens=True)["input_ids"]
        return {"input_ids": [ids[: self.seq_len] for ids in enc], "labels": [int(x) for x in batch[self.label_field]],
                "status": [TRUNCATED if len(ids) > self.seq_len else OK for ids in enc]}

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _spans(self, messages: Any) -> tuple[str, list[tuple[int, int]], int]:
        """(rendered text, character spans of the assistant turns, status)."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            return "", [], MALFORMED
        if any(m["role"] not in ROLES for m in messages):
            return "", [], UNKNOWN_ROLE
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        full = self._render(msgs, False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = self._render(msgs[:i], True) if i else ""
            through = self._render(msgs[: i + 1], False)
            if not (through.startswith(before) and full.startswith(through)):
                return "", [], TEMPLATE_UNSTABLE
            spans.append((len(before), len(through)))
        return full, spans, OK

    def _messages(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rendered = [self._spans(m) for m in batch[self.messages_field]]
        # the template writes the special tokens (BOS, turn markers) itself, as apply_chat_template does
        enc = self.tokenizer([r[0] for r in rendered], add_special_tokens=False, return_offsets_mapping=True)
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "status": []}
        for (_, spans, status), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"], strict=True):
            if status != OK:
                out["input_ids"].append([])
                out["labels"].append([])
                out["status"].append(status)
                continue
            labels = [tid if any(a <= s < b for a, b in spans) else IGNORE_INDEX
                      for tid, (s, _) in zip(ids, offsets, strict=True)]
            ids, labels, status = self._finish(list(ids), labels)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["status"].append(status)
        return out


def pack_batch(batch: dict[str, list[Any]], block: int) -> dict[str, list[Any]]:
    """Whole samples into blocks of at most `block` tokens (a batched map: blocks never cross a map batch).

    Best-fit decreasing: the longest sample first, each into the fullest block it fits. Filling blocks in
    file order left half a sample of padding per block (about 3% of a 2,048-token block for rows of ~120
    tokens); this leaves padding mostly in a map batch's last blocks. Within a block the samples keep their
    file order. Each sample's first label becomes -100: it would be predicted from the previous sample's
    last position."""
    import bisect

    status = batch.get("status") or [OK] * len(batch["input_ids"])
    keep = [i for i, s in enumerate(status) if s <= TRUNCATED]
    sizes = {i: len(batch["input_ids"][i]) for i in keep}
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (space left, block number), sorted
    for i in sorted(keep, key=lambda i: (-sizes[i], i)):
        j = bisect.bisect_left(room, (sizes[i], -1))
        if j < len(room):
            left, b = room.pop(j)
        else:
            left, b = block, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(room, (left - sizes[i], b))
    out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "seq_lens": []}
    for members in bins:
        ids: list[int] = []
        labels: list[int] = []
        for i in sorted(members):
            ids.extend(batch["input_ids"][i])
            labels.append(IGNORE_INDEX)
            labels.extend(batch["labels"][i][1:])
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["seq_lens"].append([sizes[i] for i in sorted(members)])
    return out


# ----------------------------------------------------------------------------- building and opening the cache


@dataclass
class Corpus:
    """A tokenized file, memory-mapped: `rows[i]` is a dict of Python lists (input_ids, labels[, seq_lens])."""

    rows: Any  # datasets.Dataset
    index: Any  # numpy array of the rows that train (memory-mapped), or None: all of them
    info: dict[str, Any]
    path: Path

    def __len__(self) -> int:
        return len(self.rows) if self.index is None else len(self.index)


def load_corpus(cfg: Config, source: str, tokenizer: Any, what: str = "data.source") -> Corpus:
    """Every rank: the cache for `source`, built by one process per filesystem if missing."""
    path = Path(source)
    columns = file_columns(path, what)
    fmt = resolve_format(cfg, path, columns)
    check_format(cfg, fmt, columns, tokenizer, path, what)
    key = cache_key(cfg, path, fmt, tokenizer)
    root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()
    final = root / key_name(key)
    token, builder = _builder(root)
    if not (final / DONE).is_file():
        if builder:
            _build_guarded(cfg, path, fmt, key, tokenizer, final, token, what)
        else:
            _wait(final, root, token, what)
    elif dist.rank() == 0:
        info = json.loads((final / DONE).read_text())
        print(f"{what}: reusing the tokenized cache {final} ({info['samples']:,} samples, {info['tokens']:,} tokens; "
              f"built in {info['build_s']:.1f} s)", flush=True)
    rows, index, info = open_cache(final)
    return Corpus(rows, index, info, final)


def _builder(root: Path) -> tuple[str, bool]:
    """(a token shared by this launch's ranks, whether this process builds)."""
    root.mkdir(parents=True, exist_ok=True)
    token = dist.broadcast_object(uuid.uuid4().hex[:12] if dist.rank() == 0 else None)
    if dist.world_size() == 1:
        return token, True
    per_node = _builders_are_per_node(root, token)
    return token, (dist.local_rank() == 0) if per_node else (dist.rank() == 0)


def _builders_are_per_node(root: Path, token: str) -> bool:
    """Rank 0 writes a probe into the cache directory; if some rank cannot see it, that rank's node has
    its own filesystem there, and the first rank of each node builds its own copy."""
    probe = root / f".probe-{token}"
    if dist.rank() == 0:
        probe.write_text(token)
    dist.barrier()
    missing = 0.0 if probe.is_file() else 1.0
    unseen = dist.all_reduce_sum([missing])[0]
    dist.barrier()
    if dist.rank() == 0:
        probe.unlink(missing_ok=True)
    return unseen > 0


def _error_file(root: Path, token: str) -> Path:
    return root / f".error-{token}"


def _build_guarded(cfg: Config, path: Path, fmt: str, key: dict[str, Any], tokenizer: Any, final: Path,
                   token: str, what: str) -> None:
    """Build; a failure is written where the waiting ranks look, so every rank stops with the same line."""
    try:
        build(cfg, path, fmt, key, tokenizer, final, what)
    except BaseException as e:
        msg = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
        _error_file(final.parent, token).write_text(json.dumps({"config_error": isinstance(e, ConfigError),
                                                                "message": msg}))
        raise


def _wait(final: Path, root: Path, token: str, what: str) -> None:
    """Poll the filesystem, not a collective: a long build must not trip the collective timeout. A builder
    that dies takes the job down through the launcher; one that fails says why in the error file."""
    err = _error_file(root, token)
    t0 = time.monotonic()
    while not (final / DONE).is_file():
        if err.is_file():
            rec = json.loads(err.read_text())
            if rec.get("config_error"):
                raise ConfigError(rec["message"])
            raise RuntimeError(f"{what}: building the data cache failed on another rank: {rec['message']}")
        time.sleep(0.2)
    if dist.local_rank() == 0 and dist.rank() != 0:
        print(f"{what}: rank {dist.rank()} waited {time.monotonic() - t0:.1f} s for the data cache {final}", flush=True)


def _features(task: str, packed: bool) -> Any:
    """int32 tokens (half of what Arrow infers from Python ints): what the cache stores and maps."""
    from datasets import Features, Sequence, Value

    tokens = Sequence(Value("int32"))
    cols = {"input_ids": tokens, "labels": Value("int64") if task == "seq_cls" else tokens}
    cols |= {"seq_lens": tokens} if packed else {"status": Value("int8")}
    return Features(cols)


def build(cfg: Config, path: Path, fmt: str, key: dict[str, Any], tokenizer: Any, final: Path,
          what: str = "data.source") -> dict[str, Any]:
    """Tokenize `path` into `final` (atomically: a temporary directory renamed at the end).

    The map writes its Arrow files straight into the cache directory (`cache_file_name`), and those files
    are the cache: no second copy with `save_to_disk`. Rows that cannot train are filtered out, which
    costs one flattening copy only when there are some."""
    import datasets
    import numpy as np

    d = cfg.data
    tmp = final.parent / f"{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    out = tmp / "data"
    out.mkdir(parents=True)
    num_proc = d.num_proc or max(1, min(os.cpu_count() or 1, 16))
    t0 = time.perf_counter()
    datasets.utils.logging.enable_progress_bar()
    print(f"{what}: tokenizing {path} into {final} ({fmt}, {num_proc} process{'es' * (num_proc > 1)}); "
          "later launches reuse it", file=sys.stderr, flush=True)
    try:
        raw = datasets.load_dataset(KINDS[path.suffix], data_files=str(path), split="train",
                                    cache_dir=str(tmp / "hf"))
        procs = num_proc if len(raw) >= 20_000 else None  # below that, starting workers costs more than it saves
        fn = Tokenize(tokenizer, fmt, cfg.model.task, d.seq_len, d.prompt_field, d.response_field, d.text_field,
                      d.label_field, d.messages_field)
        # an explicit fingerprint: hashing the function would serialize the whole tokenizer for nothing
        ds = raw.map(fn, batched=True, batch_size=1000, num_proc=procs, remove_columns=raw.column_names,
                     features=_features(cfg.model.task, False), cache_file_name=str(out / "tokens.arrow"),
                     writer_batch_size=WRITER_BATCH,
                     new_fingerprint=f"{key_name(key)}-tok", desc="tokenize")
        per_row = np.asarray(ds.with_format("numpy")["status"])
        status = np.bincount(per_row, minlength=6)
        _refuse_bad_rows(status, cfg, path, what)
        if status[OK] + status[TRUNCATED] == 0:
            raise ConfigError(f"{what}: {path} produced no training samples (every row is shorter than 2 tokens "
                              "or has nothing to learn within data.seq_len)")
        # Rows that cannot train stay in the file and are skipped through an index of the ones that can
        # (memory-mapped .npy, 8 bytes a row): dropping them from the Arrow data would copy all of it.
        index = None
        if status[OK] + status[TRUNCATED] < len(ds):
            index = "kept.npy"
            np.save(out / index, np.flatnonzero(per_row <= TRUNCATED))
        if packing(cfg)[0]:  # packing reads the rows in order anyway: it skips those rows itself, and needs no index
            ds = ds.map(pack_batch, batched=True, batch_size=4000, num_proc=procs, fn_kwargs={"block": d.seq_len},
                        remove_columns=ds.column_names, features=_features(cfg.model.task, True),
                        cache_file_name=str(out / "packed.arrow"), writer_batch_size=WRITER_BATCH,
                        new_fingerprint=f"{key_name(key)}-pack", desc="pack")
            index = None
        else:
            ds = ds.remove_columns("status")
        files = [Path(f["filename"]).name for f in ds.cache_files]
        for f in out.iterdir():  # the intermediate files the final dataset does not read
            if f.name not in [*files, index]:
                f.unlink()
        samples = len(ds) if index is None else int(status[OK] + status[TRUNCATED])
        info = {"key": key, "files": files, "columns": ds.column_names, "index": index, "samples": samples,
                "tokens": _token_count(ds, None if index is None else np.load(out / index)), "rows": len(raw),
                "truncated": int(status[TRUNCATED]),
                "dropped": int(status[NOTHING_TO_LEARN]), "build_s": time.perf_counter() - t0,
                "num_proc": num_proc, "format": fmt}
        _say_counts(info, cfg, what)
        shutil.rmtree(tmp / "hf", ignore_errors=True)
        (out / DONE).write_text(json.dumps(info, indent=1) + "\n")
        try:
            os.rename(out, final)
        except OSError:
            if not (final / DONE).is_file():  # another launch won the race with a complete cache: use it
                raise
        print(f"{what}: {info['samples']:,} samples, {info['tokens']:,} tokens, cached in {info['build_s']:.1f} s",
              file=sys.stderr, flush=True)
        return info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_cache(final: Path) -> tuple[Any, Any, dict[str, Any]]:
    """(rows, index of the trainable rows or None, info): the cache's Arrow files and index, memory-mapped."""
    import numpy as np
    from datasets import Dataset, concatenate_datasets

    info = json.loads((final / DONE).read_text())
    parts = [Dataset.from_file(str(final / f), in_memory=False) for f in info["files"]]
    ds = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    index = np.load(final / info["index"], mmap_mode="r") if info.get("index") else None
    return ds.select_columns(info["columns"]), index, info


def _token_count(ds: Any, index: Any = None) -> int:
    """From the Arrow list offsets: no token is read into Python."""
    import numpy as np
    import pyarrow.compute as pc

    lengths = np.asarray(pc.list_value_length(ds.data.column("input_ids")))
    return int(lengths.sum() if index is None else np.asarray(lengths)[index].sum())


def _refuse_bad_rows(status: Any, cfg: Config, path: Path, what: str) -> None:
    problems = []
    if status[UNKNOWN_ROLE]:
        problems.append(f"{status[UNKNOWN_ROLE]:,} rows have a role outside {', '.join(ROLES)}")
    if status[MALFORMED]:
        problems.append(f"{status[MALFORMED]:,} rows are not a non-empty list of {{\"role\", \"content\"}} "
                        f"messages in {cfg.data.messages_field!r}")
    if status[TEMPLATE_UNSTABLE]:
        problems.append(f"{status[TEMPLATE_UNSTABLE]:,} conversations render differently in part and in "
                        "full with the tokenizer's chat template, so the assistant turns cannot be located")
    if problems:
        raise ConfigError(f"{what}: {path}: " + "; ".join(problems) + " (fix or remove those rows)")


def _say_counts(info: dict[str, Any], cfg: Config, what: str) -> None:
    n = cfg.data.seq_len
    if info["truncated"]:
        how = ("were split into samples of at most" if info["format"] == "text" and cfg.model.task != "seq_cls"
               else "were truncated to")
        print(f"{what}: {info['truncated']:,} of {info['rows']:,} rows are longer than data.seq_len={n} and "
              f"{how} {n} tokens", file=sys.stderr, flush=True)
    if info["dropped"]:
        print(f"{what}: {info['dropped']:,} of {info['rows']:,} rows were dropped: nothing to learn within "
              f"data.seq_len={n} (a prompt that fills it, or fewer than 2 tokens)", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- cheap checks before launch


def file_columns(path: Path, what: str = "data.source") -> set[str]:
    from toolkit.runtime.data.jsonl import read_objects

    if path.suffix == ".txt":
        return {"text"}
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return set(pq.read_schema(path).names)
    for _, row in read_objects(path, what):
        return set(row)  # the first object names the columns
    raise ConfigError(f"{what}: {path} is empty")


def check_format(cfg: Config, fmt: str, columns: set[str], tokenizer: Any | None, path: Path, what: str) -> None:
    """One line for each setting that cannot work, before any tokenizing."""
    d = cfg.data
    if cfg.model.task == "seq_cls":
        need = [d.text_field, d.label_field]
        if not all(c in columns for c in need):
            raise ConfigError(f"{what}: {path} has columns {sorted(columns)}; expected "
                              f"{' and '.join(map(repr, need))} (set data.text_field / data.label_field)")
        return
    need = {"prompt_response": [d.prompt_field, d.response_field], "text": [d.text_field],
            "messages": [d.messages_field]}[fmt]
    if not all(c in columns for c in need):
        raise ConfigError(f"{what}: {path} has columns {sorted(columns)}; data.format={fmt} needs "
                          f"{' and '.join(map(repr, need))} (set data.format, or data.prompt_field / "
                          "data.response_field / data.text_field / data.messages_field)")
    if tokenizer is None:
        return
    if fmt == "messages":
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{what}: data.format=messages needs a chat template, and the tokenizer "
                              f"({getattr(tokenizer, 'name_or_path', '?')}) has none; add \"chat_template\" to its "
                              "tokenizer_config.json, or use data.format=prompt_response")
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{what}: data.format=messages needs a fast tokenizer (tokenizer.json) to map the "
                              "assistant turns to tokens")
