"""harness/checkpoints.py: a run's checkpoint files. A runtime module: a reader of the recipe may skip it.

A checkpoint is OUTPUT_DIR/checkpoint/ (the previous one kept as checkpoint.old/): the model and optimizer, one
safetensors shard file per learner rank written by torch's distributed checkpoint (shard-0000N-model-...), every
rank's RNG states (rng-RANK.json) and the trainer state (trainer_state.json, `TrainerState`: everything the loop
carries from one step to the next, with the shards' names and the optimizer's hyper-parameters). This file holds
how they are saved (`save_checkpoint`, which refuses to start a save the disk cannot hold), read back and agreed on
by every rank (`agree_on_checkpoint`, `load_checkpoint`, `read_checkpoint`; any number of ranks resumes from any
number's shards), converted from an older run's files (`migrate_checkpoint`),
`write_atomically`, the one way the run's small files are written, and `open_no_follow`, the one way a file in a run
directory is opened: never through a symbolic link (people share run directories; docs/runtime.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import pickle
import random
import re
import secrets
import shutil
import stat
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import _getdtype
from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY, _gen_file_name,
                                                    _HFStorageInfo)
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor


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
    data_digest: str = ""  # tasks.data_digest of the run's data sets as it started: a resume on other data is refused

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
# unpickled: the shards are safetensors (a JSON header, then raw tensor bytes), the RNG states and the trainer
# state are JSON; an older run's weights.pt is read, once, by migrate-checkpoint with torch's weights_only loader.
# People share run directories; a crafted file must not run code.
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
    space. Each rank writes its own shard of the model and optimizer (torch's distributed checkpoint, in
    safetensors files of about SHARD_FILE_BYTES: shard_file) and its RNG states (rng-RANK.json); no rank gathers
    the full state. Rank 0 writes trainer_state.json last (`state`, rank 0's, with the world size, the shards'
    names and the optimizer's hyper-parameters). Directories are made 0700 and files 0600: readable by their owner
    only."""
    tensors, param_groups = checkpoint_tensors(model, optimizer)  # this rank's shards (DTensors under FSDP2)
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    world = dist.get_world_size()
    keep, report, _ = agree_on_checkpoint(out, rank, load=False)  # stays until the new one is in place
    if report and rank == 0:
        print(f"[checkpoint] {report}; the others are removed to make room", file=sys.stderr)
    state = {**state, "world_size": world, "param_groups": param_groups}
    shard_bytes: list[int] = [0] * world
    dist.all_gather_object(shard_bytes, local_shard_bytes(tensors))
    need, refused = 0, None
    if rank == 0:
        need = checkpoint_bytes(shard_bytes, state, world, len(tensors))
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
    error, writing, mine = None, tmp / shard_file(rank), []
    files = max(1, math.ceil(max(shard_bytes) / SHARD_FILE_BYTES))  # per rank: the same on every rank
    try:
        mine = write_shards(tmp, tensors, files)
        writing = tmp / f"rng-{rank}.json"
        write_atomically(writing, json.dumps(rng_states()), private=True)
        read_rng(tmp, rank, world)
    except (Exception, dcp.api.CheckpointException) as e:  # an ENOSPC the estimate missed, an I/O error
        failures = getattr(e, "failures", {rank: (e, None)})  # torch's collective error: each failed rank's own
        error = f"could not write {writing} on rank {rank} ({_first_line(failures[rank][0])})" \
            if rank in failures else None
        if rank == 0 and shutil.disk_usage(out).free < need:
            error = f"{error or 'the save failed'}: {no_space_message(out, need, shutil.disk_usage(out).free, 0)}"
    except BaseException:  # a second Ctrl-C: stop at once, leaving no partial directory behind
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    written: list[tuple[str | None, list[str]]] = [(None, [])] * world
    dist.all_gather_object(written, (error, mine))
    errors = [e for e, _ in written if e]
    rotated = [None]
    if rank == 0:
        state["shards"] = [name for _, names in written for name in names]
        rotated = [_finish(out, state, keep, errors)]
    dist.broadcast_object_list(rotated, src=0)  # every rank stops together, or goes on with it in place
    if rotated[0]:
        raise SystemExit(rotated[0])


