"""The test session's replica zygote: `python tests/replica_zygote.py SOCKET`, started by tests/conftest.py.

Every train.py run of the suite starts a vLLM replica, and its `from vllm import LLM` is most of that start: 12-17
CPU-seconds of a 2-core machine's ~40 per run, some thirty times a session (docs/benchmarks.md, "The replica
zygote"). This process imports vLLM once, then listens on a unix socket. A generator process whose environment names
that socket (harness/vllm_replica.py's REPLICA_ZYGOTE_ENV) asks it for each local CPU replica, and it forks one:
the child takes the generator's environment, directory and stdout/stderr, and runs `replica_main` as a spawned
replica would, building a fresh engine with the run's settings (so the same seeds give the same tokens). What the
fork skips is the import only.

Protocol, one connection per replica: the generator sends one JSON line (replica_main's arguments, its pid, its
directory and environment) with its stdout and stderr as file descriptors; this process answers {"pid": N}, and
later {"exitcode": C} when the child ends (negative: killed by that signal, as multiprocessing says it).
The child dies with the generator (a thread waits on the generator's pidfd) and with this process (replica_main's
parent-death signal). Nothing of it is pickled; only processes of this user reach the socket (a 0700 directory).

Only the fork is new. The tests of a replica's own start and death (tests/test_pipeline_rl.py's fixtures, spawned
in the pytest process without this variable) keep multiprocessing's spawn.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def import_once() -> None:
    """What every replica imports before its engine: vLLM's LLM and the project's replica runtime. Nothing runs a
    torch kernel here (a fork after an OpenMP region is unsafe)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # a replica's default (fleet.ReplicaSettings)
    from harness import fleet, tasks, vllm_replica  # noqa: F401

    tasks.set_vllm_cpu_env()
    from vllm import LLM, SamplingParams  # noqa: F401


def serve(path: str) -> None:
    """Import, then listen at `path` (its existence says "ready") and fork a replica per request until the parent
    (the test session) goes."""
    from harness import vllm_replica

    vllm_replica.set_parent_death_signal(signal.SIGTERM)
    parent = os.getppid()
    try:
        import_once()
    except BaseException:  # the generators asking are told at once, not after their wait
        Path(path + ".failed").write_text(traceback.format_exc())
        raise
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".part")
    os.rename(path + ".part", path)  # whole, or not there: a client never meets a half-bound socket
    listener.listen(16)
    children: dict[int, socket.socket] = {}  # child pid -> its generator's connection
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.2)
        if readable:
            conn, _ = listener.accept()
            pid = fork_replica(conn, listener, children)
            if pid is not None:
                children[pid] = conn
        reap(children)


def fork_replica(conn: socket.socket, listener: socket.socket, children: dict) -> int | None:
    """Read one request and fork its replica; its pid (answered to the generator), or None for a bad request."""
    try:
        conn.settimeout(10)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        while not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                raise ConnectionError("the request ended early")
            data += more
        request = json.loads(data)
        if len(fds) != 2:
            raise ValueError(f"expected stdout and stderr, got {len(fds)} descriptors")
    except (OSError, ValueError) as e:
        with_close(conn, {"error": f"{type(e).__name__}: {e}"})
        return None
    pid = os.fork()
    if pid == 0:  # the replica
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        run_child(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    print(f"forked {request['name']} (pid {pid}) for the generator process {request['watch_pid']}", flush=True)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: the generator's streams, directory and environment, a watch on the generator, then
    replica_main; an exception that ends it is told and gives the exit status as in multiprocessing's child, and
    the child ends through exit_at_once as a spawned replica does."""
    import multiprocessing

    from harness import vllm_replica  # imported by the zygote already

    code = 0
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        watch(request["watch_pid"])
        multiprocessing.current_process().name = request["name"]
        module, _, qualname = request["config_type"].partition(":")
        if not module.startswith("harness."):
            raise ValueError(f"config_type {request['config_type']!r} is not the project's")
        config_type = getattr(importlib.import_module(module), qualname)
        vllm_replica.replica_main(request["address"], bytes.fromhex(request["secret"]), request["local_id"], None,
                                  os.getppid(), config_type=config_type)
    except BaseException as stop:
        if not isinstance(stop, SystemExit):
            print(f"Process {request['name']}:", file=sys.stderr)
        code = vllm_replica.report_exit(stop)
    vllm_replica.exit_at_once(code)


def watch(pid: int) -> None:
    """Kill this process when process `pid` (the generator) ends, as the parent-death signal does for a spawned
    replica: this process's parent is the zygote, so prctl cannot follow the generator."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)

    def wait() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="generator-watch", daemon=True).start()


def reap(children: dict) -> None:
    """Tell each ended child's generator its exit code (-N: killed by signal N)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with_close(conn, {"exitcode": os.waitstatus_to_exitcode(status)})


def with_close(conn: socket.socket, answer: dict) -> None:
    try:
        conn.sendall(json.dumps(answer).encode() + b"\n")
    except OSError:
        pass
    conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
