"""harness/checkpoints.py: a run's checkpoint files. A runtime module: a reader of the recipe may skip it.

A checkpoint is OUTPUT_DIR/checkpoint/ (the previous one kept as checkpoint.old/): the model and optimizer
(weights.pt), every rank's RNG states (rng-RANK.json) and the trainer state (trainer_state.json, `TrainerState`:
everything the loop carries from one step to the next). This file holds how they are saved (`save_checkpoint`,
which refuses to start a save the disk cannot hold), read back and agreed on by every rank (`agree_on_checkpoint`,
`load_checkpoint`, `read_checkpoint`), converted from an older run's pickled RNG files (`migrate_checkpoint`),
`write_atomically`, the one way the run's small files are written, and `open_no_follow`, the one way a file in a run
directory is opened: never through a symbolic link (people share run directories; docs/runtime.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pickle
import random
import re
import secrets
import shutil
import stat
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


# ----------------------------------------------------------------------------------------------------------------
# The trainer state: what the loop carries from one step to the next, saved in every checkpoint
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TrainerState:
    """Everything the loop carries from one step to the next; saved whole in every checkpoint
    (trainer_state.json) and restored whole by --resume."""

    step: int = 0  # optimizer steps done, which is also the version of the policy's weights
    metrics_lines: int = 0  # rows of metrics.jsonl this state covers (a resume cuts the file back to them)
    elapsed_hours: float = 0.0  # wall-clock hours of the run so far, across resumes
    eval_hours: float = 0.0  # of those, the hours spent evaluating (rank 0): rl_compute_hours leaves them out
    flops: float = 0.0
    gen_tokens: int = 0
    train_tokens: int = 0
    consumed: set[int] = field(default_factory=set)  # data indices trained on or dropped: a resume skips them
    history: dict[str, list[float]] = field(default_factory=dict)  # prompt id -> pass rate of each of its groups
    retired: set[str] = field(default_factory=set)  # prompt ids retired for good (No-Positive-Resampling)
    bad_steps_total: int = 0  # steps skipped for a non-finite loss or gradient

    def count_tokens(self, gen_tokens: int, batch: list, n_params: int) -> int:
        """Add a step's generated and trained tokens and their FLOPs (2N per generated, 6N per trained token);
        returns the trained tokens."""
        trained = sum(len(grp.prompt_ids) + len(c.token_ids) for grp in batch for c in grp.completions)
        self.train_tokens += trained
        self.gen_tokens += gen_tokens
        self.flops += 2 * n_params * gen_tokens + 6 * n_params * trained
        return trained

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "consumed": sorted(self.consumed), "retired": sorted(self.retired)}


    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> TrainerState:
        """Also reads older checkpoints: unknown keys (e.g. their always-zero reward_errors) are ignored."""
        state = cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})
        state.consumed, state.retired = set(state.consumed), set(state.retired)
        return state


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint files: model, optimizer, every rank's RNG, the trainer state. Nothing in a run directory is
# unpickled: the weights load with torch's weights_only loader (tensors and plain values, nothing else), the RNG
# states and the trainer state are JSON. People share run directories; a crafted file must not run code.
# ----------------------------------------------------------------------------------------------------------------

CHECKPOINT_DIRS = ("checkpoint", "checkpoint.old")  # newest first; checkpoint.tmp/ is a save in progress


class CheckpointError(Exception):
    """A checkpoint file that cannot be read (cut short, garbled, a pickle of objects); the message names it."""


def save_checkpoint(out: Path, model: Any, optimizer: Any, state: dict, rank: int) -> None:
    """OUTPUT_DIR/checkpoint/, the previous one kept as checkpoint.old/. A collective: every rank calls it.

    The new checkpoint is written beside the others as checkpoint.tmp/ and read back by the ranks that wrote it;
    only then does rank 0 rotate it in (checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint). The newest
    checkpoint that every rank can read (agree_on_checkpoint) is never removed or renamed over before that: what
    goes first, to make room, is every other checkpoint directory (an older checkpoint.old, a corrupt checkpoint
    after a fallback to checkpoint.old, a save cut short). So a save needs room for two checkpoints at its peak,
    and one that would not fit fails before writing anything, naming the file system, the size and the free
    space. Each rank writes its RNG states (rng-RANK.json); rank 0 the weights and trainer_state.json (`state`,
    rank 0's, with the world size). Directories are made 0700 and files 0600: readable by their owner only."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    world = dist.get_world_size()
    keep, report, _ = agree_on_checkpoint(out, rank, load=False)  # stays until the new one is in place
    if report and rank == 0:
        print(f"[checkpoint] {report}; the others are removed to make room", file=sys.stderr)
    weights, state = {"model": model_sd, "optimizer": optim_sd}, {**state, "world_size": world}
    need, refused = 0, None
    if rank == 0:
        need = checkpoint_bytes(weights, state, world)
        planted = _planted(tmp, final, old)  # checked first: nothing below may remove or measure through a link
        doomed = [] if planted else [d for d in (tmp, final, old) if d.exists() and d != keep]
        reclaimed = sum(_tree_bytes(d) for d in doomed)
        free = shutil.disk_usage(out).free
        if planted:
            refused = f"{planted}; {_kept(keep)}"
        elif free + reclaimed < need:
            refused = no_space_message(out, need, free, reclaimed) + f"; nothing was written: {_kept(keep)}"
        else:
            for d in doomed:
                shutil.rmtree(d)
            tmp.mkdir(mode=0o700)
            os.chmod(tmp, 0o700)  # whatever the umask: checkpoints are readable by their owner only
    box = [refused]  # rank 0's verdict, on every rank
    dist.broadcast_object_list(box, src=0)
    refused = box[0]
    if refused:
        raise SystemExit(f"checkpoint at step {state.get('step')}: {refused}")
    error, writing = None, tmp
    try:
        if rank == 0:
            writing = tmp / "weights.pt"
            with os.fdopen(open_no_follow(writing, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
                torch.save(weights, f)
            os.chmod(writing, 0o600)
            writing = tmp / "trainer_state.json"
            write_atomically(writing, json.dumps(state), private=True)
            read_weights(tmp / "weights.pt", expect=weights)  # read back: a short write shows here, not at resume
            read_trainer_state(tmp)
        writing = tmp / f"rng-{rank}.json"
        write_atomically(writing, json.dumps(rng_states()), private=True)
        read_rng(tmp, rank, world)
    except Exception as e:  # an ENOSPC the estimate missed, an I/O error: torch's own message names neither
        error = f"could not write {writing} on rank {rank} ({_first_line(e)})"
        if rank == 0 and shutil.disk_usage(out).free < need:
            error += f": {no_space_message(out, need, shutil.disk_usage(out).free, 0)}"
    except BaseException:  # a second Ctrl-C: stop at once, leaving no partial directory behind
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"checkpoint at step {state.get('step')} failed: {'; '.join(e for e in errors if e)}; "
                         f"{_kept(keep)}")
    rotated = [None]
    if rank == 0:
        try:  # a link planted at checkpoint.old since the check above makes a rename fail: one line, not a traceback
            if final.exists():  # the kept one (anything else there went before writing)
                final.rename(old)
            tmp.rename(final)
        except OSError as e:
            rotated = [f"checkpoint at step {state.get('step')}: could not rotate {tmp} in ({e}); it is complete, "
                       f"and {_kept(keep)}"]
    dist.broadcast_object_list(rotated, src=0)  # every rank stops together, or goes on with it in place
    if rotated[0]:
        raise SystemExit(rotated[0])


def _planted(*directories: Path) -> str | None:
    """Why a save must not touch these checkpoint directories (a symbolic link or a file where one belongs: the run
    makes neither, and removing or renaming through one would reach whatever it points at), or None."""
    for d in directories:
        try:
            refuse_unless_regular(d, directory=True, own=True)
        except LinkRefusedError as e:
            return str(e)
    return None


def _kept(keep: Path | None) -> str:
    return f"the previous checkpoint {keep} is intact" if keep else "there was no earlier checkpoint to keep"


def checkpoint_bytes(weights: dict, state: dict, world: int) -> int:
    """What a checkpoint will take on disk, from its tensors' sizes: their bytes, torch.save's archive record and
    pickled name per tensor (about 500 bytes measured; 1 KiB counted), the JSON files, and 64 KiB to spare."""
    tensors: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(weights)
    tensor_bytes = sum(t.numel() * t.element_size() + 1024 for t in tensors)
    return tensor_bytes + len(json.dumps(state)) + world * RNG_FILE_BYTES + (64 << 10)


RNG_FILE_BYTES = 32 << 10  # rng-RANK.json: Python's 625 and numpy's 624 integers, torch's 5056 bytes in hex


def no_space_message(out: Path, need: int, free: int, reclaimed: int, what: str = "a checkpoint") -> str:
    """No room on `out`'s file system for `what` of `need` bytes, with the free space (`reclaimed` of it in the
    older checkpoints a save would replace)."""
    mb = 1 << 20
    freed = f", {reclaimed / mb:.1f} MB of it in older checkpoints a save replaces" if reclaimed else ""
    size = f"{need / mb:.1f} MB" if need >= mb // 10 else f"{need} bytes"
    return (f"no space left on {file_system(out)} for {what} of {size} (free "
            f"{(free + reclaimed) / mb:.1f} MB{freed})")


def write_failure(path: Path, error: OSError, need: int, what: str) -> str:
    """One line for `path` not written (metrics.jsonl, args.json, a weight file): on a full disk (or quota) its file
    system and the free space for `what` of `need` bytes, else the error."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(path.parent).free
        return f"could not write {path}: {no_space_message(path.parent, need, free, 0, what=what)}"
    return f"could not write {path}: {error.strerror or error}"


def file_system(path: Path) -> str:
    """The device a path is on, as /proc/mounts names it, with its mount point (the path itself if unknown)."""
    target, best = path.resolve(), None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount = line.split()[:2]
            mount = mount.replace("\\040", " ")
            if (target == Path(mount) or Path(mount) in target.parents) and (best is None or len(mount) > len(best[1])):
                best = (device, mount)
    except (OSError, ValueError):
        pass
    return f"{best[0]} (mounted at {best[1]})" if best else str(path)


def _tree_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def complete_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints of a run directory, newest first (checkpoint/, then checkpoint.old/)."""
    return [out / name for name in CHECKPOINT_DIRS if (out / name / "trainer_state.json").is_file()]


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint whose trainer_state.json reads (None if none does)."""
    for ckpt in complete_checkpoints(run_dir):
        try:
            step = json.loads(read_no_follow(ckpt / "trainer_state.json")).get("step")  # a link: no step
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


def read_trainer_state(ckpt: Path) -> dict:
    path = ckpt / "trainer_state.json"
    try:
        state = json.loads(read_no_follow(path))
    except LinkRefusedError as e:
        raise CheckpointError(str(e)) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({_first_line(e)})") from None
    if not (isinstance(state, dict) and isinstance(state.get("step"), int)):
        raise CheckpointError(f"{path} holds no trainer state (no step)")
    return state


def read_weights(path: Path, expect: dict | None = None) -> dict:
    """weights.pt ({"model", "optimizer"}) through torch's weights_only loader, memory-mapped (its tensors are
    read when used, so checking a checkpoint costs little). `expect`: what was just saved, to compare names and
    shapes with."""
    try:
        with opened_no_follow(path) as opened:
            if not zipfile.is_zipfile(opened):  # torch.save's archive: a file cut short loses its directory at its end
                raise CheckpointError(f"{path} is cut short or garbled (not a torch.save archive)")
            weights = torch.load(opened, map_location="cpu", weights_only=True, mmap=True)
    except CheckpointError:
        raise
    except LinkRefusedError as e:
        raise CheckpointError(str(e)) from None
    except pickle.UnpicklingError:  # torch's message goes on to suggest weights_only=False: never here
        raise CheckpointError(f"{path} holds objects other than tensors and plain values (a pickle that could run "
                              "code): refused unread") from None
    except Exception as e:
        raise CheckpointError(f"{path} is unreadable ({_first_line(e)})") from None
    if not (isinstance(weights, dict) and isinstance(weights.get("model"), dict) and "optimizer" in weights
            and all(isinstance(t, torch.Tensor) for t in weights["model"].values())):
        raise CheckpointError(f"{path} holds no model and optimizer state")
    if expect is not None and {k: t.shape for k, t in weights["model"].items()} != \
            {k: t.shape for k, t in expect["model"].items()}:
        raise CheckpointError(f"{path} does not read back as written")
    return weights


def rng_states() -> dict[str, Any]:
    """This process's RNG states as JSON values: Python's (version, 625 ints, gauss), numpy's (name, 624 ints,
    pos, has_gauss, cached), torch's CPU generator (bytes, in hex)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss], "numpy": [name, keys.tolist(), int(pos), int(has_gauss),
                                                                    float(cached)],
            "torch": torch.get_rng_state().numpy().tobytes().hex()}


