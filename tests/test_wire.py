"""Tests of harness/wire.py, the replica channel (fast, no vLLM): the codec of plain data, and the channel between the
real endpoints (vllm_replica's listener and connect_to_generator) with a relay between them that reads, injects and
replays frames, as an attacker on the network path would. The remote-replica tests of test_pipeline_rl.py and
test_e2e.py run real replicas over it."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import pickle
import re
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from msgspec.msgpack import Ext

import pipeline_rl as pl
from harness import tasks, vllm_replica, wire

SECRET = b"the-run's-shared-secret-32-bytes"

# --------------------------------------------------------------------------------------------------------------
# The codec
# --------------------------------------------------------------------------------------------------------------


def test_plain_data_round_trips_with_its_tuples_and_types():
    msg = ("update", 3, {"manifest": [[("w", "float32", (2, 3), 0, 24)]], "none": None, "raw": b"\x00\xff",
                        "f": -1.5, "inf": float("inf"), "yes": True, 7: "an int key", "low": -2**63, "high": 2**64 - 1,
                        "empty": (), "nested": [(1, [2, (3,)]), {}]})
    back = wire.decode(wire.encode(msg))
    assert back == msg
    assert type(back) is tuple and type(back[2]["manifest"][0][0]) is tuple and type(back[2]["manifest"][0]) is list
    assert type(back[2]["manifest"][0][0][2]) is tuple and back[2]["nested"][0][1][1] == (3,)
    assert type(back[2]["yes"]) is bool and type(back[2]["f"]) is float and type(back[2]["raw"]) is bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_a_tensor_arrives_with_its_dtype_shape_and_bytes(dtype):
    t = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) * 0.75).to(dtype)  # [2, 3, 4]
    views = {"whole": t, "strided": t.transpose(0, 2), "scalar": t[1, 2, 3], "empty": t[:, :0]}
    back = wire.decode(wire.encode(("tensors", views)))[1]
    for name, sent in views.items():
        got = back[name]
        assert got.dtype == dtype and got.shape == sent.shape and torch.equal(got, sent), name
    assert back["strided"].shape == (4, 3, 2) and back["scalar"].shape == () and back["empty"].shape == (2, 0, 4)


def test_an_array_arrives_with_its_dtype_shape_and_byte_order():
    arrays = [np.arange(6, dtype=">f4").reshape(2, 3), np.array([[1, -2]], dtype=np.int16).T, np.zeros((0, 5)),
              np.array(True), np.array([1 + 2j], dtype=np.complex64)]
    for sent, got in zip(arrays, wire.decode(wire.encode(arrays))):
        assert got.dtype == sent.dtype and got.shape == sent.shape and np.array_equal(got, sent)
        assert got.flags.writeable


@dataclasses.dataclass
class _Settings:
    x: int = 1


class _Anything:
    pass


@pytest.mark.parametrize("value,says", [
    (_Settings(), "._Settings is not plain data (a dataclass: send dataclasses.asdict() of it"),
    (_Anything(), "._Anything is not plain data"),
    ({1, 2}, "msg[2]['config']: builtins.set is not plain data"),
    (np.float64(1.5), "msg[2]['config']: numpy.float64 is not plain data (a numpy scalar: send .item())"),
    ({(1, 2): 3}, "msg[2]['config']: a dict key of type tuple"),
    (print, "builtin_function_or_method is not plain data"),
    (np.array([object()]), "msg[2]['config']: a numpy array of dtype object"),
    (torch.zeros(2).to_sparse(), "msg[2]['config']: a torch.sparse_coo tensor"),
])
def test_anything_but_plain_data_is_refused_when_sent_naming_where_it_is(value, says):
    with pytest.raises(wire.WireError) as e:
        wire.encode(("start", 1, {"config": value}))
    assert says in str(e.value) and "cannot send msg[2]['config']: " in str(e.value) and "\n" not in str(e.value)
    # nested deeper, the path says where
    with pytest.raises(wire.WireError, match=r"msg\[1\]\[0\]\['k'\]"):
        wire.encode(("x", [{"k": _Anything()}]))


def test_an_int_beyond_64_bits_is_refused_in_one_line():
    with pytest.raises(wire.WireError, match="can't serialize ints"):
        wire.encode(("x", 2**64))


def test_bodies_that_are_not_such_a_message_do_not_decode():
    enc = wire._encoder.encode
    bad = {"unknown extension type 9": enc(Ext(9, b"")),
           "a tensor of unknown dtype 'object'": enc(Ext(wire._TENSOR, enc(["object", [1], b"12345678"]))),
           "shape [2, 2] needs 16 bytes, the frame has 12": enc(Ext(wire._TENSOR, enc(["float32", [2, 2], b"\0" * 12]))),
           "a bad shape [-1]": enc(Ext(wire._TENSOR, enc(["float32", [-1], b""]))),
           "an array of dtype '|O'": enc(Ext(wire._NDARRAY, enc(["|O", [1], b"\0" * 8]))),
           "truncated": wire.encode(("x", [1, 2, 3]))[:-1]}
    for says, body in bad.items():
        with pytest.raises(Exception, match=re.escape(says) if says != "truncated" else "truncated"):
            wire.decode(body)


# --------------------------------------------------------------------------------------------------------------
# The channel, with a relay on the path
# --------------------------------------------------------------------------------------------------------------


class Relay:
    """A man in the middle on the path from a replica to the generator: it forwards both ways, records every byte
    (`to_generator`, `to_replica`), and can add bytes of its own to either stream between two frames."""

    def __init__(self, target: str):
        self.target = vllm_replica.parse_address(target)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.to_generator, self.to_replica = bytearray(), bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        replica, _ = self.server.accept()
        generator = socket.create_connection(self.target)
        self.replica_side, self.generator_side = replica, generator
        self.sockets += [replica, generator]
        threading.Thread(target=self._pump, args=(replica, generator, self.to_generator), daemon=True).start()
        threading.Thread(target=self._pump, args=(generator, replica, self.to_replica), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                with self.lock:
                    record += chunk
                    dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def inject(self, data: bytes, towards: str = "generator") -> None:
        with self.lock:
            (self.generator_side if towards == "generator" else self.replica_side).sendall(data)

    def close(self) -> None:
        for s in [self.server, *self.sockets]:
            s.close()


def _planting_pickle(path: Path) -> bytes:
    """A pickle that creates the file `path` when it is loaded: what an attacker sends to run code."""
    class Plant:
        def __reduce__(self):
            return open, (str(path), "w")

    return pickle.dumps(Plant())


def _forged_frame(seq: int, body: bytes) -> bytes:
    """A frame in the channel's format, as an attacker who knows the format (not the key) makes it."""
    return wire._HEADER.pack(seq, len(body)) + body + b"\0" * wire._MAC_BYTES


