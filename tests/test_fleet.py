"""harness/fleet.py: the replica fleet's settings and checks, and the weight push, whose replicas receive at once.

The fleet's processes, connections and handshake are exercised through the scheduler in test_pipeline_rl.py and
test_wire.py; the push's real engines in test_weight_transfer.py and the end-to-end runs."""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import pipeline_rl
from harness import fleet

WAIT_S = 20.0  # far longer than a thread takes to start: reached only when the sends run one after the other


def _plan(*replicas: int) -> list[tuple]:
    """ReplicaPool.send_update's plan for `replicas`: (replica, name, bind host, workers, init, processes to watch)."""
    return [(r, f"replica {r}", "127.0.0.1", 1, True, []) for r in replicas]


def test_every_replica_receives_at_once_and_a_failed_one_is_named_while_the_others_finish(monkeypatch):
    """Replica 0's send blocks until replica 1's has begun, and replica 1's until replica 0's has: sent one after the
    other (as before), the first would wait in vain and fail. Replica 2's fails; it alone is named, with its error,
    and the others' sends complete."""
    push = fleet.WeightPush(fleet.FleetConfig(), model="no-such-model")
    began = {0: threading.Event(), 1: threading.Event()}
    finished, relayed = [], []

    def send_one(tensors, version, replica, bind_host, workers, init, watch, relay):
        if replica == 2:
            raise RuntimeError("replica 2 died during the weight broadcast")
        began[replica].set()
        relay(("weights", replica, "start", None))
        if not began[1 - replica].wait(WAIT_S):
            raise TimeoutError(f"replica {1 - replica}'s update never began while replica {replica}'s was under way")
        finished.append(replica)

    monkeypatch.setattr(push, "send_one", send_one)
    failed = push.send({}, 3, _plan(0, 1, 2), relayed.append)
    assert failed == {2: "RuntimeError: replica 2 died during the weight broadcast"}
    assert sorted(finished) == [0, 1] and sorted(m[1] for m in relayed) == [0, 1]


def test_a_generator_lost_during_a_push_is_raised_once_every_send_has_ended(monkeypatch):
    """The generator process gone (GeneratorError from the relay) is the learner's error, not one replica's: raised,
    after the other replicas' sends have ended."""
    push = fleet.WeightPush(fleet.FleetConfig(), model="no-such-model")
    ended = []

    def send_one(tensors, version, replica, bind_host, workers, init, watch, relay):
        if replica == 0:
            raise fleet.GeneratorError("generator process died (noticed while sending 'weights')")
        ended.append(replica)

    monkeypatch.setattr(push, "send_one", send_one)
    with pytest.raises(fleet.GeneratorError, match="generator process died"):
        push.send({}, 1, _plan(0, 1), lambda msg: None)
    assert ended == [1]


def test_the_engines_are_imported_while_the_generator_starts_not_at_the_first_push(monkeypatch):
    """vLLM's weight-transfer engines (harness/weight_transfer.py: 5-6 s of imports on a CPU core) were imported by
    step 1's push, which every rank waited for. Generator.start now has WeightPush.prepare import them in a thread,
    before it spawns the generator process (the process start faked here), and waits for the thread before it
    returns, so that no import of the caller's runs beside it. `prepare` imports them in a fresh interpreter, where
    nothing had (a subprocess: this session may have imported them already)."""
    order = []

    class Importing:
        def join(self) -> None:
            order.append("joined")

    monkeypatch.setattr(fleet.WeightPush, "prepare", lambda self: order.append("prepare") or Importing())
    monkeypatch.setattr(fleet.GeneratorProcess, "start", lambda self, *a, **k: order.append("spawn"))
    pipeline_rl.Generator(pipeline_rl.GeneratorConfig(model="m"), None).start()
    assert order == ["prepare", "spawn", "joined"]
    code = ("import sys; from harness import fleet; assert 'harness.weight_transfer' not in sys.modules; "
            "thread = fleet.WeightPush(fleet.FleetConfig(), model='m').prepare(); thread.join(120); "
            "print(thread.name, 'harness.weight_transfer' in sys.modules, 'vllm.distributed.weight_transfer.base' "
            "in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["scalerl-weights-import", "True", "True"]


def test_the_fleet_settings_are_checked_where_they_are_written():
    """FleetConfig refuses what fleet_problems finds, in one line per setting, named as the caller names it."""
    with pytest.raises(ValueError, match=r"^tensor_parallel_size must be >= 1 \(got 0\)"):
        fleet.FleetConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="debug_slowdown 1,0.5: X or X,Y"):
        fleet.FleetConfig(debug_slowdown=(1, 0.5))
    assert fleet.fleet_problems({"dtype": "int3", "join_timeout": 0}, lambda name: "--" + name) == [
        "--join_timeout must be a number of seconds > 0 (got 0)",
        "--dtype must be one of ['bf16', 'bfloat16', 'float', 'float16', 'float32', 'fp16', 'fp32', 'half'], got "
        "'int3'"]
    assert fleet.FleetConfig(debug_slowdown=[1, 3]).slowdown_of(5) == 3.0  # the last factor for the rest


def _hold_then_end(conn, code: int | None) -> None:  # a child process: it holds its end of the pipe, then exits
    if code is not None:  # with `code`, or sleeps until it is killed
        os._exit(code)
    time.sleep(600)


@pytest.mark.parametrize("code, said", [
    (None, "its process was killed by SIGKILL: the kernel's out-of-memory killer, unless someone sent it (dmesg names "
           "the processes it killed)"),
    (3, "its process exited with code 3")])
def test_a_local_replica_whose_process_ends_is_named_with_how_it_ended(code, said):
    """A local replica's process killed, or exiting: its connection closes, and the line that names the dead replica
    says how its process ended. The kernel's out-of-memory killer sends SIGKILL to the largest process when the host
    runs out of memory, and nothing else in a run's output would name it; the line said "its connection closed
    (process killed, or the network broke)". (SIGKILL, which no handler the child inherits from pytest can catch.)"""
    deaths = []
    pool = fleet.ReplicaPool(fleet.ReplicaSettings(model="m", replicas=1), b"x" * 32,
                             lambda slot, why: deaths.append((slot.id, why)))
    ours, theirs = multiprocessing.Pipe()
    learner, _ = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_hold_then_end, args=(theirs, code), daemon=True)
    proc.start()
    theirs.close()
    slot = pool.slot(0)
    slot.spawned(proc)
    slot.conn, slot.state = ours, "ready"
    if code is None:
        os.kill(proc.pid, signal.SIGKILL)
    assert pool.poll(learner, 10, 0, True) == [] and deaths == [(0, said)]
    assert fleet.exit_reason(-signal.SIGSEGV) == "its process was killed by SIGSEGV"
    assert fleet.exit_reason(-99) == "its process was killed by signal 99"
