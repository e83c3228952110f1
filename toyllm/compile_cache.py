"""Compiled decode steps kept on disk, so that a second process loads in seconds what the first compiled.

The cache is a folder: ``$TOYLLM_CACHE`` if set, else the user's cache folder
(``$XDG_CACHE_HOME/toyllm`` or ``~/.cache/toyllm`` on Linux,
``~/Library/Caches/toyllm`` on macOS, ``%LOCALAPPDATA%\\toyllm`` on Windows).
It holds:

- ``steps/<name>/``: one entry per compiled step, ``step.pt2`` (the
  AOTInductor package) and ``entry.json`` (the key it was built for, the
  package's size in bytes and sha256, the seconds compiling took). The name
  is a digest of the key, so a step compiled for anything else (another
  torch, another CPU, another model file) never meets this one;
- ``digests.json``: the sha256 of each model file, stored with its path,
  size and modification time, so an unchanged file is not read again;
- ``inductor/``: Inductor's own cache (``TORCHINDUCTOR_CACHE_DIR``) for the
  steps compiled just in time (``compile=True``);
- ``models/<name>/``: a model file as parsed by ``toyllm.weights`` (config,
  float32 weights, tokenizer): ``weights.pt``, ``tokenizer.json`` and
  ``entry.json`` (which holds the config), so that the
  next process does not parse the GGUF file again.

An entry is checked before it is used: its key must be the one asked for
and its package must have the recorded size and sha256. One that fails (a
foreign or stale entry, a truncated or damaged file) or does not load is
compiled again, with one line on stderr saying why. Entries are written
under a temporary name and renamed into place, so another process never
sees half of one. ``python -m toyllm cache list`` and ``cache clear`` show
and empty the folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CACHE_ENV = "TOYLLM_CACHE"          # where the cache lives, overriding the user's cache folder
PACKAGE, METADATA = "step.pt2", "entry.json"


def cache_root() -> Path:
    """The cache folder (it may not exist yet)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "toyllm"


def inductor_cache_dir() -> Path:
    """The folder given to Inductor's own cache for steps compiled just in time."""
    return cache_root() / "inductor"


