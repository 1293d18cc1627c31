"""Run under torchrun by tests/test_e2e.py: the gradient of one step of every loss, for several micro-batch
token budgets and LM-head chunk sizes, with and without --kl-coef, --tis and CISPO's other aggregation units, in
padded rows and packed ones (--packing), on synthetic groups. Rank 0 saves {(loss, config): (loss value, flat full
gradient, metrics)} to argv[1], `config` a tuple of (Args field, value) pairs (CONFIGS). argv[2], if given, is the
learner's --dtype (default float32), and argv[3] a model directory (default: the embedded base model); on a CUDA
machine the ranks run on the GPU under NCCL (tests/test_gpu.py compares that with CPU). With --reference-only it
runs the reference layout alone (LAYOUTS[0])."""

import faulthandler
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
from harness import base_model  # noqa: E402
from harness import flags  # noqa: E402
from harness import runtime  # noqa: E402
from harness.vllm_replica import exit_at_once  # noqa: E402
from tools.bench import synthetic_groups  # noqa: E402

# The settings that change the loss (KL to the reference model, importance weights, CISPO's aggregation unit): each
# is run with one micro-batch in padded rows (the reference), then with the others below.
LOSS_SETTINGS = ({}, {"kl_coef": 0.04}, {"tis": "token"})
CISPO_SETTINGS = ({"aggregation": "sample"}, {"aggregation": "token"})
# How the step is cut up, none of which may change it: one micro-batch per rank or several (--micro-batch-tokens,
# padded size or real tokens; groups of about 70 tokens split by the smaller budgets), the LM head's logits in
# chunks of 3 positions, padded rows or packed ones, activation checkpointing and CPU offload.
LAYOUTS = ({"micro_batch_tokens": 100_000, "packing": False},  # the reference
           {"micro_batch_tokens": 200, "packing": False},
           {"micro_batch_tokens": 200, "packing": False, "logits_chunk_tokens": 3},
           {"micro_batch_tokens": 100_000, "packing": True},
           {"micro_batch_tokens": 200, "packing": True},
           {"micro_batch_tokens": 60, "packing": True, "logits_chunk_tokens": 3},
           # under one completion: each alone, every group split; and the memory flags, which change no step
           {"micro_batch_tokens": 12, "packing": True, "activation_checkpointing": True, "cpu_offload": True})


def configs(loss_name: str) -> list[tuple[tuple, tuple]]:
    """(settings, layout) pairs for one loss, each a sorted tuple of (Args field, value)."""
    settings = LOSS_SETTINGS + (CISPO_SETTINGS if loss_name == "cispo" else ())
    return [(tuple(sorted(s.items())), tuple(sorted(layout.items()))) for s in settings for layout in LAYOUTS]


_BUILT: dict = {}


def built_models(model_dir: str, args: flags.Args, layout: tuple, device: torch.device) -> tuple:
    """(policy, reference or None) for `args`, built once for each layout but its micro-batch budget (which only the
    step reads; the build reads the others: the LM head's chunks, packing's attention, activation checkpointing,
    CPU offload) instead of once for each configuration: a step leaves the weights as they are, since nothing
    steps the optimizer, and no setting of LOSS_SETTINGS changes the build."""
    key = tuple(item for item in layout if item[0] != "micro_batch_tokens")
    if ("policy", key) not in _BUILT:
        torch.manual_seed(0)
        _BUILT["policy", key] = train.build_learner(model_dir, args, device)[0]
    if args.kl_coef and ("reference", key) not in _BUILT:
        reference = _BUILT["reference", key] = train.build_reference(model_dir, args, device)
        with torch.no_grad():  # move the reference off the policy, so that the KL and its gradient are not 0
            for p in reference.parameters():
                p.mul_(1.01)  # on the float32 parameters FSDP2 keeps, also under bf16 compute
    return _BUILT["policy", key], _BUILT["reference", key] if args.kl_coef else None


def main() -> None:
    # --reference-only: the reference layout alone (one padded micro-batch), which the other world size's layouts
    # are compared with; CI runs every layout on 2 ranks and this on 1.
    faulthandler.enable(all_threads=True)  # a rank that dies in native code prints where, as train.py's do
    reference_only = "--reference-only" in sys.argv
    argv = [a for a in sys.argv if a != "--reference-only"]
    out = Path(argv[1])
    dtype = argv[2] if len(argv) > 2 else "float32"
    rank, world, device = runtime.init_distributed(cpu_offload=True)  # gloo beside NCCL for the offloaded layout
    model_dir = argv[3] if len(argv) > 3 else base_model.embedded_base_model()
    results = {}
    for loss_name, loss_module in train.LOSSES.items():
        for settings, layout in configs(loss_name):
            if reference_only and layout != tuple(sorted(LAYOUTS[0].items())):
                continue
            args = flags.Args(loss=loss_name, group_size=4, dtype=dtype, **dict(settings), **dict(layout))
            model, ref_model = built_models(str(model_dir), args, layout, device)
            groups = synthetic_groups(6, 4, model.config.vocab_size)
            learner = train.Learner(model=model, optimizer=None, scheduler=None, loss=train.loss_file(args), pad_id=0,
                                    n_params=0, ref_model=ref_model)
            rewards = torch.tensor([r for grp in groups for r in grp.rewards])
            advantages = loss_module.compute_advantages(rewards, 4)
            mine = [i for i in range(len(groups)) if i % world == rank]
            my_adv = torch.cat([advantages[i * 4: (i + 1) * 4] for i in mine])
            if args.tis:  # as the loop does: the learner's old logprobs, in the same layout, against the sampler's
                with torch.no_grad():
                    train.attach_learner_logprobs(model, [groups[i] for i in mine], args, pad_id=0)
            totals = train.loss_and_backward(args, learner, [groups[i] for i in mine], my_adv,
                                             train.Step(version=0, world=world))
            metrics = runtime.reduce_metrics(totals, world)
            grads = {name: p.grad.full_tensor().float().cpu() for name, p in model.named_parameters()}
            flat = torch.cat([grads[k].flatten() for k in sorted(grads)])
            results[(loss_name, settings + layout)] = (metrics["loss"], flat, metrics)
            model.zero_grad(set_to_none=True)  # the next configuration that shares the model starts from none
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As train.py's ranks: no interpreter teardown once the results are saved. A gloo worker thread still releasing
    # the last collective's tensors takes the GIL during that teardown, and CPython's ending of it aborts the rank
    # (docs/runtime.md, "Native crashes": the crash at exit).
    exit_at_once()
