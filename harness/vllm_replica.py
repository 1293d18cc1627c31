"""harness/vllm_replica.py: the replica runtime behind pipeline_rl.py. A reader of the recipe may skip this file.

pipeline_rl.py is the generator's recipe: the staleness rule, the scheduler, the `Generator` handle. This module is
what makes it run on real machines, and it imports nothing of pipeline_rl (nor of train):

- what runs inside vLLM's processes: the interruption and slowdown logits processors (vLLM loads them by the
  names "harness.vllm_replica:InterruptionLogitsProcessor" and "harness.vllm_replica:SlowdownLogitsProcessor", with a
  "V2" suffix for vLLM's V2 model runner, which `model_runner_v2` chooses) and the worker extension
  "harness.vllm_replica.WeightSyncExtension" (two probes; importing this module in vLLM's worker registers the CPU
  weight-transfer engine of harness/weight_transfer.py);
- placement and the replicas' own settings: which GPUs the replicas and the learner take (`split_devices`,
  `replica_devices`, `visible_devices`), and the checks of their number, address, secret and transport (`replica_problems`, called by
  harness/fleet.py's fleet_problems);
- which engine of vLLM's weight-transfer API carries the weights (`choose_weight_transport`: gloo on CPU, nccl
  between GPUs, ipc to a replica on the learner's GPU), and the replica's side of its calls (`_Replica.weight_call`);
- the replica process: one vLLM engine, serving the scheduler over one connection;
- the handshake: who may connect (an HMAC challenge on the shared secret, both ways, harness/wire.py's), and the
  listener; every message after it is an authenticated frame of plain data (wire.Channel), never a pickle;
- the join command, `python pipeline_rl.py replica ...` (pipeline_rl.main hands it to `replica_command`);
- process clean-up: the vLLM processes and shared-memory segments a killed replica leaves.

Where this code needs the replicas' settings it takes harness/fleet.py's `ReplicaSettings` (or its `FleetConfig`) as an
argument (typed Any here: fleet imports this module); the fleet around the replicas (their pool, the generator
process, the weight push) is harness/fleet.py; docs/pipeline.md explains the design.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import ctypes
import errno
import io
import ipaddress
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import queue
import re
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from harness import memory_plan, tasks, vllm_internals, wire  # vllm_internals imports no vLLM until a call needs it
from harness.cli import OneLineParser, int_at_least, number  # one error line for a bad flag; argparse types
from harness.cli import torchrun_error_file  # what ended a torchrun worker, for torchrun's failure summary
from harness.cli import quiet_if_reader_gone  # a closed stdout (`| head`) ends a process quietly
from harness.cli import path_text  # the argparse type of a path: not empty, its ~ the home directory
from harness.cli import DefaultsHelpFormatter  # --help with each default, where there is one to give

# --------------------------------------------------------------------------------------------------------------
# Small helpers that pipeline_rl.py uses too
# --------------------------------------------------------------------------------------------------------------

# the dtypes a generator may load its weights in (FleetConfig.dtype checks its value against these)
DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def parse_address(text: str) -> tuple[str, int]:
    """'HOST:PORT' (IPv6: '[::1]:PORT') -> (HOST, PORT), PORT in 0..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not port.isascii():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if int(port) > 65535:
        raise ValueError(f"port {port} of {text!r} is out of range (0..65535)")
    return host.strip("[]"), int(port)


def listen_address(text: str) -> tuple[str, int, socket.AddressFamily]:
    """The address a listener binds for 'HOST:PORT': (the numeric address HOST resolves to, PORT, its family).
    ValueError, in one line, for a malformed text, a host that does not resolve, or any spelling of a wildcard
    ('0:P', '000.0.0.0:P', '[::0]:P', ':P'): judged by what the host resolves to, not by how it is written, since
    a wildcard would expose the generator on every interface of the node."""
    host, port = parse_address(text)
    wildcard = (f"{text}: name the address the replicas reach this node at, not a wildcard (only that address is "
                "bound)")
    if not host:
        raise ValueError(wildcard)
    try:  # a numeric host first, so that an address never waits on a name server
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError):
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ValueError(f"{text}: host {host!r} does not resolve ({getattr(e, 'strerror', None) or e})") \
                from None
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:0.0.0.0 is IPv4's wildcard
        if ip.is_unspecified or (mapped is not None and mapped.is_unspecified):
            raise ValueError(wildcard)
    family, _, _, _, sockaddr = infos[0]
    return sockaddr[0], port, family


WEIGHT_TRANSPORTS = ("auto", "gloo", "nccl", "ipc")  # FleetConfig.weight_transport; train.py's --weight-transport
# values of an earlier version: "broadcast" is what auto now picks; "file" is gone (weight_transport_value)
FILE_TRANSPORT_GONE = ("file: the weight file is gone; weights travel through vLLM's weight-transfer engines (auto: "
                       "gloo on CPU, nccl between GPUs, ipc to a replica on learner rank 0's GPU)")


def weight_transport_value(text: str) -> str:
    """--weight-transport's value: "broadcast" (an earlier version's) reads as auto; "file" is refused in one line
    that says what replaced it."""
    if text == "file":
        raise ValueError(FILE_TRANSPORT_GONE)
    return "auto" if text == "broadcast" else text


def choose_weight_transport(requested: str, learner_gpu: int | None, replica_gpus: list[list[int]], replicas: int,
                            remote: int, learner_ranks: int = 1) -> tuple[str, str]:
    """(vLLM weight-transfer engine, the line that names it) for `requested` (WEIGHT_TRANSPORTS): learner rank 0
    sends from `learner_gpu` (None: CPU) to `replicas` local replicas (on `replica_gpus`, empty on CPU) and `remote`
    others, each replica through an engine instance of its own. CPU: gloo, this project's engine
    (harness/weight_transfer.py). GPUs: vLLM's nccl, or its ipc where a replica shares rank 0's GPU (NCCL refuses
    two ranks on one GPU; ipc hands the replica CUDA IPC handles, no copy). ValueError: a choice that cannot work,
    in one line that starts with `requested` (the caller names the setting)."""
    requested = weight_transport_value(requested)
    if requested not in WEIGHT_TRANSPORTS:
        raise ValueError(f"{requested}: must be one of {', '.join(WEIGHT_TRANSPORTS)}")
    n = replicas + remote
    if learner_gpu is None:
        if requested in ("nccl", "ipc"):
            raise ValueError(f"{requested}: a CPU run has no GPU to send from (auto: gloo)")
        return "gloo", (f"weight transfer: vLLM's weight-transfer API, engine gloo (this project's, in vLLM's "
                        f"factory), learner rank 0 to {n} replica(s), a group each")
    shared = [i for i, gpus in enumerate(replica_gpus) if learner_gpu in gpus]
    if shared:
        where = f"replica {shared[0]} shares GPU {learner_gpu} with learner rank 0"
        if requested in ("nccl", "gloo"):
            raise ValueError(f"{requested}: {where}, and NCCL refuses two ranks on one GPU (use auto or ipc)")
        others = [i for i in range(len(replica_gpus)) if i not in shared]
        if others or remote:
            who = f"replica {others[0]}" if others else "remote replicas"
            raise ValueError(f"{requested}: {where}, so weights go by vLLM's ipc engine, which reaches that GPU only, "
                             f"and {who} would need nccl from the same GPU: give the learner GPUs of its own")
        if learner_ranks > 1:
            raise ValueError(f"{requested}: {where}; vLLM's ipc engine gathers its handles over every learner rank, "
                             f"and only rank 0 sends here: run the learner on one rank (got {learner_ranks})")
        return "ipc", f"weight transfer: vLLM's ipc engine, CUDA IPC handles on GPU {learner_gpu} ({where})"
    if requested == "ipc":
        raise ValueError(f"ipc: no replica shares learner rank 0's GPU {learner_gpu}, and ipc reaches only that GPU "
                         "(use auto or nccl)")
    engine = "nccl" if requested == "auto" else requested
    return engine, (f"weight transfer: vLLM's {engine} engine from learner rank 0 (GPU {learner_gpu}) to {n} "
                    "replica(s), a group each")


def config_weight_transport(cfg: Any, learner_gpu: int | None = None) -> tuple[str, str]:
    """choose_weight_transport for a FleetConfig `cfg`, its learner rank 0 on `learner_gpu` (default: this
    process's GPU when the config is a GPU one); the learner's ranks are its default group's, if it has one."""
    on_gpu = cfg.gen_devices is not None and torch.cuda.is_available()
    if learner_gpu is None and on_gpu:
        learner_gpu = torch.cuda.current_device()
    gen_ids = [int(x) for x in cfg.gen_devices.split(",") if x.strip()] if on_gpu else []
    replica_gpus = replica_devices(gen_ids, cfg.tensor_parallel_size) if gen_ids else []
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return choose_weight_transport(cfg.weight_transport, learner_gpu, replica_gpus,
                                   len(replica_gpus) or cfg.replicas, cfg.remote_replicas, ranks)