def _write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` in one step: a temporary file beside it, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digest(path: str | Path) -> str:
    """The sha256 (hex) of the file ``path``, remembered in ``digests.json`` by path, size in bytes and
    modification time: a model file of 100 MB is read once, not at every run."""
    path = Path(path).resolve()
    stat = path.stat()
    store = cache_root() / "digests.json"
    try:
        known = json.loads(store.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    seen = known.get(str(path))
    if isinstance(seen, dict) and seen.get("bytes") == stat.st_size and seen.get("mtime_ns") == stat.st_mtime_ns:
        return seen["sha256"]
    digest = sha256_of_file(path)
    known[str(path)] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    try:
        _write_json_atomic(store, known)
    except OSError:
        pass                                # a read-only cache costs a re-read next time, nothing more
    return digest


def entry_name(key: dict, prefix: str = "step-") -> str:
    """The folder name of the entry for ``key``: a digest of the key, the same on every platform."""
    text = json.dumps(key, sort_keys=True)
    return prefix + hashlib.sha256(text.encode()).hexdigest()[:24]


def read_metadata(folder: Path) -> dict:
    """An entry's ``entry.json`` (OSError or ValueError if missing or unreadable)."""
    meta = json.loads((folder / METADATA).read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{folder / METADATA} holds no JSON object")
    return meta


def write_metadata(folder: Path, meta: dict) -> None:
    _write_json_atomic(folder / METADATA, meta)


def remove_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


@dataclass
class CompileReport:
    """How a compiled step came to be: ``how`` is "compiled" or "loaded" (from the cache), in ``seconds``."""
    how: str
    seconds: float
    mode: str                                    # "ahead" or "jit"
    cached: bool                                 # kept in (or loaded from) the cache folder
    path: Path | None = None                     # the entry's folder, if cached
    reason: str = ""                             # why an entry found was not used ("" if none was)

    def line(self) -> str:
        way = "ahead of time (AOTInductor)" if self.mode == "ahead" else "just in time (torch.compile)"
        if self.how == "loaded" and self.mode == "jit":
            return (f"decode step compiled {way} in {self.seconds:.1f} s, its generated code found in "
                    f"Inductor's cache ({self.path})")
        if self.how == "loaded":
            return f"decode step compiled {way}: loaded from the cache in {self.seconds:.1f} s ({self.path})"
        kept = (f"kept in {self.path}" if self.mode == "ahead" else f"Inductor's cache in {self.path}") \
            if self.cached else "not kept (--no-cache)"
        return f"decode step compiled {way} in {self.seconds:.1f} s; {kept}"

    def to_json(self) -> dict:
        return {"how": self.how, "seconds": self.seconds, "mode": self.mode, "cached": self.cached,
                "path": str(self.path) if self.path else None, "reason": self.reason}


def _entry_problem(folder: Path, key: dict) -> str:
    """Why the entry in ``folder`` cannot serve ``key`` ("" if it can)."""
    try:
        meta = json.loads((folder / METADATA).read_text())
    except FileNotFoundError:
        return f"it has no {METADATA}"
    except (OSError, ValueError) as e:
        return f"its {METADATA} cannot be read ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("key") != key:
        return "its metadata describes another step (a stale or foreign entry)"
    package = folder / PACKAGE
    if not package.is_file():
        return f"its {PACKAGE} is missing"
    size = package.stat().st_size
    if size != meta.get("bytes"):
        return f"its {PACKAGE} has {size} bytes, not the {meta.get('bytes')} written (truncated or replaced)"
    if sha256_of_file(package) != meta.get("sha256"):
        return f"its {PACKAGE} does not match its recorded sha256 (damaged)"
    return ""


def load_or_build(key: dict, build: Callable[[Path], None], load: Callable[[Path], object],
                  use_cache: bool = True) -> tuple[object, CompileReport]:
    """The step for ``key``: loaded from its cache entry, or built and kept there; and how (a ``CompileReport``).

    build(path): compile and write the package to ``path``; load(path): the
    callable step from a package. ``use_cache=False`` builds into a temporary
    folder and keeps nothing.
    """
    if not use_cache:
        with tempfile.TemporaryDirectory(prefix="toyllm-step-") as folder:
            t0 = time.perf_counter()
            build(Path(folder) / PACKAGE)
            step = load(Path(folder) / PACKAGE)      # the package is read once, at loading
            return step, CompileReport("compiled", time.perf_counter() - t0, "ahead", False)
    steps = cache_root() / "steps"
    final = steps / entry_name(key)
    reason = ""
    if final.exists():
        t0 = time.perf_counter()
        reason = _entry_problem(final, key)
        if not reason:
            try:
                step = load(final / PACKAGE)
                return step, CompileReport("loaded", time.perf_counter() - t0, "ahead", True, final)
            except Exception as e:                   # a package this torch cannot load, whatever the reason
                reason = f"it failed to load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        print(f"compile cache: rebuilding {final.name}: {reason}", file=sys.stderr)
    steps.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=steps, prefix=".building-"))
    try:
        t0 = time.perf_counter()
        build(building / PACKAGE)
        seconds = time.perf_counter() - t0
        package = building / PACKAGE
        _write_json_atomic(building / METADATA, {"key": key, "bytes": package.stat().st_size,
                                                 "sha256": sha256_of_file(package), "compile_s": seconds,
                                                 "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
        step = load(package)
        # Into place in one rename. Another process may have put its own there meanwhile: a good one is kept
        # (ours is dropped), a bad one replaced.
        if final.exists() and _entry_problem(final, key):
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(building, final)
        except OSError:
            pass                                     # another process's entry for the same key is in place
        return step, CompileReport("compiled", seconds, "ahead", True, final, reason)
    finally:
        shutil.rmtree(building, ignore_errors=True)


def list_entries() -> list[dict]:
    """Every entry of the cache: name, folder, bytes on disk, and its key (None if unreadable)."""
    steps = cache_root() / "steps"
    rows = []
    for folder in sorted(steps.iterdir()) if steps.is_dir() else []:
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            key = json.loads((folder / METADATA).read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            key = None
        rows.append({"name": folder.name, "path": str(folder), "bytes": _folder_bytes(folder), "key": key})
    return rows


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def cache_bytes() -> int:
    """Bytes of everything in the cache folder."""
    root = cache_root()
    return _folder_bytes(root) if root.is_dir() else 0


def clear_cache() -> int:
    """Remove everything toyllm keeps in the cache folder; returns the bytes freed."""
    root = cache_root()
    freed = cache_bytes()
    for name in ("steps", "inductor", "models"):
        shutil.rmtree(root / name, ignore_errors=True)
    (root / "digests.json").unlink(missing_ok=True)
    return freed - cache_bytes()
