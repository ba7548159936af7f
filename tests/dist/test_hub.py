"""Hub ids (issue 79) through the real clients against a stand-in hub on 127.0.0.1 (tests/hub_server.py): a run by
id on 2 CPU ranks fetches each file once per node and pins the commit, its rerun offline sends no request, plan and
check fetch config.json alone, and every failure ends in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from _launch import write_chat
from _net import free_port
from conftest import write_tokenizer
from hub_server import Hub, use_in_process

ROOT = Path(__file__).resolve().parents[2]
ID = "acme/tiny"


def _tiny(out: Path, **extra: object) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Hub:
    tmp = tmp_path_factory.mktemp("hub")
    h = Hub(tmp / "repos")
    model = _tiny(tmp / "model")
    h.sha = h.add(ID, model)  # type: ignore[attr-defined]
    h.tag(ID, "v1", h.sha)  # type: ignore[attr-defined]
    bin_only = tmp / "bin-only"
    shutil.copytree(model, bin_only)
    (bin_only / "model.safetensors").unlink()
    (bin_only / "pytorch_model.bin").write_bytes(b"not read")
    h.add("acme/bin-only", bin_only)
    custom = tmp / "custom"
    shutil.copytree(model, custom)
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_acme.AcmeConfig"}
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "configuration_acme.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass AcmeConfig(LlamaConfig):\n    model_type = 'llama'\n")
    h.add("acme/custom", custom)
    chat = tmp / "chat"
    (chat / "data").mkdir(parents=True)
    write_chat(chat / "data" / "train.jsonl")
    (chat / "README.md").write_text("a chat dataset\n")
    h.data_sha = h.add("acme/chat", chat, kind="dataset")  # type: ignore[attr-defined]
    for repo, code in (("acme/gated", 403), ("acme/login", 401), ("acme/busy", 429)):
        h.add(repo, model)
        h.fail[repo] = code
    with h.serving():
        yield h


def _files_fetched(hub: Hub, method: str = "GET") -> Counter:
    return Counter(p.rsplit("/", 1)[1] for m, p in hub.requests if m == method and "/resolve/" in p)


def _launch(hub: Hub, home: Path, run_dir: Path, *extra: str, offline: bool = False) -> subprocess.CompletedProcess:
    env = os.environ | hub.env_for(home, offline) | {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "toolkit/train.py",
           "--ds", "ds_configs/zero2.json", f"model.name={ID}", "train.max_steps=3", "train.export=false",
           "memory.every=0", "metrics.tensorboard=false", f"train.run_dir={run_dir}", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
                          stdin=subprocess.DEVNULL)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_a_run_by_id_fetches_each_file_once_per_node_pins_the_commit_and_reruns_offline(hub: Hub,
                                                                                         tmp_path: Path) -> None:
    home = tmp_path / "home"
    hub.requests.clear()
    out = _launch(hub, home, tmp_path / "run", "model.revision=v1", "data.source=acme/chat", "data.seq_len=48")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    fetched = _files_fetched(hub)
    assert fetched and set(fetched.values()) == {1}, hub.requests  # two ranks, one node: each file once
    assert "model.safetensors" in fetched and "tokenizer.json" in fetched
    assert "train.jsonl" in fetched  # the dataset's file, once too
    assert sorted(p for m, p in hub.requests if "/api/" in p) == sorted([  # once, not per rank
        f"/api/models/{ID}/revision/v1", f"/api/models/{ID}/tree/{hub.sha}",
        "/api/datasets/acme/chat/revision/main", f"/api/datasets/acme/chat/tree/{hub.data_sha}"]), hub.requests
    record = json.loads((tmp_path / "run" / "resolved.json").read_text())["hub"]
    assert sorted((h["id"], h["revision"], h["sha"], h["offline"], h["files"]) for h in record) == [
        ("acme/chat", None, hub.data_sha, False, "dataset"), (ID, "v1", hub.sha, False, "model")]
    assert f"{ID}: revision v1 = commit {hub.sha}, model files from the hub" in out.stdout

    hub.requests.clear()
    again = _launch(hub, home, tmp_path / "offline", "model.revision=v1", "data.source=acme/chat", "data.seq_len=48",
                    offline=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert hub.requests == []  # the rerun sends nothing
    record = json.loads((tmp_path / "offline" / "resolved.json").read_text())["hub"]
    assert {h["sha"] for h in record} == {hub.sha, hub.data_sha} and all(h["offline"] for h in record)
    assert "data.source: reusing the tokenized cache" in again.stdout  # the same commit: tokenized once


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_a_gated_id_stops_every_rank_in_one_line_within_seconds(hub: Hub, tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = subprocess.run(
        ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "toolkit/train.py", "--ds",
         "ds_configs/zero2.json", "model.name=acme/gated", f"train.run_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=os.environ | hub.env_for(tmp_path / "home") | {"DS_ACCELERATOR": "cpu"}, capture_output=True,
        text=True, timeout=300, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    errors = [x for x in (out.stdout + out.stderr).splitlines() if x.startswith("error:")]
    assert out.returncode != 0 and len(errors) == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "model.name=acme/gated: the repository is gated (403): set HF_TOKEN" in errors[0]
    assert not (tmp_path / "run").exists() and took < 60, took  # nothing written; the launcher's start included


# ----------------------------------------------------------------------------- one process: plan, check, errors


@pytest.fixture
def here(hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The clients of this process pointed at the stand-in hub with a cold HF_HOME; `here(offline=True)` again."""
    from toolkit.hub import snapshot

    def use(offline: bool = False, home: Path | None = None) -> Path:
        home = home or tmp_path / "home"
        use_in_process(monkeypatch, hub.env_for(home, offline))
        monkeypatch.setattr(snapshot, "_resolved", {})
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        hub.requests.clear()
        return home

    return use


