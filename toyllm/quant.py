"""Weight formats: the same model with fewer bytes per weight.

Decoding one token multiplies every weight matrix by one vector, so each
weight is read once per token and does two floating-point operations: far
too little arithmetic to hide the memory traffic. A decode step therefore
takes at least (bytes of weights) / (memory bandwidth) seconds, and fewer
bytes per weight lower that floor in proportion. How much of it a format
gains in practice depends on its kernel, and the kernel on the CPU: the
same PyTorch picks different code on an AVX2 machine and on one with
AVX-512 (and AMX), so a format's gain over float32 moves from machine to
machine. docs/benchmarks.md (section "weights") records each format's
tokens/s, its share of the floor and the CPU it ran on; run
``python -m toyllm bench --only weights`` for this machine's figures.

Formats (``WEIGHT_FORMATS``), all for the matrices of ``nn.Linear`` layers:

- "fp32": 4 bytes per weight, the reference (the model as loaded).
- "bf16": 2 bytes; bfloat16 keeps float32's exponent range and 8 bits of
  mantissa. Each matmul casts its input to bfloat16 and its output back.
- "fp16": 2 bytes; half precision, with 11 bits of mantissa but a range up
  to 65504 (plenty for these weights). FBGEMM's kernel reads half-precision
  weights and keeps the activations in float32.
- "int8": 1 byte plus a bfloat16 scale per output channel (row):
  ``w[o, i] ~= scale[o] * q[o, i]`` with ``q`` in [-127, 127] and
  ``scale[o] = max_i |w[o, i]| / 127``; weight-only, as in gpt-fast: the
  activations are not quantized.
- "int4": 4 bits per weight, in blocks of 32 consecutive weights of a row
  that share a scale and a minimum (both bfloat16):
  ``w ~= scale * q + minimum`` with ``q`` in [0, 15], 0.625 bytes per
  weight in all. This is exactly the GGUF file's own Q4_1 layout, so for
  SmolLM2 it finds the file's 4-bit codes again (only the scales round to
  bfloat16). Weight-only too: the activations are rounded to bfloat16. The
  output projection stays int8, as the file keeps it at 8 bits
  (``OUTPUT_FORMAT``).

Only the linear layers change. Norms, RoPE, attention, the residual stream
and the logits stay float32; the embedding table stays float32 too (a
decode step reads one row of it). With tied embeddings the output
projection gets its own converted copy of the table.

The kernels: PyTorch has several CPU paths for each format, and at batch 1
they differ by large factors. Used here, the fastest measured on an x86 CPU
that keep the accuracy: oneDNN's prepacked linear for bf16, FBGEMM's
(``torch.ops.quantized``) for fp16, ``torch.ops.aten._weight_int8pack_mm``
for int8, ``torch.ops.aten._weight_int4pack_mm_for_cpu`` for int4. Where
oneDNN or FBGEMM is missing (an ARM laptop has no FBGEMM), bf16 and fp16
fall back to ``F.linear`` in that type: the same results up to rounding,
maybe slower.
"""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")
BYTES_PER_WEIGHT = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.625}   # int4: 4 bits + 2 bf16 per 32


