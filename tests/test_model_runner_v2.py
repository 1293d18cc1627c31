"""The interruption (and slowdown) logits processors under vLLM's two model runners: on a GPU configuration vLLM 0.32
runs V2 wherever Triton is installed, and V2's own loader must accept every processor this project passes; the CPU
build runs V1. Proven on CPU with vLLM's own loaders and validators, and the V2 forcing against the V1 rule."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pipeline_rl as pl
from harness import fleet, vllm_replica

INTERRUPT = {"budget": 4, "phrase": [7, 8, 9], "close": [5, 6]}


def _gpu_machine(monkeypatch: pytest.MonkeyPatch, triton: bool = True) -> None:
    """What vllm_replica reads of a GPU machine: Triton installed, no VLLM_USE_V2_MODEL_RUNNER set."""
    import vllm.triton_utils

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", triton)


def _request_state(max_num_reqs: int, history: torch.Tensor, prompt_lens: list[int]) -> SimpleNamespace:
    """The parts of vLLM's V2 RequestState a logits processor reads (host arrays .np, device tensors .gpu)."""
    prompt = np.array(prompt_lens, dtype=np.int32)
    return SimpleNamespace(device=torch.device("cpu"), max_num_reqs=max_num_reqs, vocab_size=history.shape[1],
                           all_token_ids=SimpleNamespace(gpu=history), prompt_len=SimpleNamespace(np=prompt),
                           prefill_len=SimpleNamespace(np=prompt), total_len=SimpleNamespace(gpu=None))


def test_model_runner_choice(monkeypatch):
    _gpu_machine(monkeypatch)
    assert vllm_replica.model_runner_v2(on_gpu=True) and not vllm_replica.model_runner_v2(on_gpu=False)
    _gpu_machine(monkeypatch, triton=False)  # vLLM falls back to V1 without Triton: so do the names
    assert not vllm_replica.model_runner_v2(on_gpu=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the user's choice wins, as in vLLM
    assert vllm_replica.model_runner_v2(on_gpu=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m", gen_devices="0"))[
        "logits_processors"][0].endswith("V2")


def test_v2_loader_accepts_every_processor_of_a_gpu_configuration(monkeypatch):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor import (LogitsProcessor, build_custom_logits_processors,
                                                            build_custom_logits_processors_params_validator)

    _gpu_machine(monkeypatch)
    names = vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m", gen_devices="0", debug_slowdown=2))[
        "logits_processors"]
    assert names == ["harness.vllm_replica:InterruptionLogitsProcessorV2",
                     "harness.vllm_replica:SlowdownLogitsProcessorV2"]
    # the frontend's check at start and at each request's admission
    validate = build_custom_logits_processors_params_validator(names)
    validate(SamplingParams(max_tokens=8, extra_args={"scalerl_interrupt": INTERRUPT}))
    validate(SamplingParams(max_tokens=8))
    with pytest.raises(VLLMValidationError, match="scalerl_interrupt"):
        validate(SamplingParams(max_tokens=8, extra_args={"scalerl_interrupt": {"budget": 4}}))
    # the worker's: load and construct them as the V2 model runner does
    state = _request_state(4, torch.zeros(4, 16, dtype=torch.int32), [0] * 4)
    processors = build_custom_logits_processors(SimpleNamespace(speculative_config=None), state, False, names)
    assert len(processors) == 2 and all(isinstance(p, LogitsProcessor) for p in processors)
    with pytest.raises(ValueError, match="speculative"):
        build_custom_logits_processors(SimpleNamespace(speculative_config=object()), state, False, names[:1])


def test_v1_loader_accepts_the_cpu_configuration(monkeypatch):
    from vllm.v1.sample.logits_processor import LogitsProcessor, _load_custom_logitsprocs

    _gpu_machine(monkeypatch)  # even with Triton at hand, a CPU replica runs V1 (replica_main pins it)
    names = vllm_replica.vllm_engine_kwargs(fleet.ReplicaSettings(model="m", debug_slowdown=2))["logits_processors"]
    assert names == ["harness.vllm_replica:InterruptionLogitsProcessor", "harness.vllm_replica:SlowdownLogitsProcessor"]
    assert all(issubclass(c, LogitsProcessor) for c in _load_custom_logitsprocs(names))
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    validate_logits_processors_parameters(names, SamplingParams(extra_args={"scalerl_interrupt": INTERRUPT}))
    with pytest.raises(VLLMValidationError, match="scalerl_interrupt"):
        validate_logits_processors_parameters(names, SamplingParams(extra_args={"scalerl_interrupt": {"budget": -1,
                                                                                                      "phrase": [],
                                                                                                      "close": []}}))


def test_v2_forcing_follows_the_v1_rule():
    """Random completions, some closing their thinking early, decoded step by step in a batch whose rows and slots
    differ: every step's logits under V2 equal those _ForcePhrase (the V1 rule) gives, and a forced token's logprob
    is 0."""
    from vllm import SamplingParams

    rng = random.Random(0)
    vocab, slots_n, steps = 12, 6, 14
    cls = vllm_replica.InterruptionLogitsProcessorV2
    prompt_lens = [rng.randint(1, 3) for _ in range(slots_n)]
    history = torch.zeros(slots_n, 32, dtype=torch.int32)
    processor = cls(SimpleNamespace(speculative_config=None), _request_state(slots_n, history, prompt_lens))
    rules, outputs = {}, {}
    for s in range(slots_n):
        spec = {"budget": rng.randint(0, 5), "phrase": [7, 8, 9], "close": [5, 6]} if s != 2 else None
        assert processor.add_request(s, SamplingParams(extra_args={"scalerl_interrupt": spec} if spec else None)) \
            == (spec is not None)
        rules[s] = vllm_replica._ForcePhrase(*vllm_replica.interruption_spec({"scalerl_interrupt": spec})) \
            if spec else None
        outputs[s] = []
    forced_seen = 0
    for _ in range(steps):
        slots = np.array(rng.sample(range(slots_n), slots_n))  # the batch order changes every step
        seq_lens = np.array([prompt_lens[s] + len(outputs[s]) for s in slots], dtype=np.int32)
        logits = torch.randn(slots_n, vocab)
        ctx = SimpleNamespace(idx_mapping_np=slots, seq_lens_upper_bound_np=seq_lens)
        got = processor.apply(logits.clone(), ctx)
        for b, s in enumerate(slots.tolist()):
            want = rules[s](outputs[s], logits[b].clone()) if rules[s] else logits[b]
            assert torch.equal(got[b], want), (s, outputs[s])
            if torch.isinf(got[b]).any():
                forced_seen += 1
                assert torch.log_softmax(got[b], -1).max().item() == 0.0
            token = int(got[b].argmax()) if torch.isinf(got[b]).any() else rng.choice([1, 5, 6])
            history[s, prompt_lens[s] + len(outputs[s])] = token
            outputs[s].append(token)
    closed_early = [s for s, rule in rules.items() if rule and rule.done and rule.scanned < rule.budget]
    assert forced_seen >= 3 and closed_early  # the test forced phrases, and left completions that closed alone
