"""harness/vllm_internals.py: every call this project makes into vLLM outside its public API, in one place.

vLLM's public surface for this project is `vllm.LLM` (generate, collective_rpc, the weight-transfer calls of
vllm/entrypoints/rl/offline.py), `SamplingParams`, its outputs, and the weight-transfer factories and base classes
(vllm/distributed/weight_transfer/). Everything else the project reaches for is listed in INTERNALS below, with
where it is used; the calls themselves go through the functions at the bottom where they are calls, so that a vLLM
upgrade that moves one is fixed here. tests/test_vllm_internals.py checks every entry against the installed vLLM
and fails with one line naming the entry that is gone.

Checked against vLLM VLLM_CHECKED (the version requirements*.txt pin).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

VLLM_CHECKED = "0.32.0"


@dataclass(frozen=True)
class Internal:
    """One thing of vLLM's the project relies on outside its public API. `path` is "module:Qualified.name"; with
    `instance` set, the last part is an attribute an instance gets at run time (looked for as `self.NAME` in the
    class's source, since a class does not hold it)."""

    path: str
    used_by: str
    instance: bool = False


INTERNALS: tuple[Internal, ...] = (
    # the replica's engine loop (harness/vllm_replica.py, _Replica): vLLM's V1 LLMEngine, stepped by hand so that
    # each finished request goes back as it finishes and weights change between two steps
    Internal("vllm.v1.engine.llm_engine:LLMEngine.engine_core", "_Replica: pause/resume, shutdown", instance=True),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.step", "_Replica.run: one engine step at a time"),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.add_request", "_Replica.handle: requests by id, with cache salt"),
    Internal("vllm.entrypoints.llm:LLM.renderer", "_Replica.handle: the engine's inputs, rendered", instance=True),
    Internal("vllm.renderers.base:BaseRenderer.render_cmpl", "_Replica.handle: token prompts as add_request takes them "
             "(raw prompts are deprecated in 0.32)"),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.has_unfinished_requests", "_Replica.run"),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.reset_prefix_cache", "_Replica.weight_call: after an update"),
    Internal("vllm.v1.engine.core_client:SyncMPClient.call_utility", "pause_scheduler/resume_scheduler below"),
    Internal("vllm.v1.engine.core:EngineCore.pause_scheduler", "pause_scheduler below ('keep' mode)"),
    Internal("vllm.v1.engine.core:EngineCore.resume_scheduler", "resume_scheduler below"),
    Internal("vllm.v1.engine.core_client:EngineCoreClient.shutdown", "shutdown_engine_core below"),
    # the worker extension's probes (WeightSyncExtension) and the CPU weight-transfer engine
    # (harness/weight_transfer.py): the worker's model and vLLM's layerwise reload
    Internal("vllm.v1.worker.gpu_model_runner:GPUModelRunner.model", "WeightSyncExtension's probes", instance=True),
    Internal("vllm.model_executor.model_loader.reload:initialize_layerwise_reload",
             "weight_transfer.GlooWeightTransferEngine.start_weight_update"),
    Internal("vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
             "weight_transfer.GlooWeightTransferEngine.finish_weight_update"),
    Internal("vllm.distributed.weight_transfer.packed_tensor:pack_tensors", "weight_transfer: the trainer's chunks"),
    Internal("vllm.distributed.weight_transfer.packed_tensor:unpack_tensor", "weight_transfer: the worker's chunks"),
    Internal("vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead.quant_method",
             "weight_transfer.refresh_tied_head: a tied head packed again", instance=True),
    # the interruption and slowdown logits processors (harness/vllm_replica.py)
    Internal("vllm.v1.sample.logits_processor:AdapterLogitsProcessor", "InterruptionLogitsProcessor (V1)"),
    Internal("vllm.v1.worker.gpu.sample.logits_processor:LogitsProcessor", "the V2 logits processors"),
    Internal("vllm.v1.worker.gpu.states:RequestState.prompt_len", "InterruptionLogitsProcessorV2", instance=True),
    Internal("vllm.v1.worker.gpu.states:RequestState.all_token_ids", "InterruptionLogitsProcessorV2", instance=True),
    Internal("vllm.v1.worker.gpu.states:RequestState.max_num_reqs", "the V2 logits processors", instance=True),
    Internal("vllm.v1.worker.gpu.sample.logits_processor.interface:LogitsContext.idx_mapping_np",
             "InterruptionLogitsProcessorV2", instance=True),
    Internal("vllm.v1.worker.gpu.sample.logits_processor.interface:LogitsContext.seq_lens_upper_bound_np",
             "InterruptionLogitsProcessorV2", instance=True),
    # choosing the model runner and checking vLLM's shared memory (harness/vllm_replica.py)
    Internal("vllm.envs:VLLM_USE_V2_MODEL_RUNNER", "model_runner_v2"),
    Internal("vllm.triton_utils:HAS_TRITON", "model_runner_v2"),
    Internal("vllm.distributed.device_communicators.shm_broadcast:check_shm_free_space", "shm_problem"),
    # how vLLM's loader finds a local model's weights: a glob of its path (loadable_model_path below)
    Internal("vllm.model_executor.model_loader.default_loader:DefaultModelLoader._prepare_weights",
             "loadable_model_path: the model of every vLLM engine the project builds"),
)


