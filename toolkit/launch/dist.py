"""Process-group helpers. `prepare_env` must run before deepspeed is first imported."""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import MutableMapping
from typing import Any, NoReturn


def prepare_env() -> list[str]:
    """Pick the accelerator and fix environment traps before `import deepspeed`; returns notes to print.

    DeepSpeed reads DS_ACCELERATOR once, at its first import, so this must come first.
    """
    import logging

    import torch

    # transformers and peft import torchao (a dependency, for train.precision=fp8) whenever it is installed;
    # its import logs a warning per optional CUDA extension a CPU-only torch cannot load, on every rank
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # ... and with torch >= 2.12 its float8 module registers enums that torch now handles itself: a deprecation
    # warning per enum per rank, about torchao's code, not the run's
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    notes: list[str] = []
    ranks_from_openmpi(os.environ)
    if not torch.cuda.is_available() and "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = "cpu"
        notes.append("no CUDA device: running on CPU (DS_ACCELERATOR=cpu, gloo)")
    try:
        from toolkit.launch.cuda_arch import sanitize_cuda_arch_list
    except ImportError:  # pragma: no cover - module ships with the toolkit
        return notes
    msg = sanitize_cuda_arch_list(os.environ)
    if msg:
        notes.append(msg)
    return notes


def ranks_from_openmpi(environ: MutableMapping[str, str]) -> bool:
    """Under mpirun (DeepSpeed's openmpi launcher) take RANK, WORLD_SIZE and LOCAL_RANK from
    OpenMPI's own variables; True when it did.

    DeepSpeed would find them with mpi4py (an MPI binding on every node, built against that
    MPI) and guess the master from `hostname -I` on rank 0. launch.sh passes MASTER_ADDR and
    MASTER_PORT with `-x`; only then is everything torch needs here, so only then do we map.
    """
    if "RANK" in environ or "OMPI_COMM_WORLD_RANK" not in environ or "MASTER_ADDR" not in environ:
        return False
    environ["RANK"] = environ["OMPI_COMM_WORLD_RANK"]
    environ["WORLD_SIZE"] = environ["OMPI_COMM_WORLD_SIZE"]
    environ["LOCAL_RANK"] = environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    environ.setdefault("MASTER_PORT", "29500")
    return True


def on_cpu() -> bool:
    return os.environ.get("DS_ACCELERATOR") == "cpu"


def init_distributed(timeout_s: int | None = None, gpu_limit_gib: float = 0.0) -> None:
    """The process group; `timeout_s` bounds how long a rank waits in a collective for a peer that is
    gone (DeepSpeed's default is 10 minutes, the HF Trainer's 30); `gpu_limit_gib` is memory.gpu_limit_gib."""
    import datetime

    import torch.distributed as tdist

    if on_cpu() and rank() == 0 and not (tdist.is_available() and tdist.is_initialized()):
        # DeepSpeed's CPU backend compiles a shared-memory op here: about a minute of silence on
        # a machine's first run, which looked like a hang before this line existed.
        print("starting the process group (gloo); on the first CPU run on a machine DeepSpeed compiles "
              "its shared-memory comm op here (about a minute, cached for later runs)", flush=True)
    if not (tdist.is_available() and tdist.is_initialized()) and local_rank() == 0:
        from toolkit.launch import oplocks

        # a build killed mid-way leaves its lock, and the shared-memory op built next would wait on it forever. One
        # process per host looks (another rank removing it first left rank 0 nothing to say); the others wait on the
        # lock in torch's FileBaton until it is gone
        oplocks.clear_stale(say=print)
    import deepspeed

    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu() else "nccl", **kw)
    release_deepspeed_shm()
    if not on_cpu():
        import torch

        torch.cuda.set_device(local_rank())
        limit_gpu_memory(gpu_limit_gib)


_gpu_limit_bytes: int | None = None


def limit_gpu_memory(gib: float) -> None:
    """memory.gpu_limit_gib on this rank's GPU (after set_device); 0 leaves the whole GPU."""
    global _gpu_limit_bytes
    if on_cpu() or (gib <= 0 and _gpu_limit_bytes is None):
        return
    import torch

    if gib <= 0:  # an earlier run in this process (tests share launches) capped it
        torch.cuda.set_per_process_memory_fraction(1.0)
        _gpu_limit_bytes = None
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    _gpu_limit_bytes = min(total, int(gib * 2**30))
    torch.cuda.set_per_process_memory_fraction(_gpu_limit_bytes / total)
    if rank() == 0:
        above = " (above the GPU: no cap)" if gib * 2**30 > total else ""
        print(f"memory.gpu_limit_gib={gib:g}: each rank's allocator capped at {_gpu_limit_bytes / 2**30:.1f} of the "
              f"GPU's {total / 2**30:.1f} GiB{above}", flush=True)


