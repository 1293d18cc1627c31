"""Run under torchrun (2 ranks, gloo, CPU): train.py's own learner step in a loop for a number of seconds, as the
loop runs it (train.make_learner; the learner's old logprobs, train.attach_learner_logprobs, without grad; the
advantages, loss_and_backward through the chunked FP32 head, optimizer_step, reduce_metrics), then the weight push's
gathers (runtime.push_state_dict, each pushed tensor's sum checked against its shards'), on synthetic groups of 2 to
6 prompts. `vary`: each step takes one of several layouts (micro-batch budgets, packing, LM-head chunks of 3
positions), the same on every rank: each once in turn, then drawn at random. `kl`: with --kl-coef (the frozen
reference's forwards without grad). `gathered`: after the old logprobs, one more forward without grad and no reshard,
which leaves FSDP2's root unit gathered as attach_learner_logprobs did before its fix; every third step also pushes in
that state. `busy`: a thread of rank 0 computes and allocates all the time, as tests/gloo_gather_loop.py's. `ckpt`:
every fourth step also saves a checkpoint (harness/checkpoints.save_checkpoint: torch's distributed checkpoint, read
back, rotated), as runs do. `rounds=N` and `teardown` as in tests/gloo_gather_loop.py (stop after N steps; end
through the interpreter's teardown). It looks for the native crash of FSDP2 over gloo (docs/runtime.md, "Native
crashes") on the path gloo_gather_loop.py does not take (its steps call the model's forward):

    torchrun --standalone --nproc_per_node 2 tests/learner_step_loop.py MODEL_DIR SECONDS [vary] [kl] [gathered] [busy]
                                                                        [ckpt] [rounds=N] [teardown]

Rank 0 prints `done: N steps ...` and the count of wrong tensors; a crash prints faulthandler's stacks."""

import faulthandler
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
from gloo_gather_loop import busy, push_is_right, ranks_go_on, rounds_asked, stand_in_generator  # noqa: E402
from harness import base_model, checkpoints, flags, runtime  # noqa: E402
from harness.vllm_replica import exit_at_once  # noqa: E402
from tools.bench import synthetic_groups  # noqa: E402

# How a step is cut up (tests/learner_probe.py's layouts): one micro-batch or several, padded or packed rows, the LM
# head's logits in chunks of 3 positions or whole.
LAYOUTS = ({"micro_batch_tokens": 100_000, "packing": False},
           {"micro_batch_tokens": 200, "packing": False},
           {"micro_batch_tokens": 200, "packing": False, "logits_chunk_tokens": 3},
           {"micro_batch_tokens": 100_000, "packing": True},
           {"micro_batch_tokens": 60, "packing": True, "logits_chunk_tokens": 3})


def step_args(model_path: str, layout: dict, kl: bool) -> flags.Args:
    """A --tis run's flags (old logprobs from the learner) in `layout`, with the model's optimiser defaults."""
    args = flags.Args(model=model_path, loss="cispo", group_size=4, tis="token", kl_coef=0.04 if kl else 0.0, **layout)
    embedded = Path(model_path).resolve() == base_model.BASE_MODEL_DIR.resolve()
    flags.resolve_defaults(args, embedded=embedded, on_gpu=False)
    return args


def one_step(args: flags.Args, learner: train.Learner, groups: list, run: SimpleNamespace, version: int,
             gathered: bool) -> bool:
    """The learner's old logprobs, then a step on this rank's share of `groups`. Returns whether FSDP2's root unit
    was left gathered before the step (`gathered`)."""
    mine = runtime.this_ranks_share(groups, run)
    with torch.no_grad():
        train.attach_learner_logprobs(learner.model, mine, args, learner.pad_id)
        if gathered:
            runtime.idle_forward(learner.model, learner.pad_id, backward=False)
    left = not any(hasattr(p, "to_local") for p in learner.model.model.norm.parameters())
    _, my_advantages = train.compute_advantages(args, learner, groups, run)
    learner.optimizer.zero_grad(set_to_none=True)
    totals = train.loss_and_backward(args, learner, mine, my_advantages, train.Step(version, run.world))
    train.optimizer_step(args, learner, totals.get("loss", 0.0), has_groups=True)
    runtime.reduce_metrics(totals, run.world)
    return left


def main(model_path: str, seconds: float, extra: list[str]) -> None:
    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo")
    run = SimpleNamespace(rank=dist.get_rank(), world=dist.get_world_size())
    stop = threading.Event()
    worker = threading.Thread(target=busy, args=(stop,), daemon=True)
    if "busy" in extra and run.rank == 0:
        worker.start()
    generator = stand_in_generator() if run.rank == 0 else None
    rng = random.Random(0)  # the same draws on every rank: the same layouts and batches, so the same collectives
    learners: dict[tuple, train.Learner] = {}
    box = [tempfile.mkdtemp(prefix="learner-step-loop-") if run.rank == 0 and "ckpt" in extra else None]
    dist.broadcast_object_list(box, src=0)  # one run directory for both ranks' checkpoints
    start, steps, wrong, left = time.time(), 0, 0, 0
    while True:
        layout = LAYOUTS[0]
        if "vary" in extra:  # every layout once, then at random (drawn at every step: the later draws are as before)
            drawn = rng.randrange(len(LAYOUTS))
            layout = LAYOUTS[steps if steps < len(LAYOUTS) else drawn]
        args = step_args(model_path, layout, "kl" in extra)
        key = tuple(sorted((k, v) for k, v in layout.items() if k != "micro_batch_tokens"))  # what the build reads
        if key not in learners:
            learners[key] = train.make_learner(args, model_path, torch.device("cpu"), run.rank)
        learner = learners[key]
        groups = synthetic_groups(rng.randint(2, 6), args.group_size, learner.model.config.vocab_size, seed=steps)
        if "gathered" in extra and steps % 3 == 0:  # a push in the half-gathered state, before the step
            with torch.no_grad():
                runtime.idle_forward(learner.model, learner.pad_id, backward=False)
            wrong += push_is_right(learner.model, runtime.push_state_dict(learner.model, generator), run.rank)
        left += one_step(args, learner, groups, run, steps, "gathered" in extra)
        wrong += push_is_right(learner.model, runtime.push_state_dict(learner.model, generator), run.rank)
        steps += 1
        if box[0] is not None and steps % 4 == 0:
            checkpoints.save_checkpoint(Path(box[0]), learner.model, learner.optimizer, {"step": steps}, run.rank)
        if not ranks_go_on(start, seconds, steps, rounds_asked(extra)):
            break
    stop.set()
    if worker.is_alive():
        worker.join()
    if run.rank == 0:
        if box[0] is not None:
            shutil.rmtree(box[0])
        print(f"done: {steps} steps ({', '.join(extra) or 'plain'}) in {time.time() - start:.0f} s on "
              f"{len(learners)} learners, {wrong} tensors wrong, root unit left gathered before {left} steps; "
              f"torch {torch.__version__}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3:])
    if "teardown" not in sys.argv[3:]:
        exit_at_once()  # as train.py's ranks: the crash at exit (docs/runtime.md, "Native crashes") is not this loop's
