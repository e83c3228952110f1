"""KV caches: keep each layer's keys and values so decoding never recomputes them.

Every cache implements the ``KVCache`` protocol, so generation, serving and
the disaggregated handover use any of them (this module's two and
``toyllm.paged.PagedKVCache``) without reading their insides:

- ``cache.update(layer, k, v)`` appends this call's K and V, shaped
  (B, Hkv, T, D), to layer ``layer`` and returns all of that layer's K and V
  so far, (B, Hkv, S, D).
- ``cache.length`` is the number of tokens the cache holds (after a whole
  forward pass has updated every layer).
- ``cache.keys(layer)`` / ``cache.values(layer)`` read a layer back.
- ``cache.batch_size`` and ``cache.free_tokens`` say which batch it takes
  and how many more tokens fit, so a request is refused before any work.

``DynamicKVCache`` grows by concatenation: simple, but each append copies the
whole layer (with ``headroom``, only every few appends). ``StaticKVCache``
preallocates one buffer per layer, as an accelerator without dynamic shapes
must, and makes appending free.
"""
from __future__ import annotations

import math
from typing import Iterator, Protocol, runtime_checkable

import torch

from .answers import shortcut
from .checks import check_int
from .model import ModelConfig


@runtime_checkable
class KVCache(Protocol):
    """What every KV cache offers: the interface ``generate``, ``serve`` and ``serve_disaggregated`` rely on.

    Sizes are in tokens (rows per sequence and K/V head); tensors are
    (B, Hkv, S, D): batch, K/V heads, tokens, head dimension.
    """

    kind: str                       # its name in messages ("dynamic", "static", "paged")
    n_layers: int

    @property
    def length(self) -> int:
        """Tokens held (after a whole forward has updated every layer)."""

    @property
    def batch_size(self) -> int | None:
        """Sequences it holds or was built for; None while a cache that takes any batch is still empty."""

    @property
    def free_tokens(self) -> float:
        """Tokens it can still take per sequence (``math.inf`` for a cache that grows without limit)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, Hkv, T, D) to ``layer``; return all of the layer's keys and values (B, Hkv, S, D)."""

    def keys(self, layer: int) -> torch.Tensor | None:
        """The layer's keys held, (B, Hkv, S, D)."""

    def values(self, layer: int) -> torch.Tensor | None:
        """The layer's values held, (B, Hkv, S, D)."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values), each (B, Hkv, S, D)."""


def copy_into(src: KVCache, dst: KVCache) -> KVCache:
    """Append every layer of ``src`` to ``dst`` (the rows copied into dst's own storage); returns ``dst``."""
    if src.n_layers != dst.n_layers:
        raise ValueError(f"cannot copy a cache of {src.n_layers} layers into one of {dst.n_layers}")
    if src.length > dst.free_tokens:
        raise ValueError(f"the {dst.kind} cache has room for {dst.free_tokens} more tokens, "
                         f"not the {src.length} of the {src.kind} cache copied into it")
    for layer in range(src.n_layers):
        dst.update(layer, src.keys(layer), src.values(layer))
    return dst


