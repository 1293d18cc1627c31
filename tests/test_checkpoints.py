"""harness/checkpoints.py: a checkpoint and its predecessor, the fallback, planted links and pickles, a full disk,
and older checkpoints migrated."""

import copy
import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import train
from harness import checkpoints, commands, flags, runtime, vllm_replica
from helpers import file_tree, saved_run

SHARD = "shard-00001-model-00001-of-00001.safetensors"  # rank 0's shard of the model and optimizer


def test_trainer_state_round_trips_through_its_json():
    """What a checkpoint's trainer_state.json holds comes back whole on --resume (sets included)."""
    state = checkpoints.TrainerState(step=7, metrics_lines=9, flops=1.5, consumed={3, 1}, retired={"p2"},
                                     history={"p1": [0.5, 1.0]}, bad_steps_total=2)
    assert checkpoints.TrainerState.from_json(json.loads(json.dumps(state.to_json()))) == state


def test_a_checkpoint_keeps_its_predecessor_and_resume_falls_back_to_it(tmp_path, one_rank_group, capsys):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        checkpoints.save_checkpoint(tmp_path, model, optimizer, {"step": step}, rank=0)
    assert checkpoints.complete_checkpoints(tmp_path) == [tmp_path / "checkpoint", tmp_path / "checkpoint.old"]
    assert (tmp_path / "checkpoint" / "rng-0.json").exists()  # each rank's RNG states
    state, used = checkpoints.load_checkpoint(tmp_path, model, optimizer, rank=0)
    assert state["step"] == 2 and used == tmp_path / "checkpoint"
    assert checkpoints.shard_file(0) == SHARD
    # a shard file cut in half: named, and the previous checkpoint is used
    weights = tmp_path / "checkpoint" / SHARD
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    state, used = checkpoints.load_checkpoint(tmp_path, model, optimizer, rank=0)
    assert state["step"] == 1 and used == tmp_path / "checkpoint.old"
    assert f"{tmp_path / 'checkpoint' / SHARD} is cut short" in capsys.readouterr().err
    # a crash between the two renames: checkpoint.old complete, checkpoint.tmp partial, no checkpoint
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.tmp")
    (tmp_path / "checkpoint.tmp" / "trainer_state.json").unlink()
    (tmp_path / "args.json").write_text(json.dumps({"max_steps": 5}))
    assert flags.parse_args(["--resume", str(tmp_path)]).max_steps == 5  # --resume accepts it
    assert checkpoints.load_checkpoint(tmp_path, model, optimizer, rank=0)[0]["step"] == 1
    (tmp_path / "checkpoint.old" / SHARD).write_bytes(b"garbage")
    with pytest.raises(SystemExit, match=f"no checkpoint could be read by every rank.*checkpoint.old/{SHARD} is cut"):
        checkpoints.load_checkpoint(tmp_path, model, optimizer, rank=0)


