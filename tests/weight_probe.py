"""harness/vllm_replica.py's weight broadcast without vLLM: the learner's WeightSender and fake replicas in processes of
their own, each joining its own weight group and receiving every bucket. Used by tests/test_pipeline_rl.py (gloo, CPU)
and tests/test_gpu.py (NCCL, GPU), and runnable alone to time a broadcast:

    python tests/weight_probe.py gloo cpu cpu,cpu 540      # 540 MB to two receivers on CPU
    python tests/weight_probe.py nccl cuda:0 cuda:1 540    # over NCCL, a receiver on the second GPU
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import vllm_replica  # noqa: E402


def _receiver(group: dict, device: str, manifest: list, out: str, die: bool, die_after: int) -> None:
    """A replica's worker without vLLM: join the weight group (rank 1), receive every bucket, save what arrived.
    `die`: it dies after `die_after` buckets (0: after joining, before the update)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    member = vllm_replica.open_weight_group(group, 1)
    if die and not die_after:  # a replica that dies after joining, before the update
        os._exit(3)
    received = {}
    for i, bucket in enumerate(manifest):
        if die and i == die_after:  # mid-broadcast: the learner's next bucket has no receiver
            os._exit(3)
        buffer = torch.empty(vllm_replica.bucket_nbytes(bucket), dtype=torch.uint8, device=member.device)
        member.broadcast(buffer).wait()
        received.update({k: v.cpu().clone() for k, v in vllm_replica.unpack_bucket(buffer, bucket)})
    torch.save(received, out)


def run_weight_broadcast(tmp_path: Path, backend: str, learner_device: str, receiver_devices: list[str],
                         die: int | None = None, mb: int = 8, bucket_mb: int | None = None, die_after: int = 0
                         ) -> tuple[dict, list[dict | None], float]:
    """The learner's WeightSender (on `learner_device`) and one fake replica per entry of `receiver_devices`, each
    in its own group; replica `die` dies after joining (or after `die_after` buckets, mid-broadcast), and the sender
    watches the receivers' processes as it watches a replica's. Every live receiver's tensors are checked against
    the learner's. Returns (the send's failures, what each receiver got, seconds of the send)."""
    if learner_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(learner_device))
    torch.manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(mb * 2**18 // 8, device=learner_device) for i in range(8)}  # mb MB
    manifest = vllm_replica.weight_manifest(tensors, bucket_bytes=(bucket_mb or max(1, mb // 4)) << 20)
    sender = vllm_replica.WeightSender("127.0.0.1", backend, timeout_s=60)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for r, device in enumerate(receiver_devices):
        host, port = sender.address
        group = {"store_host": host, "store_port": port, "prefix": f"probe/{r}", "world": 2, "backend": backend,
                 "timeout_s": 60, "bind_host": "127.0.0.1"}
        proc = ctx.Process(target=_receiver, args=(group, device, manifest, str(tmp_path / f"r{r}.pt"), r == die,
                                                   die_after))
        proc.start()
        sender.join(r, group)
        procs.append(proc)
    if die is not None and not die_after:
        procs[die].join(30)
    watch = {r: vllm_replica.local_processes(proc.pid, []) for r, proc in enumerate(procs)}
    t0 = time.perf_counter()
    failures = sender.send(tensors, manifest, list(range(len(receiver_devices))),
                           gone=lambda r: vllm_replica.dead_processes(watch[r]))
    seconds = time.perf_counter() - t0
    for proc in procs:
        proc.join(120)
    got = [torch.load(tmp_path / f"r{r}.pt") if r != die else None for r in range(len(receiver_devices))]
    for r, received in enumerate(got):
        if received is not None:
            assert set(received) == set(tensors), r
            assert all(torch.equal(received[k], tensors[k].cpu()) for k in tensors), r
    return failures, got, seconds


if __name__ == "__main__":
    backend, learner, receivers, mb = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
    with tempfile.TemporaryDirectory() as tmp:
        run_weight_broadcast(Path(tmp), backend, learner, receivers, mb=mb, bucket_mb=256)  # warm-up: groups form
        failures, _, seconds = run_weight_broadcast(Path(tmp), backend, learner, receivers, mb=mb, bucket_mb=256)
    print(f"{backend}: {mb} MB from {learner} to {len(receivers)} receiver(s) ({sys.argv[3]}) in {seconds:.3f} s "
          f"({mb * len(receivers) / 1024 / seconds:.2f} GB/s sent in all); failures {failures}")
