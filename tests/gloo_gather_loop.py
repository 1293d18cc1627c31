"""Run under torchrun (2 ranks, gloo, CPU): the learner as train.py builds it (train.build_learner: FSDP2 units per
decoder layer, the LM head's, the root), then in a loop for a number of seconds a training step on random tokens
(`train`) or none (`push`), and a weight push's gathers (runtime.push_state_dict, one full_tensor() all-gather per
tensor, cast on rank 0 as for a generator). Each pushed tensor's sum is checked against the sum of the ranks' shards.
`busy`: rank 0 also runs a thread that computes and allocates all the time, as its in-process generator does.
`transfer`: rank 0 also sends each push through the weight transfer's gloo engines (harness/weight_transfer.py, made
by vLLM's factories, as Generator.update_weights does), a second gloo group whose store rank 0 hosts, to a receiving
engine in a thread of rank 0 (the replica's end), and checks that every tensor arrived whole.
`nograd`: each round starts with 1 to 3 forwards without grad that leave FSDP2's root unit gathered (no reshard
after them: attach_learner_logprobs before its fix), then pushes before the training step on even rounds, after it
on odd ones: gathers and steps in that half-gathered state.
`rounds=N`: stop after N rounds if SECONDS have not passed first (tests/test_e2e.py runs every path once so).
`teardown`: end through the interpreter's teardown, where a gloo worker thread can crash the rank (the crash at
exit); without it the ranks skip it, as train.py's do, so that a crash is one made during the loop.
It looks for the native crash that FSDP2 over gloo has shown a few times (docs/runtime.md, "Native crashes"):

    torchrun --standalone --nproc_per_node 2 tests/gloo_gather_loop.py MODEL_DIR SECONDS train|push [busy] [transfer]
                                                                       [nograd] [rounds=N] [teardown]

Rank 0 prints `done: N pushes ...` and the count of wrong tensors; a crash prints faulthandler's stacks."""

import faulthandler
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
from harness import flags, runtime  # noqa: E402
from harness.vllm_replica import exit_at_once  # noqa: E402


def busy(stop: threading.Event) -> None:
    """Work in another thread of rank 0, as its generator does beside the learner: torch kernels and allocations.
    Stopped and joined before the process exits: a thread still inside a torch kernel at exit aborted a rank here
    ("terminate called without an active exception", then SIGSEGV), after every push had been checked."""
    while not stop.is_set():
        a = torch.randn(192, 192)
        (a @ a).softmax(-1).sum().item()
        _ = [bytearray(4096) for _ in range(64)]


def stand_in_generator() -> SimpleNamespace:
    """What runtime.push_state_dict reads of rank 0's generator: its fleet's transport, devices and dtype."""
    fleet = SimpleNamespace(weight_transport="file", gen_devices=None, dtype="float32")
    return SimpleNamespace(config=SimpleNamespace(fleet=fleet))


def rounds_asked(extra: list[str]) -> float:
    """The N of a `rounds=N` word, else no bound."""
    return next((int(word.split("=", 1)[1]) for word in extra if word.startswith("rounds=")), float("inf"))


def ranks_go_on(start: float, seconds: float, done: int = 0, rounds: float = float("inf")) -> bool:
    """Whether `seconds` since `start` have not yet passed on every rank and fewer than `rounds` rounds are `done`:
    both ranks stop after the same round."""
    go_on = torch.tensor([float(time.time() - start < seconds and done < rounds)])
    dist.all_reduce(go_on, op=dist.ReduceOp.MIN)
    return bool(go_on.item())


def push_is_right(model: torch.nn.Module, weights: dict, rank: int) -> int:
    """How many pushed tensors' sums differ from their shards' (float64 sums; float32 pushes: only the summation
    order differs, far below 1e-9 of the sum of magnitudes)."""
    wrong = 0
    for name, param in model.state_dict(keep_vars=True).items():
        if not hasattr(param, "to_local"):
            continue
        local = param.to_local().double()
        sums = torch.tensor([local.sum().item(), local.abs().sum().item()], dtype=torch.float64)
        dist.all_reduce(sums)
        if rank == 0 and abs(weights[name].double().sum().item() - sums[0].item()) > 1e-9 * (1 + sums[1].item()):
            wrong += 1
            print(f"wrong: {name}: pushed sum {weights[name].double().sum().item()}, shards' {sums[0].item()}")
    return wrong


