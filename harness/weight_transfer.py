"""harness/weight_transfer.py: the CPU weight-transfer engine, a backend of vLLM's own weight-transfer API.

vLLM 0.32 moves weights from a trainer to its workers through engines registered in two factories
(vllm/distributed/weight_transfer/): `nccl` between separate GPUs, `ipc` for a worker on the trainer's GPU. Neither
runs without a GPU, so this module registers a third, "gloo", modelled on the nccl engine: the same calls in the
same order (the trainer's `trainer_init` drives the worker's `init_weight_transfer_engine`, then each round
`start_weight_update`, `update_weights` while the trainer broadcasts, `finish_weight_update` with the weight version),
the same update info (names, dtype names, shapes), and vLLM's own packing (`pack_tensors`/`unpack_tensor`) and
layerwise reload. What differs is the wire: a torch.distributed gloo group of the trainer (rank 0) and one replica's
workers, which it polls, so that a replica that dies mid-broadcast fails its own group within a poll instead of
holding the trainer.

vLLM's worker imports this module through harness.vllm_replica (its worker extension), which registers the engine
before the worker builds it; the trainer side registers it the same way (`register`).
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   VLLMWeightSyncClient, WeightSource, WeightTransferEngine,
                                                   WeightTransferInitInfo, WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

BACKEND = "gloo"  # the name both factories know this engine by (WeightTransferConfig(backend="gloo"))
BUFFER_BYTES = 256 * 1024 * 1024  # bytes packed into one broadcast (a tensor larger than this goes alone)


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a replica's workers need to join its group: the trainer's TCPStore, their rank offset (1: the trainer
    is rank 0), the group's size (1 + the replica's workers), where the worker's gloo device binds, the timeout."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bind_host: str
    timeout_s: float
    buffer_size_bytes: int = BUFFER_BYTES


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round's parameters, in the order the trainer sends them (vLLM's NCCL update info, field for field)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update info: {len(self.names)} names, {len(self.dtype_names)} dtype names and "
                             f"{len(self.shapes)} shapes; they must match")


def chunk_bounds(nbytes: list[int], buffer_size_bytes: int) -> list[tuple[int, int]]:
    """[start, end) parameter indices of each packed broadcast, the way vLLM's pack_tensors cuts them: it takes
    tensors until the bytes taken exceed `buffer_size_bytes`, the tensor that crossed the line included."""
    bounds, start, total = [], 0, 0
    for i, n in enumerate(nbytes):
        total += n
        if total > buffer_size_bytes:
            bounds.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(nbytes):
        bounds.append((start, len(nbytes)))
    return bounds


def open_group(address: str, port: int, rank: int, world_size: int, bind_host: str, timeout_s: float,
               store: Any = None) -> Any:
    """A gloo process group of `world_size` ranks that rendezvous at the TCPStore on address:port (`store`: the
    trainer's, which hosts it); no default group is involved."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _broadcast(pg: Any, buffer: torch.Tensor) -> Any:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    return pg.broadcast([buffer], options)


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """The worker side: joins the replica's group, receives packed chunks, loads them by vLLM's layerwise reload."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.buffer_size_bytes = BUFFER_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()  # a group of an earlier trainer connection is gone: drop it before forming the next
        rank = self.parallel_config.rank + init_info.rank_offset
        self.buffer_size_bytes = init_info.buffer_size_bytes
        self.group = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                init_info.bind_host, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        _quiet_reload()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class's, less its torch.accelerator.synchronize(), which raises where there is no accelerator
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: init_weight_transfer_engine first")
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        nbytes = [int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size()
                  for s, d in zip(update_info.shapes, dtypes)]
        for start, end in chunk_bounds(nbytes, self.buffer_size_bytes):
            buffer = torch.empty(sum(nbytes[start:end]), dtype=torch.uint8)
            _broadcast(self.group, buffer).wait()
            self.model.load_weights(unpack_tensor(buffer, update_info.names[start:end],
                                                  update_info.shapes[start:end], dtypes[start:end],
                                                  nbytes[start:end]))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_head(self.model)

    def shutdown(self) -> None:
        self.group = None


def refresh_tied_head(model: torch.nn.Module) -> None:
    """Pack a tied LM head again after a reload. A tied head (SmolLM2's) shares the embedding's weight, and a tied
    state dict sends no lm_head.weight: the layerwise reload updates the shared weight in place but, having loaded
    nothing into the head, does not process the head again, so on CPU its GEMM keeps the weight packed from the old
    values and the sampler scores every later token with the base model's head (on SmolLM2 a max |log-ratio| of
    0.01 after a 1e-3 nudge to the embedding)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is None:
        raise RuntimeError(f"{type(model).__name__} ties its LM head but has no lm_head.quant_method: cannot "
                           "process the head again after a weight reload")
    method.process_weights_after_loading(head)


class _RotaryCacheFilter:
    """logging filter: drops vLLM's reload warnings about RotaryEmbedding, whose buffer is not a checkpoint weight,
    and about a tied ParallelLMHead, which has no weight of its own to load (refresh_tied_head)."""

    def filter(self, record: Any) -> bool:
        return not (record.msg == "%s: Failed to load weights"
                    and record.args in (("RotaryEmbedding",), ("ParallelLMHead",)))


def _quiet_reload() -> None:
    import logging

    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryCacheFilter) for f in reload_log.filters):
        reload_log.addFilter(_RotaryCacheFilter())


