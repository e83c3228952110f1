"""A decode step with fixed shapes, compiled once: gpt-fast's answer to a small model's per-call cost.

A batch-1 decode step of SmolLM2 makes about 1,300 operator calls from
Python, and each costs microseconds of dispatch whatever its size: on a
2-core CPU that fixed cost is about as long as reading the weights
(docs/benchmarks.md, "weights"). A compiler removes most of it: Inductor
turns the whole step into one generated C++ function that calls the weight
kernels and fuses the small operators between them (norms, RoPE, softmax,
the residual adds) into a few loops.

A compiler wants the same shapes at every call, and the plain decode step
changes shape every token (its keys grow by one). So this step, like
gpt-fast's, sees the whole cache every time: a buffer of ``capacity`` rows
per layer, the new token's keys and values written at its position
(``index_copy_``), and the attention masked to the positions written so
far. The extra rows cost a few dot products each; the shapes never change,
so the step compiles once per batch size and capacity.

The arithmetic is the model's own (``Block.qkv``, ``Block.finish``, the
same weights and kernels); only the attention is PyTorch's fused kernel
over the masked buffer instead of the model's attention function. Greedy
tokens match the eager path (tested); logits agree to rounding.

Use it through ``generate(..., compile=True)`` or ``python -m toyllm
generate --compile jit``. The eager path stays the
one the lessons read; this one is an engine option.

``generate(..., compile="ahead")`` compiles the same step ahead of time
instead: ``torch.export`` captures it as a graph and AOTInductor builds a
shared library from it, which the step then calls with no Python tracing
machinery (no guards to check) between the calls. Its weight kernels must
be ATen operators (float32, int8, int4): AOTInductor cannot call back into
Python, which FBGEMM's and oneDNN's packed formats (fp16, bf16) need.

What triggers a compile. The buffers hold a bucket of tokens, not the
request's exact length: the prompt plus the new tokens rounded up to the
next of 64, 96, 128, 192, 256, 384, ... (``capacity_bucket``: each a power of
two or one and a half times one, up to the model's max_context), so a step
holds at most 1.5 times the rows it needs beyond the smallest bucket. Each
extra row costs time at every step, because the attention reads the whole
masked buffer: on a quiet 2-core Intel Xeon, SmolLM2 int4's step took 1.67x
as long at capacity 256 as at 69 (docs/benchmarks.md), which is why the
buckets are this fine. So a new prompt length or token count compiles nothing while
it stays in its bucket; a compile happens for a new (weight format, batch
size, bucket), once per process for ``compile=True`` and once per machine
for ``compile="ahead"``: its package is kept in the cache folder
(``toyllm.compile_cache``), keyed by everything that changes the compiled
code (the model file's sha256, or the weights' own for a model not read from
a file; the weight format; batch; bucket; the model's shape; torch's
version; the CPU capability PyTorch found; ``COMPILED_STEP_VERSION``), and a
later process loads it in seconds. Just-in-time steps get Inductor's own
cache in the same folder, which saves the C++ compiler's work on a second
run but still traces the model (docs/benchmarks.md gives the seconds).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import platform
import time
import unittest.mock
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from . import compile_cache
from .attention import group_queries
from .quant import weight_format

# Inductor's settings for the step: treat the weights as constants (freezing lets it prepack them for
# its kernels and fold what depends only on them) and call the kernels from generated C++, not Python.
INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True}
COMPILE_MODES = (True, "ahead")   # generate(compile=...): just in time (torch.compile) or ahead of time (AOTInductor)
# Part of every cache key: change it whenever _forward or the options above change what is compiled, so that
# packages kept from an older toyllm are not loaded.
COMPILED_STEP_VERSION = 1
SMALLEST_BUCKET = 64              # tokens: the smallest capacity a compiled step is built for


def capacity_bucket(tokens: int, max_context: int) -> int:
    """The capacity (tokens) a compiled step for ``tokens`` tokens is built for: the smallest of 64, 96, 128,
    192, 256, 384, ... (from ``SMALLEST_BUCKET``, each a power of two or 1.5 times one) that holds them, at
    most ``max_context``. Two buckets per doubling: one more compile each, kept on disk, against at most
    half as many rows again at every step."""
    if not 1 <= tokens <= max_context:
        raise ValueError(f"a compiled step holds 1 to max_context={max_context} tokens, asked for {tokens}")
    bucket = SMALLEST_BUCKET
    while bucket < tokens:
        power_of_two = bucket & (bucket - 1) == 0
        bucket = bucket * 3 // 2 if power_of_two else bucket * 4 // 3
    return min(bucket, max_context)


def check_ahead_of_time(model) -> None:
    """Raise a ValueError unless every weight kernel of ``model`` is an ATen operator AOTInductor can call."""
    untraceable = sorted({type(m).__name__ for m in model.modules() if getattr(m, "traceable", True) is False})
    if untraceable:
        raise ValueError(f"compile='ahead' needs weight kernels that are ATen operators (formats fp32, int8, "
                         f"int4); this model has {', '.join(untraceable)}, which calls back into Python")


def weights_identity(model) -> str:
    """What names the model's weights in a cache key: the sha256 of the GGUF file it was read from
    (``load_model`` records the path), else a sha256 of its tensors (a randomly initialised preset).
    A model whose weights are changed after loading must not claim its file: leave ``gguf_path`` unset."""
    path = getattr(model, "gguf_path", None)
    if path:
        return "gguf sha256:" + compile_cache.file_digest(path)
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        tensors = {**module._parameters, **module._buffers,
                   **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        for attr, t in sorted(tensors.items()):
            if t is not None:
                digest.update(f"{name}.{attr}:{t.dtype}:{tuple(t.shape)}".encode())
                digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "tensors sha256:" + digest.hexdigest()


def step_key(model, batch: int, capacity: int) -> dict:
    """Everything that changes an ahead-of-time step's compiled code: the key of its cache entry."""
    return {"step_version": COMPILED_STEP_VERSION, "weights": weights_identity(model),
            "format": weight_format(model), "config": dataclasses.asdict(model.config), "batch": batch,
            "capacity": capacity, "device": model.rope_cos.device.type, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            "system": platform.system()}