@contextlib.contextmanager
def _relayed_channel():
    """(the replica's channel, the generator's channel, the relay between them), through the real listener."""
    listener = vllm_replica.ReplicaListener("127.0.0.1:0", SECRET)
    relay = Relay(listener.address)
    relay.listener = listener
    try:
        replica, _ = vllm_replica.connect_to_generator(relay.address, SECRET, timeout=10)
        generator, _ = listener.accepted.get(timeout=10)
        yield replica, generator, relay
        replica.close()
        generator.close()
    finally:
        relay.close()
        listener.close()


def _received(relay: Relay, n: int, direction: str = "to_generator") -> None:
    deadline = time.monotonic() + 10
    while len(getattr(relay, direction)) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_pickle_is_live_so_the_tests_below_can_fail(tmp_path):
    pickle.loads(_planting_pickle(tmp_path / "planted"))
    assert (tmp_path / "planted").exists()


def test_an_injected_frame_is_refused_in_one_line_and_runs_nothing(tmp_path):
    """The attack of issue 64: a pickle injected into the stream ran code in the generator. Now a frame not made
    with the connection's key fails its MAC: refused, nothing decoded, the connection closed."""
    planted = tmp_path / "planted"
    with _relayed_channel() as (replica, generator, relay):
        replica.send(("hello", {"pid": 1}))
        assert generator.recv() == ("hello", {"pid": 1})
        relay.inject(_forged_frame(1, _planting_pickle(planted)))  # the next sequence number, a bogus MAC
        assert generator.poll(5)
        with pytest.raises(wire.FrameRefused) as e:
            generator.recv()
        assert str(e.value) == f"frame 1 ({len(_planting_pickle(planted))} bytes) fails its MAC: not sent by this " \
                               "connection's peer (injected or altered on the way)"
        assert generator.closed and not planted.exists()
        with pytest.raises(EOFError):
            generator.recv()  # nothing more is read from it
    with _relayed_channel() as (replica, generator, relay):  # the other way, towards the replica, the same
        relay.inject(_forged_frame(0, _planting_pickle(planted)), towards="replica")
        with pytest.raises(wire.FrameRefused, match="frame 0 .* fails its MAC"):
            replica.recv()
        assert not planted.exists()


