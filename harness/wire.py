"""harness/wire.py: the replica channel's wire. What a message between a replica and the generator may hold, how
both ends prove the shared secret, and how each frame is framed and authenticated. It imports nothing of the project.

- The codec (`encode`, `decode`): plain data only, as msgpack (msgspec's, which vLLM itself depends on): dict, list,
  tuple (kept a tuple), str, int, float, bool, None, bytes, and torch tensors / numpy arrays as raw bytes with a
  declared dtype and shape. Anything else is refused when encoding (`WireError`, naming where it sits in the
  message); decoding builds plain data only, so no frame can run code (no pickle crosses a socket).
- The handshake (`handshake_as_generator`, `handshake_as_replica`): both sides send a fresh 32-byte nonce and prove
  the secret with an HMAC over both nonces; the connection's key is derived from the secret and both nonces, so it
  is new for every connection and never crosses the wire. The secret does not cross either.
- The channel (`Channel`): each frame is (sequence number, length, body, HMAC-SHA256 of the three), keyed per
  direction from the connection's key. A frame with a bad MAC, a sequence number other than the next one (a replay,
  a reordering, a dropped frame) or a body that does not decode is refused (`FrameRefused`, one line) before
  anything of it is used, and the connection is closed.

What it does not do: encrypt. Prompts, completions and whatever else a message holds cross in clear (docs/pipeline.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import select
import socket
import struct
import threading
from multiprocessing import AuthenticationError
from typing import Any

import msgspec
import numpy as np
import torch

# --------------------------------------------------------------------------------------------------------------
# The codec: plain data <-> msgpack bytes
# --------------------------------------------------------------------------------------------------------------

_TUPLE, _TENSOR, _NDARRAY = 1, 2, 3  # msgpack extension codes: what msgpack itself has no type for
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})
_KEYS = frozenset({str, int})  # dict keys: all a message needs, and each decodes to itself
# a tensor's dtype as named on the wire (str(dtype) without "torch."), from a fixed list: nothing else is looked up
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}
_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex: arrays of anything else (objects) are refused
MAX_FRAME_BYTES = 1 << 30  # a frame's body; a longer one is refused when sent and when received

_encoder = msgspec.msgpack.Encoder()


class WireError(TypeError):
    """A message that the channel cannot carry (not plain data), in one line naming where the offending value sits."""


class FrameRefused(ConnectionError):
    """A frame refused by the receiving end: bad MAC, unexpected sequence number, undecodable body, or too long.
    Nothing of it was used and the connection is closed. A ConnectionError, so that whoever treats a broken
    connection as a dead peer does so here too."""


def encode(msg: Any) -> bytes:
    """`msg` (plain data, see the module's docstring) as msgpack bytes. WireError for anything else."""
    try:
        return _encoder.encode(_plain(msg, "msg"))
    except OverflowError as e:  # an int beyond 64 bits
        raise WireError(f"cannot send {msg!r:.200}: {e}") from None


def _plain(obj: Any, where: str) -> Any:
    """`obj` with each tuple, tensor and array as a msgpack extension; WireError at the first value that is not plain
    data. `where` names obj's place in the message, for the error."""
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    if kind is list or kind is tuple:
        if _SCALARS.issuperset(map(type, obj)):  # the common case (token ids, logprobs): checked in C, not copied
            items = obj  # msgspec writes a tuple as an array, as a list
        else:
            items = [_plain(x, f"{where}[{i}]") for i, x in enumerate(obj)]
        return items if kind is list else msgspec.msgpack.Ext(_TUPLE, _encoder.encode(items))
    if kind is dict:
        out = {}
        for k, v in obj.items():
            if type(k) not in _KEYS:
                raise WireError(f"cannot send {where}: a dict key of type {type(k).__name__} ({k!r:.80}); keys are "
                                "str or int")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, torch.Tensor):
        return msgspec.msgpack.Ext(_TENSOR, _encoder.encode(_tensor_parts(obj, where)))
    if kind is np.ndarray:
        if obj.dtype.kind not in _NUMPY_KINDS or obj.dtype.hasobject:
            raise WireError(f"cannot send {where}: a numpy array of dtype {obj.dtype} (numbers and bools only)")
        return msgspec.msgpack.Ext(_NDARRAY, _encoder.encode([obj.dtype.str, list(obj.shape),
                                                              np.ascontiguousarray(obj).tobytes()]))
    hint = (" (a dataclass: send dataclasses.asdict() of it and rebuild it on the other side)"
            if hasattr(kind, "__dataclass_fields__") else " (a numpy scalar: send .item())"
            if isinstance(obj, np.generic) else "")
    raise WireError(f"cannot send {where}: {kind.__module__}.{kind.__qualname__} is not plain data{hint}; the "
                    "channel carries dict, list, tuple, str, int, float, bool, None, bytes, tensors and arrays")