def _finish(out: Path, state: dict, keep: Path | None, errors: list[str]) -> str | None:
    """Rank 0, once every rank wrote its files: trainer_state.json, written last and read back, then the rotation
    (checkpoint -> checkpoint.old, checkpoint.tmp -> checkpoint). Returns why the save failed, or None."""
    tmp, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    if not errors:
        try:
            write_atomically(tmp / "trainer_state.json", json.dumps(state), private=True)
            read_checkpoint_files(tmp, None)  # read back: a short write shows here, not at resume
        except (OSError, CheckpointError) as e:
            errors = [f"could not write {tmp / 'trainer_state.json'} on rank 0 ({_first_line(e)})"]
    if errors:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"checkpoint at step {state.get('step')} failed: {'; '.join(errors)}; {_kept(keep)}"
    try:  # a link planted at checkpoint.old since the check above makes a rename fail: one line, not a traceback
        if final.exists():  # the kept one (anything else there went before writing)
            final.rename(old)
        tmp.rename(final)
    except OSError as e:
        return (f"checkpoint at step {state.get('step')}: could not rotate {tmp} in ({e}); it is complete, and "
                f"{_kept(keep)}")
    return None


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


def checkpoint_bytes(shard_bytes: list[int], state: dict, world: int, tensors: int) -> int:
    """What a checkpoint will take on disk: every rank's shard bytes (`shard_bytes`), each rank's safetensors headers
    (an entry per tensor, its name and offsets once more in torch's sharding info: 137 bytes measured for a Linear
    layer's short names, a decoder's run longer; 512 counted, for each of the `tensors` on each rank), the JSON
    files, and 64 KiB to spare."""
    headers = world * tensors * 512
    return sum(shard_bytes) + headers + len(json.dumps(state)) + world * RNG_FILE_BYTES + (64 << 10)


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


def newest_trainer_state(run_dir: Path) -> dict | None:
    """The trainer_state.json of the newest complete checkpoint whose file reads and holds a step (None if none
    does): what a resume will most likely start from, read before anything is loaded."""
    for ckpt in complete_checkpoints(run_dir):
        try:
            return read_trainer_state(ckpt)
        except CheckpointError:  # a link, unreadable, no step: the previous checkpoint's
            continue
    return None


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint whose trainer_state.json reads (None if none does)."""
    state = newest_trainer_state(run_dir)
    return None if state is None else state["step"]


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


def read_weights(path: Path) -> dict:
    """An older train.py's weights.pt ({"model", "optimizer"}, full state dicts), for migrate-checkpoint, through
    torch's weights_only loader, memory-mapped."""
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
    return weights


# The tensors of a checkpoint: the model's under "model.FQN", each parameter's optimizer state under
# "optimizer.FQN.NAME" (AdamW: step, exp_avg, exp_avg_sq), the names FSDP2 and a plain module share. Saved by torch's
# distributed checkpoint with its Hugging Face safetensors storage, one file per rank holding that rank's shards,
# each tensor's offset in the full one in the file's JSON header; read back only through SafetensorsShardReader.

SHARD_NAME = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
SHARD_FILE_BYTES = 1 << 30  # a rank's shard goes into files of about this size: a file is serialised in memory whole


def shard_file(rank: int, index: int = 1, files: int = 1) -> str:
    """The `index`-th of the `files` files rank `rank` writes its shards to (torch's Hugging Face storage's name)."""
    return _gen_file_name(index, files, rank + 1)


def file_index_mapping(tensors: dict, files: int) -> dict[str, int] | None:
    """Which of a rank's `files` files each tensor goes to (1..files), in order, by the full tensors' bytes, so the
    same on every rank and each file about 1/files of the shard; None for one file."""
    if files == 1:
        return None
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}  # a DTensor's numel is the full tensor's
    total, before, mapping = sum(sizes.values()), 0, {}
    for key, size in sizes.items():
        mapping[key] = min(files, 1 + before * files // max(total, 1))
        before += size
    return mapping


def checkpoint_tensors(model: Any, optimizer: Any, state_dicts: tuple | None = None) -> tuple[dict, list]:
    """This rank's checkpoint tensors ({"model.FQN" | "optimizer.FQN.NAME": tensor or DTensor shard}) and the
    optimizer's hyper-parameters (its param_groups, plain values, for trainer_state.json). get_state_dict without
    full_state_dict: each rank keeps its own shards, nothing is gathered. `state_dicts`: get_state_dict's result."""
    model_sd, optim_sd = state_dicts or get_state_dict(model, optimizer)
    tensors = {f"model.{k}": v for k, v in untied(model_sd).items()}
    for fqn, per_param in optim_sd["state"].items():
        for name, value in per_param.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {fqn}.{name} is not a tensor ({type(value).__name__})")
            tensors[f"optimizer.{fqn}.{name}"] = value
    return tensors, json.loads(json.dumps(optim_sd["param_groups"]))  # tuples (betas) as lists, as read back


def untied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict less the second name of a tied weight (SmolLM2's lm_head.weight is its embedding's):
    safetensors refuses two names for one memory, and loading the first fills both."""
    seen, kept = set(), {}
    for name, tensor in state_dict.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = ((local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride())
               if local.numel() else id(tensor))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor
    return kept


def local_shard_bytes(tensors: dict) -> int:
    """The bytes of this rank's shards (a replicated tensor, such as AdamW's step, counted on every rank)."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors.values()]
    return sum(t.numel() * t.element_size() for t in local)


