"""Where the learner ranks and replicas go on a GPU node and how weights travel between them, decided without a GPU:
the lines `train.py plan --gpus N` prints (and a GPU run at its start), and the chooser the generator applies."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import pipeline_rl as pl
from harness import flags, vllm_replica

REPO = Path(__file__).resolve().parent.parent


def test_one_shared_gpu_sends_weights_by_file_and_eight_gpus_broadcast_over_nccl():
    lines = flags.plan(["--gpus", "1", "--gen-devices", "0"]).splitlines()
    assert lines[:2] == ["learner rank 0: GPU 0 (shared with replica 0)", "replica 0: GPU 0"]
    transport = [line for line in lines if line.startswith("weight transport:")]
    assert len(transport) == 1 and transport[0].startswith("weight transport: file") and "NCCL broadcast" not in lines[2]
    lines = flags.plan(["--gpus", "8", "--gen-devices", "0,1,2,3,4,5", "--learner-ranks", "2"]).splitlines()
    assert lines[:3] == ["learner rank 0: GPU 6", "learner rank 1: GPU 7", "replica 0: GPU 0"]
    assert "weight transport: NCCL broadcast from learner rank 0 to 6 replica(s)" in lines
    lines = flags.plan(["--gpus", "4", "--gen-devices", "0,1", "--tensor-parallel-size", "2", "--shape",
                        "smollm2-135m"]).splitlines()
    assert "replica 0: GPUs 0,1" in lines and any("per GPU" in line for line in lines)  # the memory plan follows


def test_broadcast_on_a_shared_gpu_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        flags.plan(["--gpus", "1", "--gen-devices", "0", "--weight-transport", "broadcast"])
    err = capsys.readouterr().err.strip()
    assert "--weight-transport broadcast: replica 0 shares GPU 0 with learner rank 0" in err and "\n" not in err
    args = flags.Args(**vars(flags.build_parser().parse_args(["--gen-devices", "0", "--weight-transport",
                                                              "broadcast"])))
    assert any("NCCL refuses two ranks on one GPU" in p for p in flags.gpu_layout_problems(args, 1, 1))


def test_the_chooser():
    choose = vllm_replica.choose_weight_transport
    assert choose("auto", None, [], 2, 0) == ("broadcast", "weight transport: gloo broadcast from learner rank 0 to "
                                                           "2 replica(s)")
    assert choose("auto", 2, [[0], [1]], 2, 1)[0] == "broadcast"
    assert choose("file", 2, [[0], [1]], 2, 0)[0] == "file"
    assert choose("auto", 1, [[0, 1]], 1, 0)[0] == "file"  # tensor parallel replica over the learner's GPU
    with pytest.raises(ValueError, match="remote replicas need"):
        choose("auto", 0, [[0]], 1, 1)


def test_the_generator_applies_the_same_chooser(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # learner rank 0 on GPU 0
    shared = pl.GeneratorConfig(model="m", gen_devices="0")
    assert vllm_replica.config_weight_transport(shared)[0] == "file"
    assert vllm_replica.config_weight_transport(pl.GeneratorConfig(model="m", gen_devices="1,2"))[0] == "broadcast"
    generator = pl.Generator(pl.GeneratorConfig(model="m", gen_devices="0", weight_transport="broadcast"), None)
    with pytest.raises(pl.GeneratorError, match="weight_transport broadcast: replica 0 shares GPU 0"):
        generator.start()  # refused before any process starts
    monkeypatch.undo()
    assert vllm_replica.config_weight_transport(pl.GeneratorConfig(model="m"))[0] == "broadcast"  # CPU: gloo


class _Work:
    """A broadcast's work: done at once, or never (its replica died mid-broadcast and NCCL would wait it out)."""

    def __init__(self, finishes: bool):
        self.finishes = finishes

    def is_completed(self) -> bool:
        return self.finishes

    def wait(self) -> None:
        assert self.finishes


class _Group:
    def __init__(self, finishes: bool):
        self.finishes, self.aborted, self.pg = finishes, False, self

    def broadcast(self, buffer: torch.Tensor) -> _Work:
        return _Work(self.finishes)

    def abort(self) -> None:
        self.aborted = True


def test_a_replica_dying_mid_broadcast_is_named_and_left_behind_within_seconds():
    sender = vllm_replica.WeightSender.__new__(vllm_replica.WeightSender)  # its sending part, no store
    sender.backend, sender.timeout_s = "gloo", 300.0
    sender.groups = {0: _Group(True), 1: _Group(False), 2: _Group(True)}
    hung = sender.groups[1]
    tensors = {"a": torch.ones(1000), "b": torch.ones(1000)}
    manifest = vllm_replica.weight_manifest(tensors, 4000)
    started = time.monotonic()
    deaths = {1: "vLLM process VllmWorker (pid 4321)"}
    failed = sender.send(tensors, manifest, [0, 1, 2], gone=lambda r: deaths.get(r) if time.monotonic() - started
                         > 0.2 else None)
    assert time.monotonic() - started < 5  # not weight_timeout's 300 s
    assert failed == {1: "vLLM process VllmWorker (pid 4321) died during the weight broadcast"}
    assert hung.aborted and set(sender.groups) == {0, 2} and len(manifest) == 2  # the others got every bucket


