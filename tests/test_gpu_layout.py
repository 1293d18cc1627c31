"""Where the learner ranks and replicas go on a GPU node and how weights travel between them, decided without a GPU:
the lines `train.py plan --gpus N` prints (and a GPU run at its start), and the chooser the generator applies."""

from __future__ import annotations

import pytest
import torch

import flags
import pipeline_rl as pl
import vllm_replica


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
