"""Reading a submission on the grader's side: regular files only, never through a link, within a size cap.

The grader runs as root outside the sandbox, so whatever it reads from a
submitted folder it reads with every right there is. A submitted
``notes.py`` may be a symbolic link (to the model answers, the hidden
tests, ``/proc/self/environ``), a named pipe that never answers, a folder, a
device such as ``/dev/zero`` or a sparse file of hundreds of MiB.
``read_submission`` is the one place where the trusted side reads submitted
files: it opens each ``*.py`` without following links and without blocking,
checks that what it opened is the regular file it saw, reads at most the
cap, and decodes it as Python would. Everything else is skipped with one
line saying why; the rest of the submission is graded as usual. The sandbox
gets the text read here, never the files themselves.
"""
from __future__ import annotations

import io
import os
import re
import stat
import tokenize
from pathlib import Path

MAX_FILE_BYTES = 2**20           # one submitted .py file: at most 1 MiB
MAX_TOTAL_BYTES = 4 * 2**20      # all of them together: at most 4 MiB
_CHUNK_BYTES = 2**16             # read in pieces: a small file costs a small buffer
ALLOWED = "only regular .py files (no links) of at most 1 MiB each and 4 MiB in all, in UTF-8 or with a coding " \
          "declaration, are graded"

# PEP 263's coding declaration, as the tokenizer finds it on the first two lines.
_CODING = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)", re.ASCII)
_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder", stat.S_IFIFO: "a named pipe",
          stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}


class _Skipped(Exception):
    """Why one submitted file is not graded."""


def read_submission(folder: str | os.PathLike) -> tuple[dict[str, str], list[str]]:
    """({file name: source text}, [one line per skipped file]) for the ``*.py`` files of ``folder``.

    A file is read only if it is a regular file (not a link, even to a
    regular file), its name does not start with a dot, it holds at most
    ``MAX_FILE_BYTES`` bytes and, with the files before it in name order, at
    most ``MAX_TOTAL_BYTES``, and it decodes as Python source (UTF-8, a BOM
    or a coding declaration). Its text is saved as UTF-8 wherever it goes
    next, so a coding declaration in it is rewritten to say utf-8 (on the
    same line: line numbers do not change).
    """
    files: dict[str, str] = {}
    problems: list[str] = []
    left = MAX_TOTAL_BYTES                   # bytes the files not read yet may still hold
    folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in sorted(os.listdir(folder_fd)):
            if not name.endswith(".py"):
                continue
            try:
                data = _read_regular(name, folder_fd, left)
                files[name] = _decode(data)
                left -= len(data)
            except _Skipped as why:
                problems.append(f"{name!r} was not graded: {why}; {ALLOWED}")
    finally:
        os.close(folder_fd)
    return files, problems


def _read_regular(name: str, folder_fd: int, left: int) -> bytes:
    """The bytes of regular file ``name`` in the folder ``folder_fd``, read without following a link."""
    if name.startswith("."):
        raise _Skipped("its name starts with a dot")
    try:
        seen = os.lstat(name, dir_fd=folder_fd)
    except OSError as e:
        raise _Skipped(f"it could not be looked at ({e.strerror})") from None
    _check_regular(seen, left)
    try:
        # O_NOFOLLOW: a link put there since the lstat is refused; O_NONBLOCK: a pipe put there never blocks.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=folder_fd)
    except OSError as e:
        raise _Skipped(f"it could not be opened ({e.strerror})") from None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
            raise _Skipped("it was replaced while it was being read")
        _check_regular(opened, left)
        chunks, size = [], 0
        while size <= min(MAX_FILE_BYTES, left):        # one byte past the cap tells a file that grew
            chunk = os.read(fd, min(_CHUNK_BYTES, min(MAX_FILE_BYTES, left) + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    _check_size(len(data), left)
    return data


def _check_regular(info: os.stat_result, left: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise _Skipped(f"it is {_KINDS.get(stat.S_IFMT(info.st_mode), 'not a regular file')}")
    _check_size(info.st_size, left)


def _check_size(size: int, left: int) -> None:
    if size > MAX_FILE_BYTES:
        raise _Skipped(f"it is larger than {MAX_FILE_BYTES // 2**20} MiB")
    if size > left:
        raise _Skipped(f"with the files before it, the submission holds more than {MAX_TOTAL_BYTES // 2**20} MiB")


def _decode(data: bytes) -> str:
    """``data`` decoded as Python decodes a source file, its coding declaration (if any) rewritten to utf-8."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)                      # "utf-8-sig" drops the BOM
    except (SyntaxError, UnicodeDecodeError, LookupError) as e:
        raise _Skipped(f"it is not Python source text ({e})") from None
    if encoding in ("utf-8", "utf-8-sig"):
        return text
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines[:2]):
        match = _CODING.match(line)
        if match:
            lines[i] = line[:match.start(1)] + "utf-8" + line[match.end(1):]
            break
    return "".join(lines)