def test_the_learner_watches_a_replicas_own_processes():
    import os
    import subprocess
    import sys

    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        engine = (os.getpid(), psutil.Process().create_time(), "EngineCore")
        watch = vllm_replica.local_processes(child.pid, [engine])
        assert [label for _, _, label in watch] == ["replica process", "vLLM process EngineCore"]
        assert vllm_replica.dead_processes(watch) is None
        child.kill()
        child.wait()
        assert vllm_replica.dead_processes(watch) == f"replica process (pid {child.pid})"
    finally:
        child.kill()


def test_replica_devices_under_a_restricted_cuda_visible_devices(tmp_path):
    """--gen-devices counts the GPUs the learner sees: under CUDA_VISIBLE_DEVICES=4,6 index 1 is GPU 6, which the
    replica's own CUDA_VISIBLE_DEVICES must name (not GPU 1, someone else's)."""
    import os
    import subprocess
    import sys

    assert vllm_replica.visible_devices([1], "4,6") == "6"
    assert vllm_replica.visible_devices([0, 1], "GPU-aa, GPU-bb") == "GPU-aa,GPU-bb"
    assert vllm_replica.visible_devices([0, 2], None) == "0,2"
    with pytest.raises(ValueError, match="shows 2 GPU"):
        vllm_replica.visible_devices([2], "4,6")
    # the replica process sets it from its parent's: run its entry point up to the connection, which reports it
    script = ("import os\nfrom harness import vllm_replica\n"
              "def connect(*a):\n    print(os.environ['CUDA_VISIBLE_DEVICES']); raise ConnectionError('stop')\n"
              "vllm_replica.connect_to_generator = connect\n"
              "vllm_replica.replica_main('127.0.0.1:1', b's', 0, [1], None)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "4,6"}, cwd=REPO)  # the root, where the package is
    assert out.stdout.strip() == "6" and out.returncode == 1, out.stderr[-500:]


def test_a_receiver_killed_mid_broadcast_over_gloo_fails_only_its_own_group(tmp_path):
    """The same over real groups (gloo; `make gpu-smoke` runs it over NCCL): a receiver dies after its first bucket
    and is named within seconds, while the other gets every byte (weight_probe checks them)."""
    import weight_probe

    failures, got, seconds = weight_probe.run_weight_broadcast(tmp_path, "gloo", "cpu", ["cpu", "cpu"], die=1,
                                                               mb=8, bucket_mb=1, die_after=1)
    assert set(failures) == {1} and got[0] is not None and seconds < 20, failures


def test_a_push_is_gathered_once_per_weight_and_cast_before_any_copy():
    """What a CPU can measure of the push: rank 0 gets the weights in the generator's dtype (bf16: half the bytes of
    float32 in every bucket), a tied weight gathered once, no copy of a tensor already in that dtype, and nothing on
    the other ranks."""
    from types import SimpleNamespace

    from harness import runtime

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(64, 8)
    model.lm_head = torch.nn.Linear(8, 64, bias=False)
    model.lm_head.weight = model.embed.weight  # tied, as SmolLM2's
    generator = SimpleNamespace(config=SimpleNamespace(weight_transport="file", gen_devices=None, dtype="bfloat16"))
    weights = runtime.push_state_dict(model, generator)
    assert set(weights) == {"embed.weight", "lm_head.weight"}
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in weights.values())
    assert weights["embed.weight"].data_ptr() == weights["lm_head.weight"].data_ptr()  # one gather, one cast
    assert runtime.push_state_dict(model, None) == {}  # another rank: it took part in the gathers, keeps nothing
    tensors = vllm_replica.weight_tensors(weights, torch.bfloat16, tied=True)
    assert tensors["embed.weight"].data_ptr() == weights["embed.weight"].data_ptr()  # already bf16: no copy
    manifest = vllm_replica.weight_manifest(tensors, 256)
    assert sum(nbytes for bucket in manifest for *_, nbytes in bucket) == 64 * 8 * 2  # bf16, the tie sent once


def test_a_push_of_an_fsdp2_model_holds_the_same_weights_as_its_full_state_dict():
    """push_state_dict's one-tensor-at-a-time gathers of FSDP2's DTensors give what get_model_state_dict gave (one
    gloo rank: the learner's CPU layout), cast to the generator's dtype."""
    import socket
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from harness import runtime

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        fully_shard(model[0])
        fully_shard(model)
        assert hasattr(model.state_dict(keep_vars=True)["0.weight"], "full_tensor")  # a DTensor: gathered
        full = runtime.full_state_dict(model)
        config = SimpleNamespace(weight_transport="broadcast", gen_devices=None, dtype="bfloat16")
        pushed = runtime.push_state_dict(model, SimpleNamespace(config=config))
        assert set(pushed) == set(full)
        assert all(torch.equal(pushed[k], full[k].to(torch.bfloat16)) for k in full)
    finally:
        dist.destroy_process_group()
