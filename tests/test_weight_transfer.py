"""harness/weight_transfer.py, the CPU engine of vLLM's weight-transfer API, without a vLLM engine: its trainer side
(made by vLLM's trainer factory) and its worker side (made as vLLM's worker makes it, by the engine factory) in two
threads of this process, the worker loading into a stand-in model. The same calls in the same order as vLLM's nccl
engine; every byte arrives, across chunk boundaries; a replica that dies mid-broadcast is named in one line."""

import threading
from types import SimpleNamespace

import pytest
import torch

from harness import weight_transfer as wt


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()


class _Client:
    """vLLM's VLLMWeightSyncClient over a worker engine in a thread of this process (the replica's side)."""

    def __init__(self, worker, receive=True):
        self.worker, self.receive, self.calls, self.thread = worker, receive, [], None

    def _in_thread(self, fn, *args):
        self.thread = threading.Thread(target=fn, args=args, daemon=True)
        self.thread.start()

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", sorted(init_info)))
        self._in_thread(lambda: self.worker.init_transfer_engine(self.worker.parse_init_info(init_info)))

    def start_weight_update(self):
        self.thread.join()
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info["names"]))
        if self.receive:
            self._in_thread(self.worker.update_weights, update_info)

    def finish_weight_update(self, weight_version=None):
        self.thread.join()
        self.calls.append(("finish", weight_version))


def _worker():
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None)
    return WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="gloo"), vllm_config,
                                                     torch.device("cpu"), _Model())


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(50, 8, generator=g).bfloat16(),  # 800 bytes
            "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),  # 512
            "model.norm.weight": torch.randn(8, generator=g),  # 32
            "lm_head.weight": torch.randn(50, 8, generator=g)}  # 1600


def test_chunk_bounds_cut_where_vllms_pack_tensors_cuts():
    """pack_tensors takes tensors until the bytes taken exceed the buffer, the one that crossed included: the
    worker must cut its receive buffers at the same places (by hand: 800 > 700 ends the first chunk at one tensor;
    then 512 + 32 = 544, and + 1600 crosses, so the second takes the other three)."""
    assert wt.chunk_bounds([800, 512, 32, 1600], 700) == [(0, 1), (1, 4)]
    assert wt.chunk_bounds([100, 100, 100], 1000) == [(0, 3)]
    assert wt.chunk_bounds([], 10) == []
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    pairs = iter((str(i), torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([800, 512, 32, 1600]))
    sizes = []
    with pytest.warns(UserWarning, match="exceeds buffer_size_bytes"):  # vLLM's own packing warns of a big tensor
        while (chunk := pack_tensors(pairs, lambda item: item[1], 700)) is not None:
            sizes.append(len(chunk.names))
    assert sizes == [1, 3]


def test_the_trainer_engine_drives_vllms_calls_in_order_and_every_byte_arrives():
    worker = _worker()
    client = _Client(worker)
    tensors = _tensors()
    with pytest.warns(UserWarning, match="exceeds buffer_size_bytes"):  # vLLM's own packing warns of a big tensor
        engine = wt.trainer_engine("gloo", client=client, source=wt.StateDictSource(tensors), host="127.0.0.1",
                                   worker_host="127.0.0.1", world_size=2, timeout_s=30, buffer_bytes=700)
        assert isinstance(engine, wt.GlooTrainerWeightTransferEngine)  # what vLLM's factory made for "gloo"
        for version in (1, 2):
            client.version = version
            engine.send_weights()
    assert [c[0] for c in client.calls] == ["init", "start", "update", "finish", "start", "update", "finish"]
    assert client.calls[2][1] == list(tensors)
    assert set(worker.model.loaded) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(worker.model.loaded[name], t) and worker.model.loaded[name].dtype == t.dtype
    engine.shutdown()


def _joins_then_hangs(init_info: dict) -> None:
    """A replica's worker that joins its group, then never receives: it is killed mid-broadcast."""
    import time

    _worker().init_transfer_engine(wt.GlooWeightTransferInitInfo(**init_info))
    time.sleep(600)


class _DyingClient:
    def __init__(self):
        self.calls, self.proc = [], None

    def init_weight_transfer_engine(self, init_info):
        import multiprocessing as mp

        self.calls.append("init")
        self.proc = mp.get_context("spawn").Process(target=_joins_then_hangs, args=(dict(init_info),), daemon=True)
        self.proc.start()

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")
        self.proc.kill()  # the replica dies as the broadcast begins

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")


def test_a_replica_that_dies_mid_broadcast_is_named_in_one_line():
    """The worker's process is killed as the broadcast begins; gone() names it, and send_weights raises in one line,
    not after the timeout, without the finish call (the update did not happen)."""
    client = _DyingClient()
    big = {"w": torch.zeros(64 << 20, dtype=torch.uint8)}  # more than a socket buffers: the broadcast must wait
    engine = wt.trainer_engine("gloo", client=client, source=wt.StateDictSource(big), host="127.0.0.1",
                               worker_host="127.0.0.1", world_size=2, timeout_s=600)
    engine.gone = lambda: None if client.proc.is_alive() else "replica 1 (local, pid 123)"
    with pytest.raises(RuntimeError) as raised:
        engine.send_weights()
    assert str(raised.value) in ("replica 1 (local, pid 123) died during the weight broadcast",) or \
        str(raised.value).startswith(("RuntimeError: ", "DistBackendError: ")), raised.value
    assert "\n" not in str(raised.value) and client.calls == ["init", "start", "update"]


def test_ipc_handles_travel_as_plain_data_and_only_torch_classes_come_back():
    """vLLM's ipc engine's handles are torch's rebuild_cuda_tensor arguments (classes, a dtype, a torch.Size,
    bytes): they cross the replica channel as names and lists, and a class outside torch is refused."""
    args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 0, torch.UntypedStorage, torch.bfloat16, 0, b"\x00handle",
            24, 0, False, b"ref", 0, b"event", True)
    handles = [{"GPU-uuid": args}]
    plain = wt.plain_ipc_handles(handles)

    def only_plain(x):
        return x is None or isinstance(x, (bool, int, float, str, bytes)) or (
            isinstance(x, list) and all(map(only_plain, x))) or (
            isinstance(x, dict) and all(isinstance(k, str) and only_plain(v) for k, v in x.items()))

    assert only_plain(plain)
    back = wt.ipc_handles_from_plain(plain)
    assert back == handles and isinstance(back[0]["GPU-uuid"][1], torch.Size)
    with pytest.raises(ValueError, match="os:system, not one of torch's"):
        wt.ipc_handles_from_plain([{"GPU-uuid": [{"class": "os:system"}]}])


