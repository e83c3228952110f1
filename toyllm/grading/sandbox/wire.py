"""What crosses between the grader and the sandbox, and in which format.

Towards the sandbox (trusted data, untrusted reader): ordinary pickle. A
submitted function handed over as an argument (``step=ex04.tsp_layer``)
travels as a reference that the sandbox resolves to its own copy.

Back from the sandbox (untrusted data, trusted reader): never pickle. The
value is first reduced to plain pieces (numbers, strings, tensors, lists,
dicts, tagged records), written with ``torch.save`` and read with
``torch.load(weights_only=True)``, which only rebuilds tensors and basic
types. A reply is bounded before anything in it is read: its frame is at most
``MAX_REPLY_BYTES``, every record of its zip archive is stored as it is (never
deflated, so nothing inflates), its pickle (all but the tensors' data) is at
most ``MAX_REPLY_PICKLE_BYTES``, and rebuilding it makes at most
``MAX_REPLY_VALUES`` values (a pickle's shared references cannot multiply). Whatever else a submission returns (a NumPy scalar, its own class)
arrives as an ``Unsendable`` that shows its type and repr, so a type check in
a graded test fails with a readable message instead of running its code.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
import struct
import zipfile
from fractions import Fraction
from types import SimpleNamespace

import torch

_MAX_DEPTH = 64
_LENGTH = struct.Struct("!Q")
MAX_REPLY_BYTES = 256 * 2**20     # one reply from the sandbox, as sent and as loaded (bytes)
MAX_REPLY_PICKLE_BYTES = 32 * 2**20   # the part of a reply that is not tensor data (its pickle, bytes)
MAX_REPLY_VALUES = 2**22          # numbers, strings, tensors and containers rebuilt from one reply


class ReplyTooLarge(Exception):
    """A reply from the sandbox is over a size limit; it is refused before it is loaded.

    Not a ``ValueError``: a graded test that expects the submission to raise one must not take this for it.
    """


class Unsendable:
    """Stands for a value of a type that cannot come back from the sandbox (shown by type and repr)."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return f"<{self.type_name}: {self.text}>"

    def __eq__(self, other) -> bool:
        return False

    __hash__ = None


class Record(SimpleNamespace):
    """A dataclass instance that came back from the sandbox, as attributes (``result.logits``)."""


# --------------------------------------------------------------------------- towards the sandbox

class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if getattr(getattr(obj, "func", obj), "stays_trusted", False) is True:      # harness.trusted_cost
            raise TypeError("a grading cost holds the expected answer and stays in the grader's process: "
                            "hand the submission harness.Counted(cost) instead")
        ref = getattr(obj, "_toyllm_remote_ref", None)
        return ref() if callable(ref) and not isinstance(obj, type) else None


def to_sandbox(obj) -> bytes:
    buf = io.BytesIO()
    _RefPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def from_grader(data: bytes, resolve) -> object:
    """Read a request inside the sandbox; ``resolve(ref)`` turns a function reference into the function."""
    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            return resolve(pid)
    return _Unpickler(io.BytesIO(data)).load()


# --------------------------------------------------------------------------- back from the sandbox

