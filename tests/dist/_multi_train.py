"""Run several trainings in one `deepspeed` launch (2 CPU ranks), one after another.

Each run is a full `toolkit.train.main(argv)`; sharing the launch saves ~30 s of process start and
imports per run, which keeps the distributed suite inside CI's budget. Usage (the launcher inserts
--local_rank first):  deepspeed --num_gpus 2 tests/dist/_multi_train.py RUNS.json
RUNS.json: [{"name": str, "argv": [...], "expect_rc": 0, "partial": "checkpoints/x", "kill_rank": 1}, ...];
results go to each run's own run_dir. "expect_rc": the exit code the run must give (a refused run: 1). "partial": a
checkpoint directory rank 0 leaves half-written under the run_dir first, as a save killed mid-way would.
"kill_rank": that rank is SIGKILLed once the run has started (a fault injected into the launch itself). "env":
variables set for that run alone (a TOOLKIT_FAULT_* hook).

With TOOLKIT_TEST_OUTCOMES=PREFIX (tests/dist/_launch.py sets it), each rank appends a line to PREFIX.rankN.jsonl
when a run starts and when it ends ({"i", "name", "rc", "expect_rc", "error"}): the launch reads which runs ended as
they should, and where its processes ended when one did not.
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[2])  # repo root, as toolkit/train.py does


def reset_accelerate() -> None:
    # Accelerate keeps one process-wide state (incl. the DeepSpeed plugin) across Trainer instances;
    # a new run with another ZeRO config needs it cleared. The process group itself is kept.
    try:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    except ImportError:
        pass
    # and torch.compile's state as a new process has it: each run compiles its own layers, not counted against
    # the graphs dynamo keeps per function (torch._dynamo.config.recompile_limit) by the runs before it
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def record(**fields: object) -> None:
    """One line of this rank's outcomes, flushed to the disk at once: the process may be killed next."""
    prefix = os.environ.get("TOOLKIT_TEST_OUTCOMES")
    if not prefix:
        return
    with open(f"{prefix}.rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
        f.write(json.dumps(fields) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _status_error(run: dict) -> str | None:
    """The error a run's status.json names, for the outcome line of a run that ended otherwise than expected."""
    run_dir = next((Path(a.split("=", 1)[1]) for a in run["argv"] if a.startswith("train.run_dir=")), None)
    try:
        return str(json.loads((run_dir / "status.json").read_text()).get("error"))[:500] if run_dir else None
    except (OSError, ValueError):
        return None


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    runs = json.loads(Path(args[0]).read_text())
    from toolkit import train

    failed = 0
    for i, run in enumerate(runs):
        index, expect = run.get("i", i), run.get("expect_rc", 0)
        record(i=index, name=run["name"], event="start")
        reset_accelerate()
        # one write, on a line of its own: both ranks print the marker at once into one log, and print()'s text and
        # newline are two writes when unbuffered, so two markers could run together on one line (CI saw it)
        sys.stdout.write(f"\n=== run {run['name']}\n")
        sys.stdout.flush()
        if run.get("partial") and int(os.environ.get("RANK", "0")) == 0:
            run_dir = next(Path(a.split("=", 1)[1]) for a in run["argv"] if a.startswith("train.run_dir="))
            partial = run_dir / run["partial"]
            partial.mkdir(parents=True)
            (partial / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"cut off mid-write")
        if run.get("kill_rank") == int(os.environ.get("RANK", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
        error, saved = None, {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        try:
            rc = train.main(run["argv"])
        except Exception as e:  # record and go on: the test reads status.json per run
            print(f"=== run {run['name']} raised {type(e).__name__}: {e}", flush=True)
            rc, error = 1, f"{type(e).__name__}: {e}"[:500]
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if rc != expect and error is None:
            error = _status_error(run)
        record(i=index, name=run["name"], rc=rc, expect_rc=expect, error=error)
        failed += rc != expect
    return 1 if failed else 0


if __name__ == "__main__":
    from toolkit.launch import dist

    dist.exit_process(main())  # as toolkit/train.py: no interpreter finalization, where gloo's threads can abort