# --------------------------------------------------------------------------------------------------------------
# The trainer side
# --------------------------------------------------------------------------------------------------------------


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: the address the trainer's TCPStore and gloo device bind (the replicas reach it
    there), the replica's end of the group (`worker_bind_host`), the group's size, the timeout."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    world_size: int
    worker_bind_host: str
    timeout_s: float
    buffer_size_bytes: int = BUFFER_BYTES


class StateDictSource(WeightSource):
    """A WeightSource over full tensors already gathered and cast (vllm_replica.weight_tensors' dict)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer side: hosts the group's TCPStore, is rank 0, and drives the round trip through `client`
    (vLLM's VLLMWeightSyncClient protocol) in the nccl engine's order. `gone()` names the replica's dead processes
    (None while they live): polled during a broadcast, so that a replica that dies mid-broadcast is named."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None, is_sender: bool,
                 init_info: GlooTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = init_info
        self.group: Any = None
        self.gone: Callable[[], str | None] = lambda: None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> "GlooTrainerWeightTransferEngine":
        import torch.distributed as dist

        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if not engine.is_sender:
            return engine
        listener = store_listener(init_info.master_address)
        try:  # TCPStore would bind every interface with a socket of its own: it gets one bound to the address alone
            store = dist.TCPStore(init_info.master_address, listener.getsockname()[1], is_master=True,
                                  wait_for_workers=False, timeout=timedelta(seconds=init_info.timeout_s),
                                  master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the descriptor now
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=store.port, rank_offset=1,
            world_size=init_info.world_size, bind_host=init_info.worker_bind_host, timeout_s=init_info.timeout_s,
            buffer_size_bytes=init_info.buffer_size_bytes)
        with ThreadPoolExecutor(max_workers=1) as exe:  # the workers block in the rendezvous, as this rank does
            future = exe.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = open_group(init_info.master_address, store.port, 0, init_info.world_size,
                                      init_info.master_address, init_info.timeout_s, store=store)
            future.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        update_info = GlooWeightTransferUpdateInfo(names=[m.name for m in meta],
                                                   dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                                   shapes=[list(m.shape) for m in meta])
        self.client.start_weight_update()
        self.client.update_weights(asdict(update_info))
        pairs = self._checked(iter(self.source), meta)
        while (chunk := pack_tensors(pairs, lambda item: item[1], self.info.buffer_size_bytes)) is not None:
            self._wait(_broadcast(self.group, chunk.packed_tensor))
        self.client.finish_weight_update()

    @staticmethod
    def _checked(pairs: Iterator[tuple[str, torch.Tensor]], meta: list[ParamMeta]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """The source's pairs, each checked against the metadata the workers size their buffers from."""
        sent = 0
        for name, tensor in pairs:
            m = meta[sent] if sent < len(meta) else None
            if m is None or (name, tensor.dtype, tuple(tensor.shape)) != (m.name, m.dtype, m.shape):
                raise ValueError(f"WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} where its "
                                 f"metadata() declared {m}")
            sent += 1
            yield name, tensor
        if sent != len(meta):
            raise ValueError(f"WeightSource yielded {sent} parameters, its metadata() {len(meta)}")

    def _wait(self, work: Any) -> None:
        """Until `work` completes; RuntimeError, in one line, if it fails, the replica dies or timeout_s passes."""
        deadline = time.monotonic() + self.info.timeout_s
        while True:
            try:
                if work.is_completed():
                    work.wait()  # raises the work's error, if it failed
                    return
            except Exception as e:
                raise RuntimeError(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
            why = self.gone()
            if why:
                self.shutdown()
                raise RuntimeError(f"{why} died during the weight broadcast")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the weight broadcast took over {self.info.timeout_s:.0f} s")
            time.sleep(0.002)

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None and hasattr(group, "abort"):
            try:
                group.abort()
            except Exception:
                pass  # dropped either way


def store_listener(host: str) -> socket.socket:
    """A listening TCP socket on `host` alone (a numeric address, or a name that resolves) and a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = socket.getaddrinfo(host, 0, family, socket.SOCK_STREAM)[0][4][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


def trainer_init_info(engine: str, *, host: str, worker_host: str, world_size: int, timeout_s: float,
                      buffer_bytes: int = BUFFER_BYTES) -> TrainerInitInfo:
    """The trainer init info of vLLM's engine `engine` for one replica of `world_size - 1` workers (reached at
    `worker_host`) and learner rank 0 (at `host`, the only trainer rank that sends): gloo's (this module's), or
    vLLM's own nccl (a TCPStore rendezvous at a free port of `host`) or ipc (packed buffers, no rendezvous)."""
    if engine == BACKEND:
        return GlooTrainerInitInfo(rank=0, master_address=host, world_size=world_size, worker_bind_host=worker_host,
                                   timeout_s=timeout_s, buffer_size_bytes=buffer_bytes)
    if engine == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(rank=0, master_address=host, master_port=free_port(host), world_size=world_size)
    if engine == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=0, packed=True)
    raise ValueError(f"no trainer engine {engine!r} (gloo, nccl or ipc)")


