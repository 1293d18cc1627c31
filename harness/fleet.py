"""harness/fleet.py: the generator's replica fleet. A reader of the recipe may skip this file.

pipeline_rl.py is the staleness rule and the scheduler that applies it; this module is the infrastructure under it,
and imports nothing of pipeline_rl (nor of train):

- `FleetConfig`: where and how the replicas run (their number, devices, address, secret, timeouts, vLLM's engine
  settings, the weight transport, the debug slowdowns), its checks (`fleet_problems`), and `ReplicaSettings`, what a
  replica's engine is started with (the fleet's settings and the few of the generator's that the engine reads);
- `ReplicaSlot` and `ReplicaPool`: the scheduler's view of each replica, the listener they connect to, their hello
  and start, the messages that come from them and the learner (`ReplicaPool.poll`), their deaths' process side (a
  dead replica's processes killed), the relay of weight calls, their shutdown;
- `GeneratorProcess`: the learner's end of the generator process (spawn, pipe, a death noticed, close and kill), and
  `generator_process_main`, that process's own start and end around the scheduler;
- `WeightPush`: the learner's side of a weight update, through vLLM's weight-transfer API: which engine carries
  the weights (chosen once at the start), the cast to the generator's dtype, and one trainer engine per replica, all
  sending at once (a thread each), a replica whose send fails named and dropped while the others finish.

What runs inside a replica (vLLM's engine, its logits processors, the handshake's other side) is
harness/vllm_replica.py; docs/pipeline.md explains the design.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Mapping

import torch

from harness import vllm_replica, wire
from harness.vllm_replica import DTYPES, parse_address


class GeneratorError(RuntimeError):
    """The generator process failed to start, died, or reported an error."""


class GeneratorTimeout(GeneratorError, TimeoutError):
    """A call to the generator did not complete within its timeout (the generator is closed: start a new one)."""


class Fatal(RuntimeError):
    """The generator cannot go on, for a reason its message says in full (no traceback needed)."""


# --------------------------------------------------------------------------------------------------------------
# The fleet's settings
# --------------------------------------------------------------------------------------------------------------


@dataclass
class FleetConfig:
    """Where and how the generator's replicas run. train.py's flags of the same names take their defaults from here
    and are checked by the same `fleet_problems` (harness/flags.py)."""

    # generator weights dtype (bfloat16 on GPU)
    dtype: str = "float32"
    # compute the LM head in float32 on the generator (automatic with float32 weights)
    fp32_lm_head: bool = True
    # prompt + completion tokens the engine reserves per sequence
    max_model_len: int = 256
    # GPU path: comma-separated CUDA device ids for the local replicas, e.g. '4,5,6,7' (None: CPU vLLM)
    gen_devices: str | None = None
    # vLLM tensor parallelism of each replica: the local replicas take gen_devices in runs of this many
    tensor_parallel_size: int = 1
    # vLLM engines on this node (GPU: len(gen_devices) / tensor_parallel_size of them; CPU: they share the machine)
    replicas: int = 1
    # replicas on other nodes to wait for (`python pipeline_rl.py replica --connect HOST:PORT`, docs/pipeline.md)
    remote_replicas: int = 0
    # HOST:PORT the generator listens on for replicas, local ones included (port 0: a free one); remote replicas
    # need an address they reach
    listen: str = "127.0.0.1:0"
    # the secret every replica must prove (HMAC challenge); None: a random one, for local replicas only
    secret: bytes | None = None
    # seconds to wait for every replica to connect and start its engine (a missing one is named, then start fails)
    join_timeout: float = 600.0
    # the engine of vLLM's weight-transfer API that carries new weights to each replica: gloo (CPU, this project's:
    # harness/weight_transfer.py), nccl (separate GPUs) or ipc (a replica on learner rank 0's GPU); auto: the one
    # for the layout (vllm_replica.choose_weight_transport; the generator's start settles it). An earlier
    # version's "broadcast" reads as auto; its "file" is gone
    weight_transport: str = "auto"
    # bytes per packed broadcast of the gloo engine: the learner holds one packed chunk at a time, a replica one
    weight_bucket_bytes: int = 256 << 20
    # seconds a replica's weight group may take to form or to carry an update before the replica is given up
    weight_timeout: float = 300.0
    # GPU path: vLLM's share of each generator GPU
    gpu_memory_utilization: float = 0.5
    # vLLM enforce_eager (default: True on CPU)
    enforce_eager: bool | None = None
    # vLLM max_num_seqs (default: vLLM's)
    max_num_seqs: int | None = None
    # run vLLM's engine core in processes of its own (vLLM's default) rather than inside the replica's process;
    # None: own processes on GPU, inside on CPU, where the engine core's and the worker's busy-wait loops (vLLM
    # spins up to 1 s after every step) take cores the learner needs
    engine_process: bool | None = None
    # CPU: torch threads of the engine when it runs inside the replica's process (None: torch's default, one per
    # core, or OMP_NUM_THREADS, which torchrun sets to 1 for train.py's ranks and so for their generator); fewer
    # leave cores to a learner that shares the machine (two threads beside a busy learner stall each other)
    num_threads: int | None = None
    # VLLM_LOGGING_LEVEL in the replicas
    vllm_log_level: str = "WARNING"
    # debug knob: vLLM's engine sleeps (x - 1) times the duration of every step (SlowdownLogitsProcessor), to emulate
    # a generator x times slower relative to its learner; a tuple gives each replica its own x (replica i: x[i])
    debug_slowdown: float | tuple[float, ...] = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.debug_slowdown, (list, tuple)):
            self.debug_slowdown = tuple(float(x) for x in self.debug_slowdown)
        problems = fleet_problems({f.name: getattr(self, f.name) for f in fields(FleetConfig)})
        if problems:
            raise ValueError("; ".join(problems))

    def slowdowns(self) -> tuple[float, ...]:
        return self.debug_slowdown if isinstance(self.debug_slowdown, tuple) else (float(self.debug_slowdown),)

    def slowdown_of(self, replica: int) -> float:
        """debug_slowdown of replica `replica` (a tuple gives one per replica, the last one for the rest)."""
        factors = self.slowdowns()
        return factors[min(replica, len(factors) - 1)]


@dataclass
class ReplicaSettings(FleetConfig):
    """What a replica's engine starts with: the fleet's settings and the generator's that vLLM's engine reads (the
    model, the run's seed, whether the interruption processor runs). It crosses the connection as plain data."""

    model: str = ""
    seed: int = 0
    interruptions: bool = True


def fleet_problems(values: Mapping[str, Any], name: Callable[[str], str] = str) -> list[str]:
    """What is wrong with these fleet settings; [] when nothing is. The one place where each check is written:
    FleetConfig raises on them, and train.py's flags report them before anything starts (flags.check_args).
    `values` maps FleetConfig field names to values (a missing one is not checked); `name` spells a field as the
    caller calls it (harness/flags.py: its command-line flag)."""
    v, problems = values, []
    if "tensor_parallel_size" in v and v["tensor_parallel_size"] < 1:
        problems.append(f"{name('tensor_parallel_size')} must be >= 1 (got {v['tensor_parallel_size']})")
    if "join_timeout" in v and not 0 < v["join_timeout"] < float("inf"):
        problems.append(f"{name('join_timeout')} must be a number of seconds > 0 (got {v['join_timeout']})")
    if "dtype" in v and v["dtype"] is not None and v["dtype"] not in DTYPES:
        problems.append(f"{name('dtype')} must be one of {sorted(DTYPES)}, got {v['dtype']!r}")
    factors = v.get("debug_slowdown", ())
    factors = tuple(factors) if isinstance(factors, (tuple, list)) else (factors,)
    if not all(x >= 1 for x in factors):
        shown = ",".join(f"{x:g}" for x in factors)
        problems.append(f"{name('debug_slowdown')} {shown}: X or X,Y,... (one per replica), each must be >= 1 "
                        "(1 = full speed)")
    return problems + vllm_replica.replica_problems(v, name)


# --------------------------------------------------------------------------------------------------------------
# The replicas: a slot each, and the pool that owns them
# --------------------------------------------------------------------------------------------------------------


def exit_reason(code: int) -> str:
    """How a replica's process ended (its exit code; -N: killed by signal N), in words. SIGKILL is what the kernel's
    out-of-memory killer sends, which nothing else in a run's output would name."""
    if code == -signal.SIGKILL:
        return ("its process was killed by SIGKILL: the kernel's out-of-memory killer, unless someone sent it (dmesg "
                "names the processes it killed)")
    if code < 0:
        try:
            return f"its process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"its process was killed by signal {-code}"
    return f"its process exited with code {code}"


@dataclass
class ReplicaSlot:
    """The scheduler's view of one replica: expected -> starting (connected) -> ready (engine up) -> dead, each step
    one of its methods."""

    id: int
    local: bool
    devices: list[int] | None = None  # a local GPU replica's CUDA devices (None on CPU)
    proc: Any = None  # a local replica's process
    conn: Any = None
    pid: int | None = None
    host: str = ""  # where its connection came from
    bind_host: str = ""  # where its workers are reached (its end of the connection)
    tensor_parallel_size: int = 1
    state: str = "expected"
    version: int | None = None  # the weights it holds; None: not yet the run's (a late joiner)
    capacity: int = 1  # groups it takes at once: vLLM's max_num_seqs / group_size
    group: dict | None = None  # its weight group, once formed
    info: dict = field(default_factory=dict)
    reason: str = ""  # why it died

    @property
    def name(self) -> str:
        where = "local" if self.local else f"remote, {self.host or 'not connected'}"
        return f"replica {self.id} ({where}{f', pid {self.pid}' if self.pid else ''})"

    @property
    def usable(self) -> bool:
        return self.state == "ready" and self.version is not None

    def spawned(self, proc: Any) -> None:
        self.proc, self.pid = proc, proc.pid

    def connect(self, conn: Any, host: str, pid: int | None, bind_host: str, tensor_parallel_size: int) -> None:
        """Its hello came: it starts its engine, and holds none of the run's weights until it is told which."""
        self.conn, self.host, self.pid, self.state = conn, host, pid, "starting"
        self.bind_host, self.tensor_parallel_size = bind_host, tensor_parallel_size
        self.version, self.group, self.reason = None, None, ""

    def engine_up(self, info: dict, group_size: int) -> None:
        self.info, self.state = info, "ready"
        self.capacity = max(1, info["max_num_seqs"] // group_size)

    def holds(self, version: int) -> None:
        self.version = version

    def join(self, group: dict) -> None:
        self.group = group

    def die(self, reason: str) -> str:
        """Close its connection and kill its processes; the state it was in ("dead": it was already, and nothing is
        done)."""
        previous = self.state
        if previous == "dead":
            return previous
        self.state, self.reason, self.version, self.group = "dead", reason, None, None
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
            self.conn = None
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.local:  # a remote replica's processes are on its own node
            vllm_replica.kill_processes(self.info.get("vllm_processes", []))
        return previous


class ReplicaPool:
    """Replica bookkeeping, the one owner of the replica slots: the listener that replicas connect to, their hello and
    start, the messages that come from them, the loads' replicas and the capacities admission reads, their weight
    groups, and their shutdown. A replica that fails (its connection, its process, a send to it) is handed to
    `on_death` (the scheduler's)."""

    def __init__(self, settings: ReplicaSettings, secret: bytes, on_death: Callable[[ReplicaSlot, str], None],
                 max_concurrent_groups: int | None = None):
        """A slot per replica: the local ones (with their devices) first, then the remote places."""
        self.cfg, self.secret, self.on_death = settings, secret, on_death
        self.max_concurrent_groups = max_concurrent_groups
        self.listener: vllm_replica.ReplicaListener | None = None
        self.new_conns: list[tuple[Any, tuple]] = []  # authenticated, no hello yet
        gen_ids = [int(x) for x in settings.gen_devices.split(",") if x.strip()] if settings.gen_devices else []
        devices = (vllm_replica.replica_devices(gen_ids, settings.tensor_parallel_size) if gen_ids
                   else [None] * settings.replicas)
        self.replicas = {i: ReplicaSlot(i, local=True, devices=devices[i],
                                        tensor_parallel_size=settings.tensor_parallel_size)
                         for i in range(settings.replicas)}
        for j in range(settings.remote_replicas):
            i = settings.replicas + j
            self.replicas[i] = ReplicaSlot(i, local=False)

    # ---- start and connections ------------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Listen, and spawn the local replicas (the scheduler then polls until `all_ready`)."""
        self.listener = vllm_replica.ReplicaListener(self.cfg.listen, self.secret)
        for slot in self.replicas.values():
            if slot.local:
                slot.spawned(vllm_replica.start_replica(self.listener.address, self.secret, slot.id, slot.devices,
                                                        ReplicaSettings))

    def all_ready(self) -> bool:
        return all(s.state == "ready" for s in self.replicas.values())

    def check_start(self, deadline: float) -> None:
        """Fatal if a replica died while starting, or `deadline` (time.monotonic) passed with some not ready."""
        dead = [s for s in self.replicas.values() if s.state == "dead"]
        if dead:
            raise Fatal("; ".join(f"{s.name} failed to start: {s.reason}" for s in dead))
        if time.monotonic() >= deadline:
            raise Fatal(self.missing_message())

    def hand_version(self, version: int) -> None:
        """Every replica started holds the run's weights `version`."""
        for slot in self.replicas.values():
            slot.holds(version)

    def missing_message(self) -> str:
        lines = []
        for s in self.replicas.values():
            if s.state == "ready":
                continue
            if s.local:
                lines.append(f"{s.name} did not start its vLLM engine within {self.cfg.join_timeout:.0f} s")
            elif s.state == "expected":
                lines.append(f"replica {s.id} (remote) never connected to {self.listener.address} within "
                             f"{self.cfg.join_timeout:.0f} s: start it on its node with `python pipeline_rl.py "
                             f"replica --connect {self.listener.address} --secret-file FILE`")
            else:
                lines.append(f"{s.name} connected but did not start its vLLM engine within "
                             f"{self.cfg.join_timeout:.0f} s")
        return "; ".join(lines)

    def connections(self) -> dict[Any, Any]:
        """{connection: its slot, or ("new", peer) for one not yet said hello}, after taking what the listener
        accepted."""
        if self.listener is not None:
            while not self.listener.accepted.empty():
                self.new_conns.append(self.listener.accepted.get())
        owners: dict[Any, Any] = {s.conn: s for s in self.replicas.values() if s.conn is not None}
        owners.update({c: ("new", peer) for c, peer in self.new_conns})
        return owners

    def poll(self, learner: Any, timeout: float, version: int, running: bool) -> list[tuple[Any, tuple | None]]:
        """Wait up to `timeout` for a message from the learner's connection or any replica's; the messages that came,
        as (owner, message): ("learner", message), or ("learner", None) when its connection closed; (slot,
        message) from a replica. A new connection's hello is answered here (`on_hello`, with weights `version`; a
        run `running` labels a joiner's weights only by its next update), and a replica whose connection fails or
        whose process exited goes to `on_death`."""
        owners: dict[Any, Any] = {learner: "learner"}
        owners.update(self.connections())
        try:
            ready = mpc.wait(list(owners), timeout)
        except OSError:
            ready = []
        messages: list[tuple[Any, tuple | None]] = []
        for conn in ready:
            owner = owners[conn]
            if isinstance(owner, tuple):  # ("new", peer)
                self.answer_hello(conn, owner[1], version, running)
                continue
            try:
                msg = conn.recv()
            except wire.FrameRefused as e:  # a replica's channel (the learner's pipe has no frames to refuse):
                self.on_death(owner, f"refused a frame on its connection: {e}")  # nothing of it was used, it is closed
                continue
            except (EOFError, OSError):
                if owner == "learner":
                    messages.append(("learner", None))
                else:
                    self.on_death(owner, self.gone_reason(owner))
                continue
            messages.append((owner, msg))
        for slot, reason in self.silent_exits():
            self.on_death(slot, reason)
        return messages

    def greet(self, timeout: float, version: int) -> None:
        """Answer the hellos of new connections that come within `timeout` (weights `version`), and read nothing
        else: what the replicas and the learner send waits for `poll`. The scheduler calls it while it is still being
        built, so that a replica spawned at its start gets its settings and builds its engine meanwhile."""
        new = {conn: owner[1] for conn, owner in self.connections().items() if isinstance(owner, tuple)}
        if not new:  # the listener's thread accepts into a queue, which no wait can watch
            time.sleep(timeout)
            return
        try:
            ready = mpc.wait(list(new), timeout)
        except OSError:
            ready = []
        for conn in ready:
            self.answer_hello(conn, new[conn], version, running=False)

    def answer_hello(self, conn: Any, peer: tuple, version: int, running: bool) -> None:
        """A new connection's first message (`on_hello`); one whose frame is refused is named, a closed one is
        forgotten."""
        try:
            msg = conn.recv()
        except wire.FrameRefused as e:  # nothing of it was used; the connection is closed
            self.refuse_frame(conn, peer, str(e))
            return
        except (EOFError, OSError):
            self.forget_new(conn)
            return
        self.forget_new(conn)
        self.on_hello(conn, peer, msg, version, running=running)

    def forget_new(self, conn: Any) -> None:
        self.new_conns = [(c, p) for c, p in self.new_conns if c is not conn]

    def refuse_frame(self, conn: Any, peer: tuple, reason: str) -> None:
        """A new connection's first frame was refused (wire.FrameRefused): forget it, and name it in one line."""
        self.forget_new(conn)
        line = f"refused a frame from {peer[0]}:{peer[1]} before its hello: {reason}"
        self.listener.refused.append(line)
        print(f"[generator] {line}", file=sys.stderr, flush=True)

    def engine_config(self) -> ReplicaSettings:
        """The settings a replica's engine needs, without the secret or the run's replica layout."""
        return dataclasses.replace(self.cfg, secret=None, replicas=1, remote_replicas=0, listen="127.0.0.1:0")

    def on_hello(self, conn: Any, peer: tuple, msg: tuple, version: int, running: bool) -> None:
        """A new connection's first message: a replica takes its place and is told to start its engine with weights
        `version` (unless the run is `running`: a late joiner's base weights are labelled only by its first update)."""
        if msg[0] != "hello":
            conn.close()
            return
        hello = msg[1]
        local_id = hello.get("local_id")
        if local_id is not None:
            slot = self.replicas.get(local_id)
            slot = slot if slot is not None and slot.local and slot.state == "expected" else None
        else:  # a remote replica takes the first free remote place (one never filled, or one whose replica died)
            slot = next((s for s in self.replicas.values() if not s.local and s.state in ("expected", "dead")), None)
        if slot is None:
            reason = (f"the run expects {self.cfg.remote_replicas} remote replica(s) and has them all" if local_id is
                      None else f"no local replica {local_id} is expected")
            line = f"refused replica pid {hello.get('pid')} from {peer[0]}: {reason}"
            self.listener.refused.append(line)
            print(f"[generator] {line}", file=sys.stderr, flush=True)
            try:
                conn.send(("refused", reason))
            finally:
                conn.close()
            return
        rejoin = slot.state == "dead"
        slot.connect(conn, peer[0], hello.get("pid"), hello.get("bind_host") or peer[0],
                     hello.get("tensor_parallel_size") or self.cfg.tensor_parallel_size)
        # a replica that joins a running run holds the base weights: label them -1 until its first update. The
        # settings go as plain data (the channel carries no objects); the replica builds its ReplicaSettings again
        conn.send(("start", asdict(self.engine_config()), slot.id, None if (rejoin or running) else version))
        if rejoin or running:
            print(f"[generator] {slot.name} joined; it gets prompts once the next weight update reaches it",
                  file=sys.stderr, flush=True)

    def send_to(self, slot: ReplicaSlot, msg: tuple) -> bool:
        try:
            slot.conn.send(msg)
            return True
        except (OSError, EOFError, BrokenPipeError, AttributeError) as e:
            self.on_death(slot, f"sending to it failed ({type(e).__name__})")
            return False

    # ---- what the others read -------------------------------------------------------------------------------------
    def slot(self, replica: int) -> ReplicaSlot:
        return self.replicas[replica]

    def slots(self) -> list[ReplicaSlot]:
        return list(self.replicas.values())

    def ready_slots(self) -> list[ReplicaSlot]:
        return [s for s in self.replicas.values() if s.state == "ready"]

    def usable_ids(self) -> list[int]:
        """The replicas admission may send to: engine up, holding the run's weights."""
        return [s.id for s in self.replicas.values() if s.usable]

    def capacities(self) -> dict[int, int]:
        return {s.id: s.capacity for s in self.replicas.values()}

    def max_in_flight(self) -> int:
        return self.max_concurrent_groups or max(1, sum(s.capacity for s in self.replicas.values() if s.usable))

    def describe(self, s: ReplicaSlot) -> dict:
        return {"id": s.id, "name": s.name, "local": s.local, "pid": s.pid, "host": s.host, "state": s.state,
                "version": s.version, "devices": s.devices, "vllm_processes": s.info.get("vllm_processes", []),
                "capacity": s.capacity, "reason": s.reason}

    def describe_all(self) -> list[dict]:
        return [self.describe(s) for s in self.replicas.values()]

    def address(self) -> str:
        return self.listener.address

    def refused_lines(self) -> list[str]:
        return list(self.listener.refused) if self.listener else []

    def refused_count(self) -> int:
        return len(self.listener.refused) if self.listener else 0

    def head(self) -> Any:
        """What the first replica's engine says of its LM head."""
        return next(iter(self.replicas.values())).info.get("head")

    def descendants(self) -> list[tuple]:
        """(pid, create time, name) of the local replicas' processes and their vLLM processes, for the learner."""
        import psutil

        descendants = []
        for slot in self.replicas.values():
            if slot.local:
                descendants.append((slot.pid, psutil.Process(slot.pid).create_time(), slot.proc.name))
                descendants += slot.info.get("vllm_processes", [])
        return descendants

    # ---- weights, faults, shutdown ----------------------------------------------------------------------------------
    def send_update(self) -> list[tuple]:
        """The plan of a weight update for the learner: [(replica, name, its workers' address, its workers (the
        tensor-parallel size), whether its weight-transfer engine must be initialized first, the processes to watch
        while the learner sends)], one entry per ready replica. The learner's trainer engine for each then makes
        vLLM's weight-transfer calls, which this process relays to the replica in order (relay_weight_call)."""
        plan = []
        for s in self.ready_slots():
            init = s.group is None
            s.join({"engine": self.cfg.weight_transport})
            watch = vllm_replica.local_processes(s.pid, s.info.get("vllm_processes", [])) if s.local else []
            plan.append((s.id, s.name, s.bind_host, s.tensor_parallel_size, init, watch))
        return plan

    def relay_weight_call(self, replica: int, method: str, payload: Any) -> None:
        """One call of the learner's trainer engine on replica `replica`'s client (plain data), passed on; a replica
        that is gone gets nothing (the learner's engine notices it gone)."""
        slot = self.replicas.get(replica)
        if slot is not None and slot.state == "ready":
            self.send_to(slot, ("weights", method, payload))

    def silent_exits(self) -> list[tuple[ReplicaSlot, str]]:
        """(slot, why) of each local replica whose process exited without a word (its connection may linger)."""
        exits = []
        for s in self.replicas.values():
            if s.local and s.proc is not None and s.state != "dead" and not s.proc.is_alive():
                if s.conn is not None and s.conn.poll(0):
                    continue  # its last message first
                exits.append((s, exit_reason(s.proc.exitcode)))
        return exits

    def gone_reason(self, slot: ReplicaSlot) -> str:
        """Why `slot`'s replica is gone once its connection closed: how its process ended, for a local one whose
        process ends within a second; else what a closed connection means."""
        if slot.local and slot.proc is not None:
            slot.proc.join(1.0)
            if slot.proc.exitcode is not None:
                return exit_reason(slot.proc.exitcode)
        return "its connection closed (process killed, or the network broke)"

    def dead_summary(self) -> str:
        return "; ".join(f"{s.name}: {s.reason}" for s in self.replicas.values() if s.state == "dead")

    def shutdown(self) -> None:
        """Close every replica: ask, wait a little, then kill what is left (and its vLLM processes)."""
        for s in self.replicas.values():
            if s.conn is not None:
                try:
                    s.conn.send(("close",))
                except (OSError, EOFError, BrokenPipeError):
                    pass
        deadline = time.monotonic() + 10
        for s in self.replicas.values():
            if s.proc is not None:
                s.proc.join(max(0.1, deadline - time.monotonic()))
                if s.proc.is_alive():
                    s.proc.kill()
                    s.proc.join(5)
            if s.local:
                vllm_replica.kill_processes(s.info.get("vllm_processes", []))
        if self.listener is not None:
            self.listener.close()


# --------------------------------------------------------------------------------------------------------------
# The generator process: the learner's end of it, and its own start and end around the scheduler
# --------------------------------------------------------------------------------------------------------------


def run_secret(config: FleetConfig) -> bytes:
    """The secret the replicas prove: the configured one, else a random one (local replicas only: nobody else needs
    it)."""
    return config.secret or secrets.token_bytes(32)


def generator_process_main(conn: Any, build: Callable[..., Any], build_args: tuple, parent_pid: int) -> None:
    """Entry point of the generator process: a session of its own, death with the learner, then `build(conn,
    *build_args)` (the scheduler, which spawns its replicas), its `start()` answered "ready" to the learner, its
    `run()`; whatever ends it, its `shutdown()`, every child killed, and "closed"."""
    try:
        os.setsid()  # Ctrl-C in the terminal goes to the learner, which closes us in order
    except OSError:
        pass
    vllm_replica.set_parent_death_signal(signal.SIGTERM)  # the learner died: shut the replicas down in order
    if os.getppid() != parent_pid:  # the learner died before prctl took effect
        return
    vllm_replica.exit_on_sigterm()
    for var in vllm_replica.TORCHRUN_VARS:
        os.environ.pop(var, None)
    scheduler = None
    try:
        scheduler = build(conn, *build_args)
        info = scheduler.start()
        conn.send(("ready", info))
        scheduler.run()
    except BaseException as e:  # report everything, including SystemExit from SIGTERM
        try:
            text = str(e) if isinstance(e, Fatal) else f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            conn.send(("error", text))
        except Exception:
            pass
        if not isinstance(e, (SystemExit, Fatal, KeyboardInterrupt)):
            raise
    finally:
        try:
            if scheduler is not None:
                scheduler.shutdown()
        finally:  # whatever cut the shutdown short, no replica outlives us: multiprocessing would wait for it at exit
            for child in mp.active_children():
                child.kill()
        try:
            conn.send(("closed", None))
        except Exception:
            pass
    vllm_replica.exit_at_once()  # closed in order (an error above propagates instead, with its exit status)


class GeneratorProcess:
    """The learner's end of the generator process: its start, the pipe to it, a death noticed on either end (as
    GeneratorError, within a fraction of a second), its close in order or by force, and the replicas and vLLM
    processes that outlive it. `on_close` runs at the end of `close` (the weight engines' shutdown)."""

    def __init__(self, on_close: Callable[[], None] = lambda: None):
        self.proc: Any = None
        self.conn: Any = None
        self.info: dict = {}
        self.started_at = 0.0
        self.closed = False
        self.close_sent = False
        self.dead_reason: str | None = None
        self.on_close = on_close

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, build: Callable[..., Any], build_args: tuple, timeout: float) -> None:
        """Spawn the process (generator_process_main with `build`), and wait up to `timeout` for its "ready"."""
        if self.proc is not None:
            raise GeneratorError("generator already started")
        if self.closed:
            raise GeneratorError("generator is closed")
        self.started_at = time.time()  # vLLM's shared-memory segments are younger than this (close())
        parent_conn, child_conn = mp.get_context("spawn").Pipe(duplex=True)
        self.conn = parent_conn
        try:  # a signal during the spawn (seconds on a loaded machine) must not leave the process running either
            self.proc = vllm_replica.start_process(generator_process_main, "scalerl-generator",
                                                   (child_conn, build, build_args, os.getpid()))
            child_conn.close()
            atexit.register(self.close)
            _, self.info = self.recv("ready", timeout, what="start")
        except BaseException:
            child_conn.close()
            self.close()
            raise

    def begin_close(self) -> None:
        """Ask the generator process to shut down in order, and return at once; close() then waits for it."""
        if self.closed or self.close_sent or self.proc is None or self.conn is None:
            return
        self.close_sent = True
        try:
            self.conn.send(("close",))
        except (OSError, EOFError, BrokenPipeError):
            pass

    def close(self, timeout: float = 30.0) -> None:
        """Stop the generator process and everything vLLM started; idempotent."""
        if self.closed:
            return
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        if self.proc is not None and self.proc.is_alive():
            self.begin_close()
        self.closed = True
        proc, conn = self.proc, self.conn
        if proc is not None:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if conn is not None:
            conn.close()
        # the replicas and vLLM processes that outlived the generator process (e.g. after it was SIGKILLed): nothing
        # can shut them down in order any more
        vllm_replica.kill_processes(self.info.get("descendants", []))
        if self.info.get("descendants"):
            vllm_replica.remove_leaked_segments(self.started_at)
        self.on_close()

    def check_usable(self) -> None:
        if self.closed:
            raise GeneratorError("generator is closed" + (f": {self.dead_reason}" if self.dead_reason else ""))
        if self.proc is None:
            raise GeneratorError("generator not started: call start() first")
        if self.close_sent:
            raise GeneratorError("generator is closing")

    def send(self, msg: tuple) -> None:
        self.check_usable()
        try:
            self.conn.send(msg)
        except (OSError, EOFError, BrokenPipeError) as e:
            self.proc.join(1.0)  # a broken pipe usually means the process is gone: say so, as recv does
            if self.proc.is_alive():
                self.die(f"lost the connection to the generator process while sending {msg[0]!r} ({e})")
            self.die(f"generator process died (noticed while sending {msg[0]!r}: {e})")

    def die(self, reason: str, exit_code: bool = True) -> None:
        """Close and raise; `exit_code`: add the process's exit code (not where the process said why it ended)."""
        self.dead_reason = reason
        code = self.proc.exitcode if self.proc is not None else None
        self.close(timeout=2.0)
        raise GeneratorError(f"{reason} (exit code {code})" if exit_code else reason)

    def recv(self, expected: str, timeout: float | None, what: str) -> tuple:
        """The next message, which must be `expected`; GeneratorError if the process failed, refused the request
        ("fail") or died, GeneratorTimeout (and the process closed) after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            try:
                has = self.conn.poll(wait)
            except (OSError, EOFError):
                has = False
            if has:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    self.proc.join(1.0)
                    self.die(f"generator process died during {what}")
                if msg[0] == "error":  # a replica's death is handled there; this one is the generator's own end
                    self.proc.join(5.0)
                    self.die(f"generator process failed during {what}: {msg[1]}", exit_code=False)
                if msg[0] == "fail":
                    raise GeneratorError(msg[1])
                if msg[0] == "closed":
                    self.die(f"generator process exited during {what}")
                if msg[0] != expected:
                    raise GeneratorError(f"protocol error: expected {expected!r}, got {msg[0]!r}")
                return msg
            if not self.proc.is_alive():
                if self.conn.poll(0):  # a last message (its error) may still be in the pipe
                    continue
                self.die(f"generator process died during {what}")
            if deadline is not None and time.monotonic() >= deadline:
                # the request is still pending in the generator: its late answer would be taken for the next one's
                self.dead_reason = f"no answer to {what} within {timeout} s"
                self.close(timeout=5.0)
                raise GeneratorTimeout(f"generator did not answer {what} within {timeout} s; it has been closed")


# --------------------------------------------------------------------------------------------------------------
# Weights: the learner's side of vLLM's weight-transfer API, every replica at once
# --------------------------------------------------------------------------------------------------------------


class ReplicaWeightClient:
    """vLLM's VLLMWeightSyncClient (vllm/distributed/weight_transfer/base.py) for one replica: each call becomes one
    message of plain data, ("weights", replica, method, payload), that `relay` hands to the generator process, which
    passes it on to the replica, which makes the same call on its vllm.LLM, in the same order. A call does not wait
    for the replica's answer (the trainer engine runs the transfer meanwhile); a replica whose call fails says so and
    is taken out of the run."""

    def __init__(self, relay: Callable[[tuple], None], replica: int, version: int):
        self.relay, self.replica, self.version = relay, replica, version

    def _call(self, method: str, payload: Any) -> None:
        self.relay(("weights", self.replica, method, payload))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init", dict(init_info))

    def start_weight_update(self) -> None:
        self._call("start", None)

    def update_weights(self, update_info: Any) -> None:
        from harness import weight_transfer

        self._call("update", weight_transfer.plain_update_info(dict(update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish", int(weight_version) if weight_version is not None else self.version)


def _read_tie_flag(model: str) -> bool:
    try:
        from transformers import AutoConfig

        return bool(getattr(AutoConfig.from_pretrained(model), "tie_word_embeddings", False))
    except Exception:
        return False


class WeightPush:
    """The learner's side of weight updates: the engine of vLLM's weight-transfer API that carries them (chosen at
    the start: `choose`), the cast of a full state dict to the generator's dtype (`tensors`), and for each replica a
    trainer engine of vLLM's factory (gloo on CPU, nccl or ipc on GPU) that makes init (once per replica), start,
    update and finish with the version, all replicas at once (`send`)."""

    def __init__(self, config: FleetConfig, model: str):
        self.cfg = config
        self.tied = _read_tie_flag(model)
        self.engines: dict[int, Any] = {}  # replica id -> its trainer-side weight-transfer engine
        self.relay_lock = threading.Lock()  # the replicas' threads share the one pipe to the generator process

    def choose(self) -> tuple[FleetConfig, str]:
        """The transport train.py printed at its start (the same chooser), settled: (the config with it, the line
        that names it). GeneratorError names a transport that cannot work on this layout."""
        try:
            kind, line = vllm_replica.config_weight_transport(self.cfg)
        except ValueError as e:
            raise GeneratorError(f"weight_transport {e}") from None
        self.cfg = dataclasses.replace(self.cfg, weight_transport=kind)
        return self.cfg, line

    def prepare(self) -> threading.Thread:
        """Import vLLM's weight-transfer engines (harness/weight_transfer.py) in a thread, while the generator
        starts: the first push needs them, and their import (vLLM's config and engine classes, 5-6 s on a CPU core)
        came at step 1's push, where rank 0, and every rank behind it, waited for it. Started here, it runs while
        rank 0 waits for the replicas. A failed import is left to the push's own import, which raises it there."""
        def import_engines() -> None:
            with contextlib.suppress(Exception):
                importlib.import_module("harness.weight_transfer")

        thread = threading.Thread(target=import_engines, name="scalerl-weights-import", daemon=True)
        thread.start()
        return thread

    def tensors(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict as the replicas load it (vllm_replica.weight_tensors): what cast is left is done here (none
        for runtime.push_state_dict's weights, already in the generator's dtype)."""
        return vllm_replica.weight_tensors(state_dict, DTYPES.get(self.cfg.dtype, torch.float32), self.tied)

    def send(self, tensors: dict[str, torch.Tensor], version: int, plan: list[tuple],
             relay: Callable[[tuple], None]) -> dict[int, str]:
        """Weights `version` to every replica of `plan` (ReplicaPool.send_update's) at once, a thread each, their
        calls passed to `relay`. Returns {replica: why} for each whose send failed (its engine is dropped; the
        others finish theirs). A GeneratorError (the generator process is gone) is raised once all have ended."""
        def locked(msg: tuple) -> None:
            with self.relay_lock:
                relay(msg)

        failed: dict[int, str] = {}
        lost: list[GeneratorError] = []

        def one(replica: int, bind_host: str, workers: int, init: bool, watch: list) -> None:
            try:
                self.send_one(tensors, version, replica, bind_host, workers, init, watch, locked)
            except GeneratorError as e:
                lost.append(e)
            except Exception as e:  # this replica's engine is dropped; the others carry on
                failed[replica] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                engine = self.engines.pop(replica, None)
                with contextlib.suppress(Exception):
                    engine is not None and engine.shutdown()

        threads = [threading.Thread(target=one, args=(replica, bind_host, workers, init, watch),
                                    name=f"scalerl-weights-{replica}", daemon=True)
                   for replica, _name, bind_host, workers, init, watch in plan]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if lost:
            raise lost[0]
        return failed

    def send_one(self, tensors: dict[str, torch.Tensor], version: int, replica: int, bind_host: str, workers: int,
                 init: bool, watch: list, relay: Callable[[tuple], None]) -> None:
        """One replica's round of vLLM's weight-transfer calls, from its trainer engine (made first if `init`)."""
        from harness import weight_transfer  # vLLM's factory knows the gloo engine once this is imported

        client = ReplicaWeightClient(relay, replica, version)
        source = weight_transfer.StateDictSource(tensors)
        engine = None if init else self.engines.get(replica)
        if engine is None:
            old = self.engines.pop(replica, None)
            if old is not None:
                old.shutdown()
            engine = weight_transfer.trainer_engine(self.cfg.weight_transport, client=client, source=source,
                                                    host=parse_address(self.cfg.listen)[0], worker_host=bind_host,
                                                    world_size=1 + workers, timeout_s=self.cfg.weight_timeout,
                                                    buffer_bytes=self.cfg.weight_bucket_bytes)
            self.engines[replica] = engine
        engine.client, engine.source = client, source
        engine.gone = lambda: vllm_replica.dead_processes(watch)  # the gloo engine polls it while it broadcasts
        engine.send_weights()

    def shutdown(self) -> None:
        """Every trainer engine's stores and groups."""
        for engine in self.engines.values():
            with contextlib.suppress(Exception):
                engine.shutdown()
        self.engines.clear()