@pytest.mark.slow
def test_a_tied_head_follows_an_update_through_vllms_calls(real_model_dir):
    """SmolLM2's tied LM head through a real vLLM engine and the LLM's own weight-transfer calls: the embedding
    nudged by 1e-3 and pushed without lm_head.weight (a tied state dict leaves the alias out), vLLM's sampler
    logprobs then equal the learner's under the nudged weights (float32; 1.7e-5 measured here, so 1e-3 leaves room
    for another CPU's kernels) and not the base weights' (0.16 measured). Without the engine's refresh of the head
    vLLM kept the base head's packed weights: 0.096 off the learner's."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from harness import tasks, vllm_internals, vllm_replica

    tasks.set_vllm_cpu_env()
    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings
    with vllm_internals.engine_start():
        llm = LLM(model=str(real_model_dir), dtype="float32", max_model_len=256, enforce_eager=True,
                  weight_transfer_config={"backend": "gloo"}, enable_chunked_prefill=False,
                  max_num_batched_tokens=4096, logprobs_mode="processed_logprobs")

    class Client:  # the replica's calls, made on the LLM itself (the receive in a thread, beside the broadcast)
        thread = None

        def init_weight_transfer_engine(self, info):
            self.thread = threading.Thread(target=llm.init_weight_transfer_engine, args=({"init_info": info},))
            self.thread.start()

        def start_weight_update(self):
            self.thread.join()
            llm.start_weight_update()

        def update_weights(self, info):
            self.thread = threading.Thread(target=llm.update_weights, args=({"update_info": info},))
            self.thread.start()

        def finish_weight_update(self, weight_version=None):
            self.thread.join()
            llm.finish_weight_update("1")

    with torch.no_grad():
        base = hf.model.embed_tokens.weight.clone()
        hf.model.embed_tokens.weight.add_(1e-3 * torch.randn(base.shape, generator=torch.Generator().manual_seed(0)))
    tensors = vllm_replica.weight_tensors(hf.state_dict(), torch.float32, tied=True)
    assert "lm_head.weight" not in tensors
    wt.trainer_engine("gloo", client=Client(), source=wt.StateDictSource(tensors), host="127.0.0.1",
                      worker_host="127.0.0.1", world_size=2, timeout_s=120).send_weights()
    assert llm.get_weight_version() == "1"
    prompt = [1, 504, 3458, 314, 3575, 30, 28, 216]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=1.0, logprobs=0,
                                                                       seed=3), use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    sampled = torch.tensor([out.logprobs[i][t].logprob for i, t in enumerate(ids)])

    def learner_gap() -> float:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
        ours = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        return (ours - sampled).abs().max().item()

    assert learner_gap() < 1e-3
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(base)
    assert learner_gap() > 1e-2  # the check tells the two weights apart