def check_weight_format(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format weights={weights!r}; choose one of {list(WEIGHT_FORMATS)}")


def _fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _ConvertedLinear(nn.Module):
    """Base of the converted layers: ``forward(x (..., in)) -> (..., out)`` in float32, like ``nn.Linear``.

    exact_top (for an output projection): kernels that write bfloat16
    outputs round a logit near 25 to a multiple of 0.125, and the two best
    tokens can be closer than that (SmolLM2's first answer token to "What is
    the capital of France?" leads by 0.08), so rounding alone could change a
    greedy choice. With exact_top=k the k largest outputs of each row are
    recomputed in float32 from the same stored weights: a (k, in) slice, a
    negligible read next to the whole matrix.
    """

    fmt = "fp32"
    kernel = "F.linear"
    bf16_outputs = False     # does the kernel round its outputs to bfloat16 (so exact_top applies)?

    def __init__(self, in_features: int, out_features: int, exact_top: int = 0):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.exact_top = min(exact_top, out_features)
        self._register()

    def _register(self) -> None:
        self.key = key = next(_KEYS)
        _LAYERS[key] = weakref.ref(self, lambda _: _LAYERS.pop(key, None))

    def __setstate__(self, state):
        super().__setstate__(state)
        self._register()                 # a new process (the grader's sandbox) has its own table

    # Can a compiler trace ``product`` (plain tensors and ATen operators)? If not, a compiled graph calls
    # it as one opaque operator (``converted_linear``), which costs a call back into Python.
    traceable = False

    def forward(self, x):
        """``product(x)``; inside a compiled graph, as one opaque operator unless the compiler can trace it."""
        if torch.compiler.is_compiling() and not self.traceable:
            return torch.ops.toyllm.converted_linear(x, self.key)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) times the weights: (..., out) float32."""
        raise NotImplementedError

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights (and scales) a matrix-vector product reads."""
        return self.in_features * self.out_features * BYTES_PER_WEIGHT[self.fmt]

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The stored weights of output channels ``index`` (...,) as float32 (..., in)."""
        raise NotImplementedError

    def _exact_top(self, x, y):
        if self.exact_top:
            top = y.topk(self.exact_top, dim=-1).indices                     # (..., k)
            y.scatter_(-1, top, (self.rows(top) @ x.float().unsqueeze(-1)).squeeze(-1))
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"
                + (f", exact_top={self.exact_top}" if self.exact_top else ""))


class BF16Linear(_ConvertedLinear):
    """bfloat16 weights; each call rounds its input to bfloat16, and the kernel writes bfloat16 outputs."""

    fmt = "bf16"
    bf16_outputs = True

    def __init__(self, weight: torch.Tensor, exact_top: int = 0):
        super().__init__(weight.shape[1], weight.shape[0], exact_top)
        self.weight = weight.detach().to(torch.bfloat16).contiguous()      # (out, in)
        if _onednn_bf16():
            try:   # a private op: prepacking puts the weight in oneDNN's blocked layout once, not every call
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
                self.kernel = "onednn"
                self(torch.zeros(1, self.in_features))
            except (RuntimeError, AttributeError):
                self.kernel = "F.linear"
        if self.kernel == "onednn" and not self.exact_top:
            self.weight = None                                              # the packed copy is all it reads

    def rows(self, index):
        return self.weight[index].float()

    def product(self, x):
        xb = x.to(torch.bfloat16)
        if self.kernel == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(xb, self.packed, None, "none", [], "")
        else:
            y = F.linear(xb, self.weight)
        return self._exact_top(x, y.float())


class FP16Linear(_ConvertedLinear):
    """float16 weights. FBGEMM's kernel keeps the activations and outputs in float32."""

    fmt = "fp16"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        if _fbgemm():
            self.kernel = "fbgemm"
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)
        else:
            self.weight = weight.detach().to(torch.float16).contiguous()

    def product(self, x):
        if self.kernel == "fbgemm":
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return F.linear(x.to(torch.float16), self.weight).float()


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per output channel: (q (out, in) int8, scale (out,) float32)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0                  # (out,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
    return q, scale


class Int8Linear(_ConvertedLinear):
    """Weight-only int8: int8 weights with per-channel scales, bfloat16 activations, the kernel gpt-fast uses.

    ``torch.ops.aten._weight_int8pack_mm`` converts each weight to the
    activations' type as it reads it. With float32 activations it has no
    fast path (about 100x slower here), so inputs are rounded to bfloat16 and
    outputs come back in bfloat16 (hence exact_top for the logits).
    FBGEMM's dynamic int8 kernel measured faster still, but it quantizes
    the activations too, with one scale for the whole input: SmolLM2's
    outlier activations then cost too much accuracy (under half of the
    teacher-forced top-1 predictions kept), so it is not used.
    """

    fmt = "int8"
    kernel = "int8pack"
    bf16_outputs = True
    traceable = True          # an ATen operator on plain tensors: Inductor compiles it with the rest

    def __init__(self, weight: torch.Tensor, exact_top: int = 0):
        super().__init__(weight.shape[1], weight.shape[0], exact_top)
        q, scale = int8_per_channel(weight)                                 # (out, in), (out,)
        # buffers, not plain attributes: they move with the module, and torch.export sees them as its state
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale.to(torch.bfloat16), persistent=False)

    @property
    def weight_nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def rows(self, index):
        return self.q[index].float() * self.scale[index, None].float()

    def product(self, x):
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.q, self.scale)
        return self._exact_top(x, y.float().view(*shape[:-1], self.out_features))


INT4_BLOCK = 32   # weights per int4 block (a row's 32 consecutive inputs), as in GGUF's Q4_0/Q4_1