def _cli(*argv: str) -> tuple[int, list[str]]:
    import contextlib
    import io

    from toolkit.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(list(argv))
    return rc, buf.getvalue().splitlines()


def test_plan_and_check_by_id_fetch_the_config_alone(hub: Hub, here, tmp_path: Path) -> None:
    here()
    rc, lines = _cli("plan", "--model", ID, "--gpus", "8", "--gpu-mem", "80", "--seq", "2048", "--global-batch", "64")
    assert rc == 0, lines
    assert _files_fetched(hub) == Counter({"config.json": 1}), hub.requests
    here(home=tmp_path / "cold")
    rc, lines = _cli("check", "ds_configs/zero2.json", "--explain", f"model.name={ID}")
    assert rc == 0, lines
    assert _files_fetched(hub) == Counter({"config.json": 1}), hub.requests
    assert any(f"{ID}: revision the default branch = commit {hub.sha}, config.json from the hub" in x for x in lines)


@pytest.mark.parametrize(("name", "extra", "want"), [
    ("acme/gated", [], "model.name=acme/gated: the repository is gated (403): set HF_TOKEN"),
    ("acme/login", [], "model.name=acme/login: the repository is gated (401): set HF_TOKEN"),
    ("acme/missing", [], "model.name=acme/missing: repository not found on http://127.0.0.1:"),
    (ID, ["model.revision=v9"], "model.name=acme/tiny (model.revision=v9): revision 'v9' not found"),
    ("acme/busy", [], "model.name=acme/busy: the hub rate-limits this machine (429)"),
    ("acme/custom", [], "its config asks for the repository's own Python (auto_map); set model.trust_remote_code=true"),
])
def test_each_failure_is_one_line(hub: Hub, here, name: str, extra: list[str], want: str) -> None:
    here()
    t0 = time.monotonic()
    rc, lines = _cli("check", "ds_configs/zero2.json", "--explain", f"model.name={name}", *extra)
    errors = [x for x in lines if x.startswith("error:")]
    assert rc == 1 and len(errors) == 1 and want in errors[0], lines
    assert time.monotonic() - t0 < 30


def test_offline_and_not_cached_names_the_cache_and_the_command_that_fetches_it(hub: Hub, here) -> None:
    home = here(offline=True)
    rc, lines = _cli("check", "ds_configs/zero2.json", "--explain", f"model.name={ID}")
    errors = [x for x in lines if x.startswith("error:")]
    assert rc == 1 and len(errors) == 1, lines
    assert f"offline (HF_HUB_OFFLINE=1) and not in the cache {home / 'hub'}" in errors[0]
    assert f"`hf download {ID}`" in errors[0] and hub.requests == []


def test_bin_weights_only_are_refused_in_one_line(hub: Hub, here) -> None:
    here()
    from toolkit.config.ds_config import ConfigError
    from toolkit.hub import resolve

    with pytest.raises(ConfigError, match=r"has \.bin weights only \(pytorch_model\.bin\)"):
        resolve("acme/bin-only")


def test_custom_code_loads_with_trust_remote_code(hub: Hub, here) -> None:
    here()
    rc, lines = _cli("check", "ds_configs/zero2.json", "--explain", "model.name=acme/custom",
                     "model.trust_remote_code=true")
    assert rc == 0, lines
    assert _files_fetched(hub) == Counter({"config.json": 1, "configuration_acme.py": 1}), hub.requests
    assert any("model.trust_remote_code=true: acme/custom runs its repository's own Python" in x for x in lines)


def test_a_hand_made_cache_works_offline(tmp_path: Path, here) -> None:
    """The hub cache's layout written by hand (refs and a snapshot of plain files): by the default branch, a tag
    and the sha, with no request."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "hub" / "models--acme--local"
    _tiny(repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    (repo / "refs" / "v2").write_text(sha)
    for revision in (None, "v2", sha):
        here(offline=True, home=tmp_path / "cache")
        from toolkit.hub import resolve

        got = resolve("acme/local", revision)
        assert got.sha == sha and got.offline and Path(got.path) == repo / "snapshots" / sha
    from toolkit.config.schema import load_config
    from toolkit.runtime.model import build_tokenizer, model_config

    cfg = load_config(None, ["model.name=acme/local", "model.revision=v2"])
    assert model_config(cfg).hidden_size == 64 and build_tokenizer(cfg) is not None


def test_a_dataset_by_id_is_its_splits_file_and_a_new_commit_is_another_file(hub: Hub, here, tmp_path: Path) -> None:
    """The tokenize-once cache keys a file by its path and times: the snapshot's path holds the commit, so a new
    commit of the dataset is read (and tokenized) again, the same one reuses its cache."""
    from toolkit.hub.datasets import local_source

    here()
    first = local_source("acme/chat", "train", None, "data.source")
    assert first.endswith(f"/snapshots/{hub.data_sha}/data/train.jsonl")
    changed = tmp_path / "chat2"
    (changed / "data").mkdir(parents=True)
    write_chat(changed / "data" / "train.jsonl")
    (changed / "data" / "test.jsonl").write_text((changed / "data" / "train.jsonl").read_text())
    sha = hub.add("acme/chat2", changed, kind="dataset")
    here()
    assert local_source("acme/chat2", "test", None, "data.eval_source").endswith(f"/{sha}/data/test.jsonl")
    from toolkit.config.ds_config import ConfigError

    with pytest.raises(ConfigError, match="no file of split 'validation'"):
        local_source("acme/chat2", "validation", None, "data.source")