def split_devices(gen_devices: str | None, num_devices: int) -> tuple[list[int], list[int]]:
    """(learner device ids, generator device ids) for a node with `num_devices` GPUs and `--gen-devices`.
    Learner rank r uses learner_ids[r % len(learner_ids)]; the generator child sees only gen ids."""
    gen = [int(x) for x in gen_devices.split(",") if x.strip()] if gen_devices else []
    bad = [d for d in gen if not 0 <= d < num_devices]
    if bad:
        raise ValueError(f"gen_devices {bad} out of range for {num_devices} devices")
    learner = [d for d in range(num_devices) if d not in gen]
    return (learner or list(range(num_devices))), gen
# --------------------------------------------------------------------------------------------------------------
# A replica's settings and devices, and where an interruption starts (the fleet in harness/fleet.py checks them;
# the generator process's scheduler is pipeline_rl.py's)
# --------------------------------------------------------------------------------------------------------------


def replica_problems(values: Mapping[str, Any], name: Callable[[str], str]) -> list[str]:
    """What is wrong with the replicas' settings (their number, the address they connect to, the secret, the weight
    transport); harness/fleet.py's fleet_problems, where every fleet setting is checked, calls it: `values` holds
    FleetConfig's field names, `name` spells a field as the caller calls it."""
    v, problems = values, []
    replicas, remote = v.get("replicas", 1), v.get("remote_replicas", 0)
    if replicas < 0 or remote < 0:
        problems.append(f"{name('replicas')} and {name('remote_replicas')} must be >= 0")
    elif replicas + remote < 1:
        problems.append(f"{name('replicas')} 0 needs {name('remote_replicas')} 1 or more: someone must generate "
                        "(their sum must be >= 1)")
    if "listen" in v:
        try:
            listen_address(v["listen"])
        except ValueError as e:
            problems.append(f"{name('listen')} {e}" if str(e).startswith(v["listen"]) else f"{name('listen')}: {e}")
    if remote and not v.get("secret"):
        problems.append(f"{name('remote_replicas')} needs {name('secret')}: replicas on other nodes must prove a "
                        "shared secret (e.g. `head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`, copied to "
                        "each node)")
    if "weight_transport" in v:
        try:
            transport = weight_transport_value(v["weight_transport"])
        except ValueError as e:
            problems.append(f"{name('weight_transport')} {e}")
        else:
            if transport not in WEIGHT_TRANSPORTS:
                problems.append(f"{name('weight_transport')} must be one of {', '.join(WEIGHT_TRANSPORTS)}, got "
                                f"{v['weight_transport']!r}")
            elif transport == "ipc" and remote:
                problems.append(f"{name('weight_transport')} ipc reaches a replica on learner rank 0's GPU only: "
                                "remote replicas need 'nccl' (or auto)")
    return problems