def test_a_replayed_frame_is_refused_in_one_line_and_runs_nothing(tmp_path):
    """A frame the replica really sent, sent again by the relay: its MAC holds, its sequence number is an old one."""
    with _relayed_channel() as (replica, generator, relay):
        _received(relay, 80)  # the handshake's answer: 16 magic + 32 nonce + 32 proof
        start = len(relay.to_generator)
        replica.send(("update_failed", 4, "once"))
        assert generator.recv() == ("update_failed", 4, "once")
        recorded = bytes(relay.to_generator[start:])
        replica.send(("updated", 5, 0.5))
        assert generator.recv() == ("updated", 5, 0.5)
        relay.inject(recorded)
        with pytest.raises(wire.FrameRefused) as e:
            generator.recv()
        assert str(e.value) == "frame 0 is not the next one (2): replayed, reordered or one dropped"
        assert generator.closed


def test_a_frame_altered_on_the_way_or_declared_too_long_is_refused():
    with _relayed_channel() as (replica, generator, relay):
        relay.inject(wire._HEADER.pack(0, wire.MAX_FRAME_BYTES + 1))
        with pytest.raises(wire.FrameRefused, match=r"a frame of 1073741825 bytes declared, over the channel's"):
            generator.recv()
    with _relayed_channel() as (replica, generator, relay):
        body = wire.encode(("add", []))
        relay.inject(wire._HEADER.pack(0, len(body)) + body)  # a MAC's 32 bytes still to come: the replica's frame's
        replica.send(("close",))  # its bytes now complete a frame whose MAC is not over them
        with pytest.raises(wire.FrameRefused, match="fails its MAC"):
            generator.recv()


def test_no_secret_crosses_the_relay_in_clear():
    """The relay sees the handshake and the frames: neither the shared secret nor the connection's key (from which
    each frame's key comes) is among their bytes."""
    with _relayed_channel() as (replica, generator, relay):
        replica.send(("hello", {"pid": 1}))
        generator.recv()
        generator.send(("add", [("t0.0", [1, 2, 3], "salt", {"seed": 7})]))
        replica.recv()
        _received(relay, 1, "to_replica")
        seen = bytes(relay.to_generator) + bytes(relay.to_replica)
        for secret in (SECRET, generator._key, generator._send_key, replica._send_key):
            assert secret not in seen
        assert b"salt" in seen  # what a message holds crosses in clear: the channel authenticates, it does not hide