def test_a_run_directory_is_never_read_through_a_planted_link(tmp_path, one_rank_group, capsys):
    """Reads too: a link at args.json, a checkpoint's files or metrics.jsonl, pointing at another run's file, would
    hand this run that run's flags, model or curve. Each read refuses it by name, even one planted after a check."""
    other, out = tmp_path / "other", tmp_path / "run"
    for run in (other, out):
        run.mkdir()
        flags.write_args_json(run, flags.Args(output_dir=str(run)), 0, [])
        model = torch.nn.Linear(3, 2)
        checkpoints.save_checkpoint(run, model, torch.optim.AdamW(model.parameters()), {"step": 4}, rank=0)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "compute_hours": 0.1, "val_pass_rate": 0.5}) + "\n")
    ckpt = out / "checkpoint"
    for path in (out / "args.json", ckpt / "trainer_state.json", ckpt / SHARD, ckpt / "rng-0.json",
                 out / "metrics.jsonl"):
        path.unlink()
        path.symlink_to(other / path.relative_to(out))
    refused = "is a symbolic link: refused, nothing was read through it"
    with pytest.raises(ValueError, match=f"{out / 'args.json'} {refused}"):
        flags.read_args_json(out)
    with pytest.raises(SystemExit) as stop:  # --resume: one line naming it, before anything starts
        flags.parse_args(["--resume", str(out)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and f"{out / 'args.json'} {refused}" in err, err
    assert checkpoints.newest_checkpoint_step(out) is None  # its step is not this run's
    for read in (lambda: checkpoints.read_trainer_state(ckpt), lambda: checkpoints.shard_header(ckpt / SHARD),
                 lambda: checkpoints.read_rng(ckpt, 0, 1)):
        with pytest.raises(checkpoints.CheckpointError, match=refused):
            read()
    with pytest.raises(checkpoints.LinkRefusedError, match=f"{out / 'metrics.jsonl'} {refused}"):
        runtime.read_run_metrics(out / "metrics.jsonl")
    (ckpt / "rng-0.json").unlink()
    (ckpt / "rng-0.pt").symlink_to(other / "checkpoint" / "rng-0.json")  # migrate-checkpoint's input
    with pytest.raises(SystemExit, match=f"{ckpt / 'rng-0.pt'} is refused .*{refused}"):
        checkpoints.migrate_checkpoint(out)
    assert not (ckpt / "rng-0.json").exists() and (other / "checkpoint" / "rng-0.json").is_file()


def test_checkpoints_are_never_written_or_read_through_a_planted_link(tmp_path, victim, one_rank_group, capsys):
    """A link in place of checkpoint.tmp/ stops the save before anything is written, naming it; a link in place of
    a checkpoint's file makes that checkpoint unreadable (named), the older one is used, and the next save removes
    the link, never its target."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    out = tmp_path / "run"
    out.mkdir()
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "weights.pt").write_text("precious\n")
    (out / "checkpoint.tmp").symlink_to(victim_dir)
    with pytest.raises(SystemExit, match=f"{out / 'checkpoint.tmp'} is a symbolic link: refused"):
        checkpoints.save_checkpoint(out, model, optimizer, {"step": 1}, rank=0)
    assert (victim_dir / "weights.pt").read_text() == "precious\n" and sorted(os.listdir(out)) == ["checkpoint.tmp"]
    (out / "checkpoint.tmp").unlink()
    for step in (1, 2):
        checkpoints.save_checkpoint(out, model, optimizer, {"step": step}, rank=0)
    (out / "checkpoint" / "trainer_state.json").unlink()
    (out / "checkpoint" / "trainer_state.json").symlink_to(victim)
    state, used = checkpoints.load_checkpoint(out, model, optimizer, rank=0)
    assert (state["step"], used) == (1, out / "checkpoint.old")
    assert f"{out / 'checkpoint' / 'trainer_state.json'} is a symbolic link" in capsys.readouterr().err
    checkpoints.save_checkpoint(out, model, optimizer, {"step": 3}, rank=0)
    assert checkpoints.load_checkpoint(out, model, optimizer, rank=0)[0]["step"] == 3
    assert victim.read_text() == "precious\n" and not any(p.is_symlink() for p in out.rglob("*"))


def test_a_link_planted_at_checkpoint_old_during_a_save_is_one_line(tmp_path, victim, one_rank_group, monkeypatch):
    """Planted after the save's check, before its rotation: the rename fails (ENOTDIR); one line, nothing followed."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    out = tmp_path / "run"
    out.mkdir()
    checkpoints.save_checkpoint(out, model, optimizer, {"step": 1}, rank=0)
    read_back = checkpoints.read_trainer_state

    def plant_then_read(ckpt):  # the save reads its new checkpoint back just before rotating it in
        if ckpt.name == "checkpoint.tmp":
            (out / "checkpoint.old").symlink_to(victim)
        return read_back(ckpt)

    monkeypatch.setattr(checkpoints, "read_trainer_state", plant_then_read)
    with pytest.raises(SystemExit, match=r"^checkpoint at step 2: could not rotate .*checkpoint.tmp in \(.*\); it is "
                                         r"complete, and the previous checkpoint .* is intact$"):
        checkpoints.save_checkpoint(out, model, optimizer, {"step": 2}, rank=0)
    assert victim.read_text() == "precious\n"


@pytest.fixture(params=["disk_usage", "tmpfs"])
def small_disk(request, tmp_path, monkeypatch):
    """A directory on a file system with room for two checkpoints of saved_run(size=320) (1.2 MB each) and not
    three: a real 3.5 MB tmpfs where this machine lets the test mount one (root), else a tmp_path whose
    shutil.disk_usage says so."""
    out = tmp_path / "small"
    out.mkdir()
    if request.param == "tmpfs":
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3500k", "tmpfs", str(out)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (not root)")
        yield out
        subprocess.run(["umount", "-l", str(out)], check=True)  # lazy: a file left open must not keep it
        return
    real = shutil.disk_usage

    def usage(path):
        used = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        return real(path)._replace(free=3500 * 1024 - used) if Path(path) == out else real(path)

    monkeypatch.setattr(checkpoints.shutil, "disk_usage", usage)
    yield out


def test_a_full_disk_fails_before_writing_and_keeps_the_checkpoints(small_disk, one_rank_group):
    """A save that would not fit stops before writing anything, with one line naming the file system, the size and
    the free space; the previous checkpoints are intact and no partial directory is left."""
    model, optimizer = saved_run(small_disk, steps=(1, 2), size=320)  # two checkpoints: room for no third
    before = file_tree(small_disk)
    # someone else's file: now even the room of checkpoint.old, which a save frees first, is not enough
    (small_disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - (40 << 10)))
    with pytest.raises(SystemExit) as stop:
        checkpoints.save_checkpoint(small_disk, model, optimizer, {"step": 3, "metrics_lines": 4}, rank=0)
    message = str(stop.value.code)
    assert re.search(r"no space left on .+ for a checkpoint of 1\.\d MB \(free \d\.\d MB", message), message
    assert f"the previous checkpoint {small_disk / 'checkpoint'} is intact" in message
    (small_disk / "filler").unlink()
    assert file_tree(small_disk) == before and not (small_disk / "checkpoint.tmp").exists()
    # without the filler it fits: the older checkpoint.old goes first, so two checkpoints' room is enough
    checkpoints.save_checkpoint(small_disk, model, optimizer, {"step": 3, "metrics_lines": 4}, rank=0)
    assert [json.loads((c / "trainer_state.json").read_text())["step"] for c in
            checkpoints.complete_checkpoints(small_disk)] == [3, 2]