def visible_devices(indices: list[int], visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a replica given devices `indices`: those count the GPUs this process sees
    (torch.cuda.device_count()), so under a CUDA_VISIBLE_DEVICES of `visible` ("4,6", or GPU UUIDs) index i is its
    i-th entry, kept as written; without one the indices are the GPUs' own numbers."""
    if visible is None:
        return ",".join(str(i) for i in indices)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    bad = [i for i in indices if not 0 <= i < len(entries)]
    if bad:
        raise ValueError(f"devices {bad}: CUDA_VISIBLE_DEVICES={visible} shows {len(entries)} GPU(s)")
    return ",".join(entries[i] for i in indices)


def replica_devices(gen_ids: list[int], tensor_parallel_size: int) -> list[list[int]]:
    """The devices of each local replica: gen_ids in consecutive runs of tensor_parallel_size ('0,1,2,3' with TP 2:
    [[0, 1], [2, 3]]); refused when they do not split evenly."""
    tp = tensor_parallel_size
    if tp < 1 or not gen_ids or len(gen_ids) % tp:
        raise ValueError(f"{len(gen_ids)} generator devices do not split into replicas of tensor_parallel_size {tp}")
    return [gen_ids[i: i + tp] for i in range(0, len(gen_ids), tp)]


def find_subsequence_end(ids: list[int], pattern: list[int], start: int = 0, stop: int | None = None) -> int | None:
    """Index just past the first occurrence of `pattern` in ids[start:stop], or None."""
    stop = len(ids) if stop is None else min(stop, len(ids))
    n = len(pattern)
    for end in range(max(start, 0) + n, stop + 1):
        if ids[end - n : end] == pattern:
            return end
    return None


def interruption_start(token_ids: list[int], budget: int, close_ids: list[int]) -> int | None:
    """Where the interruption phrase was forced (== budget), or None: the same rule the logits processor applies.
    The phrase is forced iff the completion reached `budget` tokens without `</think>` in its first `budget`."""
    if len(token_ids) <= budget:
        return None
    if find_subsequence_end(token_ids, close_ids, 0, budget) is not None:
        return None
    return budget


# --------------------------------------------------------------------------------------------------------------
# Code that runs inside vLLM's processes: the interruption logits processor and the weight-sync worker extension
# --------------------------------------------------------------------------------------------------------------

# Not vLLM's own thinking budget (SamplingParams.thinking_token_budget): on the V1 runner it forces the phrase into
# the answer of a completion that closed </think> itself within its budget (tests/test_thinking_budget.py), and on V2
# it counts and stops by other rules than ScaleRL's (docs/pipeline.md, the design's section 3).
_INTERRUPT_KEY = "scalerl_interrupt"

class _ForcePhrase:
    """Per-request state: force `phrase` at position `budget` unless `close` appeared in the first `budget` tokens."""

    def __init__(self, budget: int, phrase: list[int], close: list[int]):
        self.budget, self.phrase, self.close = budget, phrase, close
        self.done = False
        self.scanned = 0  # output tokens already scanned for `close`

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.done:
            return logits
        n = len(output_ids)
        limit = min(n, self.budget)
        if self.scanned < limit:
            if find_subsequence_end(output_ids, self.close, self.scanned - len(self.close) + 1, limit) is not None:
                self.done = True  # the model closed its thinking itself
                return logits
            self.scanned = limit
        i = n - self.budget
        if i < 0:
            return logits
        if i >= len(self.phrase):
            self.done = True
            return logits
        forced = self.phrase[i]
        logits.fill_(float("-inf"))
        logits[forced] = 0.0
        return logits


def _interruption_processor_class() -> type:
    """Build the vLLM logits processor class on first use, so that importing this module (in every learner rank)
    does not import vLLM. vLLM loads it as "harness.vllm_replica:InterruptionLogitsProcessor" (module __getattr__
    below)."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class InterruptionLogitsProcessor(AdapterLogitsProcessor):
        """vLLM v1 logits processor for ScaleRL's interruptions; active on requests whose SamplingParams.extra_args
        carry {"scalerl_interrupt": {"budget": b, "phrase": [...], "close": [...]}}."""

        @classmethod
        def validate_params(cls, params: Any) -> None:  # at admission: a malformed spec fails its request only
            interruption_spec(params.extra_args)

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params: Any) -> Any:
            spec = interruption_spec(params.extra_args)
            return None if spec is None else _ForcePhrase(*spec)

    InterruptionLogitsProcessor.__module__ = __name__
    InterruptionLogitsProcessor.__qualname__ = "InterruptionLogitsProcessor"
    return InterruptionLogitsProcessor


_SLOWDOWN_ENV = "SCALERL_DEBUG_GEN_SLOWDOWN"  # FleetConfig.debug_slowdown, read inside vLLM's worker


class WorkPace:
    """A debug slowdown: `pause()` sleeps (x - 1) times the work done since `start()`, so that the work takes x times
    as long. The work is measured by the clock a busy machine does not stretch: on CPU the calling thread's CPU time;
    the wall time there also held the time other processes had the cores, which the sleep multiplied, so that the
    busier the machine the slower the knob made the work (a test's generator at x = 4 took 10 s on two cores shared
    with busy loops, and 178 s with another fixture's replicas beside it). On a GPU, whose work is no thread's CPU
    time, the wall time. Used by the generator's engine (_Pace) and train.py's --debug-learner-slowdown."""

    def __init__(self, factor: float, on_cpu: bool) -> None:
        self.factor = factor
        self.work_clock = time.thread_time if on_cpu else time.perf_counter
        self.work_start = self.work_clock()

    def start(self) -> None:
        self.work_start = self.work_clock()

    def pause(self) -> None:
        if self.factor > 1:  # a thread's clock read from another thread could go back: that is no sleep, no error
            time.sleep((self.factor - 1) * max(0.0, self.work_clock() - self.work_start))


class _Pace(WorkPace):
    """Paces each engine step by x = SCALERL_DEBUG_GEN_SLOWDOWN (WorkPace), so that the engine itself (not just our
    reading of its outputs: vLLM's EngineCore runs in its own process) runs x times slower. A step's work is what
    happened since the previous step ended (on CPU, the CPU time of the engine's thread, the one that steps the
    model and calls this), a gap of a second or more being an idle engine."""

    def __init__(self, on_cpu: bool) -> None:
        super().__init__(float(os.environ.get(_SLOWDOWN_ENV, "1")), on_cpu)
        self.last_step_end: float | None = None  # wall time

    def step(self) -> None:
        if self.last_step_end is not None and time.perf_counter() - self.last_step_end < 1.0:
            self.pause()
        self.last_step_end = time.perf_counter()
        self.start()


def _slowdown_processor_class() -> type:
    """A vLLM (V1) logits processor that changes no logit and paces the engine (_Pace): the debug knob behind
    FleetConfig.debug_slowdown."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class SlowdownLogitsProcessor(LogitsProcessor):
        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool):
            self.pace = _Pace(on_cpu=torch.device(device).type == "cpu")

        def is_argmax_invariant(self) -> bool:
            return False  # keep vLLM from skipping it

        def update_state(self, batch_update: Any) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            self.pace.step()
            return logits

    SlowdownLogitsProcessor.__module__ = __name__
    SlowdownLogitsProcessor.__qualname__ = "SlowdownLogitsProcessor"
    return SlowdownLogitsProcessor


# vLLM 0.32 runs a GPU engine with its V2 model runner wherever Triton is installed, and V2 loads only logits
# processors of its own interface (vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor); the CPU build has no
# Triton and runs V1, whose interface is the one above. `model_runner_v2` picks one, replica_main pins vLLM to it
# (VLLM_USE_V2_MODEL_RUNNER), and vllm_engine_kwargs names the classes of that interface.

def model_runner_v2(on_gpu: bool) -> bool:
    """Whether a replica's vLLM runs its V2 model runner: VLLM_USE_V2_MODEL_RUNNER where the user set it (parsed as
    vLLM parses it), else V2 on a GPU with Triton (vLLM 0.32's own default for this project's settings) and V1 on
    CPU, the runner the CPU tests cover."""
    import vllm.envs as envs

    setting = envs.VLLM_USE_V2_MODEL_RUNNER
    if setting is not None:
        return bool(setting)
    if not on_gpu:
        return False
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def interruption_spec(extra_args: Mapping[str, Any] | None) -> tuple[int, list[int], list[int]] | None:
    """(budget, phrase, close) of a request's SamplingParams.extra_args, None without an interruption; a malformed
    one is refused in one line (V2 checks it when the request is admitted)."""
    spec = (extra_args or {}).get(_INTERRUPT_KEY)
    if not spec:
        return None
    try:
        budget, phrase, close = int(spec["budget"]), [int(t) for t in spec["phrase"]], [int(t) for t in spec["close"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{_INTERRUPT_KEY} must be {{'budget': int, 'phrase': [ids], 'close': [ids]}}: {e}") from None
    if budget < 0 or not phrase:
        raise ValueError(f"{_INTERRUPT_KEY}: budget must be >= 0 and the phrase not empty, got {spec!r}")
    return budget, phrase, close


def forced_rows(slots: np.ndarray, seq_lens: np.ndarray, prompt_lens: np.ndarray, budget: np.ndarray,
                phrase_len: np.ndarray) -> np.ndarray:
    """The batch rows whose next token may be forced, from the host's arrays alone (no GPU sync): row b (request
    slot slots[b]) has n = seq_lens[b] - prompt_lens[slot] output tokens, and position n is in the phrase's span
    when 0 <= n - budget < len(phrase) (budget -1: no interruption). Exact without speculative decoding."""
    b = budget[slots]
    i = seq_lens[: len(slots)] - prompt_lens[slots] - b
    return np.flatnonzero((b >= 0) & (i >= 0) & (i < phrase_len[slots]))


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 host list on `device` without waiting for the GPU (pinned, non-blocking)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def force_unless_closed(logits: torch.Tensor, rows: list[int], forced: list[int], slots: list[int], starts: list[int],
                        budgets: list[int], history: torch.Tensor, close: list[int]) -> torch.Tensor:
    """V2's forcing, decided on the device: each row in `rows` gets logit 0 for its token in `forced` and -inf for
    every other, unless `close` lies within its first `budget` output tokens (history[slot, start:start+budget],
    history being vLLM's committed token ids per request slot). The rows share one `close`."""
    device, k, width, c = logits.device, len(rows), max(budgets), len(close)
    closed = torch.zeros(k, dtype=torch.bool, device=device)
    if 0 < c <= width:
        pos = (_on(starts, device)[:, None] + torch.arange(width, device=device)).clamp(max=history.shape[1] - 1)
        tokens = history[_on(slots, device)[:, None], pos]  # [k, width]
        match = torch.arange(width - c + 1, device=device)[None] <= _on(budgets, device)[:, None] - c
        for j, token in enumerate(close):
            match = match & (tokens[:, j: j + width - c + 1] == token)
        closed = match.any(dim=1)
    row_ids = _on(rows, device)
    phrase_logits = torch.full((k, logits.shape[1]), float("-inf"), dtype=logits.dtype, device=device)
    phrase_logits[torch.arange(k, device=device), _on(forced, device)] = 0.0
    logits[row_ids] = torch.where(closed[:, None], logits[row_ids], phrase_logits)
    return logits


def _interruption_processor_v2_class() -> type:
    """The interruption logits processor for vLLM's V2 model runner (GPU): the rule of _ForcePhrase, which rows it
    applies to read from the host's lengths (`forced_rows`), whether the model closed its thinking decided on the
    device (`force_unless_closed`), so that no step waits for the GPU."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class InterruptionLogitsProcessorV2(LogitsProcessor):
        def __init__(self, vllm_config: Any, req_states: Any):
            if getattr(vllm_config, "speculative_config", None) is not None:
                raise ValueError("InterruptionLogitsProcessorV2: speculative decoding is not supported (its rows "
                                 "are per draft token, and the forcing reads one row per request)")
            self.req_states = req_states
            self.budget = np.full(req_states.max_num_reqs, -1, dtype=np.int64)
            self.phrase_len = np.zeros(req_states.max_num_reqs, dtype=np.int64)
            self.specs: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (phrase, close)

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            interruption_spec(sampling_params.extra_args)

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            spec = interruption_spec(sampling_params.extra_args)  # a slot is reused: overwrite all of its state
            self.budget[req_idx], self.phrase_len[req_idx] = (spec[0], len(spec[1])) if spec else (-1, 0)
            self.specs[req_idx] = (spec[1], spec[2]) if spec else ([], [])
            return spec is not None

        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            slots = ctx.idx_mapping_np
            rows = forced_rows(slots, ctx.seq_lens_upper_bound_np, self.req_states.prompt_len.np, self.budget,
                               self.phrase_len)
            by_close: dict[tuple[int, ...], list[tuple]] = {}
            for b in rows.tolist():
                s = int(slots[b])
                phrase, close = self.specs[s]
                start = int(self.req_states.prompt_len.np[s])
                i = int(ctx.seq_lens_upper_bound_np[b]) - start - int(self.budget[s])
                by_close.setdefault(tuple(close), []).append((b, phrase[i], s, start, int(self.budget[s])))
            history = self.req_states.all_token_ids.gpu
            for close, group in by_close.items():
                logits = force_unless_closed(logits, *map(list, zip(*group)), history=history, close=list(close))
            return logits

    InterruptionLogitsProcessorV2.__module__ = __name__
    InterruptionLogitsProcessorV2.__qualname__ = "InterruptionLogitsProcessorV2"
    return InterruptionLogitsProcessorV2


def _slowdown_processor_v2_class() -> type:
    """SlowdownLogitsProcessor for vLLM's V2 model runner (the debug knob on a GPU)."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class SlowdownLogitsProcessorV2(LogitsProcessor):
        def __init__(self, vllm_config: Any, req_states: Any):
            self.pace = _Pace(on_cpu=False)  # V2 runs on a GPU only

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            return True  # V2 calls apply only for a batch where some request asks for it: all do

        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            self.pace.step()
            return logits

    SlowdownLogitsProcessorV2.__module__ = __name__
    SlowdownLogitsProcessorV2.__qualname__ = "SlowdownLogitsProcessorV2"
    return SlowdownLogitsProcessorV2


_LAZY_CLASSES = {"InterruptionLogitsProcessor": _interruption_processor_class,
                 "SlowdownLogitsProcessor": _slowdown_processor_class,
                 "InterruptionLogitsProcessorV2": _interruption_processor_v2_class,
                 "SlowdownLogitsProcessorV2": _slowdown_processor_v2_class}


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        cls = _LAZY_CLASSES[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def weight_tensors(state_dict: Mapping[str, Any], dtype: torch.dtype, tied: bool) -> dict[str, torch.Tensor]:
    """The tensors of a full HF-named state dict as the generator loads them: contiguous, floats in `dtype`, on
    the device they come on (rank 0's GPU for an NCCL broadcast: runtime.push_state_dict), wrapper prefixes
    stripped; a tensor already in `dtype` is not copied. An untied model must include lm_head.weight (else vLLM keeps a stale head); a tied
    one leaves it out: it is the embedding itself, which vLLM loads (skipping the alias), and safetensors refuses
    two names for one storage, as a tied learner's state dict has them."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        if hasattr(value, "full_tensor"):
            raise ValueError(f"{name} is a sharded DTensor: pass a full state dict (FSDP2: get_model_state_dict("
                             "model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))")
        for prefix in ("_orig_mod.", "module."):
            while name.startswith(prefix):
                name = name[len(prefix):]
        t = value.detach()
        if t.dtype.is_floating_point and t.dtype != dtype:
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    if tied:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise ValueError("state dict has no lm_head.weight: vLLM would keep a stale LM head (send it always)")
    return tensors


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); reached through `LLM.collective_rpc`. Weights themselves
    arrive through vLLM's weight-transfer API (the worker's init_weight_transfer_engine, start_weight_update,
    update_weights, finish_weight_update); importing this module registers the CPU engine for them
    (harness/weight_transfer.py). What is left here are two probes the tests use."""

    def scalerl_head_info(self) -> dict:
        model = self.model_runner.model  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        lp = getattr(model, "logits_processor", None)
        return {"weight_dtype": str(getattr(getattr(head, "weight", None), "dtype", None)),
                "head_dtype": str(getattr(lp, "head_dtype", None))}

    def scalerl_param_checksum(self, name: str) -> float:
        params = dict(self.model_runner.model.named_parameters())  # type: ignore[attr-defined]
        return float(params[name].detach().double().sum())


# --------------------------------------------------------------------------------------------------------------
# A replica: one vLLM engine in a process of its own, on this node or another
# --------------------------------------------------------------------------------------------------------------

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                  "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                  "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def cpu_kv_cache_bytes(model: str, dtype: str | None, max_model_len: int) -> int:
    """Host memory for the KV cache of one replica on CPU, given to vLLM as `kv_cache_memory_bytes`: the
    VLLM_CPU_KVCACHE_SPACE GiB of the environment (vLLM's own setting; tasks.VLLM_CPU_ENV makes it 1 unless the user
    set it), or more where one sequence of `max_model_len` tokens of `model` needs more: vLLM refuses to start an
    engine that cannot hold one ("To serve at least one request ..."), with advice for a GPU. The need is
    memory_plan.sequence_kv_cache_bytes, in the generator's dtype (float32 when None). A config that does not read
    leaves the environment's size, and vLLM to say what is wrong."""
    from transformers import AutoConfig  # here, not at the top: a replica on a GPU does not ask

    setting = cpu_kv_cache_setting()
    try:
        config = AutoConfig.from_pretrained(model).get_text_config()
        need = memory_plan.sequence_kv_cache_bytes(config, DTYPES.get(dtype, torch.float32).itemsize, max_model_len)
    except (OSError, ValueError, AttributeError, TypeError):
        return setting
    return max(setting, need)


def cpu_kv_cache_setting() -> int:
    """VLLM_CPU_KVCACHE_SPACE in bytes (1 GiB where it is not set); a value vLLM would not read raises ValueError."""
    setting = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or tasks.VLLM_CPU_ENV["VLLM_CPU_KVCACHE_SPACE"]
    if not setting.strip().isdigit() or int(setting) < 1:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={setting}: vLLM reads a whole number of GiB, at least 1")
    return int(setting) << 30


def vllm_engine_kwargs(cfg: Any, replica: int = 0) -> dict[str, Any]:
    """The arguments of replica `replica`'s `vllm.LLM` (each replica samples with a seed of its own); `cfg` is a
    harness/fleet.py's ReplicaSettings. vLLM finds our classes by the names of this module."""
    on_gpu = cfg.gen_devices is not None
    kwargs: dict[str, Any] = dict(
        model=vllm_internals.loadable_model_path(cfg.model), dtype=cfg.dtype, seed=cfg.seed + 7919 * replica,
        max_model_len=cfg.max_model_len,
        enforce_eager=(not on_gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
        logprobs_mode="processed_logprobs",  # logprobs after temperature: what the sampler really used
        worker_extension_cls=f"{__name__}.WeightSyncExtension",
        # weights arrive by vLLM's weight-transfer API; the engine is the one the generator chose at its start
        weight_transfer_config={"backend": cfg.weight_transport if cfg.weight_transport in ("gloo", "nccl", "ipc")
                                else ("nccl" if on_gpu else "gloo")},
        tensor_parallel_size=cfg.tensor_parallel_size, disable_log_stats=True, enable_prefix_caching=True,
    )
    if kwargs["weight_transfer_config"]["backend"] == "gloo":  # vLLM's factory must know it before an LLM is built
        from harness import weight_transfer  # noqa: F401  (importing it registers the engine)
    v2 = "V2" if model_runner_v2(on_gpu) else ""  # the classes of the runner's interface (replica_main pins it)
    if cfg.interruptions:
        kwargs["logits_processors"] = [f"{__name__}:InterruptionLogitsProcessor{v2}"]
    if cfg.slowdown_of(replica) > 1:  # the factor reaches vLLM's worker through the environment (replica_main)
        kwargs["logits_processors"] = kwargs.get("logits_processors", []) + [f"{__name__}:SlowdownLogitsProcessor{v2}"]
    if cfg.fp32_lm_head and DTYPES.get(cfg.dtype, torch.float32) != torch.float32:
        kwargs["hf_overrides"] = {"head_dtype": "float32"}  # lm_head matmul and logits in float32
    if on_gpu:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    else:  # every request is seeded (pipeline_rl.sampling_seed); vLLM rewinds a seeded request's generator after a
        # chunk of its prefill (Generator.set_offset), which a CPU generator cannot do: "CPU Generator does not use
        # offset". Whole prefills only, then, in steps of at least one full sequence.
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, cfg.max_model_len),
                      kv_cache_memory_bytes=cpu_kv_cache_bytes(cfg.model, cfg.dtype, cfg.max_model_len))
    if cfg.max_num_seqs:
        kwargs["max_num_seqs"] = cfg.max_num_seqs
    return kwargs


def completion_text(tokenizer: Any, prompt_ids: list[int], token_ids: list[int], stopped: bool) -> str:
    """A finished completion's text as vLLM's detokenizer writes it, decoded once at its end. The replica's requests
    skip vLLM's detokenizing (SamplingParams(detokenize=False)): it decodes every sampled token of every request at
    every engine step, and each logprob's token too, which no one here reads; on the tiny model that took 15% of
    the replica's time. vLLM's fast detokenizer steps a tokenizers DecodeStream primed with the prompt, without
    special tokens, over the completion less the token that stopped it; so does this (tests/test_thinking_budget.py
    compares the two on both models' completions). A tokenizer without a Rust backend: its plain decode."""
    ids = token_ids[:-1] if stopped else token_ids
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.decode(ids, skip_special_tokens=True)
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)
    return "".join(stream.step(backend, i) or "" for i in ids)


def sampled_output(out: Any, version: int, tokenizer: Any = None) -> dict[str, Any]:
    """What a replica sends back of one finished vLLM request: its tokens, the sampler's logprob of each, the
    weight version that sampled each (vLLM's spans; `version` where it gives none), its text and finish reason.
    `tokenizer`: decode the text here (completion_text), for a request vLLM did not detokenize; None: vLLM's text."""
    c = out.outputs[0]
    token_ids = list(c.token_ids)
    n = len(token_ids)
    logprobs = [0.0] * n
    lps = c.logprobs
    if lps is not None and hasattr(lps, "start_indices"):  # FlatLogprobs: the sampled token comes first
        for i, s in enumerate(lps.start_indices[:n]):
            if lps.token_ids[s] != token_ids[i]:
                raise RuntimeError("logprobs out of step with the sampled tokens")
            logprobs[i] = float(lps.logprobs[s])
    elif lps is not None:
        for i, (tok, entry) in enumerate(zip(token_ids, lps)):
            logprobs[i] = float(entry[tok].logprob)
    versions = [version] * n
    for span in c.weight_versions or []:
        for i in range(span.start, min(span.end, n)):
            versions[i] = int(span.version)
    finish = str(c.finish_reason)
    text = c.text if tokenizer is None else completion_text(tokenizer, out.prompt_token_ids, token_ids,
                                                              finish == "stop")
    return {"rid": out.request_id, "token_ids": token_ids, "logprobs": logprobs, "versions": versions,
            "text": text, "finish_reason": finish}


class _Replica:
    """Runs in a replica process: one vLLM engine. It takes requests from the scheduler, steps the engine, sends
    back each finished completion as it comes, and applies weight updates between two engine steps."""

    def __init__(self, conn: Any, replica_id: int, config: Any, version: int | None):  # config: ReplicaSettings
        self.conn, self.id, self.cfg = conn, replica_id, config
        self.version = -1 if version is None else version  # -1: not the run's weights yet (a late joiner)
        self.send_lock = threading.Lock()  # the engine watcher thread sends too
        self.closing = False
        self.updating = False  # between a weight update's start and its finish (weight_call)
        self.weights_failed = False  # a call of this update failed: the rest of it is skipped

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def init_engine(self) -> dict:
        from vllm import LLM

        kwargs = vllm_engine_kwargs(self.cfg, self.id)
        if "kv_cache_memory_bytes" in kwargs:  # its size holds VLLM_CPU_KVCACHE_SPACE, which vLLM lets override it
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        with vllm_internals.engine_start():  # no deprecation of vLLM's in every run
            self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()  # texts are decoded once a completion ends (completion_text)
        self.llm.update_weight_version(str(self.version))
        import psutil

        procs = psutil.Process().children(recursive=True)
        self.vllm_processes = [(p.pid, p.create_time(), p.name()) for p in procs]
        if self.vllm_processes:  # vLLM's engine core or workers in processes of their own: watch them
            threading.Thread(target=self.watch_engine, daemon=True).start()
        return {"pid": os.getpid(), "vllm_processes": self.vllm_processes,
                "max_num_seqs": self.engine.vllm_config.scheduler_config.max_num_seqs,
                "head": self.llm.collective_rpc("scalerl_head_info")[0]}

    def dead_vllm_processes(self) -> str | None:
        """'vLLM process NAME (pid P)' for each of this replica's vLLM processes that has died, or None."""
        return dead_processes((pid, created, f"vLLM process {name}")
                              for pid, created, name in getattr(self, "vllm_processes", []))

    def failure(self, error: BaseException) -> str:
        """What to report of an error: a dead vLLM process first, since vLLM's own error (EngineDeadError) may
        arrive before the watcher sees the process gone, and the dead process is the cause a user must read."""
        dead = self.dead_vllm_processes()
        return (f"{dead} died; " if dead else "") + f"{type(error).__name__}: {error}\n{traceback.format_exc()}"

    def watch_engine(self) -> None:
        """A vLLM process of this replica died: engine.step() would wait for its outputs forever, so report it
        and exit; the scheduler then moves this replica's work to the others."""
        while not self.closing:
            dead = self.dead_vllm_processes()
            if dead and not self.closing:
                try:
                    self.send(("error", f"{dead} died"))
                finally:
                    os._exit(70)
            time.sleep(0.2)

    def run(self) -> None:
        busy_s = 0.0  # engine time since the last message: sent with the next finished completions
        while not self.closing:
            # no step from a weight update's start to its finish: the model's layers are being reloaded (vLLM's
            # layerwise reload puts them on the meta device until each is whole)
            busy = self.engine.has_unfinished_requests() and not self.updating
            while self.conn.poll(0.0 if busy else 0.2):
                try:
                    msg = self.conn.recv()
                except EOFError:  # the scheduler is gone
                    self.closing = True
                    return
                self.handle(msg)
                busy = not self.updating  # handle the rest of the queue before the next step, without waiting
                if self.closing:
                    return
            if self.engine.has_unfinished_requests() and not self.updating:
                t0 = time.perf_counter()
                outputs = self.engine.step()
                busy_s += time.perf_counter() - t0
                done = [sampled_output(out, self.version, self.tokenizer) for out in outputs if out.finished]
                if done:
                    self.send(("outputs", done, busy_s))
                    busy_s = 0.0

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":  # rendered as vLLM 0.32 asks (Renderer.render_cmpl), where raw prompts are deprecated
            rendered = self.llm.renderer.render_cmpl([{"prompt_token_ids": prompt_ids, "cache_salt": salt}
                                                      for _, prompt_ids, salt, _ in msg[1]]) if msg[1] else []
            for (rid, _, _, spec), engine_input in zip(msg[1], rendered):
                self.engine.add_request(rid, engine_input, self.sampling_params(spec))
        elif kind == "weights":  # one call of vLLM's weight-transfer API, relayed from the learner's trainer engine
            self.weight_call(msg[1], msg[2])
        elif kind == "debug":
            what = msg[1]
            value = self.llm.collective_rpc("scalerl_param_checksum", args=(what.split(":", 1)[1],))[0] \
                if what.startswith("checksum:") else None
            self.send(("debug", value))
        elif kind == "close":
            self.closing = True
        else:
            raise ValueError(f"unknown command {kind!r}")

    @staticmethod
    def sampling_params(spec: dict) -> Any:
        """A request's vLLM SamplingParams from the scheduler's spec (pipeline_rl's request spec). Only the sampled
        token's logprob, in vLLM's flat lists (no Logprob object and dict per token), and no detokenizing: the
        replica decodes a completion's text once it ends (completion_text)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra = {_INTERRUPT_KEY: spec["interrupt"]} if spec.get("interrupt") else None
        return SamplingParams(temperature=spec["temperature"], top_p=1.0, top_k=0, max_tokens=spec["max_tokens"],
                              logprobs=0, flat_logprobs=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra, seed=spec.get("seed"))

    def weight_call(self, method: str, payload: Any) -> None:
        """Make on this replica's vllm.LLM the call the learner's trainer engine made on its client (harness/
        weight_transfer.py; vLLM's nccl and ipc engines drive the same four): init_weight_transfer_engine, then per
        update start_weight_update, update_weights, finish_weight_update with the version (payload: plain data).
        The engine core is paused from start to finish, so that no step runs on half-loaded weights and the
        version labels stay exact. A failed call is reported once ("update_failed": the scheduler takes this replica
        out) and the rest of its update skipped."""
        if method == "init":
            self.weights_failed = False
        elif self.weights_failed:
            return
        try:
            if method == "init":
                self.llm.init_weight_transfer_engine({"init_info": payload})
            elif method == "start":
                self.update_t0 = time.perf_counter()
                self.updating = True
                self.pause_engine()
                self.llm.start_weight_update()
            elif method == "update":
                self.llm.update_weights({"update_info": decode_update_info(payload)})
            elif method == "finish":
                version = int(payload)
                self.llm.finish_weight_update(str(version))
                if not self.engine.has_unfinished_requests():
                    self.engine.reset_prefix_cache()  # only possible while nothing runs; else the cache salt protects
                self.version = version
                self.updating = False
                self.resume_engine()
                self.send(("updated", version, time.perf_counter() - self.update_t0))
            else:
                raise ValueError(f"unknown weight-transfer call {method!r}")
        except Exception as e:  # half an update may be in: the scheduler takes this replica out
            self.weights_failed = True  # and no step more on weights half loaded (self.updating stays)
            with contextlib.suppress(Exception):
                self.resume_engine()
            self.send(("update_failed", method, f"{method}: {type(e).__name__}: {str(e)[:500]}"))

    def pause_engine(self) -> None:
        # An engine core in its own process steps on its own: pause it until resume. One in this process steps only
        # when run() calls engine.step(), not during a weight call.
        core = self.engine.engine_core
        if vllm_internals.has_utility_calls(core) and not getattr(self, "paused", False):
            vllm_internals.pause_scheduler(core)
            self.paused = True

    def resume_engine(self) -> None:
        if getattr(self, "paused", False):
            vllm_internals.resume_scheduler(self.engine.engine_core)
            self.paused = False

    def shutdown(self) -> None:
        """Stop vLLM's engine process, if it has one (SIGTERM, then a kill after 1 s). An engine inside this process
        (the CPU's) ends with it: its teardown (a garbage collection of the weights and KV cache, its process groups)
        took 1.4 s at the end of every run, for a process about to exit."""
        self.closing = True
        llm = getattr(self, "llm", None)
        if llm is not None and not engine_in_this_process():
            try:
                vllm_internals.shutdown_engine_core(llm, timeout=1.0)
            except Exception:
                pass


def decode_update_info(payload: dict) -> dict:
    """An update info as the weight-transfer engine takes it, from the plain data the channel carried (an ipc
    engine's CUDA IPC handles, sent as names and lists: harness/weight_transfer.plain_update_info)."""
    from harness import weight_transfer

    return weight_transfer.update_info_from_plain(payload)


def engine_in_this_process() -> bool:
    """Whether vLLM's engine runs inside this replica's process, as replica_main chose it for vLLM (its
    VLLM_ENABLE_V1_MULTIPROCESSING): then nothing of it outlives the process."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1"


def exit_at_once(code: int = 0) -> None:
    """End a process that has closed in order and told its parent so: its exit handlers (atexit's: a math-verify
    server's close, multiprocessing's), then exit with `code` without the interpreter's teardown of torch and vLLM,
    which took 1.7 s at the end of every run in a replica and 0.9 s in the generator process, and in which a gloo
    worker thread still finishing a collective can crash the process (docs/runtime.md, "Native crashes"). Only
    where nothing outlives it that the teardown would clean: a replica whose engine ran in its own process (GPUs)
    leaves vLLM's shared-memory queues to that teardown, so it exits the usual way."""
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def report_exit(stop: BaseException) -> int:
    """What the interpreter would print and return for an exception that ended the program: SystemExit's message
    (to stderr, status 1) or status, else the traceback (through sys.excepthook) and status 1; but nothing, status 1,
    when stdout's reader is gone (`train.py plan ... | head`), as harness/cli.exit_with ends a command. Under torchrun
    the error is also handed to its failure summary (harness/cli.torchrun_error_file)."""
    if quiet_if_reader_gone(stop):
        return 1
    if isinstance(stop, SystemExit):
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
        torchrun_error_file(stop, code)  # under torchrun: its failure summary names the error, not a URL
        return code
    sys.excepthook(type(stop), stop, stop.__traceback__)
    torchrun_error_file(stop, 1)
    return 1


class _MainReferences(pickle.Pickler):
    """Pickles into nothing, noting whether what it pickles names anything defined in `__main__`."""

    found = False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, mpc.Connection):  # a pipe end: multiprocessing passes it its own way
            return int, ()
        try:
            self.found = self.found or getattr(obj, "__module__", None) == "__main__"
        except Exception:  # an object whose attribute lookup fails: assume the worst
            self.found = True
        return NotImplemented


def start_process(target: Callable[..., Any], name: str, args: tuple, kwargs: dict | None = None) -> Any:
    """Start `target(*args, **kwargs)` in a fresh interpreter (multiprocessing's spawn: vLLM and CUDA need one) and
    return the started Process. Spawn runs the parent's main script again in the child, so that what the child
    unpickles from `__main__` exists there: under torchrun that is train.py, whose imports cost 2.5 s of a run's start
    in the generator process and again in each replica, and nothing the project sends a child comes from it. So the
    script is left out, unless `target` or its arguments name something defined in it (a task class in a user's own
    script). The arguments travel through spawn's pipe between this process and its child, not a socket of the
    network."""
    proc = mp.get_context("spawn").Process(target=target, name=name, args=args, kwargs=kwargs or {})
    finder = _MainReferences(io.BytesIO())
    try:
        finder.dump((target, args, kwargs))
    except Exception:  # not picklable as plain pickle: leave it to multiprocessing, main script and all
        finder.found = True
    main = sys.modules["__main__"]
    if finder.found or not hasattr(main, "__file__"):
        return _start_or_kill(proc)
    main_file, main_spec = main.__file__, getattr(main, "__spec__", None)
    del main.__file__  # spawn's preparation data then names no main script (nor module) to run again
    main.__spec__ = None
    try:
        return _start_or_kill(proc)
    finally:
        main.__file__, main.__spec__ = main_file, main_spec


def _start_or_kill(proc: Any) -> Any:
    """proc.start(); if it is interrupted (a Ctrl-C or SIGTERM during a run's start raises SystemExit wherever the
    main thread is; a spawn on a loaded machine takes seconds), a child already spawned is killed, not left behind.
    A child spawned before its preparation data was sent exits by itself on the pipe's end."""
    try:
        proc.start()
    except BaseException:
        if proc.pid is not None:
            proc.kill()
            proc.join(5)
        raise
    return proc


# A test hook, never set by the project: the socket of tests/replica_zygote.py, a process of the test session that has
# imported vLLM once and forks each run's local CPU replicas (saving the 12-17 s import of vLLM at each start).
REPLICA_ZYGOTE_ENV = "SCALERL_TEST_REPLICA_ZYGOTE"
ZYGOTE_WAIT_S = 300.0  # the zygote may still be importing vLLM when a run asks it first


def start_replica(address: str, secret: bytes, local_id: int, devices: list[int] | None,
                  config_type: Callable[..., Any]) -> Any:
    """Start local replica `local_id` of a generator listening at `address`: replica_main in a process of its own
    (spawned; under the test session's zygote, forked from it). Returns the started process (what the pool reads:
    pid, name, is_alive, join, exitcode, kill)."""
    name = f"scalerl-replica-{local_id}"
    zygote = os.environ.get(REPLICA_ZYGOTE_ENV)
    if zygote and devices is None:
        return ForkedReplica.start(zygote, name, {
            "address": address, "secret": secret.hex(), "local_id": local_id,
            "config_type": f"{config_type.__module__}:{config_type.__qualname__}"})
    return start_process(replica_main, name, (address, secret, local_id, devices, os.getpid()),
                         {"config_type": config_type})


class ForkedReplica:
    """A replica forked by the test session's zygote (tests/replica_zygote.py), seen as multiprocessing's Process is:
    the zygote is its parent, so it reports the child's exit code over this process's connection to it (one JSON
    line), and a child whose zygote connection ends (the zygote died) counts as killed. The child dies with this
    process (the zygote watches it for the child), gets this process's environment, directory and stdout/stderr."""

    def __init__(self, sock: socket.socket, pid: int, name: str):
        self.sock, self.pid, self.name = sock, pid, name
        self.exitcode: int | None = None
        self._buf = b""  # what came from the zygote past the last whole line

    @classmethod
    def start(cls, path: str, name: str, request: dict) -> "ForkedReplica":
        """Ask the zygote at `path` for replica `name` (replica_main's arguments in `request`); waits while the
        zygote still imports vLLM."""
        deadline = time.monotonic() + ZYGOTE_WAIT_S
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if os.path.exists(path + ".failed"):
                    raise RuntimeError(f"the test session's replica zygote failed to start: "
                                       f"{Path(path + '.failed').read_text().strip().splitlines()[-1]}") from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the test session's replica zygote at {path} did not answer within "
                                       f"{ZYGOTE_WAIT_S:.0f} s") from None
                time.sleep(0.1)
        request = {**request, "name": name, "watch_pid": os.getpid(), "cwd": os.getcwd(), "env": dict(os.environ)}
        sys.stdout.flush(), sys.stderr.flush()  # descriptors 1 and 2, which a spawned child would inherit
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [1, 2])
        proc = cls(sock, 0, name)
        answer = proc._read(None)
        if "pid" not in answer:
            sock.close()
            raise RuntimeError(f"the test session's replica zygote did not start {name}: {answer}")
        proc.pid = answer["pid"]
        return proc

    def _read(self, timeout: float | None) -> dict:
        """The zygote's next line within `timeout` ({} if none came); its end counts as the child killed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not mpc.wait([self.sock], left):
                return {}
            data = self.sock.recv(65536)
            self._buf += data or json.dumps({"exitcode": -signal.SIGKILL}).encode() + b"\n"
        line, self._buf = self._buf.split(b"\n", 1)
        answer = json.loads(line)
        if "exitcode" in answer:
            self.exitcode = answer["exitcode"]
            self.sock.close()
        return answer

    def is_alive(self) -> bool:
        if self.exitcode is None:
            self._read(0)
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is None:
            self._read(timeout)

    def kill(self) -> None:
        if self.is_alive():  # not a pid the zygote has reaped (and the system may give again)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (a no-op where prctl is missing)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except Exception:
        pass


def exit_on_sigterm() -> None:
    """SIGTERM ends the process through its `finally` blocks; a second one is ignored, so that the shutdown they
    run (closing the replicas) is not cut short by it (the learner's close() escalates to SIGKILL anyway)."""
    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def replica_main(address: str, secret: bytes, local_id: int | None, devices: list[int] | None,
                  parent_pid: int | None, model: str | None = None, tensor_parallel_size: int | None = None,
                  connect_timeout: float = 60.0, config_type: Callable[..., Any] | None = None) -> None:
    """Entry point of a replica process: connect to the scheduler at `address`, prove the secret, start the engine
    with the run's settings (which come over the connection as a dict: `config_type`, fleet.ReplicaSettings,
    builds them again and checks them) and serve. `local_id`: the place of a replica the generator process started
    itself; None for one that joined with `python pipeline_rl.py replica`."""
    if parent_pid is not None:  # started by the generator process (or the join command): die with it. SIGKILL, since
        # a replica blocked in a weight broadcast (C code) would not see a SIGTERM before the group's timeout
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent_pid:
            return
    exit_on_sigterm()
    for var in TORCHRUN_VARS:  # a vLLM started under torchrun must not see the learner's process group
        os.environ.pop(var, None)
    if devices is not None:  # before anything touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    else:
        tasks.set_vllm_cpu_env()
    try:
        conn, bind_host = connect_to_generator(address, secret, connect_timeout)
    except ConnectionError as e:  # unreachable, or refused (a wrong secret): one line on this side, no traceback
        print(f"[replica] {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    replica, refused = None, False
    try:
        conn.send(("hello", {"pid": os.getpid(), "local_id": local_id, "node": socket.gethostname(),
                             "bind_host": bind_host, "devices": devices,
                             "tensor_parallel_size": tensor_parallel_size}))
        msg = conn.recv()
        if msg[0] == "refused":
            print(f"[replica] the generator at {address} refused this replica: {msg[1]}", file=sys.stderr, flush=True)
            return
        _, settings, replica_id, version = msg
        overrides = {k: v for k, v in (("model", model), ("tensor_parallel_size", tensor_parallel_size)) if v}
        if config_type is None:
            raise TypeError("replica_main needs config_type (fleet.ReplicaSettings) to read the run's settings")
        config = config_type(**{**settings, **overrides})  # checked again, with this node's values
        os.environ.setdefault("VLLM_LOGGING_LEVEL", config.vllm_log_level)
        os.environ[_SLOWDOWN_ENV] = str(config.slowdown_of(replica_id))
        # vLLM's engine and workers read the runner choice from here: the one vllm_engine_kwargs names classes for
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if model_runner_v2(config.gen_devices is not None) else "0"
        engine_process = config.gen_devices is not None if config.engine_process is None else config.engine_process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
        if devices is None and config.num_threads:  # before vLLM's CPU worker starts: it refuses it afterwards
            torch.set_num_threads(config.num_threads)
        if engine_process and (problem := shm_problem()):  # a failed start's one line, not the engine's traceback
            conn.send(("error", problem))
            return
        replica = _Replica(conn, replica_id, config, version)
        info = replica.init_engine()
        replica.send(("ready", info))
        replica.run()
    except wire.FrameRefused as e:  # nothing of it ran; the generator sees this connection close
        print(f"[replica] refused a frame from the generator at {address}: {e}; this replica stops",
              file=sys.stderr, flush=True)
        refused = True
    except BaseException as e:  # report everything, including SystemExit from SIGTERM
        try:
            conn.send(("error", replica.failure(e) if replica is not None else
                       f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
        if not isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
    finally:
        if replica is not None:
            replica.shutdown()
        try:
            conn.send(("closed", None))
        except Exception:
            pass
    if refused:
        raise SystemExit(1)
    if engine_in_this_process():  # the CPU's
        exit_at_once()  # closed in order (an error above propagates instead, with its traceback and exit status)


# --------------------------------------------------------------------------------------------------------------
# Who may connect: an HMAC challenge on the shared secret, both ways (wire's handshake), then wire.Channel
# --------------------------------------------------------------------------------------------------------------

HANDSHAKE_S = 10  # a connection that has not proved the secret by then is refused
MAX_HANDSHAKES = 16  # connections proving the secret at once; one more is closed at once (a replica tries again)
# accept() errors that pass (descriptors or buffers short for a moment, a peer gone before it was accepted)
ACCEPT_TRANSIENT = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO)


def _set_recv_timeout(owner: Any, seconds: float) -> None:
    """SO_RCVTIMEO on a socket (0: none): a blocking read then fails instead of waiting forever."""
    dup = socket.fromfd(owner.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    try:
        dup.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))
    finally:
        dup.close()


def connect_to_generator(address: str, secret: bytes, timeout: float) -> tuple[wire.Channel, str]:
    """A channel to the generator process at HOST:PORT (both sides proved the secret; each frame is authenticated),
    retried until `timeout` (a replica may be started before the learner, or meet a listener busy with other
    connections), and the local address it leaves from (where this node's workers are reached). A wrong secret is
    refused at once (ConnectionRefusedError)."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _handshake_with_generator(host, port, secret)
        except mpc.AuthenticationError as e:
            raise ConnectionRefusedError(f"the generator at {address} refused this replica: wrong secret? ({e})") \
                from None
        except (OSError, EOFError) as e:  # not listening yet, or the connection closed before the challenge ended
            if time.monotonic() >= deadline:
                raise ConnectionError(f"could not connect to the generator at {address} within {timeout:.0f} s ({e}): "
                                      "is the learner running and listening there (train.py --gen-listen)?") from None
            time.sleep(1.0)


def _handshake_with_generator(host: str, port: int, secret: bytes) -> tuple[wire.Channel, str]:
    """One try of connect_to_generator: connect, then the challenge both ways."""
    sock = socket.create_connection((host, port), timeout=HANDSHAKE_S)
    sock.settimeout(None)
    bind_host = sock.getsockname()[0]
    _set_recv_timeout(sock, HANDSHAKE_S)
    try:
        channel = wire.handshake_as_replica(sock, secret)
    except BaseException:
        sock.close()
        raise
    _set_recv_timeout(sock, 0)
    return channel, bind_host


class RefusedLog:
    """The lines of refused connections: each counted (len), the last KEEP kept (iteration, indexing), so that a
    flood fills neither memory nor the log (the listener prints the first PRINT_FIRST, then one in PRINT_EVERY)."""

    KEEP, PRINT_FIRST, PRINT_EVERY = 100, 20, 100

    def __init__(self) -> None:
        self.total = 0
        self.lines: collections.deque[str] = collections.deque(maxlen=self.KEEP)
        self._lock = threading.Lock()

    def append(self, line: str) -> None:
        with self._lock:
            self.total += 1
            self.lines.append(line)

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.lines))

    def __getitem__(self, index: int) -> str:
        return list(self.lines)[index]


class ReplicaListener:
    """The generator process's listening socket: binds exactly `address`; each connection must prove the secret
    within HANDSHAKE_S seconds in all (in a thread of its own, so a silent one blocks nothing) or is refused and
    logged. At most MAX_HANDSHAKES wait at once: a flood of connections holds no more threads or descriptors than
    that, and once it stops a replica joins again within HANDSHAKE_S. `accepted` holds a wire.Channel per
    connection that proved the secret."""

    def __init__(self, address: str, secret: bytes):
        host, port, family = listen_address(address)  # refuses a wildcard however it is spelled, before binding
        self.sock = socket.create_server((host, port), family=family, backlog=64)
        bound = self.sock.getsockname()[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self.secret = secret
        self.accepted: queue.Queue = queue.Queue()  # (wire.Channel, (host, port)) that proved the secret
        self.refused = RefusedLog()
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True, name="scalerl-listener").start()

    def _accept_loop(self) -> None:
        short = False  # said once: accept() failing for a moment (out of descriptors)
        while True:
            try:
                sock, peer = self.sock.accept()
            except OSError as e:
                if self._closed:
                    return
                if e.errno not in ACCEPT_TRANSIENT:
                    print(f"[generator] stopped accepting replica connections on {self.address} ({e}): no replica "
                          "can join or rejoin this run", file=sys.stderr, flush=True)
                    return
                if not short:
                    print(f"[generator] cannot accept a replica connection for now ({e}); trying again",
                          file=sys.stderr, flush=True)
                short = True
                time.sleep(0.2)
                continue
            short = False
            if not self._slots.acquire(blocking=False):
                sock.close()
                self._refuse(peer, f"{MAX_HANDSHAKES} other connections are proving the secret")
                continue
            threading.Thread(target=self._handshake, args=(sock, peer), daemon=True).start()

    def _refuse(self, peer: tuple, reason: str) -> None:
        line = f"refused a connection from {peer[0]}:{peer[1]}: {reason}"
        self.refused.append(line)
        n = len(self.refused)
        if n <= RefusedLog.PRINT_FIRST or n % RefusedLog.PRINT_EVERY == 0:
            more = f" ({n} refused so far; from now on one in {RefusedLog.PRINT_EVERY} is printed)" \
                if n >= RefusedLog.PRINT_FIRST else ""
            print(f"[generator] {line}{more}", file=sys.stderr, flush=True)

    def _handshake(self, sock: socket.socket, peer: tuple) -> None:
        # SO_RCVTIMEO bounds each read, the timer the whole handshake: a byte every few seconds cannot hold a slot.
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns; the handshake fails

        timer = threading.Timer(HANDSHAKE_S, expire)
        timer.daemon = True
        try:
            timer.start()
            _set_recv_timeout(sock, HANDSHAKE_S)
            channel = wire.handshake_as_generator(sock, self.secret)
            timer.cancel()
            if expired.is_set():
                raise TimeoutError("the deadline passed as it ended")
        except Exception as e:
            timer.cancel()
            reason = "wrong secret" if isinstance(e, mpc.AuthenticationError) else "not this version's handshake" \
                if isinstance(e, ValueError) else f"no valid handshake within {HANDSHAKE_S} s"
            self._refuse(peer, f"{reason} ({type(e).__name__}: {e})")
            sock.close()
            return
        finally:
            self._slots.release()
        _set_recv_timeout(sock, 0)
        self.accepted.put((channel, peer))

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


# --------------------------------------------------------------------------------------------------------------
# Clean-up: the processes and files a dead replica or engine leaves behind
# --------------------------------------------------------------------------------------------------------------


def kill_processes(processes: Iterable[tuple[int, float, str]]) -> None:
    """Kill the processes (pid, create time, name) that are still the ones recorded, and wait until they are gone."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return
    survivors = [p for pid, created, _ in processes if (p := _same_process(pid, created)) is not None]
    for p in survivors:
        try:
            p.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + 5
    while survivors and time.monotonic() < deadline:
        survivors = [p for p in survivors if _alive(p)]
        time.sleep(0.05)


def shm_problem() -> str | None:
    """vLLM's engine in processes of its own keeps its queues in /dev/shm: the first alone takes 10 chunks of
    VLLM_MQ_MAX_CHUNK_BYTES_MB (160 MiB by default), and vLLM refuses less from inside its engine core process, whose
    message the replica never sees (it learns only that the engine failed). The same check of vLLM's, in its own
    words, before the engine starts: None where there is room."""
    import vllm.envs as envs
    from vllm.distributed.device_communicators.shm_broadcast import check_shm_free_space

    try:
        check_shm_free_space((10 * envs.VLLM_MQ_MAX_CHUNK_BYTES_MB) << 20, allocation_name="vLLM's engine queues")
    except RuntimeError as e:
        return str(e)
    return None


def remove_leaked_segments(since: float, shm: Path = Path("/dev/shm")) -> list[str]:
    """Unlink vLLM's shared-memory queues (psm_*) made since `since` that no live process maps or holds open any
    more: a killed engine core leaves them, and Python's resource tracker would remove them only when the learner
    exits. Segments of any other live vLLM are in use, hence kept."""
    if not shm.is_dir():
        return []
    candidates = {}
    for p in shm.glob("psm_*"):
        try:
            st = p.stat()
        except OSError:
            continue
        if st.st_uid == os.getuid() and st.st_mtime >= since - 1:
            candidates[str(p)] = p
    if not candidates:
        return []
    for proc in Path("/proc").iterdir():  # drop every segment that some process still maps or has open
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
            fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        for name in list(candidates):
            if name in maps or name in fds:
                del candidates[name]
    removed = []
    for name, p in candidates.items():
        try:
            p.unlink()
            removed.append(p.name)
        except OSError:
            pass
    return removed


def dead_processes(processes: Iterable[tuple[int, float, str]]) -> str | None:
    """'LABEL (pid P)' for each of `processes` (pid, creation time, label) that has died, joined by commas; or None."""
    dead = [f"{label} (pid {pid})" for pid, created, label in processes
            if (p := _same_process(pid, created)) is None or not _alive(p)]
    return ", ".join(dead) or None


def local_processes(pid: int | None, vllm_processes: Iterable[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """A local replica's process `pid` and its vLLM processes as (pid, creation time, label): what the learner
    watches while it broadcasts to the replica (WeightSender.send's `gone`)."""
    import psutil

    try:
        own = [(pid, psutil.Process(pid).create_time(), "replica process")] if pid else []
    except psutil.Error:
        own = []
    return own + [(p, t, f"vLLM process {name}") for p, t, name in vllm_processes]


def _same_process(pid: int, created: float) -> Any:
    """The psutil process `pid` if it is still the one created at `created` (not gone, not a recycled pid)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - created) < 1e-3 else None
    except psutil.Error:
        return None


def _alive(p: Any) -> bool:
    """psutil process still running (a zombie waiting to be reaped counts as dead)."""
    try:
        import psutil

        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


# --------------------------------------------------------------------------------------------------------------
# The join command of a generator node
# --------------------------------------------------------------------------------------------------------------


def read_secret(path: str | os.PathLike) -> bytes:
    """The shared secret in file `path` (surrounding whitespace dropped). Refused unless only its owner can read
    it, as ssh refuses a private key: a secret others can read is no secret."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"secret file {p}: no such file")
    if p.stat().st_mode & 0o077:
        raise ValueError(f"secret file {p} is readable by others: chmod 600 {p}")
    secret = p.read_bytes().strip()
    if len(secret) < 16:
        raise ValueError(f"secret file {p}: at least 16 bytes expected (e.g. `head -c 32 /dev/urandom | base64 > {p}`)")
    return secret


def replica_parser() -> argparse.ArgumentParser:
    """The flags of `python pipeline_rl.py replica`."""
    parser = OneLineParser(
        prog="pipeline_rl.py replica", formatter_class=DefaultsHelpFormatter,
        description="Start vLLM replicas on this node for a train.py run on another node. The run's engine settings "
                    "(model, dtype, sampling, lengths) come from the learner; this command says only where and how "
                    "many.")
    parser.add_argument("--connect", required=True, help="HOST:PORT the run's generator listens on (train.py "
                        "--gen-listen)")
    parser.add_argument("--secret-file", type=path_text, required=True, help="file holding the run's shared secret "
                        "(train.py --gen-secret-file), readable by its owner only")
    parser.add_argument("--replicas", type=int_at_least(1), default=None, help="replicas to start (default: 1 on CPU; "
                        "on GPU, the number of --gen-devices / --tensor-parallel-size)")
    parser.add_argument("--gen-devices", default=None, help="GPU: comma-separated CUDA devices of this node for the "
                        "replicas, taken in runs of --tensor-parallel-size")
    parser.add_argument("--tensor-parallel-size", type=int_at_least(1), default=1,
                        help="vLLM tensor parallelism of each replica")
    parser.add_argument("--model", type=path_text, default=None, help="the run's model as a path on this node "
                        "(default: the learner's --model, which must then be a hub name or the same path here)")
    parser.add_argument("--connect-timeout", type=number(0.0, above=True), default=600.0,
                        help="seconds to keep trying to reach the learner (a replica may be started before it)")
    return parser


def replica_args(argv: list[str]) -> tuple[argparse.Namespace, bytes, list[list[int] | None], int]:
    """`pipeline_rl.py replica`'s flags, checked before anything connects: (the flags, the secret, each replica's
    devices, the number of replicas). A bad flag exits with status 2 and one line naming it."""
    parser = replica_parser()
    args = parser.parse_args(argv)
    try:
        secret = read_secret(args.secret_file)
    except ValueError as e:
        parser.error(f"--secret-file: {e}")
    try:
        if not parse_address(args.connect)[0]:  # ':5000' was taken, and reached this node only
            raise ValueError(f"no host in {args.connect!r}: give the address of the run's generator node, as "
                             "train.py --gen-listen names it")
    except ValueError as e:
        parser.error(f"--connect: {e}")
    try:
        ids = [int(x) for x in args.gen_devices.split(",") if x.strip()] if args.gen_devices else []
        devices: list[list[int] | None] = list(replica_devices(ids, args.tensor_parallel_size)) if ids else [None]
    except ValueError as e:
        parser.error(f"--gen-devices {args.gen_devices}: {e}")
    n = args.replicas or len(devices)
    if ids and n > len(devices):
        parser.error(f"--replicas {n}: --gen-devices {args.gen_devices} makes {len(devices)} replica(s) of "
                     f"{args.tensor_parallel_size} device(s)")
    return args, secret, devices, n


def replica_command(argv: list[str], config_type: Callable[..., Any]) -> int:
    """`python pipeline_rl.py replica --connect HOST:PORT --secret-file FILE ...`: start replicas on this node for
    a run whose learner listens at HOST:PORT (train.py --gen-listen). `config_type`: fleet.ReplicaSettings,
    which each replica builds from the settings the generator sends. Returns the exit status."""
    args, secret, devices, n = replica_args(argv)
    on_gpu = devices != [None]
    procs = [start_process(replica_main, f"scalerl-replica-{i}",
                           (args.connect, secret, None, devices[i] if on_gpu else None, os.getpid(), args.model,
                            args.tensor_parallel_size if on_gpu else None, args.connect_timeout),
                           {"config_type": config_type})
             for i in range(n)]
    print(f"[replica] {n} replica(s) connecting to {args.connect}", file=sys.stderr, flush=True)
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:
            p.join(15)
    return max((p.exitcode or 0 for p in procs), default=0)


if "vllm.distributed.weight_transfer" in sys.modules:  # inside a vLLM worker, which imports this module for
    from harness import weight_transfer as _registers_the_cpu_engine  # noqa: F401  its extension before its engine
