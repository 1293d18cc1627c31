"""pipeline_rl.py: the generator's recipe. The bounded-staleness rule, and the scheduler that applies it over vLLM
replicas, with in-flight weight updates and a sync mode.

The learner (train.py, rank 0) owns a `Generator`. `Generator.start()` spawns the generator process, which runs the
scheduler over one vLLM replica or many, on this node or others. It moves prompts, completions, per-token logprobs,
per-token weight versions and weights; it knows nothing of losses.

The rule, first in the file. V = the learner's optimizer steps done; a token sampled with weights v has lag V - v;
k = max_off_policy. `get_batch(n, V)` never returns a group with a loss-masked token of lag > k. A group admitted to a
replica that holds weights g has the deadline g + k, and is admitted only while every group owed by then still fits
into the learner steps left (`admission_allowed`), and while the learner is fed, at most `buffer_steps` learner
steps' worth ahead of it (`should_admit`). Each batch takes the earliest deadlines first (`plan_batch`), so the
learner waits instead of dropping. Sync mode: get_batch generates n fresh groups with the current weights (lag 0).

The file, in order:
  the settings and records   GeneratorConfig (the rule's knobs first), Completion, Group
  the staleness rule         admission_allowed, off_policy_problems, should_admit, mandatory_count, plan_batch,
                             lag_stats, and the checks of the settings (config_problems)
  the scheduler              in the generator process, objects that own their state, in pipeline order: _DataStream
                             (prompts in), _GroupTable (the groups), _Admission, _Rewards (completions out),
                             _BatchChoice, _ReplicaFaults (a replica's death); _Scheduler routes the messages to them
  the handle                 Generator, the learner's side
  the join command           main: `python pipeline_rl.py replica --connect HOST:PORT --secret-file FILE ...`
Beneath it, in the harness (a reader of the recipe may skip them): harness/fleet.py, the replica fleet (the
replicas' settings, their processes, the listener and handshake, their ends, the generator process, the weight transport
and its engines, all replicas at once), and harness/vllm_replica.py, what runs inside vLLM's processes.

The design in full (sections 1-8: in-flight updates, the staleness rule and why it drops nothing, interruptions,
sampler logprobs, the FP32 LM head, placement, faults, who may connect): docs/pipeline.md, "The generator's design
in full".
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from harness import fleet, tasks, vllm_replica
from harness.fleet import FleetConfig, GeneratorError, GeneratorTimeout  # noqa: F401  (the handle raises them)
from harness.fleet import Fatal as _Fatal  # the generator cannot go on: its message says why in full
from harness.tasks import Problem, Task

# --------------------------------------------------------------------------------------------------------------
# The settings and the records
# --------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class GeneratorConfig:
    """Settings of the generator: the rule's knobs, then what is sampled, then the fleet that samples it
    (harness/fleet.py's FleetConfig: replicas, devices, addresses, vLLM's engine settings). train.py's flags of the
    same names share their defaults and are checked by the same `config_problems` (harness/flags.py's are handed
    it); train.py's generator_config maps the flags onto a GeneratorConfig."""

    # ---- the rule
    # pipeline: stream continuously with in-flight weight updates (PipelineRL-k); sync: generate a batch, train, sync
    mode: str = "pipeline"
    # k: the learner never trains on a token sampled more than k optimizer steps ago (ScaleRL: 8)
    max_off_policy: int = 8
    # freshness: admit at most this many learner steps' worth of groups ahead of the learner's next request (1:
    # generate the next batch while the learner trains on this one; None: only k limits it)
    buffer_steps: int | None = 1
    # groups the learner consumes per step, if known up front (else learned from get_batch)
    groups_per_batch: int | None = None
    # cap on groups in flight in the generator (default: vLLM's max_num_seqs / group_size); the staleness rule adds
    # its own bound
    max_concurrent_groups: int | None = None
    # ---- what is sampled
    # HF model directory or name that the generator starts from
    model: str
    # completions per prompt (G)
    group_size: int = 8
    # sampling temperature (the learner divides its logits by it)
    temperature: float = 1.0
    # ScaleRL interruption-based length control; off: plain max_tokens truncation (DAPO's overlong penalty)
    interruptions: bool = True
    # the interruption point is drawn uniformly in this range of completion tokens (train.py's tiny-task default,
    # above the task's ~29-token scratchpad; ScaleRL: 10240 to 12288)
    think_budget: tuple[int, int] = (34, 40)
    # tokens allowed after the interruption phrase (ScaleRL: 2048)
    answer_budget: int = 8
    # generation budget without interruptions, and the overall cap of a completion with them
    max_tokens: int = 48
    # seed of the samplers and think budgets (one per completion: sampling_seed) and of the data (unless data_seed)
    seed: int = 0
    # seed of the task's train stream (default: seed); keep it fixed across a resume, since data_start and
    # skip_indices are positions in this stream
    data_seed: int | None = None
    # seconds one reward may take (past it the completion scores -1 and counts in reward_timeouts); seconds the
    # learner's get_batch waits for its groups before the generator is given up, naming the request
    reward_timeout: float = 10.0
    batch_timeout: float = 3600.0
    # ---- the fleet that samples it: where and how the replicas run (harness/fleet.py)
    fleet: FleetConfig = field(default_factory=FleetConfig)

    def __post_init__(self) -> None:
        self.think_budget = tuple(int(x) for x in self.think_budget)  # type: ignore[assignment]
        if isinstance(self.fleet, Mapping):  # as plain data
            self.fleet = FleetConfig(**self.fleet)
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "fleet"}
        problems = config_problems({**values, "max_model_len": self.fleet.max_model_len})
        if problems:
            raise ValueError("; ".join(problems))

    def replica_settings(self) -> fleet.ReplicaSettings:
        """What each replica's engine starts with: the fleet's settings, the model, the seed, the interruptions."""
        return fleet.ReplicaSettings(**dataclasses.asdict(self.fleet), model=self.model, seed=self.seed,
                                     interruptions=self.interruptions)


@dataclass
class Completion:
    """One sampled completion; the lists are per completion token (the prompt is not included)."""

    token_ids: list[int]
    sampler_logprobs: list[float]  # log-prob of each token under the sampler's distribution (after temperature)
    versions: list[int]  # weight version that sampled each token
    loss_mask: list[bool]  # False on tokens the model did not choose (the interruption phrase)
    text: str
    finish_reason: str  # "stop" | "length" | "interrupted"
    reward: float
    reward_error: str | None = None  # the reward function raised: reward is -1.0 and the error is here
    interrupted: bool = False  # the interruption phrase was inserted
    truncated: bool = False  # ran into max_tokens (also possible after an interruption)
    think_budget: int | None = None  # drawn interruption point (None without interruptions)
    replica: int = 0  # the replica that sampled it
    # Filled in by the learner, never by the generator: its own log-probs of token_ids before the first update
    # of a round (sync mode, TIS); None means the sampler's log-probs stand for the old policy.
    old_logprobs: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Group:
    """The G completions of one prompt."""

    problem: Problem
    data_index: int  # index in the task's train stream; -1 for evaluation groups
    prompt_ids: list[int]
    completions: list[Completion]
    admitted_version: int = 0  # generator weights version when the prompt was admitted

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    @property
    def min_version(self) -> int:
        """Oldest weight version over the loss-masked tokens (the admission version if there are none)."""
        versions = [v for c in self.completions for v, m in zip(c.versions, c.loss_mask) if m]
        return min(versions) if versions else self.admitted_version

    @property
    def max_version(self) -> int:
        versions = [v for c in self.completions for v in c.versions]
        return max(versions) if versions else self.admitted_version


# --------------------------------------------------------------------------------------------------------------
# The staleness rule: pure functions (unit-tested without vLLM)
# --------------------------------------------------------------------------------------------------------------