def gpu_memory_bytes(context_bytes: int = 0) -> int:
    """This rank's GPU as the run may use it: the whole GPU, or under memory.gpu_limit_gib the cap plus
    context_bytes (the cap holds the allocator; a CUDA context lives outside it: the planner's allowance for one)."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return total if _gpu_limit_bytes is None else min(total, _gpu_limit_bytes + context_bytes)


def release_deepspeed_shm() -> None:
    """Unlink the shared-memory files DeepSpeed's CPU allreduce made for this launch. Collective (a barrier)
    on a one-host CPU run under DeepSpeed's launcher (LOCAL_SIZE set); nothing elsewhere. Call it on every
    rank after the process group exists.

    Why by hand: with every rank on one host, DeepSpeed's CPU backend (its shm comm op, 0.19.8) creates one
    66 MB POSIX shared-memory file per rank, /dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_
    {MASTER_PORT}_{rank}, and never unlinks it (its shared_close is never called): every CPU launch left
    its ranks' buffers in RAM until reboot (tests/conftest.py clears a test session's at its end). On this
    project's 24 GiB test machine 332 of them (22 GiB of /dev/shm, from killed sessions and a running one)
    built up and the kernel's OOM killer ended a test run. Each rank maps every rank's file inside
    init_distributed, so after a barrier the names can go: the mappings stay valid, and the memory is freed
    when the last rank exits, also when it is killed."""
    world = world_size()
    if int(os.environ.get("LOCAL_SIZE", "0")) != world:
        return  # DeepSpeed makes the files only for a one-host group (shm_interface.cpp), one rank included
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or not (tdist.is_available() and tdist.is_initialized()):
        return
    tdist.barrier()  # every rank has mapped every file: it maps them all before init_distributed returns
    prefix = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
              f"{os.environ.get('MASTER_PORT', '')}")
    for r in range(tdist.get_world_size()):  # every rank's name, so a rank killed right here leaves none
        with contextlib.suppress(FileNotFoundError):  # another rank was first, or the op was not built
            os.unlink(f"{prefix}_{r}")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def device() -> Any:
    import torch

    return torch.device("cpu") if on_cpu() else torch.device("cuda", local_rank())


def seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum floats across ranks (no-op on one process)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_tensor(t: Any) -> Any:
    """Sum a tensor across ranks in place and return it; on NCCL the host does not wait for it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the object itself on one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank ([obj] on one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def exit_process(rc: int) -> NoReturn:
    """End a launched rank: destroy the process group, run the atexit handlers, flush, and leave
    without interpreter finalization.

    Why not a plain `raise SystemExit`: gloo's worker threads (pt_gloo_runloop, gloo_tcp_loop) outlive
    `destroy_process_group()` (seen on torch 2.13 with no ProcessGroup object left in Python), and tearing
    them down inside finalization sometimes aborts a finished run ("terminate called without an active
    exception", exit code -6: a completed ZeRO-3 offload run reported as failed by the launcher, in CI).
    Everything a run writes is closed before this point; the atexit handlers (logging's flush among them)
    still run."""
    import atexit

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # every rank, after the last collective
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # what normal exit runs first; finalization is what we skip
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(rc)


# How long the exit handler below releases the GIL: 75 launches of a two-rank gloo script whose last line
# is a collective, six processes on two cores, all exited 0 with 0.05 s and with 0.2 s; without it 10 of 20
# aborted. The margin is for busier hosts; it is paid once per process, at exit.
SETTLE_AT_EXIT_S = 0.2
_settle_registered = False


def settle_at_exit(seconds: float = SETTLE_AT_EXIT_S) -> None:
    """Register, once per process, an exit handler that sleeps `seconds` on a multi-rank run, for scripts
    the toolkit does not end itself (a plain HF Trainer script with `ToolkitCallback`). Later calls,
    whatever their `seconds`, do nothing.

    Why: gloo's worker threads (pt_gloo_runloop) drop their reference to a finished collective's tensors
    after the caller has been woken, and that drop takes the GIL. When the collective is the script's last
    act (the callback's memory table at train end, a final save), the main thread can reach interpreter
    finalization first; a thread that takes the GIL during finalization exits through C++ code that cannot
    unwind, and a finished rank aborts with "terminate called without an active exception" (exit -6;
    pytorch/pytorch#190489, open). Seen with gloo; NCCL's watchdog thread drops its finished work the same
    way and may be exposed too. atexit handlers run before finalization, so sleeping there hands the GIL to
    those threads. `destroy_process_group()` does not do it here: DeepSpeed's engine keeps the group alive,
    so its threads are not joined; for the same reason the handler goes by the world size, not by
    `is_initialized()`, which `Trainer.end()` (accelerate's `end_training`) turns False."""
    global _settle_registered
    if _settle_registered:
        return
    import atexit
    import time

    def settle() -> None:
        tdist = sys.modules.get("torch.distributed")  # never imports torch at exit
        if tdist is not None and (world_size() > 1 or (tdist.is_available() and tdist.is_initialized())):
            time.sleep(seconds)

    atexit.register(settle)
    _settle_registered = True


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def quiet_libraries() -> None:
    """DeepSpeed and transformers log at INFO on every rank; keep the console to our own lines."""
    import logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_warning()
    if rank() != 0:
        transformers.logging.set_verbosity_error()
