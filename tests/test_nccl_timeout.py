"""The learner's process group waits as long as rank 0 may work alone: NCCL's 10-minute default would have its
watchdog kill the ranks waiting while rank 0 starts vLLM, runs the step-0 evaluation or waits for a batch."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
import torch

from harness import flags, runtime


class _Stop(Exception):
    pass


def test_the_timeout_that_reaches_init_process_group(monkeypatch, tmp_path):
    args = flags.Args(**vars(flags.build_parser().parse_args(
        ["--gen-devices", "0", "--gen-join-timeout", "900", "--max-tokens", "40000", "--output-dir",
         str(tmp_path / "run")])))
    calls = []
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the NCCL branch, as on a one-GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime, "claim_output_dir", lambda *a: (_ for _ in ()).throw(_Stop()))  # stop right after
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(_Stop):
            with runtime.set_up(args):
                pass
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run keeps gloo's own 30 minutes
        with pytest.raises(_Stop):
            with runtime.set_up(flags.Args(**vars(flags.build_parser().parse_args(
                    ["--output-dir", str(tmp_path / "cpu")])))):
                pass
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    (backend, kwargs), cpu = calls
    assert cpu == ("gloo", {})
    assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 0)
    # vLLM's start (900 s + the minute Generator.start adds), then an evaluation and a batch of 40,000-token
    # completions at 10 tokens/s each
    assert kwargs["timeout"] == timedelta(seconds=900 + 60 + 2 * 4000)
    short = flags.Args(**vars(flags.build_parser().parse_args([])))
    assert runtime.process_group_timeout(short) == timedelta(seconds=600 + 60 + 2 * 1800)  # at least gloo's 30 min
    assert runtime.process_group_timeout(short) > timedelta(minutes=10)  # NCCL's default