def test_a_failed_write_names_the_file_and_leaves_no_partial_directory(tmp_path, one_rank_group, monkeypatch):
    """A write that fails all the same (the estimate beaten by another writer, an I/O error): torch's own message
    (`basic_ios::clear: iostream error`) names no file; the save's names it, removes checkpoint.tmp and keeps the
    newest checkpoint (the older checkpoint.old made room for the new one before it was written)."""
    model, optimizer = saved_run(tmp_path)
    before = file_tree(tmp_path / "checkpoint")

    def full(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save", full)  # what torch's distributed checkpoint writes a shard with
    with pytest.raises(SystemExit, match=rf"could not write .*checkpoint.tmp/{SHARD} on rank 0 \(RuntimeError: "
                                         r"basic_ios::clear.*previous checkpoint .*checkpoint is intact"):
        checkpoints.save_checkpoint(tmp_path, model, optimizer, {"step": 3, "metrics_lines": 4}, rank=0)
    assert file_tree(tmp_path / "checkpoint") == before and not (tmp_path / "checkpoint.tmp").exists()
    assert checkpoints.complete_checkpoints(tmp_path) == [tmp_path / "checkpoint"]


def test_a_save_needs_two_checkpoints_of_space_at_its_peak(tmp_path, one_rank_group, monkeypatch):
    """The space the checkpoints take, measured after every file operation of a save (docs/runtime.md states the
    result): at most the kept checkpoint and the new one, where the old order (write, then delete the oldest) held
    three."""
    model, optimizer = saved_run(tmp_path, steps=(1, 2), size=320)
    one = sum(len(b) for b in file_tree(tmp_path / "checkpoint").values())
    sizes = []

    def measured(function):
        def wrapper(*args, **kwargs):
            result = function(*args, **kwargs)
            sizes.append(sum(len(b) for name, b in file_tree(tmp_path).items() if name.startswith("checkpoint")))
            return result
        return wrapper

    for module, name in ((checkpoints.torch, "save"), (checkpoints, "write_atomically"),
                         (checkpoints.shutil, "rmtree")):
        monkeypatch.setattr(module, name, measured(getattr(module, name)))
    monkeypatch.setattr(Path, "rename", measured(Path.rename))
    checkpoints.save_checkpoint(tmp_path, model, optimizer, {"step": 3, "metrics_lines": 4}, rank=0)
    peak = max(sizes) / one
    print(f"peak space of a save: {peak:.3f} checkpoints ({max(sizes)} bytes, one checkpoint {one} bytes)")
    assert 1.9 < peak <= 2.01, sizes


class _Payload:
    """Unpickled, it would create the file MARKER: what a crafted checkpoint would do with a shell command."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_is_never_run(tmp_path, one_rank_group, capsys):
    """A pickle payload in every file of both checkpoints (the weights as a torch.save archive, the JSON files and
    the old RNG pickles as raw pickles): --resume, export, evaluate --resume and migrate-checkpoint refuse them,
    and the payload never runs."""
    import pickle

    run, marker = tmp_path / "run", tmp_path / "MARKER"
    model, optimizer = saved_run(run)
    for ckpt in checkpoints.complete_checkpoints(run):
        torch.save({"model": _Payload(marker), "optimizer": _Payload(marker)}, ckpt / SHARD)
        (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))  # what DCP's default reader would unpickle
        torch.save(_Payload(marker), ckpt / "rng-0.pt")  # an older train.py's RNG file
        for name in ("trainer_state.json", "rng-0.json"):
            (ckpt / name).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(SystemExit, match="no checkpoint could be read by every rank"):
        checkpoints.load_checkpoint(run, model, optimizer, rank=0)
    with pytest.raises(SystemExit, match="export .*: no checkpoint could be read"):
        commands.export(run, tmp_path / "exported")
    with pytest.raises(SystemExit, match="no checkpoint could be read"):
        train.main(["evaluate", "--resume", str(run)])
    for ckpt in checkpoints.complete_checkpoints(run):  # weights alone planted: what export and evaluate read
        checkpoints.write_atomically(ckpt / "trainer_state.json", json.dumps({"step": 2, "shards": [SHARD]}))
    with pytest.raises(SystemExit, match=f"{SHARD} is cut short or garbled"):
        commands.export(run, tmp_path / "exported")
    (run / "checkpoint" / "rng-0.json").unlink()
    with pytest.raises(SystemExit, match="rng-0.pt is refused .*nothing in it was run") as refused:
        train.main(["migrate-checkpoint", str(run)])
    assert "weights_only" not in str(refused.value) and "Re-running" not in str(refused.value)  # torch's advice
    assert "holds objects other than tensors" in str(refused.value) and "could run code" in str(refused.value)
    assert not marker.exists()
    assert "weights_only=False" not in capsys.readouterr().err  # torch's advice to load it anyway is not passed on


def test_an_older_checkpoint_is_refused_until_migrated(tmp_path, one_rank_group, capsys):
    """Checkpoints of an older train.py keep their RNG states in pickles (rng-RANK.pt): --resume refuses them with
    the command that converts them, once, through torch's weights_only loader; then it resumes as before."""
    import numpy as np

    model, optimizer = saved_run(tmp_path)
    for ckpt in checkpoints.complete_checkpoints(tmp_path):  # as the older train.py wrote them
        (ckpt / "rng-0.json").unlink()
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
                   ckpt / "rng-0.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    with pytest.raises(SystemExit, match=f"older train.py.*train.py migrate-checkpoint {tmp_path}`"):
        checkpoints.load_checkpoint(tmp_path, model, optimizer, rank=0)
    train.main(["migrate-checkpoint", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["converted"] == [
        str(tmp_path / name / "rng-0.json") for name in ("checkpoint", "checkpoint.old")]
    assert not list(tmp_path.rglob("rng-*.pt"))
    assert checkpoints.load_checkpoint(tmp_path, model, optimizer, rank=0)[0]["step"] == 2
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected  # the saved states, restored


OLD_RUN = Path(__file__).parent / "data" / "checkpoint-v1"  # see tests/data/README.md


def _old_run_copy(tmp_path: Path) -> Path:
    """A copy of the run that the train.py before sharded checkpoints saved (2 learner ranks, one weights.pt per
    checkpoint), its args.json pointing at the tiny model it was trained from, tests/data/mini-arith."""
    run = tmp_path / "old-run"
    shutil.copytree(OLD_RUN, run)
    args = json.loads((run / "args.json").read_text())
    (run / "args.json").write_text(json.dumps({**args, "model": str(OLD_RUN.parent / "mini-arith"),
                                               "output_dir": str(run)}))
    return run


def test_a_checkpoint_of_the_older_format_is_migrated_into_shards(tmp_path, one_rank_group, capsys):
    """The older train.py's checkpoints (weights.pt: full tensors gathered on rank 0) are refused with the command
    that converts them; migrate-checkpoint writes one shard per checkpoint, bit for bit the same tensors, and the
    optimizer's hyper-parameters into trainer_state.json; then the model and optimizer load as saved, on one rank
    here (a 2-rank resume: test_e2e.py), and export reads the model from the shard."""
    from transformers import AutoModelForCausalLM

    run = _old_run_copy(tmp_path)
    old = torch.load(OLD_RUN / "checkpoint" / "weights.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(OLD_RUN.parent / "mini-arith", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    with pytest.raises(SystemExit, match=f"older train.py.*weights.pt.*train.py migrate-checkpoint {run}`"):
        checkpoints.load_checkpoint(run, model, optimizer, rank=0)
    train.main(["migrate-checkpoint", str(run)])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["converted"] == [
        str(run / name / SHARD) for name in ("checkpoint", "checkpoint.old")]
    for name in ("checkpoint", "checkpoint.old"):
        assert sorted(p.name for p in (run / name).iterdir()) == ["rng-0.json", "rng-1.json", SHARD,
                                                                 "trainer_state.json"]
    state, used = checkpoints.load_checkpoint(run, model, optimizer, rank=0)
    assert (state["step"], used) == (json.loads((OLD_RUN / "checkpoint" / "trainer_state.json").read_text())["step"],
                                     run / "checkpoint")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, old["model"][name]), name
    loaded = optimizer.state_dict()
    assert loaded["param_groups"][0]["lr"] == old["optimizer"]["param_groups"][0]["lr"]  # not the 1.0 made here
    names = [n for n, _ in model.named_parameters()]
    assert all(old["optimizer"]["state"][n]["exp_avg"].abs().max() > 0 for n in names)  # its steps trained
    for index, name in enumerate(names):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][index][key], old["optimizer"]["state"][name][key]), (name, key)
    exported = commands.export(run, tmp_path / "exported")
    assert exported["checkpoint"] == str(run / "checkpoint")
    from safetensors.torch import load_file

    written = load_file(tmp_path / "exported" / "model.safetensors")
    assert all(torch.equal(written[n], old["model"][n]) for n in written) and set(written) <= set(old["model"])
    assert train.main(["migrate-checkpoint", str(run)]) is None  # once migrated, nothing more to convert
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["converted"] == []
    for where in (tmp_path / "no-such-run", tmp_path / "exported"):  # a mistyped directory, one that is no run's
        with pytest.raises(SystemExit, match=f"^migrate-checkpoint: {where} holds no checkpoint to convert"):
            train.main(["migrate-checkpoint", str(where)])