class DynamicKVCache:
    """A cache that grows as tokens arrive: every append allocates and copies, unless it has headroom.

    With ``headroom`` = 0 (the default, the KV-cache blog's cache) each append
    is a ``torch.cat``: a new buffer per layer, the whole cache copied into it.
    With ``headroom`` = h > 0 a growth copies the cache into a buffer with h
    spare rows per sequence and K/V head, and the next appends (up to h
    tokens) write into them in place: one copy every h + 1 decode steps, as a
    Python list over-allocates to append in amortised constant time. Either
    way the rows of each sequence and head lie together, at most h spare rows
    before the next ones, which a batched matrix product reads fastest
    (``toyllm.bench.decode.window_products`` measures it; a static cache's slots are
    sized for the longest sequence). ``copies`` counts
    the growths that copied held rows; ``copied_rows`` the rows they moved
    (per sequence and head, K and V counted once).
    """

    kind = "dynamic"

    def __init__(self, n_layers: int, headroom: int = 0):
        self.n_layers = n_layers
        self.headroom = check_int(headroom, "headroom must be a whole number of rows >= 0", 0)
        self._k: list[torch.Tensor | None] = [None] * n_layers     # per layer: (B, Hkv, rows, D), rows >= held
        self._v: list[torch.Tensor | None] = [None] * n_layers
        self._len = [0] * n_layers                                  # per layer: rows held
        self.copies = self.copied_rows = 0

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_tokens: int | None = None, headroom: int = 0, **_) -> "DynamicKVCache":
        return cls(cfg.n_layers, headroom)

    @property
    def length(self) -> int:
        return self._len[-1]

    @property
    def batch_size(self) -> int | None:
        """The batch of the first append; None before it (an empty cache takes any batch)."""
        return None if self._k[0] is None else self._k[0].shape[0]

    @property
    def free_tokens(self) -> float:
        """``math.inf``: the cache grows as tokens arrive."""
        return math.inf

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        held, T = self._len[layer], k.shape[-2]
        first = self._k[layer] is None
        full = not first and held + T > self._k[layer].shape[-2]        # no room left: the held rows move
        if full:
            self.copies += 1
            self.copied_rows += held
        if self.headroom == 0:
            if full:
                k = torch.cat([self._k[layer], k], dim=-2)                # (B, Hkv, S, D): a new buffer
                v = torch.cat([self._v[layer], v], dim=-2)
            self._k[layer], self._v[layer] = k, v
        else:
            if first or full:
                self._grow(layer, k, held + T + self.headroom)
            self._k[layer][:, :, held:held + T] = k                         # in place, into the spare rows
            self._v[layer][:, :, held:held + T] = v
        self._len[layer] = held + T
        if self.headroom == 0:
            return self._k[layer], self._v[layer]          # exactly the rows held: nothing to slice off
        return self.keys(layer), self.values(layer)

    def _grow(self, layer: int, like: torch.Tensor, rows: int) -> None:
        """Move layer ``layer`` into new buffers of ``rows`` rows per sequence (the held rows copied)."""
        B, H, _, D = like.shape
        held = self._len[layer]
        # Plain tensors even inside generate's inference mode: the cache may be written in place
        # later, outside it, and an inference tensor refuses that.
        with torch.inference_mode(False):
            k_buf = torch.empty(B, H, rows, D, dtype=like.dtype, device=like.device)     # (B, Hkv, rows, D)
            v_buf = torch.empty_like(k_buf)
        if held:
            k_buf[:, :, :held] = self._k[layer][:, :, :held]
            v_buf[:, :, :held] = self._v[layer][:, :, :held]
        self._k[layer], self._v[layer] = k_buf, v_buf

    def keys(self, layer: int) -> torch.Tensor | None:
        """The rows held, (B, Hkv, S, D), a view without the spare rows; None before the first append."""
        k = self._k[layer]
        return None if k is None else k[:, :, :self._len[layer]]

    def values(self, layer: int) -> torch.Tensor | None:
        v = self._v[layer]
        return None if v is None else v[:, :, :self._len[layer]]

    @classmethod
    def from_layers(cls, layers) -> "DynamicKVCache":
        """A cache holding the given per-layer (k, v) pairs, each (B, Hkv, S, D), as they are (no copy)."""
        layers = list(layers)
        cache = cls(len(layers))
        for i, (k, v) in enumerate(layers):
            cache.update(i, k, v)
        return cache

    def __iter__(self):
        """Per-layer (keys, values), each (B, Hkv, S, D)."""
        return ((self.keys(i), self.values(i)) for i in range(self.n_layers))