class _Step(torch.nn.Module):
    """The decoder's step as a module, the form ``torch.export`` takes (the model's weights are its state)."""

    def __init__(self, decoder: "CompiledDecoder", model):
        super().__init__()
        self.model, self.decoder = model, decoder

    def forward(self, ids, pos, k_buf, v_buf):
        return self.decoder._forward(ids, pos, k_buf, v_buf)


class CompiledDecoder:
    """``model``'s decode step for ``batch`` sequences of up to ``capacity`` tokens, compiled at the first step.

    ``prefill(ids)`` runs a prompt (B, T) eagerly through the same function
    and fills the buffers; ``step(tokens)`` feeds one token per sequence
    (B, 1) through the compiled step. Both return float32 logits (B, vocab).
    ``reset()`` starts over (the old rows stay but are masked out).
    ahead_of_time: compile with ``torch.export`` and AOTInductor (see the
    module's docstring) instead of ``torch.compile``.
    cache: keep the compiled step in the cache folder and load it from there
    (``toyllm.compile_cache``); False compiles and keeps nothing.
    ``build()`` compiles (or loads) now; otherwise the first step does.
    ``report`` then says how it went (``compile_cache.CompileReport``).
    """

    def __init__(self, model, capacity: int, batch: int = 1, ahead_of_time: bool = False, cache: bool = True):
        cfg = model.config
        if not 1 <= capacity <= cfg.max_context:
            raise ValueError(f"capacity must be between 1 and max_context={cfg.max_context} tokens, got {capacity}")
        # a weak reference: the decoders are kept per model (``compiled_decoder``), and a strong one from
        # there would keep every model ever compiled alive
        self._model, self.batch = weakref.ref(model), batch
        # Exactly what was asked for, not rounded up: every row past the last token still costs each step
        # time (SmolLM2 int8, a 69-token request: its step over 256 rows ran about 1.4x slower than over
        # 69, measured), so a request of another length compiles its own step.
        self.capacity = capacity
        device = model.rope_cos.device
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, self.capacity, cfg.head_dim)
        # zeros, not empty: a masked row still meets the softmax's zero weight, and 0 * NaN would be NaN
        self.k = torch.zeros(shape, device=device)                       # (L, B, Hkv, capacity, D)
        self.v = torch.zeros(shape, device=device)
        self.length = 0                                                  # tokens written so far
        # The step's token input: one tensor, always the same, so the compiled step sees the same strides at
        # every call (a column sliced from generate's (B, T + n) buffer has strides that change with T + n,
        # and torch.compile would compile again for each)
        self._tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1)
        if ahead_of_time:
            check_ahead_of_time(model)
        self.ahead_of_time, self.cache = ahead_of_time, cache
        self._compiled = None                                            # built by build(), or at the first step
        self.report: compile_cache.CompileReport | None = None

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        """Logits (B, vocab) of the last of ids (B, T) at positions pos (T,), after the rows before pos[0]."""
        model = self._model()
        x = model.tok_emb(ids)                                           # (B, T, d_model)
        cos, sin = model.rope_cos[pos], model.rope_sin[pos]              # (T, D/2)
        cfg = model.config
        B, T = ids.shape
        group = cfg.n_heads // cfg.n_kv_heads
        # The G query heads that share a K/V head become G*T rows of one query block (group_queries), so
        # the attention reads each cached row once, where copying K and V out to every query head would
        # write the whole buffer again on every layer of every step. Row g*T + t is token t.
        visible = model.position_ids[:self.capacity][None, :] <= pos[:, None]   # (T, capacity)
        visible = visible.repeat(group, 1)                               # (G*T, capacity)
        for i, layer in enumerate(model.layers):
            q, k, v = layer.qkv(x, cos, sin)                             # (B, H, T, D), (B, Hkv, T, D) x 2
            k_buf[i].index_copy_(2, pos, k)
            v_buf[i].index_copy_(2, pos, v)
            heads = F.scaled_dot_product_attention(group_queries(q, cfg.n_kv_heads), k_buf[i], v_buf[i],
                                                   attn_mask=visible)    # (B, Hkv, G*T, D)
            x = layer.finish(x, layer.project(heads.reshape(B, cfg.n_heads, T, cfg.head_dim)))
        return model.head(x[:, -1:])[:, -1]                              # (B, vocab)

    def _positions(self, n: int) -> torch.Tensor:
        if self.length + n > self.capacity:
            raise ValueError(f"the compiled step holds {self.capacity} tokens and has {self.length}; "
                             f"cannot add {n}")
        pos = self._model().position_ids[self.length:self.length + n]
        self.length += n
        return pos

    def _check(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.shape[0] != self.batch:
            raise ValueError(f"ids must have shape ({self.batch}, tokens) for this compiled step, "
                             f"got {tuple(ids.shape)}")

    def reset(self) -> None:
        self.length = 0

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run prompts ids (B, T) eagerly; returns the last position's logits (B, vocab)."""
        self._check(ids)
        return self._forward(ids, self._positions(ids.shape[1]), self.k, self.v)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One compiled decode step for tokens (B, 1); returns logits (B, vocab). The first call compiles."""
        self._check(tokens)
        if tokens.shape[1] != 1:
            raise ValueError(f"a decode step takes one token per sequence, got {tokens.shape[1]}")
        if self._compiled is None:
            self.build()
        self._tokens.copy_(tokens)
        return self._compiled(self._tokens, self._positions(1), self.k, self.v)

    @torch.inference_mode()
    def build(self) -> "compile_cache.CompileReport":
        """Compile the step now (or load it from the cache); returns how, and in how many seconds."""
        if self.report is not None:
            return self.report
        model = self._model()
        # An example step at the last row: that row is masked until a token is written there, which
        # overwrites it, so the rows of a prompt already prefilled are left as they are.
        tokens, pos = self._tokens, model.position_ids[self.capacity - 1:self.capacity]
        if self.ahead_of_time:
            self._compiled, self.report = compile_cache.load_or_build(
                step_key(model, self.batch, self.capacity), lambda path: self._compile_ahead(tokens, pos, path),
                lambda path: torch._inductor.aoti_load_package(str(path)), use_cache=self.cache)
            return self.report
        folder = compile_cache.inductor_cache_dir() if self.cache else None
        compiled = torch.compile(self._forward, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        from torch._dynamo.utils import counters

        hits = counters["inductor"]["fxgraph_cache_hit"]
        t0 = time.perf_counter()
        with _inductor_cache(folder):
            compiled(tokens, pos, self.k, self.v)                        # compiles, then runs once
        self._compiled = compiled
        # A hit in Inductor's cache skips code generation and the C++ compiler; tracing the model still runs.
        how = "loaded" if counters["inductor"]["fxgraph_cache_hit"] > hits else "compiled"
        self.report = compile_cache.CompileReport(how, time.perf_counter() - t0, "jit", self.cache, folder)
        return self.report

    def _compile_ahead(self, tokens: torch.Tensor, pos: torch.Tensor, path: Path) -> None:
        """Export the step for these shapes and build it with AOTInductor into the package ``path``."""
        model = self._model()
        # export traces outside inference mode (its tensors would become constants it cannot name), with
        # ordinary copies of the example inputs
        with torch.inference_mode(False), torch.no_grad():
            program = torch.export.export(_Step(self, model), (tokens.clone(), pos.clone(), self.k, self.v),
                                          strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs={"freezing": True})


@contextlib.contextmanager
def _inductor_cache(folder: Path | None):
    """Point Inductor's own cache (``TORCHINDUCTOR_CACHE_DIR``, read at each use) at ``folder`` for a while;
    None turns its caches off meanwhile (``--no-cache``: compile afresh, keep nothing)."""
    if folder is None:
        import torch._inductor.config

        with torch._inductor.config.patch(force_disable_caches=True):
            yield
        return
    with unittest.mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": str(folder)}):
        yield


# One compiled step per (model, batch, bucket), kept as long as the model lives: compiling takes tens of
# seconds, and a second generate() call of the same model should not pay it again.
_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_decoder(model, tokens: int, batch: int = 1, ahead_of_time: bool = False,
                     cache: bool = True) -> CompiledDecoder:
    """The model's compiled decoder for ``batch`` sequences of up to ``tokens`` tokens, reset, made once per
    bucket (``capacity_bucket``). ``cache``: see ``CompiledDecoder``; it matters only when the step is built."""
    decoders = _DECODERS.setdefault(model, {})
    key = (batch, capacity_bucket(tokens, model.config.max_context), ahead_of_time)
    if key not in decoders:
        decoders[key] = CompiledDecoder(model, key[1], batch, ahead_of_time, cache)
    decoder = decoders[key]
    decoder.reset()
    return decoder