@pytest.mark.filterwarnings("error::UserWarning")  # torch's "assuming the intent is to load in a single process"
def test_an_export_in_bfloat16_holds_the_master_weights_rounded_and_says_so(tmp_path, capsys):
    """`train.py export --dtype bfloat16`: half the bytes of the float32 master weights, each tensor rounded from
    them to the nearest (as torch casts), and a config.json that says bfloat16, so that transformers and vLLM load it
    in that dtype without a flag. float32 stays the default: the weights as trained."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    run = _old_run_copy(tmp_path)
    train.main(["migrate-checkpoint", str(run)])
    train.main(["export", str(run), str(tmp_path / "f32")])
    train.main(["export", str(run), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["dtype"] for line in lines[-2:]] == ["float32", "bfloat16"]
    master = load_file(tmp_path / "f32" / "model.safetensors")
    rounded = load_file(tmp_path / "bf16" / "model.safetensors")
    assert master.keys() == rounded.keys() and all(t.dtype == torch.float32 for t in master.values())
    assert all(rounded[n].dtype == torch.bfloat16 and torch.equal(rounded[n], master[n].to(torch.bfloat16))
               for n in master)
    assert AutoConfig.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    assert AutoConfig.from_pretrained(tmp_path / "f32").dtype == torch.float32
    with pytest.raises(SystemExit):
        train.main(["export", str(run), str(tmp_path / "int8"), "--dtype", "int8"])
    err = capsys.readouterr().err
    assert "argument --dtype: invalid choice: 'int8'" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "int8").exists()


def test_a_large_shard_is_split_into_files_and_reads_back_whole(tmp_path, one_rank_group, monkeypatch, capsys):
    """A rank's shard goes into files of about SHARD_FILE_BYTES (each serialised in memory whole before it is
    written, so the file's size bounds a save's host memory); a resume reads every piece back bit for bit."""
    model, optimizer = saved_run(tmp_path, steps=(1,), size=64)  # weight 16 KiB, each moment as much
    monkeypatch.setattr(checkpoints, "SHARD_FILE_BYTES", 20 << 10)
    model(torch.ones(1, 64)).sum().backward()
    optimizer.step()
    checkpoints.save_checkpoint(tmp_path, model, optimizer, {"step": 2}, rank=0)
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["shards"] == [f"shard-00001-model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert max((tmp_path / "checkpoint" / f).stat().st_size for f in state["shards"]) < 40 << 10
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    fresh = torch.nn.Linear(64, 64)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    assert checkpoints.load_checkpoint(tmp_path, fresh, fresh_optimizer, rank=0)[0]["step"] == 2
    for name, tensor in saved[0].items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    for index, per_param in saved[1]["state"].items():
        for key, tensor in per_param.items():
            assert torch.equal(fresh_optimizer.state_dict()["state"][index][key], tensor), (index, key)
    (tmp_path / "checkpoint" / state["shards"][1]).unlink()  # one file of three missing: named, the older one used
    assert checkpoints.load_checkpoint(tmp_path, fresh, fresh_optimizer, rank=0) == (
        {**json.loads((tmp_path / "checkpoint.old" / "trainer_state.json").read_text())}, tmp_path / "checkpoint.old")
    assert f"{tmp_path / 'checkpoint' / state['shards'][1]} is missing" in capsys.readouterr().err


class _Tied(torch.nn.Module):
    """An LM head tied to its embedding, as SmolLM2's: one weight under two names."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_weight_is_saved_once_and_loads_into_both_names(tmp_path, one_rank_group):
    """safetensors refuses two names for one memory (a save of SmolLM2 failed so): the second name is left out,
    and loading the first fills the weight both names share."""
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters())
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    checkpoints.save_checkpoint(tmp_path, model, optimizer, {"step": 1}, rank=0)
    header = checkpoints.shard_header(tmp_path / "checkpoint" / SHARD)
    assert "model.embed.weight" in header and "model.head.weight" not in header
    fresh = _Tied()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    checkpoints.load_checkpoint(tmp_path, fresh, fresh_optimizer, rank=0)
    assert torch.equal(fresh.embed.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight
    moments = [o.state_dict()["state"][0]["exp_avg"] for o in (fresh_optimizer, optimizer)]
    assert torch.equal(*moments) and moments[0].abs().max() > 0


def test_a_large_older_checkpoint_is_migrated_into_files_of_the_shard_size(tmp_path, one_rank_group, monkeypatch):
    """migrate-checkpoint writes the older weights.pt in files of about SHARD_FILE_BYTES too (one file would be
    serialised in memory whole), and they load back as one."""
    from transformers import AutoModelForCausalLM

    run = _old_run_copy(tmp_path)
    monkeypatch.setattr(checkpoints, "SHARD_FILE_BYTES", 500 << 10)  # the 1.35 MB of tensors in 3 files
    written = checkpoints.migrate_checkpoint(run)["converted"]
    assert written[:3] == [str(run / "checkpoint" / f"shard-00001-model-0000{i}-of-00003.safetensors")
                           for i in (1, 2, 3)]
    model = AutoModelForCausalLM.from_pretrained(OLD_RUN.parent / "mini-arith", dtype=torch.float32)
    checkpoints.load_checkpoint(run, model, torch.optim.AdamW(model.parameters()), rank=0)
    old = torch.load(OLD_RUN / "checkpoint" / "weights.pt", weights_only=True)
    assert all(torch.equal(t, old["model"][n]) for n, t in model.state_dict().items())