def read_rng(ckpt: Path, rank: int, world: int | None) -> dict[str, Any] | None:
    """This rank's RNG states from rng-RANK.json, checked on scratch generators (a garbled file fails here, not
    when set). None for a rank the saving run did not have (its world size, `world`, was smaller): it keeps its
    fresh seeding. A checkpoint of an older train.py (pickled rng-RANK.pt) is refused with how to convert it."""
    path = ckpt / f"rng-{rank}.json"
    if not path.exists():
        if (ckpt / f"rng-{rank}.pt").exists() or (ckpt / "rng-0.pt").exists():
            raise CheckpointError(f"{ckpt} was written by an older train.py: its RNG states are pickles (rng-*.pt), "
                                  "which are never loaded; convert them once with `python train.py migrate-checkpoint "
                                  f"{ckpt.parent}`")
        if world is not None and rank >= world:
            return None
        raise CheckpointError(f"{path} is missing")
    try:
        saved = json.loads(read_no_follow(path))
        version, internal, gauss = saved["python"]
        python = (version, tuple(internal), gauss)
        random.Random().setstate(python)
        name, keys, pos, has_gauss, cached = saved["numpy"]
        numpy_state = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
        np.random.RandomState().set_state(numpy_state)
        torch_state = torch.frombuffer(bytearray.fromhex(saved["torch"]), dtype=torch.uint8).clone()
        torch.Generator().set_state(torch_state)
    except LinkRefusedError as e:
        raise CheckpointError(str(e)) from None
    except (OSError, ValueError, TypeError, KeyError, OverflowError, RuntimeError) as e:
        raise CheckpointError(f"{path} is unreadable ({_first_line(e)})") from None
    return {"python": python, "numpy": numpy_state, "torch": torch_state}


