"""Test tiers: unit (pure, seconds), dist (real DeepSpeed on 2 CPU ranks), gpu(n) (skipped without n GPUs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests that launch DeepSpeed in this process tree run on the CPU accelerator unless GPUs exist.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = None
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        if have is None:
            have = _gpu_count()
        need = marker.args[0] if marker.args else 1
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {have}"))


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_shm_buffers() -> object:
    """DeepSpeed's CPU shm comm op leaves a 66 MiB /dev/shm buffer per rank and port behind, and killed
    ranks (the fault tests) leave theirs too: across runs they fill /dev/shm, and then RAM. Remove the
    ones this session created, once every launched process is gone, and none that a live process still
    maps (another test session running beside this one: its ranks open their peers' buffers by name)."""
    from pathlib import Path

    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_allreduce_buffer_*")) if shm.is_dir() else set()
    yield
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped |= {line.split()[-1] for line in maps.read_text().splitlines() if "deepspeed_allreduce" in line}
        except OSError:  # the process ended while we looked
            continue
    for f in set(shm.glob("deepspeed_allreduce_buffer_*")) - before if shm.is_dir() else ():
        if str(f) not in mapped:
            f.unlink(missing_ok=True)


CHAT_WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "log", "what", "did", "do", "answer", "question",
              "yes", "no", "user", "assistant", "system", ":", "be", "brief", "hello", "where", "is", "it"]
# A ChatML-like template written for the word-level test tokenizer: every marker is a vocabulary word.
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant : {% endif %}")


def write_tokenizer(out: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A small local word-level tokenizer (file data needs one, and nothing may be downloaded), with a
    chat template unless told otherwise."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *CHAT_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")