def _plain(obj, depth=0):
    """``obj`` as pieces ``torch.load(weights_only=True)`` accepts, tagged where the type matters."""
    if depth > _MAX_DEPTH:
        return {"~": "opaque", "type": "nested too deep", "repr": "..."}
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if isinstance(obj, float):                 # a NumPy float64 is a float: keep its value, not its class
        return float(obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().as_subclass(torch.Tensor).cpu().clone()
    if type(obj) is tuple:
        return {"~": "tuple", "v": [_plain(x, depth + 1) for x in obj]}
    if type(obj) is list:
        return {"~": "list", "v": [_plain(x, depth + 1) for x in obj]}
    if type(obj) in (set, frozenset):
        return {"~": type(obj).__name__, "v": [_plain(x, depth + 1) for x in obj]}
    if type(obj) is dict:
        return {"~": "dict", "v": [[_plain(k, depth + 1), _plain(v, depth + 1)] for k, v in obj.items()]}
    if type(obj) is Fraction:
        return {"~": "fraction", "v": [obj.numerator, obj.denominator]}
    if type(obj) is bytes:
        return {"~": "bytes", "v": torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj else torch.empty(0, dtype=torch.uint8)}
    if type(obj) is complex:
        return {"~": "complex", "v": [obj.real, obj.imag]}
    if isinstance(obj, torch.Size):
        return {"~": "tuple", "v": list(obj)}
    if isinstance(obj, torch.dtype):
        return {"~": "dtype", "v": str(obj)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _plain(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj)}
        return {"~": "record", "type": type(obj).__qualname__, "v": fields}
    try:
        text = repr(obj)[:300]
    except Exception:                      # a repr that raises is the submission's problem, not ours
        text = "?"
    return {"~": "opaque", "type": f"{type(obj).__module__}.{type(obj).__qualname__}", "repr": text}


def _rebuild(obj, budget: list[int]):
    """``obj`` as the values it stands for; ``budget[0]``: how many more values may be made."""
    budget[0] -= 1
    if budget[0] < 0:
        raise ReplyTooLarge(f"the submission's reply holds over {MAX_REPLY_VALUES} values; "
                            f"at most {MAX_REPLY_VALUES} can come back from the sandbox")
    if isinstance(obj, list):                  # never produced bare by _plain, but harmless
        return [_rebuild(x, budget) for x in obj]
    if not isinstance(obj, dict):
        return obj
    tag, v = obj.get("~"), obj.get("v")
    if tag == "tuple":
        return tuple(_rebuild(x, budget) for x in v)
    if tag == "list":
        return [_rebuild(x, budget) for x in v]
    if tag == "set":
        return {_rebuild(x, budget) for x in v}
    if tag == "frozenset":
        return frozenset(_rebuild(x, budget) for x in v)
    if tag == "dict":
        return {_rebuild(k, budget): _rebuild(x, budget) for k, x in v}
    if tag == "fraction":
        return Fraction(int(v[0]), int(v[1]))
    if tag == "bytes":
        return v.to(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor) else bytes(v)
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "dtype":
        return getattr(torch, str(v).removeprefix("torch."))
    if tag == "record":
        return Record(**{str(k): _rebuild(x, budget) for k, x in v.items()})
    if tag == "opaque":
        return Unsendable(str(obj.get("type")), str(obj.get("repr")))
    raise ValueError(f"unknown value tag {tag!r} from the sandbox")


def to_grader(obj) -> bytes:
    """Serialise a reply inside the sandbox (a dict of plain pieces)."""
    buf = io.BytesIO()
    torch.save(_plain(obj), buf)
    return buf.getvalue()


def from_sandbox(data: bytes):
    """Read a reply on the trusted side: tensors and basic types only, nothing that runs code.

    ReplyTooLarge if it would take more than ``MAX_REPLY_BYTES`` once loaded or make more than
    ``MAX_REPLY_VALUES`` values.
    """
    _check_archive(data)
    return _rebuild(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"), [MAX_REPLY_VALUES])


def _check_archive(data: bytes) -> None:
    """Refuse a reply whose records are compressed or add up to more than ``MAX_REPLY_BYTES``, from its
    zip directory alone (torch.save stores every record as it is, so a compressed one is crafted)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise ValueError(f"the submission's reply is not a torch.save archive ({e})") from None
    packed = [r.filename for r in records if r.compress_type != zipfile.ZIP_STORED or r.file_size != r.compress_size]
    if packed:
        raise ReplyTooLarge(f"the submission's reply holds compressed records ({', '.join(packed[:3])}); "
                            "replies are torch.save archives, whose records are stored as they are")
    _check_size(sum(r.file_size for r in records))
    # The pickle is the part that grows when loaded (a shared reference costs 2 bytes, a list slot 8).
    pickled = sum(r.file_size for r in records if r.filename.endswith("data.pkl"))
    if pickled > MAX_REPLY_PICKLE_BYTES:
        raise ReplyTooLarge(f"the submission's reply has {pickled / 2**20:.0f} MiB of Python values besides tensor "
                            f"data; at most {MAX_REPLY_PICKLE_BYTES // 2**20} MiB can come back from the sandbox "
                            "(return a tensor instead of a long list)")


def _check_size(n: int) -> None:
    if n > MAX_REPLY_BYTES:
        raise ReplyTooLarge(f"the submission's reply was {n / 2**20:.0f} MiB; at most "
                            f"{MAX_REPLY_BYTES // 2**20} MiB can come back from the sandbox")


# --------------------------------------------------------------------------- framing on a socket

def send(sock, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv(sock, limit: int = 2**31) -> bytes:
    """One frame; ConnectionError when the other side is gone or sends a frame over ``limit`` bytes."""
    head = _recv_exactly(sock, _LENGTH.size)
    (n,) = _LENGTH.unpack(head)
    if n > limit:
        raise ConnectionError(f"a reply of {n} bytes is over the limit of {limit}")
    return _recv_exactly(sock, n)


def recv_reply(sock) -> bytes:
    """One reply from the sandbox: ReplyTooLarge, before any of it is read, if over ``MAX_REPLY_BYTES``."""
    (n,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    _check_size(n)
    return _recv_exactly(sock, n)


def _recv_exactly(sock, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the sandbox closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