def trainer_engine(engine: str, *, client: VLLMWeightSyncClient, source: WeightSource, host: str, worker_host: str,
                   world_size: int, timeout_s: float, buffer_bytes: int = BUFFER_BYTES) -> TrainerWeightTransferEngine:
    """A ready trainer engine of vLLM's factory for one replica (trainer_init_info's arguments): its init call has
    gone to the replica through `client`, and its group is formed."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    info = trainer_init_info(engine, host=host, worker_host=worker_host, world_size=world_size, timeout_s=timeout_s,
                             buffer_bytes=buffer_bytes)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def free_port(host: str) -> int:
    """A port of `host` that is free now (vLLM's nccl engine binds its TCPStore there itself)."""
    with store_listener(host) as listener:
        return listener.getsockname()[1]


def register() -> None:
    """Register the gloo engine in vLLM's two factories, once per process (vLLM refuses a second registration)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                         (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)):
        try:
            factory.register_engine(BACKEND, cls)
        except ValueError:  # already registered by an earlier import in this process
            pass


register()


# --------------------------------------------------------------------------------------------------------------
# vLLM's ipc engine as plain data: its update info carries CUDA IPC handles as torch's rebuild_cuda_tensor
# arguments, which hold classes (the tensor's and storage's), a dtype and a torch.Size. The replica channel carries
# plain data only, so they travel as names and lists, and only names under torch are turned back into classes.
# --------------------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, type):
        return {"class": f"{value.__module__}:{value.__qualname__}"}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise TypeError(f"an IPC handle holds a {type(value).__name__}, which has no plain form")


def _unplain(value: Any) -> Any:
    import importlib

    if isinstance(value, dict) and len(value) == 1:
        (kind, v), = value.items()
        if kind == "class":
            module, _, qualname = v.partition(":")
            if module != "torch" and not module.startswith("torch."):
                raise ValueError(f"an IPC handle names the class {v}, not one of torch's: refused")
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            return obj
        if kind == "dtype":
            dtype = getattr(torch, v)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"an IPC handle names the dtype {v!r}, which is not one")
            return dtype
        if kind == "size":
            return torch.Size(v)
        if kind == "device":
            return torch.device(v)
    if isinstance(value, list):
        return tuple(_unplain(v) for v in value)
    return value


def plain_ipc_handles(handles: Any) -> Any:
    """IPCWeightTransferUpdateInfo.ipc_handles ({gpu uuid: rebuild args}, or a list of them) as plain data."""
    if isinstance(handles, list):
        return [plain_ipc_handles(h) for h in handles]
    return {uuid: _plain(args) for uuid, args in handles.items()}


def ipc_handles_from_plain(handles: Any) -> Any:
    """plain_ipc_handles' inverse."""
    if isinstance(handles, list):
        return [ipc_handles_from_plain(h) for h in handles]
    return {uuid: _unplain(args) for uuid, args in handles.items()}


def plain_update_info(update_info: dict[str, Any]) -> dict[str, Any]:
    """An engine's update info as plain data (only the ipc engine's needs a change)."""
    if update_info.get("ipc_handles") is not None:
        return {**update_info, "ipc_handles": plain_ipc_handles(update_info["ipc_handles"])}
    return update_info


def update_info_from_plain(update_info: dict[str, Any]) -> dict[str, Any]:
    if update_info.get("ipc_handles") is not None:
        return {**update_info, "ipc_handles": ipc_handles_from_plain(update_info["ipc_handles"])}
    return update_info