def _tensor_parts(t: torch.Tensor, where: str) -> list:
    """[dtype name, shape, raw bytes] of a dense tensor (copied to the CPU)."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES or t.layout != torch.strided:
        raise WireError(f"cannot send {where}: a {t.layout} tensor of dtype {t.dtype} (dense tensors of "
                        f"{', '.join(_TORCH_DTYPES)} only)")
    flat = t.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    return [name, list(t.shape), flat.view(torch.uint8).numpy().tobytes()]


def decode(body: bytes | memoryview) -> Any:
    """The message in `body` (from `encode`): plain data, tensors on the CPU. ValueError (or msgspec's
    DecodeError) for bytes that are not such a message."""
    return _decoder.decode(body)


def _ext(code: int, data: memoryview) -> Any:
    if code == _TUPLE:
        return tuple(_decoder.decode(data))
    if code == _TENSOR:
        name, shape, raw = _decoder.decode(data)
        dtype = _TORCH_DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            raise ValueError(f"a tensor of unknown dtype {name!r:.40}")
        n = _checked_numel(shape, len(raw), dtype.itemsize)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if n else torch.empty(0, dtype=dtype)
        return flat.reshape(shape)
    if code == _NDARRAY:
        text, shape, raw = _decoder.decode(data)
        dtype = np.dtype(text) if type(text) is str and len(text) <= 8 else None
        if dtype is None or dtype.kind not in _NUMPY_KINDS or dtype.hasobject:
            raise ValueError(f"an array of dtype {text!r:.40}")
        _checked_numel(shape, len(raw), dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    raise ValueError(f"unknown extension type {code}")


def _checked_numel(shape: Any, nbytes: int, itemsize: int) -> int:
    """The number of elements of `shape` (a list of ints >= 0) if `nbytes` is exactly their size, else ValueError."""
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"a bad shape {shape!r:.80}")
    numel = 1
    for d in shape:
        numel *= d
    if numel * itemsize != nbytes:
        raise ValueError(f"shape {shape} needs {numel * itemsize} bytes, the frame has {nbytes}")
    return numel


_decoder = msgspec.msgpack.Decoder(ext_hook=_ext)

# --------------------------------------------------------------------------------------------------------------
# The handshake: both sides prove the secret over fresh nonces, and derive the connection's key
# --------------------------------------------------------------------------------------------------------------

MAGIC = b"scalerl channel1"  # 16 bytes, first on the wire from each side: the protocol and its version
NONCE_BYTES = 32
_REFUSED = hashlib.sha256(b"scalerl: the generator refused the proof").digest()  # sent instead of its own proof


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def handshake_as_generator(sock: socket.socket, secret: bytes) -> Channel:
    """The generator's side, on a connected socket (its reads bounded by the caller): send a nonce, check the
    replica's proof, prove the secret in turn. AuthenticationError for a wrong proof (the replica is told), ValueError
    for a peer that does not speak this protocol, OSError/EOFError for a connection that broke."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + nonce)
    answer = _read_exact(sock, len(MAGIC) + NONCE_BYTES + 32)
    if answer[:len(MAGIC)] != MAGIC:
        raise ValueError("not a replica of this version (its first bytes are not the channel's)")
    peer_nonce, proof = answer[len(MAGIC):-32], answer[-32:]
    if not hmac.compare_digest(proof, _mac(secret, b"replica proof", nonce, peer_nonce)):
        sock.sendall(_REFUSED)
        raise AuthenticationError("its proof of the secret is wrong")
    sock.sendall(_mac(secret, b"generator proof", nonce, peer_nonce))
    return Channel(sock, _mac(secret, b"channel key", nonce, peer_nonce), "generator")


