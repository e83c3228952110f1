"""What crosses between the grader and the sandbox, and in which format.

Towards the sandbox (trusted data, untrusted reader): ordinary pickle. A
submitted function handed over as an argument (``step=ex04.tsp_layer``)
travels as a reference that the sandbox resolves to its own copy.

Back from the sandbox (untrusted data, trusted reader): never pickle. The
value is first reduced to plain pieces (numbers, strings, tensors, lists,
dicts, tagged records), written with ``torch.save`` and read with
``torch.load(weights_only=True)``, which only rebuilds tensors and basic
types. Whatever else a submission returns (a NumPy scalar, its own class)
arrives as an ``Unsendable`` that shows its type and repr, so a type check in
a graded test fails with a readable message instead of running its code.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
import struct
from fractions import Fraction
from types import SimpleNamespace

import torch

_MAX_DEPTH = 64
_LENGTH = struct.Struct("!Q")


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


def _rebuild(obj):
    if isinstance(obj, list):                  # never produced bare by _plain, but harmless
        return [_rebuild(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    tag, v = obj.get("~"), obj.get("v")
    if tag == "tuple":
        return tuple(_rebuild(x) for x in v)
    if tag == "list":
        return [_rebuild(x) for x in v]
    if tag == "set":
        return {_rebuild(x) for x in v}
    if tag == "frozenset":
        return frozenset(_rebuild(x) for x in v)
    if tag == "dict":
        return {_rebuild(k): _rebuild(x) for k, x in v}
    if tag == "fraction":
        return Fraction(int(v[0]), int(v[1]))
    if tag == "bytes":
        return bytes(v.tolist())
    if tag == "complex":
        return complex(float(v[0]), float(v[1]))
    if tag == "dtype":
        return getattr(torch, str(v).removeprefix("torch."))
    if tag == "record":
        return Record(**{str(k): _rebuild(x) for k, x in v.items()})
    if tag == "opaque":
        return Unsendable(str(obj.get("type")), str(obj.get("repr")))
    raise ValueError(f"unknown value tag {tag!r} from the sandbox")


def to_grader(obj) -> bytes:
    """Serialise a reply inside the sandbox (a dict of plain pieces)."""
    buf = io.BytesIO()
    torch.save(_plain(obj), buf)
    return buf.getvalue()


def from_sandbox(data: bytes):
    """Read a reply on the trusted side: tensors and basic types only, nothing that runs code."""
    return _rebuild(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"))


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


def _recv_exactly(sock, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the sandbox closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