def admission_allowed(unconsumed: int, gen_version: int, next_learner_version: int, k: int,
                      groups_per_step: int) -> bool:
    """May one more group be admitted? `unconsumed` groups are admitted and not yet consumed by the learner.

    The new group's tokens all have version >= gen_version, so its deadline is D = gen_version + k. It is admitted
    only if, counting it, the groups that must be consumed by D fit into the learner steps left before D:
    unconsumed + 1 <= (D - next_learner_version + 1) * groups_per_step.
    """
    steps_left = gen_version + k - next_learner_version + 1
    return unconsumed + 1 <= steps_left * max(1, groups_per_step)


def off_policy_problems(mode: str, k: int, name: str = "--max-off-policy") -> list[str]:
    """What is wrong with k = --max-off-policy (GeneratorConfig.max_off_policy) in `mode`; [] when nothing is.
    The one place where k's meaning in each mode is stated and checked:

    - pipeline: the hard bound on a loss-masked token's lag, learner version minus the version of the weights that
      sampled it (`admission_allowed`, `plan_batch`). k >= 0; k = 0 is on-policy: every token trained on was
      sampled with the learner's current weights. (ScaleRL: 8.)
    - sync: the optimizer steps per generation round, PPO-off-policy-k: one round of fresh groups is split into k
      steps, so the last step trains on tokens k - 1 steps old. k >= 1; k = 1 is on-policy.
    """
    if mode == "pipeline" and k < 0:
        return [f"{name} {k}: in pipeline mode it bounds a token's lag in optimizer steps and must be >= 0 "
                "(0: on-policy)"]
    if mode == "sync" and k < 1:
        return [f"{name} {k}: in sync mode it is the optimizer steps per generation round "
                "(PPO-off-policy-k) and must be >= 1 (1: on-policy)"]
    return []


def steps_per_round(mode: str, k: int) -> int:
    """The optimizer steps one generation round feeds, k's other half: in sync mode k (one round of fresh groups
    split into k steps), in pipeline mode 1 (there k bounds a token's lag instead). The learner reads it here for
    the round it pulls (train.py's pull_round) and the groups it asks the generator for at once."""
    return k if mode == "sync" else 1


def should_admit(*, unconsumed: int, in_flight: int, max_in_flight: int, gen_version: int,
                 next_learner_version: int, k: int, groups_per_step: int, waiting_for: int = 0,
                 buffer_steps: int | None = None, learner_starved: bool = False) -> bool:
    """The generator's admission decision: the concurrency cap, then the staleness rule (`admission_allowed`),
    then the buffer limit, which applies only while the learner is fed: a learner blocked in get_batch without
    enough finished groups (`learner_starved`) shows that generation is the bottleneck, and the generator then
    fills its engine up to the concurrency cap and k. A learner blocked for `waiting_for` groups is never left
    without them (no deadlock when the groups per step were under-estimated or the buffer is 0; plan_batch's
    hard check still holds)."""
    if in_flight >= max_in_flight:
        return False
    # the buffer limit: at most buffer_steps learner steps' worth of groups admitted ahead of the next request
    fresh = buffer_steps is None or learner_starved or unconsumed + 1 <= buffer_steps * max(1, groups_per_step)
    if fresh and admission_allowed(unconsumed, gen_version, next_learner_version, k, groups_per_step):
        return True
    return unconsumed < waiting_for


def mandatory_count(deadlines: Iterable[int], learner_version: int, groups_per_step: int) -> int:
    """r = max_j (n_j - j*B)^+ with n_j = #(deadline <= V + j): how many of the earliest-deadline groups the batch
    for learner version V must contain so that every other group still fits before its deadline."""
    B = max(1, groups_per_step)
    counts = collections.Counter(max(0, d - learner_version) for d in deadlines)
    r, n = 0, 0
    for j in sorted(counts):
        n += counts[j]
        r = max(r, n - j * B)
    return r


@dataclass
class _Entry:
    """What the batch planner needs to know about one unconsumed group."""

    gid: int
    deadline: int
    ready: bool
    min_version: int | None = None  # known once ready
    order: int = 0  # completion (or admission) order: earlier first among equals


def plan_batch(entries: list[_Entry], num_groups: int, learner_version: int, k: int,
               groups_per_step: int) -> tuple[list[int] | None, list[int]]:
    """Choose the groups for `get_batch(num_groups, learner_version)`.

    Returns (chosen gids, or None if the learner must wait; gids of ready groups too stale to use (lag > k)).
    Ready groups are judged by their real min_version; the earliest-deadline mandatory set is waited for.
    """
    stale = [e.gid for e in entries if e.ready and learner_version - e.min_version > k]
    live = [e for e in entries if not (e.ready and learner_version - e.min_version > k)]
    live.sort(key=lambda e: (e.deadline, not e.ready, e.order))
    r = min(num_groups, mandatory_count((e.deadline for e in live), learner_version, groups_per_step))
    mandatory = live[:r]
    if not all(e.ready for e in mandatory):
        return None, stale
    rest = [e for e in live[r:] if e.ready]
    if len(rest) < num_groups - r:
        return None, stale
    return [e.gid for e in mandatory] + [e.gid for e in rest[: num_groups - r]], stale


def lag_histogram(groups: Iterable[Group], learner_version: int) -> dict[int, int]:
    """{lag: number of loss-masked tokens} with lag = learner_version - token version."""
    hist: collections.Counter[int] = collections.Counter()
    for g in groups:
        for c in g.completions:
            for v, m in zip(c.versions, c.loss_mask):
                if m:
                    hist[learner_version - v] += 1
    return dict(sorted(hist.items()))


def lag_stats(groups: list[Group], learner_version: int) -> dict[str, Any]:
    hist = lag_histogram(groups, learner_version)
    total = sum(hist.values())
    return {
        "lag_hist": hist,
        "frac_tokens_by_lag": {lag: n / total for lag, n in hist.items()} if total else {},
        "lag_mean": sum(lag * n for lag, n in hist.items()) / total if total else 0.0,
        "lag_max": max(hist) if hist else 0,
    }


MODES = ("pipeline", "sync")  # GeneratorConfig.mode; train.py's --mode


def config_problems(values: Mapping[str, Any], name: Callable[[str], str] = str) -> list[str]:
    """What is wrong with the rule's and the sampling's settings; [] when nothing is. The one place where each check
    is written: GeneratorConfig raises on them, and train.py's flags report them before anything starts (train.py
    hands this to flags.parse_args). `values` maps GeneratorConfig field names to values (a missing one is not
    checked; max_model_len, the fleet's, is checked against max_tokens); `name` spells a field as the caller calls
    it (harness/flags.py: its command-line flag). The fleet's own settings: harness/fleet.py's fleet_problems."""
    v, problems = values, []
    if "mode" in v and v["mode"] not in MODES:
        problems.append(f"{name('mode')} must be 'pipeline' or 'sync', got {v['mode']!r}")
    elif "max_off_policy" in v:
        problems += off_policy_problems(v.get("mode", "pipeline"), v["max_off_policy"], name("max_off_policy"))
    if v.get("buffer_steps") is not None and v["buffer_steps"] < 0:
        problems.append(f"{name('buffer_steps')} must be >= 0 (got {v['buffer_steps']})")
    problems += [f"{name(key)} must be >= 1 (got {v[key]})"
                 for key in ("group_size", "answer_budget", "max_tokens")
                 if key in v and v[key] < 1]
    problems += [f"{name(key)} must be a number of seconds > 0 (got {v[key]})"
                 for key in ("reward_timeout", "batch_timeout")
                 if key in v and not 0 < v[key] < float("inf")]
    if "temperature" in v and not v["temperature"] > 0:
        problems.append(f"{name('temperature')} must be > 0 (got {v['temperature']}): RL samples, and greedy "
                        "decoding has no usable logprobs")
    if "think_budget" in v and not 1 <= v["think_budget"][0] <= v["think_budget"][1]:
        low, high = v["think_budget"]
        problems.append(f"{name('think_budget')} '{low},{high}': expected MIN,MAX with 1 <= MIN <= MAX, e.g. 34,40")
    if "max_model_len" in v and "max_tokens" in v and v["max_model_len"] <= v["max_tokens"]:
        problems.append(f"{name('max_model_len')} ({v['max_model_len']}) must exceed {name('max_tokens')} "
                        f"({v['max_tokens']}): it holds the prompt and the completion")
    return problems


