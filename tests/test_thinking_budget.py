"""ScaleRL's interruption against vLLM's own thinking budget (`SamplingParams(thinking_token_budget=b)`, which forces
`ReasoningConfig.reasoning_end_str` once b thinking tokens are spent), on the model runner the CPU build runs (V1).

The same prompts, seeds and drawn budgets go through this project's logits processor and through vLLM's budget, on
the tiny model and on SmolLM2, and the completions are compared token for token. The budget is configured as close to
ScaleRL's rule as vLLM allows: vLLM counts thinking tokens from the last reasoning-start marker, ScaleRL from the
completion's first token, so the marker is the generation prompt's last token (one token: vLLM 0.32's V1 counts a
longer marker from a wrong offset); the forced string is the task's interruption phrase.

What it shows (the decision in docs/pipeline.md, the design's section 3): where the phrase is forced, vLLM's budget
gives the same tokens at the same positions with sampler logprob 0, inside the same answer budget (and it forces the
phrase again if its start marker recurs after it: SmolLM2's marker is a newline). But a completion that closed
`</think>` itself before its budget and is still writing at the budget gets the phrase forced into its answer,
because V1 ends a thinking span only at its own forced string. ScaleRL leaves such a completion alone, so the project
keeps its processor. When a vLLM upgrade fixes this, the test fails and says so.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from harness import tasks, vllm_replica

SAMPLES = 4  # completions per prompt, each with its own seed and drawn budget


def _generate(model_dir: str, task_name: str, think_budget: tuple[int, int], answer_budget: int) -> dict:
    """In a process of its own (one vLLM engine per model): every completion twice, through the project's processor
    and through vLLM's budget, on one engine configured with both. Returns token ids, logprobs and the budgets."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config.reasoning import ReasoningConfig

    import pipeline_rl as pl

    task = {"tiny": tasks.ArithmeticTask(), "smollm2": tasks.SmallArithmeticTask()}[task_name]
    problems = task.problems("val")[:8] if task_name == "smollm2" else \
        [p for _, (_, p) in zip(range(8), task.train_stream(0))]
    tok = AutoTokenizer.from_pretrained(model_dir)
    phrase = tok(task.interruption_phrase, add_special_tokens=False)["input_ids"]
    close = tok(tasks.THINK_CLOSE, add_special_tokens=False)["input_ids"]
    prompts = [tasks.chat_prompt_ids(tok, p.prompt) for p in problems]
    start = tok.decode(prompts[0][-1:])  # where the completion begins: ScaleRL counts its budget from there
    assert all(p[-1] == prompts[0][-1] for p in prompts)
    assert tok.encode(start, add_special_tokens=False) == prompts[0][-1:]  # one token (docs/pipeline.md: why)

    config = pl.GeneratorConfig(model=model_dir, interruptions=True, fleet=pl.FleetConfig(max_model_len=256))
    # the project's engine, with its interruption processor, as a replica of that generator builds it
    kwargs = vllm_replica.vllm_engine_kwargs(config.replica_settings())
    kwargs["reasoning_config"] = ReasoningConfig(reasoning_start_str=start, reasoning_end_str=task.interruption_phrase)
    llm = LLM(**kwargs)
    llm.llm_engine.engine_core.set_weight_version("0")
    out: dict = {"phrase": phrase, "close": close, "marker": prompts[0][-1], "budgets": []}
    for mode in ("processor", "native"):
        requests, params = [], []
        for i, ids in enumerate(prompts):
            for j in range(SAMPLES):
                seed = 1000 * i + j
                budget = random.Random(seed).randint(*think_budget)
                interrupt = {"budget": budget, "phrase": phrase, "close": close}
                if mode == "processor":
                    out["budgets"].append(budget)
                # the project's request (pipeline_rl's request spec), or the same one with vLLM's budget instead
                p = vllm_replica._Replica.sampling_params({
                    "temperature": 1.0, "max_tokens": budget + len(phrase) + answer_budget, "seed": seed,
                    "interrupt": interrupt if mode == "processor" else None})
                if mode == "native":
                    p = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
                                       logprobs=p.logprobs, output_kind=p.output_kind, seed=p.seed,
                                       thinking_token_budget=budget)
                params.append(p)
                requests.append({"prompt_token_ids": ids, "cache_salt": mode})  # no KV shared between the modes
        outputs = llm.generate(requests, params, use_tqdm=False)
        # the project's requests skip vLLM's detokenizing, and the replica decodes their texts (tokenizer given);
        # vLLM's budget's requests keep it: its texts against the replica's decoding of the same tokens
        out[mode] = [vllm_replica.sampled_output(o, 0, tok if mode == "processor" else None) for o in outputs]
        if mode == "native":
            out["texts"] = [(o.outputs[0].text, vllm_replica.completion_text(
                tok, o.prompt_token_ids, list(o.outputs[0].token_ids), o.outputs[0].finish_reason == "stop"))
                for o in outputs]
    return out


