"""Where the learner ranks and replicas go on a GPU node and which engine of vLLM's weight-transfer API carries the
weights, decided without a GPU: the lines `train.py plan --gpus N` prints (and a GPU run at its start), the chooser
the generator applies, and the requests a GPU run would send, accepted by vLLM's own dataclasses."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import pipeline_rl as pl
from harness import flags, fleet, vllm_replica

REPO = Path(__file__).resolve().parent.parent


def test_one_shared_gpu_uses_vllms_ipc_engine_and_eight_gpus_its_nccl_engine():
    lines = flags.plan(["--gpus", "1", "--gen-devices", "0"]).splitlines()
    assert lines[:2] == ["learner rank 0: GPU 0 (shared with replica 0)", "replica 0: GPU 0"]
    transport = [line for line in lines if line.startswith("weight transfer:")]
    assert len(transport) == 1 and transport[0].startswith("weight transfer: vLLM's ipc engine"), lines
    lines = flags.plan(["--gpus", "8", "--gen-devices", "0,1,2,3,4,5", "--learner-ranks", "2"]).splitlines()
    assert lines[:3] == ["learner rank 0: GPU 6", "learner rank 1: GPU 7", "replica 0: GPU 0"]
    assert "weight transfer: vLLM's nccl engine from learner rank 0 (GPU 6) to 6 replica(s), a group each" in lines
    lines = flags.plan(["--gpus", "4", "--gen-devices", "0,1", "--tensor-parallel-size", "2", "--shape",
                        "smollm2-135m"]).splitlines()
    assert "replica 0: GPUs 0,1" in lines and any("per GPU" in line for line in lines)  # the memory plan follows


def test_nccl_on_a_shared_gpu_and_the_weight_file_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        flags.plan(["--gpus", "1", "--gen-devices", "0", "--weight-transport", "nccl"])
    err = capsys.readouterr().err.strip()
    assert "--weight-transport nccl: replica 0 shares GPU 0 with learner rank 0" in err and "\n" not in err
    args = flags.Args(**vars(flags.build_parser().parse_args(["--gen-devices", "0", "--weight-transport", "nccl"])))
    assert any("NCCL refuses two ranks on one GPU" in p for p in flags.gpu_layout_problems(args, 1, 1))
    args = flags.Args(**vars(flags.build_parser().parse_args(["--weight-transport", "file"])))
    problems = [p for p in flags.check_args(args) if "weight" in p]
    assert problems == ["--weight-transport file: the weight file is gone; weights travel through vLLM's "
                        "weight-transfer engines (auto: gloo on CPU, nccl between GPUs, ipc to a replica on learner "
                        "rank 0's GPU)"]
    args = flags.Args(**vars(flags.build_parser().parse_args(["--weight-transport", "broadcast"])))
    assert not [p for p in flags.check_args(args) if "weight" in p]  # an earlier version's name: auto


def test_the_chooser():
    choose = vllm_replica.choose_weight_transport
    assert choose("auto", None, [], 2, 0)[0] == "gloo"
    assert choose("broadcast", None, [], 2, 0)[0] == "gloo"  # an earlier version's value reads as auto
    assert choose("auto", 2, [[0], [1]], 2, 1)[0] == "nccl"
    assert choose("auto", 1, [[0, 1]], 1, 0)[0] == "ipc"  # tensor parallel replica over the learner's GPU
    with pytest.raises(ValueError, match="remote replicas would need nccl"):
        choose("auto", 0, [[0]], 1, 1)
    with pytest.raises(ValueError, match="replica 1 would need nccl"):
        choose("auto", 0, [[0], [1]], 2, 0)
    with pytest.raises(ValueError, match="run the learner on one rank"):
        choose("auto", 0, [[0]], 1, 0, learner_ranks=2)
    with pytest.raises(ValueError, match="ipc: no replica shares"):
        choose("ipc", 2, [[0]], 1, 0)
    with pytest.raises(ValueError, match="nccl: a CPU run has no GPU"):
        choose("nccl", None, [], 1, 0)
    with pytest.raises(ValueError, match="file: the weight file is gone"):
        choose("file", None, [], 1, 0)


def test_the_generator_applies_the_same_chooser(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # learner rank 0 on GPU 0
    shared = fleet.FleetConfig(gen_devices="0")
    assert vllm_replica.config_weight_transport(shared)[0] == "ipc"
    assert vllm_replica.config_weight_transport(fleet.FleetConfig(gen_devices="1,2"))[0] == "nccl"
    generator = pl.Generator(pl.GeneratorConfig(model="m", fleet=pl.FleetConfig(gen_devices="0",
                                                                     weight_transport="nccl")), None)
    with pytest.raises(pl.GeneratorError, match="weight_transport nccl: replica 0 shares GPU 0"):
        generator.start()  # refused before any process starts
    monkeypatch.undo()
    assert vllm_replica.config_weight_transport(fleet.FleetConfig())[0] == "gloo"  # CPU


def test_the_gpu_engines_requests_pass_vllms_own_validators():
    """What a GPU run sends, checked on CPU by vLLM's own dataclasses: the trainer init info the learner builds for
    each engine, the worker init payload vLLM's nccl trainer derives from it, the update info of a round, and the
    engine each replica's LLM is configured with (vllm_engine_kwargs), which vLLM's factory knows."""
    from dataclasses import asdict

    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import (IPCTrainerInitInfo, IPCWeightTransferInitInfo,
                                                             IPCWeightTransferUpdateInfo)
    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo, NCCLWeightTransferInitInfo,
                                                              NCCLWeightTransferUpdateInfo)

    from harness import weight_transfer

    nccl = weight_transfer.trainer_init_info("nccl", host="127.0.0.1", worker_host="10.0.0.2", world_size=3,
                                             timeout_s=300)
    assert isinstance(nccl, NCCLTrainerInitInfo) and nccl.is_sender and nccl.world_size == 3  # 1 + TP 2
    assert 0 < nccl.master_port < 65536
    worker = NCCLWeightTransferInitInfo(**worker_init_payload(NCCLWeightTransferInitInfo(
        master_address=nccl.master_address, master_port=nccl.master_port, rank_offset=1, world_size=3,
        packed=nccl.packed)))  # what NCCLTrainerWeightTransferEngine.trainer_init sends, parsed as the worker does
    assert worker.rank_offset == 1 and worker.packed
    meta = weight_transfer.StateDictSource({"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
                                            "lm_head.weight": torch.zeros(4, 2, dtype=torch.bfloat16)}).metadata()
    update = NCCLWeightTransferUpdateInfo(names=[m.name for m in meta], dtype_names=["bfloat16"] * 2,
                                          shapes=[list(m.shape) for m in meta])
    assert NCCLWeightTransferUpdateInfo(**asdict(update)) == update
    with pytest.raises(ValueError, match="same size"):
        NCCLWeightTransferUpdateInfo(names=["a"], dtype_names=[], shapes=[[1]])
    ipc = weight_transfer.trainer_init_info("ipc", host="127.0.0.1", worker_host="127.0.0.1", world_size=2,
                                            timeout_s=300)
    assert isinstance(ipc, IPCTrainerInitInfo) and ipc.packed and IPCWeightTransferInitInfo(packed=ipc.packed).packed
    handle = {"GPU-0": (torch.Tensor, torch.Size([8]), (1,), 0, torch.UntypedStorage, torch.uint8, 0, b"h", 8, 0,
                        False, b"r", 0, b"e", True)}  # rebuild_cuda_tensor's arguments, as the trainer makes them
    plain = weight_transfer.plain_update_info({"names": ["w"], "dtype_names": ["uint8"], "shapes": [[8]],
                                               "ipc_handles": handle, "tensor_sizes": [8]})
    parsed = IPCWeightTransferUpdateInfo(**vllm_replica.decode_update_info(plain))  # the replica's side
    assert parsed.ipc_handles == handle
    for engine in ("nccl", "ipc", "gloo"):  # each replica's LLM names an engine vLLM's factories have
        cfg = fleet.ReplicaSettings(model="m", weight_transport=engine, gen_devices=None if engine == "gloo" else "1")
        backend = vllm_replica.vllm_engine_kwargs(cfg)["weight_transfer_config"]["backend"]
        assert WeightTransferConfig(backend=backend).backend == engine
        assert engine in WeightTransferEngineFactory._registry and engine in WeightTransferTrainerFactory._registry


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


def test_a_push_is_gathered_once_per_weight_and_cast_before_any_copy():
    """What a CPU can measure of the push: rank 0 gets the weights in the generator's dtype (bf16: half the bytes of
    float32 in every chunk), a tied weight gathered once, no copy of a tensor already in that dtype, and nothing on
    the other ranks."""
    from types import SimpleNamespace

    from harness import runtime

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(64, 8)
    model.lm_head = torch.nn.Linear(8, 64, bias=False)
    model.lm_head.weight = model.embed.weight  # tied, as SmolLM2's
    config = fleet.FleetConfig(dtype="bfloat16", weight_transport="gloo")
    generator = SimpleNamespace(config=SimpleNamespace(fleet=config))
    weights = runtime.push_state_dict(model, generator)
    assert set(weights) == {"embed.weight", "lm_head.weight"}
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in weights.values())
    assert weights["embed.weight"].data_ptr() == weights["lm_head.weight"].data_ptr()  # one gather, one cast
    assert runtime.push_state_dict(model, None) == {}  # another rank: it took part in the gathers, keeps nothing
    tensors = vllm_replica.weight_tensors(weights, torch.bfloat16, tied=True)
    assert tensors["embed.weight"].data_ptr() == weights["embed.weight"].data_ptr()  # already bf16: no copy
    from harness import weight_transfer

    meta = weight_transfer.StateDictSource(tensors).metadata()  # what the engine declares and sends
    assert [(m.name, m.dtype) for m in meta] == [("embed.weight", torch.bfloat16)]  # bf16, the tie sent once


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
        config = SimpleNamespace(fleet=fleet.FleetConfig(dtype="bfloat16", weight_transport="gloo"))
        pushed = runtime.push_state_dict(model, SimpleNamespace(config=config))
        assert set(pushed) == set(full)
        assert all(torch.equal(pushed[k], full[k].to(torch.bfloat16)) for k in full)
    finally:
        dist.destroy_process_group()