def write_shards(directory: Path, tensors: dict, files: int = 1) -> list[str]:
    """This rank's shards into `files` files directory/shard-RANK-model-I-of-FILES (a collective: torch's distributed
    checkpoint plans which rank writes a replicated tensor), made 0600 and read back: a short write shows here, not
    at resume. Returns their names (none for a rank whose every tensor another rank writes)."""
    writer = HuggingFaceStorageWriter(str(directory), fqn_to_index_mapping=file_index_mapping(tensors, files),
                                      save_distributed=True)
    dcp.save(tensors, storage_writer=writer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = [name for name in (shard_file(rank, i, files) for i in range(1, files + 1)) if (directory / name).exists()]
    for name in mine:
        os.chmod(directory / name, 0o600)
        shard_header(directory / name)
    return mine


def _cause(e: BaseException) -> BaseException:
    """The first rank's own error inside torch's CheckpointException (whose message is every rank's traceback)."""
    failures = getattr(e, "failures", None)
    return next(iter(failures.values()))[0] if failures else e


def shard_header(path: Path) -> dict[str, tuple[list[int], list[int], str]]:
    """A shard file's tensors, {name: (offsets in the full tensor, shape, dtype)}, from its JSON header alone,
    never through a link; safetensors checks that the header and the data's length agree. CheckpointError names
    the file that is missing, cut short or garbled."""
    from safetensors import SafetensorError, safe_open

    try:
        with opened_no_follow(path) as opened, safe_open(opened, framework="pt") as f:
            offsets = json.loads((f.metadata() or {}).get(CUSTOM_METADATA_KEY, "{}"))
            return {k: (list(offsets[k][SAVED_OFFSETS_KEY]) if k in offsets else [0] * len(f.get_slice(k).get_shape()),
                        list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except LinkRefusedError as e:
        raise CheckpointError(str(e)) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is cut short or garbled (not a safetensors shard: {_first_line(e)})") from None
    except OSError as e:
        raise CheckpointError(f"{path} is unreadable ({_first_line(e)})") from None


def read_shards(ckpt: Path, state: dict) -> dict[str, dict]:
    """Every shard file trainer_state.json lists, {file: its header}, checked whole: each tensor's pieces cover it
    once, so a missing or foreign shard is named before anything is loaded. A checkpoint of an older train.py
    (one weights.pt of full tensors) is refused with the command that converts it."""
    shards = state.get("shards")
    if shards is None:
        if (ckpt / "weights.pt").exists():
            raise CheckpointError(f"{ckpt} was written by an older train.py (one weights.pt, gathered on rank 0): "
                                  "convert it once into one shard per rank with `python train.py migrate-checkpoint "
                                  f"{ckpt.parent}`")
        raise CheckpointError(f"{ckpt / 'trainer_state.json'} lists no shards")
    if not (isinstance(shards, list) and shards and all(isinstance(s, str) and SHARD_NAME.fullmatch(s)
                                                          for s in shards)):
        raise CheckpointError(f"{ckpt / 'trainer_state.json'} lists shards that are not shard files: {shards!r:.200}")
    headers = {name: shard_header(ckpt / name) for name in shards}
    covered: dict[str, list] = {}
    for name, header in headers.items():
        for key, (offsets, shape, _) in header.items():
            full = covered.setdefault(key, [[0] * len(shape), 0])
            full[0] = [max(a, o + s) for a, o, s in zip(full[0], offsets, shape)]
            full[1] += math.prod(shape)
    for key, (size, volume) in covered.items():
        if volume != math.prod(size):
            raise CheckpointError(f"{ckpt}: the shards of {key} do not make it whole (a shard of another checkpoint?)")
    return headers


class SafetensorsShardReader(HuggingFaceStorageReader):
    """torch's Hugging Face safetensors reader over the shard files a checkpoint lists, and only those: each opened
    once without following a link and read through /proc/self/fd/N. Its metadata comes from the files' JSON headers:
    nothing is unpickled (torch's default FileSystemReader would pickle.load a .metadata file). close() when done."""

    def __init__(self, ckpt: Path, headers: dict[str, dict]) -> None:
        super().__init__(str(ckpt))
        self.headers, self.fds = headers, {name: open_no_follow(ckpt / name, os.O_RDONLY) for name in headers}

    def read_metadata(self) -> Metadata:
        state_dict_metadata: dict[str, TensorStorageMetadata] = {}
        storage_data: dict[MetadataIndex, _HFStorageInfo] = {}
        for name, header in self.headers.items():
            for key, (offsets, shape, dtype) in header.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
                md = state_dict_metadata.setdefault(key, TensorStorageMetadata(
                    properties=TensorProperties(dtype=_getdtype(dtype)), size=torch.Size(shape), chunks=[]))
                md.chunks.append(chunk)
                md.size = torch.Size([max(a, o + s) for a, o, s in zip(md.size, offsets, shape)])
                storage_data[MetadataIndex(fqn=key, offset=offsets)] = _HFStorageInfo(
                    relative_path=f"/proc/self/fd/{self.fds[name]}", shape=torch.Size(shape), dtype=_getdtype(dtype))
        metadata = Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def load_shards(ckpt: Path, headers: dict[str, dict], tensors: dict) -> None:
    """Fill `tensors` (checkpoint names; DTensors are filled shard by shard) in place from the checkpoint's shards,
    whatever number of ranks wrote them: torch's distributed checkpoint reads each piece where it lies. A
    collective when a process group is up. A failure is a SystemExit naming the checkpoint."""
    reader = SafetensorsShardReader(ckpt, headers)
    try:
        with warnings.catch_warnings():  # export's one process: torch warns "assuming the intent is to load in a
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # single process" (it is)
            dcp.load(tensors, storage_reader=reader, no_dist=not dist.is_initialized())
    except (Exception, dcp.api.CheckpointException) as e:
        raise SystemExit(f"could not load {ckpt} ({_first_line(_cause(e))})") from None
    finally:
        reader.close()


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
    """The files of checkpoint directory `ckpt` that rank `rank` loads: (trainer state, every shard's header, its
    RNG states); rank None (export) skips the RNG. Every shard is checked, not only this rank's: a resume on
    another number of ranks reads pieces of each. CheckpointError names the first file that does not read; a
    symbolic link (the directory or a file in it) is never read through."""
    try:
        refuse_unless_regular(ckpt, directory=True, reading=True)
        for name in ("trainer_state.json", *([] if rank is None else [f"rng-{rank}.json"])):
            refuse_unless_regular(ckpt / name, reading=True)
    except LinkRefusedError as e:
        raise CheckpointError(str(e)) from None
    state = read_trainer_state(ckpt)
    headers = read_shards(ckpt, state)
    return state, headers, None if rank is None else read_rng(ckpt, rank, state.get("world_size"))


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
    to agree with): (its trainer state, its shards' headers, rank `rank`'s RNG states or None, its directory). A
    corrupt one is named and the older one read instead; none readable is a SystemExit naming each. `purpose`
    labels the messages ("export")."""
    failures = []
    for ckpt in complete_checkpoints(out):
        try:
            return (*read_checkpoint_files(ckpt, rank), ckpt)
        except CheckpointError as e:
            failures.append(str(e))
            print(f"[{purpose}] {failures[-1]}; trying the previous checkpoint", file=sys.stderr)
    raise SystemExit(f"{purpose} {out}: no checkpoint could be read: " + ("; ".join(failures) or "none is complete"))


def load_model_weights(ckpt: Path, headers: dict, model_state: dict[str, torch.Tensor]) -> None:
    """Fill a whole model's state dict (a plain module's, on one process: export) in place from a checkpoint's
    shards, reading only the model's tensors: the optimizer's are never read."""
    load_shards(ckpt, headers, {f"model.{k}": v for k, v in untied(model_state).items()})


def load_checkpoint(out: Path, model: Any, optimizer: Any, rank: int) -> tuple[dict, Path]:
    """Restore the newest checkpoint that every rank can read (agree_on_checkpoint); rank 0 prints the report of
    any unreadable file. Each rank reads the pieces of its own shards from whichever files hold them, so a run
    resumes on another number of ranks. Returns (its trainer_state.json, its directory). A collective."""
    chosen, report, loaded = agree_on_checkpoint(out, rank)
    if report and rank == 0:
        print(f"[resume] {report}", file=sys.stderr)
    if chosen is None:
        raise SystemExit(f"resume {out}: no checkpoint could be read by every rank" + (f": {report}" if report else
                                                                                       ": none is complete"))
    state, headers, rng = loaded
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's shards; the optimizer's state made if new
    tensors, _ = checkpoint_tensors(model, optimizer, (model_sd, optim_sd))
    load_shards(chosen, headers, tensors)
    optim_sd["param_groups"] = state["param_groups"]
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
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
    """`train.py migrate-checkpoint RUN_DIR`: convert, once, the checkpoints of a run written by an older train.py
    into this one's format: pickled RNG files (rng-RANK.pt) into rng-RANK.json, and one weights.pt of full tensors
    (gathered on rank 0) into a shard file (as one rank would write it; any number of ranks resumes from it), its
    optimizer hyper-parameters into trainer_state.json. Both are read with torch's weights_only loader (numpy's
    array and dtype allowed in the RNG files): a file that holds any other object is refused, never run. The old
    files are deleted once the new ones read back. Returns the files written (none for a run already converted).
    A directory that holds no checkpoint, a mistyped one say, is one line."""
    if not complete_checkpoints(run_dir):
        raise SystemExit(f"migrate-checkpoint: {run_dir} holds no checkpoint to convert (checkpoint/ or "
                         "checkpoint.old/ with a trainer_state.json): is it a run's output directory?")
    print(f"[migrate-checkpoint] reading the pickled files of {run_dir} with torch.load(weights_only=True) "
          "(numpy arrays allowed); a file holding any other object is refused", file=sys.stderr)
    written = []
    for ckpt in complete_checkpoints(run_dir):
        written += _migrate_rng(ckpt)
        written += _migrate_weights(ckpt)
    return {"run_dir": str(run_dir), "converted": written}


def _migrate_rng(ckpt: Path) -> list[str]:
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
               np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    written = []
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
    return written


def _migrate_weights(ckpt: Path) -> list[str]:
    """weights.pt ({"model", "optimizer"}: full state dicts) -> rank 0's shard files (about SHARD_FILE_BYTES each) and
    trainer_state.json's shards and param_groups. The files are written in a fresh directory inside the checkpoint,
    then renamed in; trainer_state.json is replaced last, so a crash at any point leaves a checkpoint that is either
    still old (run it again) or new."""
    state = read_trainer_state(ckpt)
    if "shards" in state or not refuse_unless_regular(ckpt / "weights.pt", reading=True):
        return []
    try:
        weights = read_weights(ckpt / "weights.pt")
    except CheckpointError as e:
        raise SystemExit(f"migrate-checkpoint: {e}; nothing was changed") from None
    optim_sd = weights["optimizer"]
    if not (isinstance(optim_sd, dict) and isinstance(optim_sd.get("state"), dict)
            and isinstance(optim_sd.get("param_groups"), list)):
        raise SystemExit(f"migrate-checkpoint: {ckpt / 'weights.pt'} holds no optimizer state; nothing was changed")
    tensors, param_groups = checkpoint_tensors(None, None, (weights["model"], optim_sd))
    files = max(1, math.ceil(local_shard_bytes(tensors) / SHARD_FILE_BYTES))
    names = [shard_file(0, i, files) for i in range(1, files + 1)]
    scratch = ckpt / f".migrate-{secrets.token_hex(4)}"
    scratch.mkdir(mode=0o700)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            writer = HuggingFaceStorageWriter(str(scratch), fqn_to_index_mapping=file_index_mapping(tensors, files),
                                              save_distributed=True)
            dcp.save({k: v.contiguous() for k, v in tensors.items()}, storage_writer=writer, no_dist=True)
        for name in names:
            os.chmod(scratch / name, 0o600)
            os.replace(scratch / name, ckpt / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_atomically(ckpt / "trainer_state.json", json.dumps({**state, "shards": names, "param_groups": param_groups}),
                     private=True)
    read_checkpoint_files(ckpt, None)  # reads back as a resume will read it
    (ckpt / "weights.pt").unlink()
    return [str(ckpt / name) for name in names]


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