def test_a_refused_frame_is_one_line_and_a_dead_replica_for_the_scheduler(base_model_dir, tmp_path, capsys):
    """Through the scheduler: replica 0's connection gets an injected pickle, replica 1's a replayed frame; each is
    taken out as a dead replica in one line naming why, nothing of either frame runs, and replica 2 goes on. A new
    connection whose first frame is injected is dropped before its hello, in one line and the refused count."""
    config = pl.GeneratorConfig(model=str(base_model_dir), group_size=2, interruptions=False,
                                fleet=pl.FleetConfig(replicas=3))
    learner, _learner_end = mp.Pipe()
    scheduler = pl._Scheduler(learner, config, tasks.ArithmeticTask(), 0, [], [], 0, SECRET)
    planted = tmp_path / "planted"
    with _relayed_channel() as (r0, g0, relay0), _relayed_channel() as (r1, g1, relay1), \
            _relayed_channel() as (r2, g2, _), _relayed_channel() as (r3, g3, relay3):
        for slot, conn in zip(scheduler.pool.slots(), (g0, g1, g2)):
            slot.connect(conn, "127.0.0.1", 1000 + slot.id, "127.0.0.1", 1)
            slot.engine_up({"max_num_seqs": 4}, config.group_size)
            slot.holds(0)
        _received(relay1, 80)
        start = len(relay1.to_generator)
        r1.send(("outputs", [], 0.25))
        _received(relay1, start + 1)
        scheduler.poll(5)
        relay0.inject(_forged_frame(0, _planting_pickle(planted)))
        relay1.inject(bytes(relay1.to_generator[start:]))
        r2.send(("outputs", [], 0.5))
        scheduler.pool.listener = relay3.listener  # what the listener accepted, before its hello
        relay3.listener.accepted.put((g3, ("127.0.0.1", 5)))
        relay3.inject(_forged_frame(0, _planting_pickle(planted)))
        deadline = time.monotonic() + 10
        while (scheduler.pool.slot(1).state != "dead" or len(relay3.listener.refused) == 0) and \
                time.monotonic() < deadline:
            scheduler.poll(0.5)
        assert list(relay3.listener.refused) == ["refused a frame from 127.0.0.1:5 before its hello: frame 0 (" +
                                                 f"{len(_planting_pickle(planted))} bytes) fails its MAC: not sent by "
                                                 "this connection's peer (injected or altered on the way)"]
        assert g3.closed and g3 not in scheduler.pool.connections()
        assert [s.state for s in scheduler.pool.slots()] == ["dead", "dead", "ready"] and not planted.exists()
        assert "refused a frame on its connection: frame 0 " in scheduler.pool.slot(0).reason
        assert "fails its MAC" in scheduler.pool.slot(0).reason
        assert scheduler.pool.slot(1).reason == "refused a frame on its connection: frame 0 is not the next one (1): " \
                                                "replayed, reordered or one dropped"
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[generator]")]
        assert len(lines) == 3 and all("refused a frame" in line for line in lines), lines
        assert sum("died" in line for line in lines) == 2
        assert scheduler.busy_s_by_replica == {1: 0.25, 2: 0.5}


def test_a_replica_does_not_take_a_peer_that_cannot_prove_the_secret_for_the_generator():
    """Both ways: something listening at the generator's address that knows the handshake's form but not the secret
    (it answers with 32 bytes of its own) is refused by the replica, which sends it nothing more."""
    server = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(wire.MAGIC + bytes(wire.NONCE_BYTES))
            got.extend(wire._read_exact(conn, 80))
            conn.sendall(b"\1" * 32)
            with contextlib.suppress(OSError):
                while chunk := conn.recv(4096):
                    got.extend(chunk)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(ConnectionRefusedError, match="the peer did not prove the secret: not the run's generator"):
        vllm_replica.connect_to_generator(f"127.0.0.1:{server.getsockname()[1]}", SECRET, timeout=5)
    thread.join(5)
    server.close()
    assert len(got) == 80 and SECRET not in got  # its proof only: no frame, no hello


def test_both_ends_of_a_channel_send_small_frames_at_once():
    """Nagle is off on both ends (TCP_NODELAY): with it on, a weight update's "update" frame, sent right after its
    "start", waited for the replica's delayed ACK of the first (about 40 ms of the 70 ms update on the tiny model)."""
    with _relayed_channel() as (replica, generator, _relay):
        for channel in (replica, generator):
            assert channel.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
