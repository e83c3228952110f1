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

Use it through ``generate(..., compile=True)``. The eager path stays the
one the lessons read; this one is an engine option.

``generate(..., compile="ahead")`` compiles the same step ahead of time
instead: ``torch.export`` captures it as a graph and AOTInductor builds a
shared library from it, which the step then calls with no Python tracing
machinery (no guards to check) between the calls. Its weight kernels must
be ATen operators (float32, int8, int4): AOTInductor cannot call back into
Python, which FBGEMM's and oneDNN's packed formats (fp16, bf16) need.
"""
from __future__ import annotations

import tempfile
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from .attention import group_queries

# Inductor's settings for the step: treat the weights as constants (freezing lets it prepack them for
# its kernels and fold what depends only on them) and call the kernels from generated C++, not Python.
INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True}
COMPILE_MODES = (True, "ahead")   # generate(compile=...): just in time (torch.compile) or ahead of time (AOTInductor)


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
    """

    def __init__(self, model, capacity: int, batch: int = 1, ahead_of_time: bool = False):
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
        if ahead_of_time:
            untraceable = sorted({type(m).__name__ for m in model.modules() if getattr(m, "traceable", True) is False})
            if untraceable:
                raise ValueError(f"compile='ahead' needs weight kernels that are ATen operators (formats fp32, int8, "
                                 f"int4); this model has {', '.join(untraceable)}, which calls back into Python")
            self._compiled = None                                          # built at the first step
        else:
            self._compiled = torch.compile(self._forward, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        self.ahead_of_time = ahead_of_time

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
        pos = self._positions(1)
        if self._compiled is None:
            self._compiled = self._compile_ahead(tokens, pos)
        return self._compiled(tokens, pos, self.k, self.v)

    def _compile_ahead(self, tokens: torch.Tensor, pos: torch.Tensor):
        """Export the step for these shapes and build it with AOTInductor; returns the loaded step."""
        model = self._model()
        # export traces outside inference mode (its tensors would become constants it cannot name), with
        # ordinary copies of the example inputs
        with torch.inference_mode(False), torch.no_grad():
            program = torch.export.export(_Step(self, model), (tokens.clone(), pos.clone(), self.k, self.v),
                                          strict=False)
        # the package is read once, at loading: its folder can go with this decoder
        self._package_dir = tempfile.TemporaryDirectory(prefix="toyllm-aot-")
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(Path(self._package_dir.name) / "step.pt2"),
            inductor_configs={"freezing": True})
        return torch._inductor.aoti_load_package(path)


# One compiled step per (model, batch, capacity), kept as long as the model lives: compiling takes tens of
# seconds, and a second generate() call of the same model should not pay it again.
_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_decoder(model, tokens: int, batch: int = 1, ahead_of_time: bool = False) -> CompiledDecoder:
    """The model's compiled decoder for ``batch`` sequences of up to ``tokens`` tokens, reset, made once."""
    decoders = _DECODERS.setdefault(model, {})
    key = (batch, tokens, ahead_of_time)
    if key not in decoders:
        decoders[key] = CompiledDecoder(model, tokens, batch, ahead_of_time)
    decoder = decoders[key]
    decoder.reset()
    return decoder