def read_checkpoint_files(ckpt: Path, rank: int | None) -> tuple[dict, dict, dict | None]:
    """The files of checkpoint directory `ckpt` that rank `rank` loads: (trainer state, weights, its RNG states);
    rank None (export) skips the RNG. CheckpointError names the first file that does not read; a symbolic link (the
    directory or a file in it) is never read through."""
    try:
        refuse_unless_regular(ckpt, directory=True, reading=True)
        for name in ("trainer_state.json", "weights.pt", *([] if rank is None else [f"rng-{rank}.json"])):
            refuse_unless_regular(ckpt / name, reading=True)
    except LinkRefusedError as e:
        raise CheckpointError(str(e)) from None
    state = read_trainer_state(ckpt)
    weights = read_weights(ckpt / "weights.pt")
    return state, weights, None if rank is None else read_rng(ckpt, rank, state.get("world_size"))


def agree_on_checkpoint(out: Path, rank: int, load: bool = True) -> tuple[Path | None, str, tuple | None]:
    """The newest checkpoint that every rank can read, the same on every rank. Each rank reads its own files of each
    complete checkpoint (trainer_state.json, weights.pt, its rng-RANK.json); one all_gather then gives every rank
    every rank's findings. No rank falls back on its own: ranks that loaded different checkpoints would train
    shards of two models, then deadlock. Returns (that checkpoint, or None; a report naming each unreadable file
    and each rank's own newest readable checkpoint, empty when all is well; what this rank read of it, when
    `load`). A collective: every rank calls it."""
    found: dict[str, str | None] = {}
    read: dict[str, tuple] = {}
    for ckpt in complete_checkpoints(out):
        try:
            read[ckpt.name] = read_checkpoint_files(ckpt, rank)
            found[ckpt.name] = None
        except CheckpointError as e:
            found[ckpt.name] = str(e)
    reports: list[dict[str, str | None]] = [{}] * dist.get_world_size()
    dist.all_gather_object(reports, found)
    names = [n for n in CHECKPOINT_DIRS if any(n in r for r in reports)]
    chosen = next((n for n in names if all(n in r and r[n] is None for r in reports)), None)
    problems: dict[str, list[int]] = {}  # each unreadable file, with the ranks that found it so
    for r, report in enumerate(reports):
        for n in names:
            reason = report[n] if n in report else f"{out / n} is incomplete on this rank's file system"
            if reason:
                problems.setdefault(reason, []).append(r)
    text = ""
    if problems:
        own = [f"rank {r}: {next((str(out / n) for n in names if n in rep and rep[n] is None), 'none')}"
               for r, rep in enumerate(reports)]
        text = ("unreadable: " + "; ".join(f"{reason} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                                           for reason, rs in problems.items())
                + f". Newest checkpoint each rank can read: {', '.join(own)}. "
                + (f"Every rank uses {out / chosen}" if chosen else "No checkpoint is readable by every rank"))
    return (out / chosen if chosen else None), text, (read[chosen] if chosen and load else None)


def read_checkpoint(out: Path, rank: int | None, purpose: str) -> tuple[dict, dict, dict | None, Path]:
    """The newest complete checkpoint of run directory `out` that this process reads, alone (export: no other rank
    to agree with): (its trainer state, its weights {"model", "optimizer"}, rank `rank`'s RNG states or None, its
    directory). A corrupt one is named and the older one read instead; none readable is a SystemExit naming each.
    `purpose` labels the messages ("export")."""
    failures = []
    for ckpt in complete_checkpoints(out):
        try:
            return (*read_checkpoint_files(ckpt, rank), ckpt)
        except CheckpointError as e:
            failures.append(str(e))
            print(f"[{purpose}] {failures[-1]}; trying the previous checkpoint", file=sys.stderr)
    raise SystemExit(f"{purpose} {out}: no checkpoint could be read: " + ("; ".join(failures) or "none is complete"))


def load_checkpoint(out: Path, model: Any, optimizer: Any, rank: int) -> tuple[dict, Path]:
    """Restore the newest checkpoint that every rank can read (agree_on_checkpoint); rank 0 prints the report of
    any unreadable file. Returns (its trainer_state.json, its directory). A collective."""
    chosen, report, loaded = agree_on_checkpoint(out, rank)
    if report and rank == 0:
        print(f"[resume] {report}", file=sys.stderr)
    if chosen is None:
        raise SystemExit(f"resume {out}: no checkpoint could be read by every rank" + (f": {report}" if report else
                                                                                       ": none is complete"))
    state, weights, rng = loaded
    set_state_dict(model, optimizer, model_state_dict=weights["model"], optim_state_dict=weights["optimizer"],
                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rng is not None:  # None: a rank the saving run did not have keeps its fresh seeding
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
    return state, chosen


def _refusal_reason(e: BaseException) -> str:
    """Why torch's weights_only loader refused a file, in the project's words: torch's own message advises loading
    it again with weights_only=False, which would run whatever the file holds, so it is never quoted whole."""
    if isinstance(e, pickle.UnpicklingError):
        found = re.search(r"unsupported GLOBAL (\S+)|Unsupported global: GLOBAL (\S+)", str(e))
        what = f" such as {next(g for g in found.groups() if g)}" if found else ""
        return f"it holds objects other than tensors, numpy arrays and plain values{what}: a pickle that could run code"
    return _first_line(e)


def migrate_checkpoint(run_dir: Path) -> dict[str, Any]:
    """`train.py migrate-checkpoint RUN_DIR`: convert, once, the RNG files of a run's checkpoints written by an older
    train.py (rng-RANK.pt, pickles) into rng-RANK.json, deleting the pickles. They are read with torch's weights_only
    loader, allowed numpy's array and dtype besides tensors and plain values: a file that holds any other object is
    refused, never run. The weights (weights.pt) need no conversion. Returns the files written."""
    print(f"[migrate-checkpoint] reading the pickled RNG files of {run_dir} with torch.load(weights_only=True) "
          "(numpy arrays allowed); a file holding any other object is refused", file=sys.stderr)
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
               np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    written = []
    for ckpt in complete_checkpoints(run_dir):
        for pickled in sorted(ckpt.glob("rng-*.pt")):
            target = pickled.with_suffix(".json")
            try:
                with torch.serialization.safe_globals(allowed), opened_no_follow(pickled) as opened:
                    saved = torch.load(opened, map_location="cpu", weights_only=True)
                version, internal, gauss = saved["python"]
                name, keys, pos, has_gauss, cached = saved["numpy"]
                states = {"python": [version, list(internal), gauss],
                          "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
                          "torch": saved["torch"].numpy().tobytes().hex()}
            except Exception as e:
                raise SystemExit(f"migrate-checkpoint: {pickled} is refused ({_refusal_reason(e)}): it is not an "
                                 "RNG file of train.py; nothing in it was run, and nothing was changed") from None
            write_atomically(target, json.dumps(states), private=True)
            read_rng(ckpt, int(pickled.stem.split("-")[1]), None)  # reads back as a resume will read it
            pickled.unlink()
            written.append(str(target))
    return {"run_dir": str(run_dir), "converted": written}


# ----------------------------------------------------------------------------------------------------------------
# Writing into a run directory that others may write too: nothing here follows a link the run did not create
# ----------------------------------------------------------------------------------------------------------------


class LinkRefusedError(OSError):
    """A path the run would write or read that is a symbolic link, or not a regular file or a real directory: the run
    never makes one, so someone else planted it. The message names it."""


def refused_path_message(path: Path, what: str, done: str = "written") -> str:
    return (f"{path} is {what}: refused, nothing was {done} through it (a run never makes one there; remove it if "
            "it is not yours)")


def open_no_follow(path: Path, flags: int, mode: int = 0o600) -> int:
    """os.open that refuses a symbolic link or anything but a regular file at `path` (LinkRefusedError naming it),
    instead of writing through it into whatever it points at. O_NONBLOCK keeps a planted FIFO from hanging the open;
    it is cleared again for the regular file."""
    done = "read" if flags & os.O_ACCMODE == os.O_RDONLY else "written"
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LinkRefusedError(refused_path_message(path, "a symbolic link", done)) from None
        if e.errno in (errno.EISDIR, errno.ENXIO):
            raise LinkRefusedError(refused_path_message(path, "not a regular file", done)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LinkRefusedError(refused_path_message(path, "not a regular file", done))
    os.set_blocking(fd, True)
    return fd


def read_no_follow(path: Path, limit: int = -1) -> bytes:
    """The bytes of the regular file at `path` (its first `limit`, if given), never read through a link
    (LinkRefusedError naming it): a run trusts nothing in its directory that it did not create, and a link could
    make it load another run's file as its own."""
    with os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as f:
        return f.read(limit)


@contextlib.contextmanager
def opened_no_follow(path: Path) -> Iterator[str]:
    """For readers that want a path (torch.load with mmap, zipfile): the regular file at `path`, opened without
    following a link (LinkRefusedError), as /proc/self/fd/N, which names the file opened, not whatever `path` names
    by the time the reader opens it."""
    fd = open_no_follow(path, os.O_RDONLY)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def refuse_unless_regular(path: Path, directory: bool = False, reading: bool = False, own: bool = False) -> bool:
    """Whether `path` exists, refusing (LinkRefusedError) a symbolic link there, or anything but a regular file (a
    real directory, with `directory`), or with `own` one that another user owns (the run would remove it).
    `reading`: the refusal says nothing was read through it."""
    done = "read" if reading else "written"
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        raise LinkRefusedError(refused_path_message(path, "a symbolic link", done))
    if not (stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)):
        raise LinkRefusedError(refused_path_message(path, "not a directory" if directory else "not a regular file",
                                                    done))
    if own and info.st_uid != os.geteuid():
        raise LinkRefusedError(f"{path} belongs to uid {info.st_uid}, not to this run's user (uid {os.geteuid()}): "
                               "refused, nothing was removed or written there (a run never makes one so; remove it "
                               "if it is not wanted)")
    return True


def make_run_dir(path: Path) -> Path:
    """`path` as a directory of the run's own: made 0700 if missing (no one else can plant a link inside), else
    refused (LinkRefusedError naming it) if it is a symbolic link, not a directory, or another user's, so nothing is
    ever written through a link planted there or into a directory someone else prepared."""
    with contextlib.suppress(FileExistsError):  # mkdir never follows a link at `path`: it fails with EEXIST
        path.mkdir(mode=0o700)
    refuse_unless_regular(path, directory=True, own=True)
    return path


def create_beside(path: Path, mode: int = 0o600) -> tuple[int, Path]:
    """A new file beside `path` (.NAME.RANDOM.tmp), opened for writing: O_EXCL with a fresh random name, so a link
    or a file planted under any name is never written through, and a temporary left by a killed run blocks
    nothing. Returns (its descriptor, its path)."""
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def write_atomically(path: Path, text: str, private: bool = False) -> None:
    """Write `text` to a new temporary file beside `path` (create_beside), flush it to disk, then rename it over
    `path`: a kill at any moment leaves the old file or the new one, never an empty or half-written one. A link or
    a non-file at `path` is refused (LinkRefusedError), not replaced. `private`: mode 0600."""
    refuse_unless_regular(path)
    fd, tmp = create_beside(path, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