def handshake_as_replica(sock: socket.socket, secret: bytes) -> Channel:
    """The replica's side: read the generator's nonce, prove the secret over both nonces, check the generator's
    proof. AuthenticationError if the generator refused the proof or did not prove the secret itself."""
    hello = _read_exact(sock, len(MAGIC) + NONCE_BYTES)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthenticationError("the peer is not a generator of this version (its first bytes are not the "
                                  "channel's)")
    peer_nonce, nonce = hello[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + nonce + _mac(secret, b"replica proof", peer_nonce, nonce))
    proof = _read_exact(sock, 32)
    if proof == _REFUSED:
        raise AuthenticationError("the generator refused this replica's proof of the secret")
    if not hmac.compare_digest(proof, _mac(secret, b"generator proof", peer_nonce, nonce)):
        raise AuthenticationError("the peer did not prove the secret: not the run's generator")
    return Channel(sock, _mac(secret, b"channel key", peer_nonce, nonce), "replica")


def _read_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly `n` bytes; EOFError if the connection closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError(f"the connection closed after {got} of {n} bytes")
        got += k
    return buf


# --------------------------------------------------------------------------------------------------------------
# The channel: authenticated, sequenced frames of plain data
# --------------------------------------------------------------------------------------------------------------

_HEADER = struct.Struct(">QI")  # sequence number, body length
_MAC_BYTES = 32


class Channel:
    """One end of an established connection (from a handshake): send and recv messages of plain data, poll and
    fileno like a multiprocessing Connection (so multiprocessing.connection.wait takes it). A frame is read only
    whole and nothing beyond it, so a readable socket means a frame (or the end) is there. send is thread-safe."""

    def __init__(self, sock: socket.socket, key: bytes, role: str):
        peer = {"generator": "replica", "replica": "generator"}[role]
        self.sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Nagle off: a small frame sent right after another (a weight update's "start", then "update") would
            # otherwise wait for the peer's delayed ACK of the first, up to 40 ms on Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._key = key
        self._send_key = _mac(key, b"frames from", role.encode())
        self._recv_key = _mac(key, b"frames from", peer.encode())
        self._send_seq = self._recv_seq = 0
        self._send_lock = threading.Lock()

    def send(self, msg: Any) -> None:
        body = encode(msg)
        if len(body) > MAX_FRAME_BYTES:
            raise WireError(f"a message of {len(body)} bytes, over the channel's {MAX_FRAME_BYTES} per frame")
        with self._send_lock:
            header = _HEADER.pack(self._send_seq, len(body))
            mac = hmac.new(self._send_key, header, hashlib.sha256)
            mac.update(body)
            frame = b"".join((header, body, mac.digest()))
            self._send_seq += 1
            self.sock.sendall(frame)

    def recv(self) -> Any:
        """The next message. EOFError when the connection closed (between frames or within one); FrameRefused (the
        connection then closed) for a frame that is not the peer's next one, intact and decodable."""
        header = self._read(_HEADER.size)
        seq, n = _HEADER.unpack(header)
        if n > MAX_FRAME_BYTES:
            self._refuse(f"a frame of {n} bytes declared, over the channel's {MAX_FRAME_BYTES}")
        rest = memoryview(self._read(n + _MAC_BYTES))
        body, mac = rest[:n], rest[n:]
        expected = hmac.new(self._recv_key, header, hashlib.sha256)
        expected.update(body)
        if not hmac.compare_digest(mac, expected.digest()):
            self._refuse(f"frame {seq} ({n} bytes) fails its MAC: not sent by this connection's peer (injected or "
                         "altered on the way)")
        if seq != self._recv_seq:
            self._refuse(f"frame {seq} is not the next one ({self._recv_seq}): replayed, reordered or one dropped")
        self._recv_seq += 1
        try:
            return decode(body)
        except Exception as e:  # msgspec's DecodeError, or what the extension hook refused
            why = " ".join(str(e).split())
            self._refuse(f"frame {seq} ({n} bytes) does not decode to plain data: {type(e).__name__}: {why:.300}")

    def _read(self, n: int) -> bytearray:
        try:
            return _read_exact(self.sock, n)
        except OSError:
            if self.closed:  # closed here (a refused frame, or the owner's close)
                raise EOFError("the connection is closed") from None
            raise

    def _refuse(self, reason: str) -> None:
        self.close()
        raise FrameRefused(reason)

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a frame (or the end of the connection) waits, after up to `timeout` seconds."""
        poller = select.poll()  # not select.select: a process with vLLM in it may hold descriptors past 1024
        poller.register(self.fileno(), select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def fileno(self) -> int:
        fd = self.sock.fileno()
        if fd == -1:
            raise OSError("the channel is closed")
        return fd

    @property
    def closed(self) -> bool:
        return self.sock.fileno() == -1

    def close(self) -> None:
        self.sock.close()