# --------------------------------------------------------------------------------------------------------------
# The scheduler, in the generator process: its parts in pipeline order (prompts in, the groups, admission,
# completions out, batch choice, a replica's death), then _Scheduler, which routes the messages to them. The
# replicas themselves (processes, connections, the listener) are harness/fleet.py's ReplicaPool.
# --------------------------------------------------------------------------------------------------------------
# Each part is an object that owns its state (set in its own __init__) and is called through its methods; what one
# needs of another it is handed, as an argument or as the other object.


class _RequestError(ValueError):
    """A request the generator refuses (reported to the learner as GeneratorError; the generator keeps running)."""


def sampling_seed(run_seed: int, kind: str, key: str, version: int, sample: int) -> int:
    """One completion's sampler seed, hashed from the run's seed, `kind` ("t" train, "e" eval), `key` (data index or
    problem id), the weights' version and the sample's index. vLLM gives a seeded request a generator of its own, and
    its think budget is drawn from it: sync mode repeats run for run, and a resume draws what the run would have."""
    digest = hashlib.blake2b(f"{run_seed}|{kind}|{key}|{version}|{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63: torch.Generator.manual_seed takes it


def pick_replica(loads: Mapping[int, int]) -> int | None:
    """The least-loaded replica (fewest groups in flight; the lowest id among equals), or None if there is none."""
    return min(loads, key=lambda r: (loads[r], r)) if loads else None


def _make_task(task_factory: Any) -> Task:
    if isinstance(task_factory, type) or not (hasattr(task_factory, "reward") and hasattr(task_factory, "train_stream")):
        return task_factory()
    return task_factory


@dataclass
class _GroupState:
    """One group while it is generated: a record the group table holds; its completions change only through its
    methods (assigned to a replica, freed by a replica's death, filled)."""

    gid: int
    problem: Problem
    data_index: int
    prompt_ids: list[int]
    admitted_version: int
    deadline: int
    completions: list[Completion | None]
    budgets: list[int | None]
    admit_order: int
    assigned: list[int | None] = field(default_factory=list)  # the replica generating each completion
    temperature: float = 1.0
    done_order: int = -1
    min_version: int | None = None  # cached once ready

    @property
    def ready(self) -> bool:
        return all(c is not None for c in self.completions)

    def to_group(self) -> Group:
        return Group(self.problem, self.data_index, self.prompt_ids, list(self.completions),  # type: ignore[arg-type]
                     self.admitted_version)

    def assign(self, index: int, replica: int, budget: int | None) -> None:
        """Completion `index` runs on `replica`, with think budget `budget` (None: no interruption)."""
        self.assigned[index], self.budgets[index] = replica, budget

    def running_on(self) -> set[int]:
        """The replicas with a completion of this group in flight."""
        return {r for c, r in zip(self.completions, self.assigned) if c is None and r is not None}

    def free(self, replica: int) -> int:
        """The unfinished completions on `replica` (it died) wait for another; how many there were."""
        lost = [i for i, (c, r) in enumerate(zip(self.completions, self.assigned)) if c is None and r == replica]
        for i in lost:
            self.assigned[i] = None
        return len(lost)

    def unplaced(self) -> list[int]:
        """The unfinished completions on no replica (theirs died, or none held the run's weights)."""
        return [i for i, (c, r) in enumerate(zip(self.completions, self.assigned)) if c is None and r is None]

    def expects(self, index: int, replica: int) -> bool:
        """Is completion `index` still awaited from `replica` (not finished, not moved to another)?"""
        return self.completions[index] is None and self.assigned[index] == replica

    def fill(self, index: int, completion: Completion) -> None:
        self.completions[index] = completion

    def mark_ready(self, done_order: int) -> None:
        self.done_order, self.min_version = done_order, self.to_group().min_version


class _DataStream:
    """Prompts in: the task's train stream from `start`, without the data indices already consumed (a resumed run's
    `skip`) or the prompts retired (No-Positive-Resampling), and with the prompts of dropped groups first."""

    def __init__(self, task: Task, seed: int, start: int, skip: Iterable[int], retired: Iterable[str]):
        self.stream = task.train_stream(seed, start=start)
        self.skip, self.retired = set(skip), set(retired)
        listed = getattr(task, "problems", None)  # a data set's list (a generated task may have a method)
        self.listed = {p.id for p in listed} if isinstance(listed, (list, tuple)) else set()
        self.requeue: collections.deque[tuple[int, Problem]] = collections.deque()  # generated again, first
        self.admitted = 0  # prompts of the stream admitted (a requeued one counts once)
        self.last_fresh = False  # the prompt `next` gave last came from the stream, not the requeue

    def next(self) -> tuple[int, Problem]:
        self.last_fresh = not self.requeue
        if self.requeue:
            return self.requeue.popleft()
        for _ in range(0 if self.listed and self.listed <= self.retired else 1_000_000):
            index, problem = next(self.stream)
            if index in self.skip or problem.id in self.retired:
                continue
            return index, problem
        raise _Fatal(f"no training prompt left: {len(self.retired)} are retired (No-Positive-Resampling: a prompt "
                     "whose group passed at --retire-pass-rate or more is never drawn again), and the stream's "
                     "draws were all retired or trained on; a larger data set, a higher --retire-pass-rate or fewer "
                     "--max-steps")

    def count_admitted(self) -> None:
        """The prompt `next` gave last is admitted: count it, unless it was requeued (counted when first admitted)."""
        self.admitted += self.last_fresh

    def admitted_total(self) -> int:
        return self.admitted

    def put_back(self, data_index: int, problem: Problem) -> None:
        """A dropped group's prompt: generated again, before the stream's next."""
        self.requeue.append((data_index, problem))

    def queued_indices(self) -> list[int]:
        return [i for i, _ in self.requeue]

    def retire(self, problem_ids: Iterable[str]) -> None:
        self.retired.update(problem_ids)

    def unretired_count(self) -> int:
        """A data set's training prompts not retired; 0 for a task generated here (its prompts are not listed)."""
        return len(self.listed - self.retired)


class _GroupTable:
    """The groups in the generator, the one owner of their records: training groups until the learner consumes
    them, evaluation groups until their request is answered; it numbers them and counts admission and completion
    order."""

    def __init__(self) -> None:
        self.train: dict[int, _GroupState] = {}  # unconsumed training groups (in flight or ready)
        self.eval: dict[int, _GroupState] = {}
        self.next_gid = 0
        self.admit_counter = 0
        self.done_counter = 0

    def new_state(self, problem: Problem, data_index: int, prompt_ids: list[int], version: int, deadline: int,
                  samples: int, temperature: float) -> _GroupState:
        """A new group's record, numbered (not yet in the table: `add` puts it there)."""
        state = _GroupState(self.next_gid, problem, data_index, prompt_ids, version, deadline, [None] * samples,
                            [None] * samples, self.admit_counter, [None] * samples, temperature)
        self.next_gid += 1
        self.admit_counter += 1
        return state

    def add(self, state: _GroupState, *, evaluation: bool = False) -> None:
        (self.eval if evaluation else self.train)[state.gid] = state

    def unconsumed(self) -> int:
        return len(self.train)

    def in_flight(self) -> int:
        return sum(not g.ready for g in self.train.values())

    def ready_count(self) -> int:
        return sum(g.ready for g in self.train.values())

    def eval_count(self) -> int:
        return len(self.eval)

    def data_indices(self) -> list[int]:
        return [g.data_index for g in self.train.values()]

    def loads(self, replica_ids: Iterable[int]) -> dict[int, int]:
        """Groups with a completion in flight on each of `replica_ids` (training and evaluation groups)."""
        loads = {r: 0 for r in replica_ids}
        for table in (self.train, self.eval):
            for state in table.values():
                for r in state.running_on():
                    if r in loads:
                        loads[r] += 1
        return loads

    def free(self, replica: int) -> int:
        """A replica died: its unfinished completions wait for another (`unplaced`); how many there were."""
        return sum(state.free(replica) for table in (self.train, self.eval) for state in table.values())

    def unplaced(self) -> Iterator[tuple[_GroupState, list[int], str]]:
        """(group, its completions on no replica, request prefix) of every group, training ones first; each group's
        are looked at as it comes, so what a death frees while they are placed is found in the same pass."""
        for table, prefix in ((self.train, "t"), (self.eval, "e")):
            for state in table.values():
                yield state, state.unplaced(), prefix

    def awaiting(self, rid: str, replica: int) -> tuple[_GroupState, int] | None:
        """The group and completion index of request `rid` if it is still awaited from `replica`, else None (its
        group is gone, or it was finished or moved to another replica)."""
        kind, rest = rid[0], rid[1:]
        gid_s, idx_s = rest.split(".")
        gid, idx = int(gid_s), int(idx_s)
        state = (self.train if kind == "t" else self.eval).get(gid)
        if state is None or not state.expects(idx, replica):
            return None
        return state, idx

    def fill(self, state: _GroupState, index: int, completion: Completion) -> bool:
        """Store a finished completion; True if its group is now ready (it takes the next place in completion
        order)."""
        state.fill(index, completion)
        if not state.ready:
            return False
        state.mark_ready(self.done_counter)
        self.done_counter += 1
        return True

    def planner_entries(self) -> list[_Entry]:
        return [_Entry(g.gid, g.deadline, g.ready, g.min_version, g.done_order if g.ready else 10**12 + g.admit_order)
                for g in self.train.values()]

    def all_ready(self) -> bool:
        return all(g.ready for g in self.train.values())

    def in_done_order(self) -> list[int]:
        return sorted(self.train, key=lambda gid: self.train[gid].done_order)

    def pop(self, gid: int) -> _GroupState:
        return self.train.pop(gid)

    def pop_eval(self, gids: list[int]) -> list[Group] | None:
        """The evaluation groups `gids`, taken out of the table once all are ready (else None, and they stay)."""
        if not all(self.eval[g].ready for g in gids):
            return None
        return [self.eval.pop(g).to_group() for g in gids]

MAX_UNUSABLE_PROMPTS = 100_000  # too long in a row, for a task with no list of prompts (a generated stream)


@dataclass(frozen=True)
class _Demand:
    """What admission needs to know of the learner (batch choice keeps it): the groups a blocked get_batch waits for
    (0: none waits), the learner version of its next request and the groups it consumes per step."""

    waiting_for: int
    next_learner_version: int
    groups_per_step: int


class _Admission:
    """Admission: new groups from the data stream, admitted under the staleness rule (`should_admit`) to the
    least-loaded replica, each completion with its seed and think budget; a dead replica's completions placed again."""

    def __init__(self, config: GeneratorConfig, task: Task, data: _DataStream, groups: _GroupTable,
                 pool: fleet.ReplicaPool, tokenizer: Any, phrase_ids: list[int], close_ids: list[int]):
        self.cfg, self.task, self.data, self.groups, self.pool = config, task, data, groups, pool
        self.tokenizer, self.phrase_ids, self.close_ids = tokenizer, phrase_ids, close_ids
        self.skipped_long = 0  # training prompts too long for the context

    def skipped_long_prompts(self) -> int:
        return self.skipped_long

    def loads(self) -> dict[int, int]:
        """Groups with a completion in flight on each usable replica."""
        return self.groups.loads(self.pool.usable_ids())

    def request_spec(self, temperature: float, budget: int | None) -> dict:
        cfg = self.cfg
        spec: dict[str, Any] = {"temperature": temperature, "max_tokens": cfg.max_tokens, "interrupt": None}
        if budget is not None:
            spec["max_tokens"] = min(cfg.max_tokens, budget + len(self.phrase_ids) + cfg.answer_budget)
            spec["interrupt"] = {"budget": budget, "phrase": self.phrase_ids, "close": self.close_ids}
        return spec

    def submit(self, state: _GroupState, replica: fleet.ReplicaSlot, indices: Iterable[int], prefix: str) -> None:
        """Send completions `indices` of a group to `replica` (a group's completions go together: one prompt, one
        prefix-cache entry; after a replica's death, the missing ones of a group go to another)."""
        requests = []
        for i in indices:
            key = state.problem.id if prefix == "e" else str(state.data_index)
            seed = sampling_seed(self.cfg.seed, prefix, key, state.admitted_version, i)
            budget = state.budgets[i]
            if budget is None and self.cfg.interruptions:  # drawn from the seed too: a resume repeats it
                budget = random.Random(seed).randint(*self.cfg.think_budget)
            state.assign(i, replica.id, budget)
            spec = self.request_spec(state.temperature, budget)
            spec["seed"] = seed
            requests.append((f"{prefix}{state.gid}.{i}", state.prompt_ids, f"v{replica.version}", spec))
        if requests:
            self.pool.send_to(replica, ("add", requests))

    def new_group(self, problem: Problem, data_index: int, samples: int, version: int,
                  temperature: float) -> _GroupState:
        prompt_ids = tasks.chat_prompt_ids(self.tokenizer, problem.prompt)  # tokenized once: checked, then kept
        if why := tasks.prompt_overflow(problem, len(prompt_ids), self.cfg.max_tokens,
                                               self.cfg.fleet.max_model_len):
            raise _RequestError(why)
        return self.groups.new_state(problem, data_index, prompt_ids, version, version + self.cfg.max_off_policy,
                                     samples, temperature)

    def admit_one(self, version: int, replica: fleet.ReplicaSlot | None) -> None:
        """Admit the stream's next usable prompt as a group with weights `version`, sent to `replica` (None: placed
        once a replica holds the run's weights)."""
        too_long: set[str] = set()  # this call's: once it holds every admissible prompt, none is usable
        limit = self.data.unretired_count() or MAX_UNUSABLE_PROMPTS
        while True:
            index, problem = self.data.next()
            try:
                state = self.new_group(problem, index, self.cfg.group_size, version, self.cfg.temperature)
                break
            except _RequestError as e:  # a training prompt too long for max_model_len: skip it, count it
                too_long.add(problem.id)
                self.skipped_long += 1
                if len(too_long) >= limit:
                    raise _Fatal(f"no training prompt fits the context: {len(too_long)} in a row are too long (e.g. "
                                 f"{e}); raise --max-model-len or lower --max-tokens") from None
        self.data.count_admitted()
        self.groups.add(state)
        if replica is not None:
            self.submit(state, replica, range(len(state.completions)), "t")

    def admit(self, demand: _Demand) -> None:
        """Pipeline mode: admit groups to the least-loaded replicas while the staleness rule and the buffer allow."""
        need = demand.waiting_for
        starved = need > 0 and self.groups.ready_count() < need  # the learner waits on us
        loads = self.loads()
        capacity = self.pool.capacities()
        max_in_flight = self.pool.max_in_flight()
        while True:
            r = pick_replica({i: n for i, n in loads.items() if n < capacity[i]})
            if r is None or not should_admit(
                    unconsumed=self.groups.unconsumed(), in_flight=self.groups.in_flight(),
                    max_in_flight=max_in_flight, gen_version=self.pool.slot(r).version,
                    next_learner_version=demand.next_learner_version, k=self.cfg.max_off_policy,
                    groups_per_step=demand.groups_per_step, waiting_for=need, buffer_steps=self.cfg.buffer_steps,
                    learner_starved=starved):
                return
            replica = self.pool.slot(r)
            self.admit_one(replica.version, replica)
            loads[r] += 1

    def admit_batch(self, num_groups: int, version: int) -> None:
        """Sync mode: the `num_groups` groups of one batch, all with the generator's weights `version`."""
        if self.groups.unconsumed():
            raise RuntimeError("sync mode: groups left over from a previous batch")
        loads = self.loads()
        for _ in range(num_groups):
            r = pick_replica(loads)  # None: only replicas that wait for their weights; place_orphans places it
            replica = self.pool.slot(r) if r is not None else None
            self.admit_one(version if replica is None else replica.version, replica)
            if r is not None:
                loads[r] += 1

    def admit_eval(self, problems: list[Problem], samples: int, temperature: float | None, version: int) -> list[int]:
        """Evaluation groups of `problems` with weights `version`; their gids. A prompt too long refuses them all."""
        temp = self.cfg.temperature if temperature is None else temperature
        states = [self.new_group(problem, -1, samples, version, temp) for problem in problems]  # may refuse
        loads = self.loads()
        gids = []
        for state in states:
            self.groups.add(state, evaluation=True)
            r = pick_replica(loads)
            if r is not None:  # else placed by place_orphans once a replica holds the run's weights
                self.submit(state, self.pool.slot(r), range(samples), "e")
                loads[r] += 1
            gids.append(state.gid)
        return gids

    def place_orphans(self) -> None:
        """Completions on no replica (a dead replica's) go to the least-loaded usable one, as soon as there is one."""
        loads = self.loads()
        for state, lost, prefix in self.groups.unplaced():
            r = pick_replica(loads)
            if lost and r is not None:
                self.submit(state, self.pool.slot(r), lost, prefix)
                loads[r] += 1


class _Rewards:
    """Completions out: a finished vLLM request becomes a `Completion`, its interruption phrase masked, its reward
    scored by the task (a verifier that raises scores -1 and is counted, never fatal)."""

    def __init__(self, config: GeneratorConfig, task: Task, phrase_ids: list[int], close_ids: list[int]):
        self.cfg, self.task, self.phrase_ids, self.close_ids = config, task, phrase_ids, close_ids
        self.errors_total = self.timeouts_total = 0  # a timeout counts in both
        start_s = self.start_rewards()  # with the generator (a math data set's math-verify server), before any deadline
        refusal = None if start_s is None else tasks.reward_timeout_refusal(config.reward_timeout, start_s)
        if refusal:  # before any step: a deadline too short for a restart would score answers as timeouts
            raise _Fatal(refusal)

    def start_rewards(self) -> float | None:
        """What the task's rewards need started (`start_rewards`: math-verify's server), started or restarted
        here, outside any reward's deadline, which would otherwise cover the start and stop it: the seconds its
        start took, None for a task with nothing to start."""
        start = getattr(self.task, "start_rewards", None)
        return float(start()) if callable(start) else None

    def totals(self) -> tuple[int, int]:
        """(reward errors, reward timeouts) since the start."""
        return self.errors_total, self.timeouts_total

    def restarts(self) -> int:
        """Reward servers replaced since the start (the task's `reward_restarts`: math-verify's that died)."""
        count = getattr(self.task, "reward_restarts", None)
        return int(count()) if callable(count) else 0

    def make_completion(self, state: _GroupState, index: int, out: dict, replica: int) -> Completion:
        token_ids, logprobs, versions = out["token_ids"], out["logprobs"], out["versions"]
        n = len(token_ids)
        mask = [True] * n
        budget = state.budgets[index]
        start = vllm_replica.interruption_start(token_ids, budget, self.close_ids) if budget is not None else None
        interrupted = start is not None
        if interrupted:
            end = min(n, start + len(self.phrase_ids))
            if token_ids[start:end] != self.phrase_ids[: end - start]:
                raise RuntimeError(f"interruption phrase not found where forced: {token_ids[start:end]} vs "
                                   f"{self.phrase_ids}")
            for i in range(start, end):
                mask[i] = False
                logprobs[i] = 0.0
        reward, error = self.score(state.problem, out["text"])
        truncated = out["finish_reason"] == "length"
        finish = "interrupted" if interrupted else out["finish_reason"]
        return Completion(token_ids, logprobs, versions, mask, out["text"], finish, reward, error, interrupted,
                          truncated, budget, replica)

    def score(self, problem: Problem, text: str) -> tuple[float, str | None]:
        restarts = self.restarts()
        reward, error = self._score(problem, text)
        if self.restarts() > restarts:  # died since the last reward, or during this one: started again, said here
            print(f"[rewards] a reward server died and was started again ({self.restarts()} in this run: "
                  f"reward_restarts_total); the answer then being scored: "
                  f"{error if error else f'reward {reward:g}'}", file=sys.stderr, flush=True)
        return reward, error

    def _score(self, problem: Problem, text: str) -> tuple[float, str | None]:
        try:
            self.start_rewards()  # a server that died since the last reward starts again here, not under the deadline
            with tasks.reward_deadline(self.cfg.reward_timeout):
                reward = float(self.task.reward(problem, text))
            if not math.isfinite(reward):
                raise ValueError(f"reward is {reward}")
            return reward, None
        except tasks.RewardTimeout as e:  # a verifier that hangs costs its deadline; the run goes on
            self.timeouts_total += 1
            self.errors_total += 1
            return -1.0, f"RewardTimeout: {e}"
        except Exception as e:  # a broken verifier must not end the run: count it, score the sample as failed
            self.errors_total += 1
            return -1.0, f"{type(e).__name__}: {e}"


class _BatchChoice:
    """Batch choice: the learner's get_batch and evaluate requests, answered once their groups are ready
    (`plan_batch`: earliest deadline first; sync mode: exactly the groups generated for the request). It keeps what
    the learner asked: its outstanding request, its version, the groups it consumes per step."""

    def __init__(self, config: GeneratorConfig, groups: _GroupTable, data: _DataStream, version: int):
        self.cfg, self.groups, self.data = config, groups, data
        self.pending: tuple | None = None  # the learner's outstanding request
        self.next_learner_version = version
        self.step_version: int | None = None  # learner version of the current step's get_batch calls
        self.consumed_this_step = 0
        self.per_step = config.groups_per_batch or 0  # groups the learner consumes per step (0: not yet known)
        self.stale_dropped = 0
        self.dirty = False  # something changed since the last batch plan

    def groups_per_step(self) -> int:
        return self.per_step

    def dropped(self) -> int:
        """Groups dropped as too stale (lag > k) since the start."""
        return self.stale_dropped

    def changed(self) -> None:
        """Something the plan depends on changed (a group got ready or was lost, the weights moved)."""
        self.dirty = True

    def demand(self) -> _Demand:
        need = self.pending[1] if self.pending and self.pending[0] == "batch" else 0
        return _Demand(need, self.next_learner_version, self.per_step or 1)

    def request_batch(self, num_groups: int, learner_version: int, generator_version: int) -> None:
        """The learner's get_batch(num_groups, learner_version); refused if its version has outrun the weights."""
        if self.cfg.mode == "pipeline" and learner_version - generator_version > self.cfg.max_off_policy:
            raise _RequestError(
                f"learner version {learner_version} is more than k={self.cfg.max_off_policy} steps ahead of the "
                f"generator's weights (version {generator_version}): call update_weights after every optimizer step")
        if learner_version != self.step_version:
            if self.step_version is not None and self.consumed_this_step > 0:
                self.per_step = max(self.consumed_this_step, self.cfg.groups_per_batch or 0)
            self.step_version, self.consumed_this_step = learner_version, 0
        if not self.per_step:
            self.per_step = num_groups
        self.next_learner_version = learner_version
        self.pending = ("batch", num_groups, learner_version, time.perf_counter())
        self.dirty = True

    def request_eval(self, gids: list[int]) -> None:
        self.pending = ("eval", gids)
        self.dirty = True

    def reply(self) -> tuple | None:
        """The answer to the outstanding request once it can be given: ("evaluated", groups) or ("batch", groups,
        learner version); None while it waits."""
        if self.pending is None or not self.dirty:
            return None
        self.dirty = False
        if self.pending[0] == "eval":
            groups = self.groups.pop_eval(self.pending[1])
            if groups is None:
                return None
            self.pending = None
            return ("evaluated", groups)
        _, num_groups, V, t0 = self.pending
        chosen = self.choose(num_groups, V)
        if chosen is None:
            return None
        groups = [self.groups.pop(gid).to_group() for gid in chosen]
        self.consumed_this_step += len(groups)
        self.pending = None
        self.next_learner_version = V + 1
        return ("batch", groups, V)

    def choose(self, num_groups: int, V: int) -> list[int] | None:
        """The gids for get_batch(num_groups, V), or None while the learner must wait; groups too stale to use are
        dropped (counted) and their prompts generated again with fresh weights."""
        if self.cfg.mode == "sync":
            return self.groups.in_done_order() if self.groups.all_ready() else None
        chosen, stale = plan_batch(self.groups.planner_entries(), num_groups, V, self.cfg.max_off_policy,
                                   self.per_step or num_groups)
        for gid in stale:  # last resort: drop, count, and generate the prompt again with fresh weights
            state = self.groups.pop(gid)
            self.stale_dropped += 1
            self.data.put_back(state.data_index, state.problem)
        return chosen


class _ReplicaFaults:
    """A replica's death: the pool marks it dead and ends its processes, the group table frees its unfinished
    completions (admission places them on the others, or they wait for one), a line names it and the next batch's
    stats count it; the last one gone stops the generator."""

    def __init__(self, pool: fleet.ReplicaPool, groups: _GroupTable):
        self.pool, self.groups = pool, groups
        self.deaths: list[str] = []  # since the last batch
        self.deaths_total = 0

    def bury(self, slot: fleet.ReplicaSlot, reason: str) -> tuple[bool, int] | None:
        """Mark `slot` dead and free its unfinished completions: (was it still starting, how many were freed), or
        None if it was dead already."""
        previous = slot.die(reason)
        if previous == "dead":
            return None
        return previous != "ready", self.groups.free(slot.id)

    def report(self, slot: fleet.ReplicaSlot, reason: str, moved: int) -> None:
        """Name the death on stderr and in the next batch's stats; _Fatal once no replica is left."""
        left = len(self.pool.ready_slots())
        line = (f"{slot.name} died: {reason}; " + (f"{moved} unfinished completion(s) go to the other replicas; "
                                                    f"{left} replica(s) left" if left else "no replica left"))
        self.deaths.append(line)
        self.deaths_total += 1
        print(f"[generator] {line}", file=sys.stderr, flush=True)
        if not left:
            raise _Fatal(f"no replica left: {self.pool.dead_summary()}")

    def take_deaths(self) -> list[str]:
        """The deaths since the last call (one batch's)."""
        deaths, self.deaths = self.deaths, []
        return deaths

    def total(self) -> int:
        return self.deaths_total


class _Scheduler:
    """Runs in the generator process: the loop over the learner's and the replicas' messages, which it routes to its
    parts, the weight updates and the debug requests. Its parts, each an object that owns its state: `data`
    (_DataStream), `groups` (_GroupTable), `pool` (fleet.ReplicaPool), `faults` (_ReplicaFaults), `admission`
    (_Admission), `rewards` (_Rewards), `batches` (_BatchChoice). It keeps the weights' version, the update and
    debug requests in progress, and the throughput since the last batch."""

    def __init__(self, conn: Any, config: GeneratorConfig, task_factory: Any, data_start: int,
                 skip_indices: list[int], retired_ids: list[str], version: int, secret: bytes,
                 *, spawn_replicas: bool = False):
        """`spawn_replicas`: listen and start the local replicas at once (the generator process does; a test builds
        a scheduler without them, and gives it fake connections)."""
        self.conn, self.cfg = conn, config
        self.pool = fleet.ReplicaPool(config.replica_settings(), secret, self.on_death, config.max_concurrent_groups)
        if spawn_replicas:  # first: a replica's start (vLLM's import, 8 s on a CPU) then overlaps the rest of ours
            self.pool.spawn()
        tokenizer = _load_tokenizer(config.model, self.pool if spawn_replicas else None, version)
        task = _make_task(task_factory)
        self.phrase_ids = list(tokenizer(task.interruption_phrase, add_special_tokens=False)["input_ids"])
        self.close_ids = list(tokenizer(tasks.THINK_CLOSE, add_special_tokens=False)["input_ids"])
        self.version = version  # the weights every usable replica holds
        data_seed = config.seed if config.data_seed is None else config.data_seed
        self.data = _DataStream(task, data_seed, data_start, skip_indices, retired_ids)
        self.groups = _GroupTable()
        self.faults = _ReplicaFaults(self.pool, self.groups)
        self.admission = _Admission(config, task, self.data, self.groups, self.pool, tokenizer, self.phrase_ids,
                                    self.close_ids)
        self.rewards = _Rewards(config, task, self.phrase_ids, self.close_ids)
        self.batches = _BatchChoice(config, self.groups, self.data, version)
        self.update: dict | None = None  # the weight update in progress
        self.debug_wait: dict | None = None
        self.tokens_by_replica: collections.Counter[int] = collections.Counter()  # since the last reply
        self.busy_s_by_replica: collections.Counter[int] = collections.Counter()
        self.last_reply_time = time.perf_counter()
        self.closing = False
        self.started = False  # admission starts with the learner's first get_batch or update_weights

    def start(self) -> dict:
        """Wait until every replica (local and remote) has its engine up."""
        deadline = time.monotonic() + self.cfg.fleet.join_timeout
        while not self.pool.all_ready():
            self.poll(0.2)
            if self.closing:
                raise _Fatal("closed by the learner while starting")
            self.pool.check_start(deadline)
        self.pool.hand_version(self.version)
        return {"pid": os.getpid(), "address": self.pool.address(), "descendants": self.pool.descendants(),
                "replicas": self.pool.describe_all(), "max_concurrent_groups": self.pool.max_in_flight(),
                "phrase_ids": self.phrase_ids, "close_ids": self.close_ids, "head": self.pool.head()}

    def run(self) -> None:
        while not self.closing:
            self.poll(0.2)
            if self.closing:
                break
            self.admission.place_orphans()
            self.admit()
            self.try_reply()

    def admit(self) -> None:
        if self.cfg.mode == "pipeline" and self.started:
            self.admission.admit(self.batches.demand())

    def shutdown(self) -> None:
        self.pool.shutdown()

    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` for a message from the learner or any replica (fleet.ReplicaPool.poll), and handle
        every one that came."""
        for owner, msg in self.pool.poll(self.conn, timeout, self.version, running=self.started):
            if owner != "learner":
                self.handle_replica(owner, msg)
            elif msg is None:  # the learner's end closed
                self.closing = True
            else:
                self.handle_learner(msg)

    def handle_learner(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("get_batch", "update"):
            self.started = True
        try:
            if kind == "get_batch":
                self.batches.request_batch(msg[1], msg[2], self.version)
                if self.cfg.mode == "sync":
                    self.admission.admit_batch(msg[1], self.version)
            elif kind == "update":
                self.begin_update(msg[1])
            elif kind == "weights":
                self.pool.relay_weight_call(msg[1], msg[2], msg[3])
            elif kind == "sent":
                self.update["sent"] = True
                for rid, error in msg[1].items():
                    self.on_death(self.pool.slot(rid), f"its weight broadcast failed: {error}")
                self.finish_update()
            elif kind == "evaluate":
                self.batches.request_eval(self.admission.admit_eval(msg[1], msg[2], msg[3], self.version))
            elif kind == "retire":
                self.data.retire(msg[1])
            elif kind == "debug":
                self.debug(msg[1])
            elif kind == "close":
                self.closing = True
            else:
                raise ValueError(f"unknown command {kind!r}")
        except _RequestError as e:  # the learner's mistake: tell it, keep running
            self.conn.send(("fail", str(e)))

    def handle_replica(self, slot: fleet.ReplicaSlot, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outputs":
            _, outputs, busy_s = msg
            self.busy_s_by_replica[slot.id] += busy_s
            for out in outputs:
                self.on_output(slot, out)
        elif kind == "ready":
            slot.engine_up(msg[1], self.cfg.group_size)
        elif kind == "updated":
            _, version, seconds = msg
            slot.holds(version)
            if self.update is not None:
                self.update["seconds"][slot.id] = seconds
                self.update["waiting"].discard(slot.id)
                self.finish_update()
        elif kind == "update_failed":
            self.on_death(slot, f"its weight update failed: {msg[2]}")
        elif kind == "debug":
            if self.debug_wait is not None and slot.id in self.debug_wait["waiting"]:
                self.debug_wait["waiting"].discard(slot.id)
                self.debug_wait["values"][slot.id] = msg[1]
                self.finish_debug()
        elif kind == "error":  # its first line says what happened (a traceback follows it)
            self.on_death(slot, msg[1].strip().splitlines()[0])
        elif kind == "closed":
            self.on_death(slot, "it closed")

    def on_output(self, slot: fleet.ReplicaSlot, out: dict) -> None:
        """A finished request: scored into its group, unless that no longer awaits it from this replica."""
        awaited = self.groups.awaiting(out["rid"], slot.id)
        if awaited is None:
            return
        state, index = awaited
        completion = self.rewards.make_completion(state, index, out, slot.id)
        self.tokens_by_replica[slot.id] += len(out["token_ids"])
        if self.groups.fill(state, index, completion):
            self.batches.changed()

    def on_death(self, slot: fleet.ReplicaSlot, reason: str) -> None:
        """A replica is gone (_ReplicaFaults): nothing waits for it any longer, and the plans are made again. The
        last replica gone stops the generator."""
        buried = self.faults.bury(slot, reason)
        if buried is None:
            return
        was_starting, moved = buried
        for wait in (self.update, self.debug_wait):
            if wait is not None:
                wait["waiting"].discard(slot.id)
        if not self.started and was_starting:
            return  # start() reports it
        self.faults.report(slot, reason, moved)
        self.finish_update()
        self.finish_debug()
        self.batches.changed()

    def try_reply(self) -> None:
        reply = self.batches.reply()
        if reply is None:
            return
        if reply[0] == "evaluated":
            self.conn.send(reply)
            return
        _, groups, learner_version = reply
        self.conn.send(("batch", groups, self.batch_stats(groups, learner_version)))

    def batch_stats(self, groups: list[Group], learner_version: int) -> dict[str, Any]:
        """The stats sent with a batch (Generator.get_batch lists them); resets the counters kept since the last."""
        now = time.perf_counter()
        interval = max(now - self.last_reply_time, 1e-9)
        alive = len(self.pool.ready_slots())
        completions = [c for g in groups for c in g.completions]
        reward_errors_total, reward_timeouts_total = self.rewards.totals()
        groups_ready, groups_per_step = self.groups.ready_count(), self.batches.groups_per_step()
        stats: dict[str, Any] = {
            "gen_tokens": sum(c.num_tokens for c in completions),
            "gen_tokens_per_s": sum(self.tokens_by_replica.values()) / interval,
            # the engines' busy share of the interval, averaged over the replicas alive
            "gen_busy_frac": min(1.0, sum(self.busy_s_by_replica.values()) / interval / max(1, alive)),
            "reward_errors": sum(c.reward_error is not None for c in completions),
            "reward_error_examples": [c.reward_error for c in completions if c.reward_error][:3],
            "interrupted": sum(c.interrupted for c in completions),
            "truncated": sum(c.truncated for c in completions),
            "stale_dropped": self.batches.dropped(),
            "reward_errors_total": reward_errors_total,
            "reward_timeouts": sum(str(c.reward_error).startswith("RewardTimeout") for c in completions),
            "reward_timeouts_total": reward_timeouts_total,
            "reward_restarts_total": self.rewards.restarts(),
            "skipped_long_prompts": self.admission.skipped_long_prompts(),
            "groups_in_flight": self.groups.in_flight(),
            "groups_ready": groups_ready,
            # buffer depth: learner steps' worth of groups already finished and waiting for the next requests
            "buffer_depth_steps": groups_ready / max(1, groups_per_step),
            "generator_version": self.version,
            "groups_per_step": groups_per_step,
            "multi_version_completions": sum(len(set(c.versions)) > 1 for c in completions),
            "gen_replicas_alive": alive,
            # this batch's groups by the replica of their first completion; tokens generated since the last batch
            "gen_groups_by_replica": dict(sorted(collections.Counter(g.completions[0].replica
                                                                     for g in groups).items())),
            "gen_tokens_by_replica": {s.id: self.tokens_by_replica[s.id] for s in self.pool.slots()},
            "replica_deaths": self.faults.take_deaths(),
            "replica_deaths_total": self.faults.total(),
            "replica_connections_refused": self.pool.refused_count(),
        }
        stats |= lag_stats(groups, learner_version)
        self.tokens_by_replica, self.busy_s_by_replica = collections.Counter(), collections.Counter()
        self.last_reply_time = now
        return stats

    def begin_update(self, version: int) -> None:
        """Weights `version` are coming: tell the learner which replicas to send them to
        (fleet.ReplicaPool.send_update), and wait for each to say it holds them."""
        plan = self.pool.send_update()
        self.update = {"version": version, "waiting": {p[0] for p in plan}, "seconds": {}, "sent": False}
        self.conn.send(("plan", plan))

    def finish_update(self) -> None:
        u = self.update
        if u is None or not u["sent"] or u["waiting"]:
            return
        self.update = None
        self.version = u["version"]
        self.batches.changed()
        self.conn.send(("updated", u["version"], {"seconds": u["seconds"], "replicas": len(self.pool.usable_ids())}))

    def debug(self, what: str) -> None:
        if what == "state":
            self.conn.send(("debug", {
                "version": self.version, "groups": self.groups.unconsumed(), "in_flight": self.groups.in_flight(),
                "eval_groups": self.groups.eval_count(), "groups_per_step": self.batches.groups_per_step(),
                "max_groups": self.pool.max_in_flight(), "stale_dropped": self.batches.dropped(),
                "unconsumed_indices": sorted(self.groups.data_indices() + self.data.queued_indices()),
                "admitted": self.data.admitted_total(), "replicas": self.pool.describe_all(),
                "refused": self.pool.refused_lines()}))
        elif what.startswith("checksum:"):  # every ready replica's checksum of one parameter
            targets = self.pool.ready_slots()
            self.debug_wait = {"waiting": {s.id for s in targets}, "values": {}}
            for s in targets:
                self.pool.send_to(s, ("debug", what))
            self.finish_debug()
        else:
            raise _RequestError(f"unknown debug request {what!r}")

    def finish_debug(self) -> None:
        if self.debug_wait is not None and not self.debug_wait["waiting"]:
            values, self.debug_wait = self.debug_wait["values"], None
            self.conn.send(("debug", values))


def _load_tokenizer(model: str, greeting: fleet.ReplicaPool | None, version: int) -> Any:
    """AutoTokenizer.from_pretrained(model), with transformers' import: 3-5 s on a CPU core. Given the pool that has
    just spawned its replicas (`greeting`), it loads in a thread while this one answers their hellos (weights
    `version`): a replica then builds its engine meanwhile, where it waited for its settings until the scheduler was
    built."""
    def load() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)

    if greeting is None:
        return load()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scalerl-tokenizer") as loader:
        loading = loader.submit(load)
        while not loading.done():
            greeting.greet(0.05, version)
        return loading.result()


def _scheduler_in_process(conn: Any, config: GeneratorConfig, task_factory: Any, data_start: int,
                          skip_indices: list[int], retired_ids: list[str], version: int, secret: bytes) -> _Scheduler:
    """The generator process's scheduler (fleet.generator_process_main builds it there): its replicas are spawned at
    once."""
    return _Scheduler(conn, config, task_factory, data_start, skip_indices, retired_ids, version, secret,
                      spawn_replicas=True)


# --------------------------------------------------------------------------------------------------------------
# The learner-side handle
# --------------------------------------------------------------------------------------------------------------


class Generator:
    """Learner-side handle of the generator process. Use as a context manager, or call close(). The process itself
    (its start, the pipe, a death noticed, the close) is harness/fleet.py's GeneratorProcess, and the weights'
    transport its WeightPush."""

    def __init__(self, config: GeneratorConfig, task_factory: Callable[[], Task] | Task, *, data_start: int = 0,
                 skip_indices: Iterable[int] = (), retired_ids: Iterable[str] = (), initial_version: int = 0):
        self.config = config
        self._task_factory = task_factory
        self._data_start = int(data_start)
        self._skip = sorted(int(i) for i in skip_indices)
        self._retired = sorted(str(i) for i in retired_ids)
        self._version = int(initial_version)
        self._weights = fleet.WeightPush(config.fleet, config.model)
        self._process = fleet.GeneratorProcess(on_close=self._weights.shutdown)
        self.transport_line = ""  # the weight transport, named once start() has settled it
        self.last_update_s = 0.0  # the last update_weights, in all
        self.last_broadcast_s = 0.0  # of which the transfer itself (init of new replicas' engines included)
        self.last_cast_s = 0.0  # of which the cast to the generator's dtype (vllm_replica.weight_tensors)
        self.last_update_info: dict = {}  # the last update's seconds per replica and replicas left

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> None:
        """Start the generator process and its replicas; returns once every replica (local and remote) is ready.
        `timeout` (default: the config's join_timeout plus a minute) is fatal: GeneratorError, naming the missing."""
        if self._process.pid is not None:
            raise GeneratorError("generator already started")
        if self._process.closed:
            raise GeneratorError("generator is closed")
        settled, self.transport_line = self._weights.choose()  # the transport train.py printed at its start
        self.config = replace(self.config, fleet=settled)
        secret = fleet.run_secret(self.config.fleet)
        importing = self._weights.prepare()  # the first push's import of vLLM's engines, while we wait for the replicas
        self._process.start(_scheduler_in_process, (self.config, self._task_factory, self._data_start, self._skip,
                                                    self._retired, self._version, secret),
                            self.config.fleet.join_timeout + 60 if timeout is None else timeout)
        importing.join()  # done before the caller goes on: no import of its own runs beside it (a concurrent
        # circular import, as a package's modules importing each other, can fail in one of two threads)

    def __enter__(self) -> "Generator":
        if self._process.pid is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def version(self) -> int:
        return self._version

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def info(self) -> dict:
        return dict(self._process.info)

    def begin_close(self) -> None:
        """Ask the generator process to shut down in order, and return at once: what the learner does next (its
        last checkpoint) overlaps the replicas' shutdown, about a second here. close() then waits for it."""
        self._process.begin_close()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the generator process and everything vLLM started, and the weight engines; idempotent."""
        self._process.close(timeout)

    # ---- the learner's API ------------------------------------------------------------------------------------
    def get_batch(self, num_groups: int, learner_version: int, timeout: float | None = None
                  ) -> tuple[list[Group], dict]:
        """`num_groups` finished groups whose loss-masked tokens all have lag learner_version - version <= k
        (pipeline), or exactly `num_groups` fresh groups generated with the current weights (sync).

        learner_version: optimizer steps done (push those weights with update_weights first). Blocks until the
        groups are there (`stats["wait_s"]`); `timeout` (None: the config's batch_timeout) is fatal: GeneratorTimeout
        naming the request, and the generator is closed. Stats of the returned groups: gen_tokens, lag_hist {lag:
        loss-masked tokens}, frac_tokens_by_lag, lag_mean, lag_max, reward_errors, reward_timeouts, interrupted,
        truncated, multi_version_completions, gen_groups_by_replica; of the generator since the last call:
        gen_tokens_per_s, gen_busy_frac, gen_tokens_by_replica, replica_deaths (a line per replica that died); run
        totals: stale_dropped, reward_errors_total, reward_timeouts_total, reward_restarts_total (reward servers
        replaced), skipped_long_prompts, replica_deaths_total,
        replica_connections_refused; and its state: groups_in_flight, groups_ready, buffer_depth_steps,
        generator_version, groups_per_step, gen_replicas_alive."""
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        t0 = time.perf_counter()
        self._process.send(("get_batch", int(num_groups), int(learner_version), t0))
        _, groups, stats = self._process.recv("batch", timeout or self.config.batch_timeout,
                                      what=f"get_batch of {num_groups} groups for weights {learner_version}")
        stats["wait_s"] = time.perf_counter() - t0
        return groups, stats

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int,
                       timeout: float | None = 600) -> float:
        """Push a full HF-named state dict (lm_head.weight included) to every replica as weights `version`, through
        vLLM's weight-transfer API (harness/fleet.py's WeightPush): for each replica a trainer engine of vLLM's
        factory (gloo on CPU, nccl or ipc on GPU) makes init (once per replica), start, update and finish with the
        version, relayed to the replica, which makes the same calls on its vllm.LLM between two decoding steps; the
        replicas receive at once. Returns the seconds the learner spent in all; of those, `last_broadcast_s` went to
        the transfer, and `last_update_info` has each replica's seconds. A replica whose update fails is taken out
        of the run (its work goes to the others)."""
        t0 = time.perf_counter()
        tensors = self._weights.tensors(state_dict)
        self.last_cast_s = time.perf_counter() - t0  # what cast was left (none for runtime.push_state_dict's weights)
        self._process.send(("update", int(version)))
        _, plan = self._process.recv("plan", timeout, what="update_weights")
        t_transfer = time.perf_counter()
        failed = self._weights.send(tensors, version, plan, self._process.send)
        self.last_broadcast_s = time.perf_counter() - t_transfer
        self._process.send(("sent", failed))
        _, applied, self.last_update_info = self._process.recv("updated", timeout, what="update_weights")
        self._version = int(applied)
        self.last_update_s = time.perf_counter() - t0
        return self.last_update_s

    def evaluate(self, problems: list[Problem], samples: int, temperature: float | None = None,
                 timeout: float | None = None) -> list[Group]:
        """`samples` completions of each problem with the current weights (data_index -1), in problem order."""
        if not problems:
            return []
        self._process.send(("evaluate", list(problems), int(samples), temperature))
        _, groups = self._process.recv("evaluated", timeout, what="evaluate")
        return groups

    def retire(self, problem_ids: Iterable[str]) -> None:
        """No-Positive-Resampling: never admit these prompts again (groups already in flight still arrive)."""
        ids = [str(i) for i in problem_ids]
        if ids:
            self._process.send(("retire", ids))

    def _debug(self, what: str, timeout: float = 60) -> Any:
        """"state": the scheduler's state (replicas included); "checksum:NAME": {replica: sum of parameter NAME}."""
        self._process.send(("debug", what))
        return self._process.recv("debug", timeout, what="debug")[1]


def main(argv: list[str]) -> int:
    if argv[:1] != ["replica"]:
        print("pipeline_rl.py: error: its one command is `pipeline_rl.py replica --connect HOST:PORT --secret-file "
              "FILE [--replicas N] [--gen-devices 0,1,...] [--tensor-parallel-size T] [--model PATH]` (see replica "
              "--help)", file=sys.stderr)
        return 2
    return vllm_replica.replica_command(argv[1:], fleet.ReplicaSettings)


__all__ = ["GeneratorConfig", "Completion", "Group", "Generator", "GeneratorError", "GeneratorTimeout",
           "admission_allowed", "off_policy_problems", "should_admit", "mandatory_count", "plan_batch", "pick_replica",
           "lag_histogram", "lag_stats"]


if __name__ == "__main__":
    import pipeline_rl  # what runs in other processes must come from the module, not from __main__

    raise SystemExit(pipeline_rl.main(sys.argv[1:]))