def _run(model_dir: Path, task_name: str, think_budget: tuple[int, int], answer_budget: int) -> dict:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_generate, str(model_dir), task_name, think_budget, answer_budget).result()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_vllm_thinking_budget_against_the_interruption_processor(which, request):
    """(a) the phrase at the budget, (b) logprob 0 on it, (c) the answer budget: vLLM's budget agrees token for token
    wherever the processor forced the phrase, up to a second forcing of its own (it starts a new thinking span where
    its start marker recurs, here after the phrase). (d) a completion that closed its thinking itself: the processor
    leaves it alone, vLLM's V1 budget forces the phrase into its answer once it reaches the budget. (e) the texts the
    replica decodes itself for its requests, which skip vLLM's detokenizing, are vLLM's detokenizer's texts."""
    model_dir = request.getfixturevalue({"tiny": "base_model_dir", "smollm2": "real_model_dir"}[which])
    think_budget, answer_budget = {"tiny": ((20, 40), 8), "smollm2": ((4, 30), 16)}[which]
    got = _run(model_dir, which, think_budget, answer_budget)
    phrase, close, n = got["phrase"], got["close"], len(got["phrase"])
    counts = dict(same=0, interrupted=0, forced_again=0, forced_after_close=0)
    for b, old, new in zip(got["budgets"], got["processor"], got["native"]):
        ids, native = old["token_ids"], new["token_ids"]
        assert len(ids) <= b + n + answer_budget and len(native) <= b + n + answer_budget  # (c)
        differ = next((k for k, (x, y) in enumerate(zip(ids, native)) if x != y), None)
        counts["same"] += native == ids
        if vllm_replica.interruption_start(ids, b, close) == b:  # the processor forced the phrase at b
            counts["interrupted"] += 1
            assert ids[b: b + n] == phrase[: len(ids) - b]
            assert all(lp == 0.0 for lp in old["logprobs"][b: b + n] + new["logprobs"][b: b + n])  # (b)
            if native != ids:  # the same through the phrase (a); then vLLM forced it again, after its marker
                assert differ >= b + n and got["marker"] in native[b + n: differ], (b, old["text"], new["text"])
                assert native[differ: differ + n] == phrase[: len(native) - differ], (b, new["text"])
                counts["forced_again"] += 1
        elif len(ids) <= b:  # ended before its budget: nothing to force either way
            assert native == ids, (b, old["text"], new["text"])
        else:  # (d): closed </think> within its budget and still writing at it
            assert vllm_replica.find_subsequence_end(ids, close, 0, b) is not None
            assert vllm_replica.find_subsequence_end(ids, phrase) is None  # the processor left it alone
            if native != ids:  # vLLM did not
                assert native[:b] == ids[:b] and native[b: b + n] == phrase[: len(native) - b], (b, new["text"])
                counts["forced_after_close"] += 1
    print(f"\n{which}: {counts} of {len(got['budgets'])} completions")
    # (e) the replica's decoding of a completion (vllm_replica.completion_text) is vLLM's detokenizer's text
    assert all(ours == theirs for theirs, ours in got["texts"]), [t for t in got["texts"] if t[0] != t[1]][:3]
    assert sum(bool(theirs) for theirs, _ in got["texts"]) >= len(got["texts"]) // 2  # texts, not empty strings
    assert counts["interrupted"] >= 8, counts  # enough forced phrases to compare
    if which == "tiny":  # its scratchpads close at token 30, inside budgets of 20-40: (d) is met often
        assert counts["forced_after_close"] >= 2, (
            "vLLM's V1 thinking budget now leaves a completion that closed its thinking alone: it may replace the "
            f"interruption processor (docs/pipeline.md) {counts}")