def int4_blocks(weight: torch.Tensor, block: int = INT4_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization in blocks of ``block`` inputs: (q (out, in) uint8 in [0, 15], scale, minimum).

    scale and minimum are (out, in // block) float32, and ``w ~= scale * q + minimum``
    blockwise: the minimum maps to 0 and the maximum to 15. A GGUF Q4_1 block
    was made the same way, so its dequantized values give back its own codes.
    """
    out_features, in_features = weight.shape
    if in_features % block:
        raise ValueError(f"int4 needs the input size to be a multiple of {block}; this layer has {in_features} inputs")
    w = weight.detach().float().reshape(out_features, in_features // block, block)   # (out, blocks, block)
    low, high = w.amin(-1), w.amax(-1)                                               # (out, blocks)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(out_features, in_features), scale, low


class Int4Linear(_ConvertedLinear):
    """Weight-only int4 in blocks of 32 (GGUF's Q4_1 layout), bfloat16 activations.

    ``torch.ops.aten._weight_int4pack_mm_for_cpu`` reads the codes in its own
    packed layout and computes ``scale * (q - 8) + zero`` per block, so the
    zero it is given is ``minimum + 8 * scale``. Like int8's kernel it is fast
    only with bfloat16 activations (float32 ones measured about 30x slower)
    and writes bfloat16 outputs. It is not used for the output projection
    (see ``OUTPUT_FORMAT``), so it needs no exact_top.
    """

    fmt = "int4"
    kernel = "int4pack"
    bf16_outputs = True
    traceable = True          # an ATen operator on plain tensors, like int8's

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        q, scale, low = int4_blocks(weight)                                   # (out, in), (out, blocks) x2
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1),
                             persistent=False)
        self.register_buffer("scale_and_zero", torch.stack([scale, low + 8 * scale], -1).transpose(0, 1)
                             .contiguous().to(torch.bfloat16), persistent=False)            # (blocks, out, 2)

    @property
    def weight_nbytes(self) -> int:
        return self.packed.nbytes + self.scale_and_zero.nbytes

    def product(self, x):
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed,
                                                      INT4_BLOCK, self.scale_and_zero)
        return y.float().view(*shape[:-1], self.out_features)


# The converted layers by key, for the operator that calls them from a compiled graph (toyllm.compiled).
# The compiler cannot trace their kernels' arguments (FBGEMM's and oneDNN's packed weights are opaque
# objects), so a compiled step calls each layer's own product through this operator: the same kernel and
# the same results as eager, with the small operators around it fused.
_KEYS = itertools.count()
_LAYERS: dict[int, "weakref.ref[_ConvertedLinear]"] = {}


@torch.library.custom_op("toyllm::converted_linear", mutates_args=())
def converted_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    """The product of converted layer ``key`` with x (..., in): (..., out) float32."""
    return _LAYERS[key]().product(x)


@converted_linear.register_fake
def _(x, key):
    return x.new_empty((*x.shape[:-1], _LAYERS[key]().out_features))


EXACT_TOP_LOGITS = 32   # logits per row recomputed in float32 when a projection writes bfloat16 (_ConvertedLinear)
CONVERTERS = {"bf16": BF16Linear, "fp16": FP16Linear, "int8": Int8Linear, "int4": Int4Linear}
# The output projection's format, where it differs from the layers'. SmolLM2's GGUF file keeps this
# matrix (tied to the embedding table) at 8 bits, Q8_0, while its layers are Q4_1: at 4 bits the
# logits move enough to change the greedy answer to "What is the capital of France?" (measured:
# "L" overtakes "The" as the first token), at 8 bits they do not.
OUTPUT_FORMAT = {"int4": "int8"}


@torch.no_grad()
def convert_linears(model: nn.Module, weights: str) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by its ``weights`` format; returns the model.

    "fp32" leaves the model as it is. A tied output projection gets its own
    converted copy; the embedding table it shared stays float32. The output
    projection takes ``OUTPUT_FORMAT[weights]`` where that exists.
    """
    check_weight_format(weights)
    if weights == "fp32":
        return model
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                if child.bias is not None:
                    raise ValueError(f"{name}.{child_name} has a bias; only bias-free linears are converted")
                head = child_name == "lm_head"
                convert = CONVERTERS[OUTPUT_FORMAT.get(weights, weights) if head else weights]
                exact = head and convert.bf16_outputs
                extra = {"exact_top": EXACT_TOP_LOGITS} if exact else {}
                setattr(module, child_name, convert(child.weight, **extra))
    model.weight_format = weights
    return model


def weight_format(model: nn.Module) -> str:
    """The format ``convert_linears`` gave ``model`` ("fp32" if none)."""
    return getattr(model, "weight_format", "fp32")


def linear_kernel(model: nn.Module) -> str:
    """The kernels the weight products run on, joined by "+" where the output projection has its own
    (int4: "int4pack+int8pack"); "F.linear" for float32 weights."""
    kernels = dict.fromkeys(m.kernel for m in model.modules() if isinstance(m, _ConvertedLinear))
    return "+".join(kernels) or "F.linear"


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The linear layers of ``model``, float32 (``nn.Linear``) or converted, in the order of ``model.modules()``."""
    return [m for m in model.modules() if isinstance(m, (nn.Linear, _ConvertedLinear))]


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the linear layers' weights (and scales): what one decode step must read, besides the KV cache."""
    return sum(m.weight.numel() * m.weight.element_size() if isinstance(m, nn.Linear) else m.weight_nbytes
               for m in linear_layers(model))