def _resolve(path: str, instance: bool) -> None:
    """Raise (AttributeError, ImportError, LookupError) if `path` is not in the installed vLLM."""
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    parts = qualname.split(".")
    if instance:
        parts, attr = parts[:-1], parts[-1]
    for part in parts:
        obj = getattr(obj, part)
    if instance:
        annotations = {k for c in inspect.getmro(obj) for k in getattr(c, "__annotations__", {})}
        sources = []
        for c in inspect.getmro(obj):
            try:
                sources.append(inspect.getsource(c))
            except (OSError, TypeError):
                pass
        if attr not in annotations and not any(f"self.{attr}" in s for s in sources):
            raise LookupError(f"{'.'.join(parts)} no longer sets {attr}")


def missing() -> list[str]:
    """One line for each entry of INTERNALS that the installed vLLM does not have."""
    import vllm

    lines = []
    for entry in INTERNALS:
        try:
            _resolve(entry.path, entry.instance)
        except (ImportError, AttributeError, LookupError) as e:
            lines.append(f"vLLM {vllm.__version__} (checked against {VLLM_CHECKED}) has no {entry.path}, which "
                         f"{entry.used_by} uses ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return lines


# --------------------------------------------------------------------------------------------------------------
# The calls themselves
# --------------------------------------------------------------------------------------------------------------


def has_utility_calls(engine_core: Any) -> bool:
    """Whether `engine_core` (LLMEngine.engine_core) is a client of an engine core in another process, which
    steps on its own and takes utility calls; one inside this process steps only when the caller steps it."""
    return hasattr(engine_core, "call_utility")


def pause_scheduler(engine_core: Any) -> None:
    """Stop the engine core's scheduling, keeping its requests ('keep'), without clearing the prefix cache."""
    engine_core.call_utility("pause_scheduler", "keep", False)


def resume_scheduler(engine_core: Any) -> None:
    engine_core.call_utility("resume_scheduler")


def shutdown_engine_core(llm: Any, timeout: float | None = None) -> None:
    """Stop an LLM's engine core now (its processes, if it has any), rather than when the LLM is collected."""
    core = llm.llm_engine.engine_core
    core.shutdown() if timeout is None else core.shutdown(timeout=timeout)


@contextlib.contextmanager
def engine_start() -> Iterator[None]:
    """Around each `LLM(...)` the project builds: vLLM's CPU platform scans every loaded module for Triton kernels
    to replace (its triton_utils dispatcher) and so touches torch.distributed.reduce_op, whose deprecation then
    warned in every process that started an engine, a FutureWarning of vLLM's that no user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning)
        yield


def loadable_model_path(model: str) -> str:
    """`model` (LLM's model=) as vLLM can load it. vLLM's loader finds a local model's weights with
    glob.glob(os.path.join(PATH, "*.safetensors")) (DefaultModelLoader._prepare_weights), which reads *, ? and [ in
    PATH as a pattern: in a directory such as runs/export[2] it found "no model weights", and a runs/export2 beside it
    would have been read instead. Such a directory is given through a link of a plain name in a directory of this
    user's under the temp directory, made once and kept (a few bytes); a hub name, and any other path, as it is."""
    import glob
    import hashlib
    import os
    import tempfile

    path = os.path.abspath(os.path.expanduser(model))
    links = os.path.join(tempfile.gettempdir(), f"scalerl-model-links-{os.getuid()}")  # one per user: its own
    if not os.path.isdir(path) or not glob.has_magic(path) or glob.has_magic(links):
        return model
    try:
        os.makedirs(links, mode=0o700, exist_ok=True)
    except OSError:  # something else is there
        return model
    if os.path.islink(links) or os.stat(links).st_uid != os.getuid():  # not made here: vLLM's own error, then
        return model
    link = os.path.join(links, hashlib.sha1(path.encode()).hexdigest()[:16])
    if os.path.realpath(link) != os.path.realpath(path):
        made = f"{link}.{os.getpid()}"  # then renamed over: another process making the same link races harmlessly
        os.symlink(path, made)
        os.replace(made, link)
    return link