class StaticKVCache:
    """A preallocated, left-padded KV buffer that makes appending pointer arithmetic.

    A static graph sees a fixed window of ``window`` = S-1 rows per K or V
    (S = the longest sequence served): the newest token sits at the right end,
    the rows to its left are padding until the cache fills. Appending means
    writing after the window and moving its start one row to the right. With
    ``reserve`` = 2 the buffer has 2(S-1) rows and the window never runs off
    the end, so no row is ever copied; a smaller reserve (e.g. 1.5) saves
    memory but must shift the whole window back to the start now and then.
    ``copies`` counts those shifts; ``copied_rows`` the rows they moved.
    """

    kind = "static"

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, window: int,
                 reserve: float = 2.0, batch: int = 1, dtype=torch.float32, device=None):
        if window < 1:
            raise ValueError(f"window (S-1) must be at least 1 token, got {window}")
        if not 1.0 < reserve <= 2.0:
            raise ValueError(f"reserve must be in (1, 2] times the window, got {reserve}")
        self.n_layers, self.window = n_layers, window
        self.capacity = max(window + 1, int(round(reserve * window)))     # rows per K or V
        shape = (n_layers, batch, n_kv_heads, self.capacity, head_dim)
        self.k_buf = torch.empty(shape, dtype=dtype, device=device)
        self.v_buf = torch.empty(shape, dtype=dtype, device=device)
        # Only the first window needs zeros: it is the padding the window starts on. Every later row is
        # written before any view reaches it, so zeroing it too (half the buffer with reserve 2) would
        # be wasted writes, 0.4 GB for a batch of 10000 blog-sized sequences.
        self.k_buf[:, :, :, :window].zero_()
        self.v_buf[:, :, :, :window].zero_()
        self._end = [window] * n_layers     # per layer: one past the newest row; window = buf[end-window:end]
        self._len = [0] * n_layers          # per layer: real (non-padding) rows in the window
        self.copies = 0
        self.copied_rows = 0

    @classmethod
    @shortcut("2.3",
              ships="sizes a buffer in tokens; its bytes, what Exercise 2.3 computes, are not in it")
    def for_model(cls, cfg: ModelConfig, max_tokens: int, reserve: float = 2.0, batch: int = 1, **kw) -> "StaticKVCache":
        """A cache for sequences of up to ``max_tokens`` tokens (S), holding S-1 of them."""
        if max_tokens < 2:
            raise ValueError(f"max_tokens (S) must be at least 2, got {max_tokens}")
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_tokens - 1, reserve, batch, **kw)

    @property
    def length(self) -> int:
        return self._len[-1]

    @property
    def batch_size(self) -> int:
        """The batch it was built for."""
        return self.k_buf.shape[1]

    @property
    def free_tokens(self) -> int:
        """Tokens that still fit in the window (S-1 in all)."""
        return self.window - self.length

    @property
    def nbytes(self) -> int:
        """Bytes reserved for K and V of every layer."""
        return self.k_buf.nbytes + self.v_buf.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        T = k.shape[-2]
        if self._len[layer] + T > self.window:
            raise ValueError(
                f"static cache too small: it holds {self.window} tokens (S-1) and already has "
                f"{self._len[layer]}; cannot add {T}. Build it with a larger max_tokens")
        end = self._end[layer]
        if end + T > self.capacity:
            # Out of reserved rows: shift the window back to the buffer's start (the one real copy).
            keep = self.window - T
            for buf in (self.k_buf[layer], self.v_buf[layer]):
                buf[:, :, :keep] = buf[:, :, end - keep:end].clone()
            self.copies += 1
            self.copied_rows += keep
            end = keep
        # this layer's buffers, (B, Hkv, capacity, D), picked once: the appends and the returned
        # windows are slices of them (each indexing is an operator call, paid by every decode step)
        k_buf, v_buf = self.k_buf[layer], self.v_buf[layer]
        k_buf[:, :, end:end + T] = k
        v_buf[:, :, end:end + T] = v
        self._end[layer] = end + T
        self._len[layer] += T
        start = end + T - self._len[layer]
        return k_buf[:, :, start:end + T], v_buf[:, :, start:end + T]

    def window_view(self, layer: int):
        """The fixed-size (B, Hkv, S-1, D) K and V a static graph would read, padding included."""
        end = self._end[layer]
        return self.k_buf[layer, :, :, end - self.window:end], self.v_buf[layer, :, :, end - self.window:end]

    def keys(self, layer: int) -> torch.Tensor:
        """The real rows only (padding would be masked out; slicing it away is equivalent)."""
        end = self._end[layer]
        return self.k_buf[layer, :, :, end - self._len[layer]:end]

    def values(self, layer: int) -> torch.Tensor:
        end = self._end[layer]
        return self.v_buf[layer, :, :, end - self._len[layer]:end]

    def __iter__(self):
        """Per-layer (keys, values), each (B, Hkv, S, D): the real rows only."""
        return ((self.keys(i), self.values(i)) for i in range(self.n_layers))


CACHES = {cache.kind: cache for cache in (DynamicKVCache, StaticKVCache)}


def make_cache(kind: str, cfg: ModelConfig, max_tokens: int, **kw) -> KVCache:
    """A cache of ``kind`` ("dynamic" or "static") for sequences of up to ``max_tokens`` tokens."""
    if kind not in CACHES:
        raise ValueError(f"unknown cache {kind!r}; choose one of {sorted(CACHES)}")
    return CACHES[kind].for_model(cfg, max_tokens, **kw)