class _Receiver:
    """vLLM's VLLMWeightSyncClient over a worker engine of vLLM's factory in a thread of this process (the replica's
    end of the weight transfer), loading into a stand-in model that keeps what it received."""

    def __init__(self) -> None:
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        model = torch.nn.Module()
        model.loaded = {}
        model.load_weights = lambda weights: model.loaded.update((n, t.clone()) for n, t in weights)
        config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None)
        self.worker = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="gloo"), config,
                                                                torch.device("cpu"), model)
        self.thread: threading.Thread | None = None

    def _in_thread(self, fn, *args) -> None:
        self.thread = threading.Thread(target=fn, args=args, daemon=True)
        self.thread.start()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._in_thread(lambda: self.worker.init_transfer_engine(self.worker.parse_init_info(init_info)))

    def start_weight_update(self) -> None:
        self.thread.join()

    def update_weights(self, update_info: dict) -> None:
        self._in_thread(self.worker.update_weights, update_info)

    def finish_weight_update(self, weight_version=None) -> None:
        self.thread.join()


def transfer_is_right(engine, receiver: _Receiver, weights: dict) -> int:
    """Send `weights` through the trainer engine; how many tensors the receiver did not get bit for bit."""
    from harness import weight_transfer

    engine.source = weight_transfer.StateDictSource(weights)
    receiver.worker.model.loaded.clear()
    engine.send_weights()
    loaded = receiver.worker.model.loaded
    return sum(not (name in loaded and torch.equal(loaded[name], t)) for name, t in weights.items())


def forwards_without_grad(model: torch.nn.Module, n: int) -> bool:
    """`n` forwards under torch.no_grad on random tokens (shapes set by `n`, the same on every rank: the collectives
    must match), with no reshard after them. Returns whether the root unit was left gathered (its
    parameters plain tensors, not DTensors)."""
    with torch.no_grad():
        for i in range(n):
            model(input_ids=torch.randint(3, model.config.vocab_size, (1 + i, 2 + 7 * n)))
    return not any(hasattr(p, "to_local") for p in model.model.norm.parameters())


def main(model_path: str, seconds: float, mode: str, extra: list[str]) -> None:
    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stop = threading.Event()
    worker = threading.Thread(target=busy, args=(stop,), daemon=True)
    if "busy" in extra and rank == 0:
        worker.start()
    model, _ = train.build_learner(model_path, flags.Args(model=model_path), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = stand_in_generator()
    torch.manual_seed(rank)
    engine = receiver = None
    if "transfer" in extra and rank == 0:
        from harness import weight_transfer

        receiver = _Receiver()
        engine = weight_transfer.trainer_engine("gloo", client=receiver, source=None, host="127.0.0.1",
                                                worker_host="127.0.0.1", world_size=2, timeout_s=120)
    start, pushes, wrong, gathered = time.time(), 0, 0, 0
    while True:
        if "nograd" in extra:
            gathered += forwards_without_grad(model, 1 + pushes % 3)
        push_first = "nograd" in extra and pushes % 2 == 0  # a push in the half-gathered state, then the step
        if push_first:
            weights = runtime.push_state_dict(model, generator if rank == 0 else None)
            wrong += push_is_right(model, weights, rank)
        if mode == "train":
            ids = torch.randint(3, model.config.vocab_size, (2, 24))
            model(input_ids=ids).logits.float().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if not push_first:
            weights = runtime.push_state_dict(model, generator if rank == 0 else None)
            wrong += push_is_right(model, weights, rank)
        if engine is not None:
            wrong += transfer_is_right(engine, receiver, weights)
        pushes += 1
        if not ranks_go_on(start, seconds, pushes, rounds_asked(extra)):
            break
    stop.set()
    if worker.is_alive():
        worker.join()
    if engine is not None:
        engine.shutdown()
    if rank == 0:
        print(f"done: {pushes} pushes ({mode}{''.join(', ' + e for e in extra)}) in {time.time() - start:.0f} s, "
              f"{wrong} tensors wrong; torch {torch.__version__}"
              + (f"; root unit left gathered by forwards without grad {gathered} times" if "nograd" in extra else ""),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:])
    if "teardown" not in sys.argv[4:]:
        exit_at_once()  # as train.py's ranks: the crash at exit (docs/runtime.md, "Native crashes") is not this loop's
