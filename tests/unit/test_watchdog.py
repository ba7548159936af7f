"""The watchdog's decisions in one process (toolkit/runtime/faults/watchdog.py): rank 0 of a 2-rank job against a
real TCPStore, rank 1 played by the test writing its beats. The judge thread is replaced so that nothing
here ends the test process; tests/dist/test_faults.py and test_multinode_faults.py run the real thing."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from toolkit.runtime.faults import watchdog
from toolkit.runtime.faults.watchdog import _PREFIX, Watchdog


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int,
              run_id: str = "") -> Iterator[tuple[Watchdog, TCPStore]]:
    port = _port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": str(world)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(Watchdog, "_judge", lambda self: None)  # decisions are called by hand below
    dog = Watchdog(tmp_path, heartbeat_timeout_s=2, collective_timeout_s=5, where=lambda: ("train", 3), run_id=run_id)
    yield dog, master
    dog.stop.set()


@pytest.fixture
def wd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Watchdog, TCPStore]]:
    yield from _watchdog(tmp_path, monkeypatch, 2)


def _beat(store: TCPStore, n: int, pid: int = 999_999, host: str = "elsewhere", t: float | None = None) -> None:
    store.set(_PREFIX + "beat/1", json.dumps({"n": n, "pid": pid, "host": host, "start": 0.0, "step": 3,
                                              "phase": "train", "bye": False, "t": time.time() if t is None else t}))


def test_a_peer_whose_beats_stop_is_lost_after_the_timeout(wd: tuple[Watchdog, TCPStore]) -> None:
    dog, store = wd
    assert dog.beat_s == 0.5
    for n in range(1, 6):  # alive for a while: never lost, never late
        _beat(store, n)
        time.sleep(0.3)
        assert dog._lost(time.monotonic()) == {} and dog._late(time.monotonic()) == []
    silent = time.monotonic()  # from here: late first (three beats), then lost (heartbeat_timeout_s)
    while not dog._late(time.monotonic()):
        assert dog._lost(time.monotonic()) == {} and time.monotonic() - silent < 3
        time.sleep(0.05)
    while not (lost := dog._lost(time.monotonic())):
        assert time.monotonic() - silent < 4
        time.sleep(0.05)
    assert time.monotonic() - silent > 2.0  # never before heartbeat_timeout_s
    assert list(lost) == [1] and lost[1].startswith("no heartbeat for"), lost


def test_a_local_peer_that_is_gone_is_lost_at_once_unless_it_left_a_note(wd: tuple[Watchdog, TCPStore]) -> None:
    import subprocess
    import sys

    dog, store = wd
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone, on this host
    _beat(store, 1, pid=child.pid, host=dog.host)
    time.sleep(1.2)
    assert dog._lost(time.monotonic()) == {1: "its process is gone"}
    dog._marker(1).write_text(json.dumps({"pid": child.pid, "start": 0.0, "kind": "failed", "why": "ValueError: x"}))
    assert dog._lost(time.monotonic()) == {}  # it failed on its own: the job ends through that, not as a loss
    dog._marker(1).write_text(json.dumps({"pid": child.pid, "start": 0.0, "kind": "watchdog", "why": "x", "lost": {"0": "y"}}))
    assert dog._lost(time.monotonic()) == {1: "its process is gone"}  # it names me lost: I am not; it is


def test_the_hang_deadline_covers_steps_only_and_scales_with_the_slowest(wd: tuple[Watchdog, TCPStore]) -> None:
    dog, _ = wd
    dog.step_begin(1)
    assert dog.armed_at is None  # the first step compiles and allocates: no deadline
    time.sleep(0.05)
    dog.step_end()
    dog.step_begin(2)
    assert dog.armed_at is not None and dog.deadline_s() == 5.0
    time.sleep(0.1)
    dog.step_end()
    assert dog.armed_at is None  # a save or an eval after the step runs unarmed
    assert 5.15 < dog.deadline_s() < 5.5  # collective_timeout_s + twice the slowest step
    n, t0 = 2000, time.perf_counter()
    for step in range(3, 3 + n):
        dog.step_begin(step)
        dog.step_end()
    per_step_us = (time.perf_counter() - t0) / n * 1e6
    print(f"watchdog cost per step (arm + disarm, faulthandler timer included): {per_step_us:.0f} us")
    assert per_step_us < 1000, per_step_us


def test_a_communication_error_waits_for_every_peer_to_answer_then_leaves_a_note(
        wd: tuple[Watchdog, TCPStore], monkeypatch: pytest.MonkeyPatch) -> None:
    dog, store = wd
    beating = threading.Event()
    beating.set()

    def peer() -> None:
        n = 0
        while beating.is_set():
            n += 1
            _beat(store, n)
            time.sleep(0.2)
    t = threading.Thread(target=peer, daemon=True)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    # a communication error may be a peer's death: wait until it beats again (here within a few beats)
    dog.failing(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    waited = time.monotonic() - t0
    assert 0.75 < waited < 3.0, waited
    beating.clear()
    note = json.loads(dog._marker(0).read_text())
    assert note["pid"] == os.getpid() and note["start"] == dog.me["start"] and note["kind"] == "failed" and "Connection reset" in note["why"]
    assert "Connection reset by peer" in json.loads(store.get(_PREFIX + "failed"))["error"]


def test_an_error_of_its_own_leaves_at_once(wd: tuple[Watchdog, TCPStore]) -> None:
    dog, store = wd
    _beat(store, 1)  # a peer that will never answer again: not waited for, a NaN is not its doing
    time.sleep(0.6)
    t0 = time.monotonic()
    dog.failing(ValueError("loss is NaN"))
    assert time.monotonic() - t0 < 1.0
    assert json.loads(dog._marker(0).read_text())["kind"] == "failed"


def test_module_functions_are_no_ops_without_a_watchdog() -> None:
    assert watchdog._current is None
    watchdog.step_begin(5)
    watchdog.step_end()
    watchdog.failing(RuntimeError("x"))
    watchdog.close()


@pytest.fixture
def wd3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Watchdog, TCPStore]]:
    """Rank 0 of a 3-rank job: rank 1 on this host, rank 2 on another (issue 33's layout)."""
    yield from _watchdog(tmp_path, monkeypatch, 3)


def test_a_peer_its_watchdog_ended_after_a_failure_is_not_blamed_for_a_dead_host(
        wd3: tuple[Watchdog, TCPStore]) -> None:
    """Issue 33: node1 (rank 2) dies; rank 1 on this host leaves on the communication error it caused (its
    watchdog ending it after another rank's failure) before rank 2's heartbeat has run out. The verdict must
    wait for that heartbeat and name rank 2, with rank 1 as ended after it; it named rank 1, gone."""
    dog, store = wd3
    local = {"pid": 999_999, "start": 5.0, "host": dog.host}  # a pid that no longer exists, on this host
    for n in range(1, 4):  # both peers beat for a while
        store.set(_PREFIX + "beat/1", json.dumps({**local, "n": n, "step": 3, "phase": "train", "bye": False}))
        _beat3(store, n)
        time.sleep(0.3)
    (dog.run_dir / "logs").mkdir(exist_ok=True)
    dog._marker(1).write_text(json.dumps({**{k: local[k] for k in ("pid", "start")}, "kind": "watchdog",
                                          "why": "rank 2 on elsewhere failed (RuntimeError: Connection reset by "
                                                 "peer) and this rank was still running 39 s later; ending it",
                                          "lost": {}, "peer": False}))
    silent = time.monotonic()  # rank 2 beats no more; rank 1's process is gone, with its note
    time.sleep(0.7)
    assert dog._lost(time.monotonic()) == {}  # before rank 2's timeout: nobody, and never rank 1
    while not (lost := dog._lost(time.monotonic())):
        assert time.monotonic() - silent < 4
        time.sleep(0.05)
    assert list(lost) == [2] and "no heartbeat" in lost[2], lost
    assert list(dog._ended_after(lost)) == [1] and "its watchdog ended it" in dog._ended_after(lost)[1]


def test_after_a_communication_error_a_running_rank_waits_for_the_heartbeat(wd3: tuple[Watchdog, TCPStore]) -> None:
    dog, _ = wd3
    dog.timeout_s, dog.beat_s = 30.0, 3.0  # the defaults: heartbeat_timeout_s=30
    assert dog._grace({"rank": 1, "error": "loss is NaN", "peer": False}) == watchdog.FAILED_GRACE_S
    assert dog._grace({"rank": 1, "error": "Connection reset by peer", "peer": True}) == 39.0  # past the timeout
    dog.failed_verdict = {"rank": 1, "host": "x", "error": "Connection reset by peer", "peer": True}
    dog.verdict_seen = time.monotonic() - 20  # 20 s after it: the old 10 s grace would end this rank here
    assert dog._failed(time.monotonic()) is None
    dog.verdict_seen = time.monotonic() - 40
    assert dog._failed(time.monotonic()) == dog.failed_verdict


def _beat3(store: TCPStore, n: int) -> None:
    store.set(_PREFIX + "beat/2", json.dumps({"n": n, "pid": 999_998, "host": "elsewhere", "start": 0.0, "step": 3,
                                              "phase": "train", "bye": False, "t": time.time()}))


def test_a_peer_its_watchdog_ended_does_not_keep_the_others_from_ending(wd3: tuple[Watchdog, TCPStore]) -> None:
    """The other side of the change above: rank 1 ended by its watchdog after rank 2's failure (a NaN, say) is
    not lost, and not late either, so this rank still ends on that failure after its grace."""
    dog, store = wd3
    local = {"pid": 999_999, "start": 5.0, "host": dog.host}
    for n in range(1, 4):
        store.set(_PREFIX + "beat/1", json.dumps({**local, "n": n, "step": 3, "phase": "train", "bye": False}))
        _beat3(store, n)
        time.sleep(0.3)
    (dog.run_dir / "logs").mkdir(exist_ok=True)
    dog._marker(1).write_text(json.dumps({"pid": 999_999, "start": 5.0, "kind": "watchdog", "lost": {}, "peer": False,
                                          "why": "rank 2 on elsewhere failed (ValueError: loss is NaN) ..."}))
    dog.failed_verdict = {"rank": 2, "host": "elsewhere", "error": "ValueError: loss is NaN", "peer": False}
    dog.verdict_seen = time.monotonic() - watchdog.FAILED_GRACE_S - 1
    for n in range(4, 10):  # rank 2 still beats (it is failing slowly); rank 1 is gone with its note
        _beat3(store, n)
        time.sleep(0.3)
        now = time.monotonic()
        assert dog._lost(now) == {} and dog._late(now) == [] and dog._failed(now) == dog.failed_verdict


def test_a_dead_peers_last_beat_noticed_late_is_no_answer(wd: tuple[Watchdog, TCPStore]) -> None:
    """Under load rank 0's thread can notice a peer's last beat seconds late and give it an age near 0 after another
    rank's error began: only the beat's own time counts (a CI run left on such a beat before the verdict)."""
    dog, store = wd
    began = time.time()
    _beat(store, 7, t=began - 0.5)  # written before the error, by a peer that died since
    time.sleep(1.2)  # rank 0 (this watchdog's io thread) reads it now: age about 0 in the new view
    # the view ages the beat from when rank 0 noticed it, after it was written: at least the 0.5 s it was written
    # late younger than its own time says (a bound on the noticing, where `< 1.0` raced the 0.5 s beat tick)
    assert dog._age(1) <= time.time() - (began - 0.5) - 0.4 and not dog._answered_since(began)
    _beat(store, 8)  # a live peer's next beat, written now: more than ANSWER_SKEW_S after the error
    time.sleep(1.2)
    assert dog._answered_since(began)


def test_a_run_after_a_failed_one_in_the_same_processes_is_not_ended_by_its_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 83: a NaN run's "failed" verdict stayed in the rendezvous store, which outlives a run, and the next run
    of the same processes (a shared test launch, a library user training twice) read it as its own: every rank
    ended it once the grace ran out, with the old run's message ("NaN/Inf at step 3", its samples). A Muon run
    compiling for more than the grace after a NaN run died so on a fresh machine. Each run's keys are its own."""
    monkeypatch.setattr(watchdog, "FAILED_GRACE_S", 0.2)
    first = _watchdog(tmp_path / "first", monkeypatch, 2, run_id="run-a")
    dog, store = next(first)
    dog._publish("failed", {"rank": 1, "host": "elsewhere", "error": "NonFiniteError: NaN at step 3", "peer": False})
    assert json.loads(store.get(_PREFIX + "run-a/failed"))["rank"] == 1
    dog.stop.set()
    # the next run: same store, same rank 0; its peer beats on, and nobody failed in this run
    port = os.environ["MASTER_PORT"]
    monkeypatch.setattr(Watchdog, "_judge", lambda self: None)
    again = Watchdog(tmp_path / "second", heartbeat_timeout_s=2, collective_timeout_s=5, where=lambda: ("train", 1),
                     run_id="run-b")
    try:
        assert os.environ["MASTER_PORT"] == port
        deadline = time.monotonic() + 3
        while not again.view and time.monotonic() < deadline:  # the I/O thread has read the store at least once
            time.sleep(0.1)
        time.sleep(1.0)  # several reads later, past the grace
        assert again.view and again.failed_verdict is None
        assert again._failed(time.monotonic()) is None
    finally:
        again.stop.set()
