"""Starts the sandbox process: its private view of the files, then the sandbox user.

Run as a script (``python launcher.py FD REFERENCE PARENT_PID LIMITS USER
HIDE``) by ``sandbox.Sandbox``, with the grader's rights; it imports only
the standard library, so it starts fast. As root it

1. makes a private mount namespace (when the kernel allows it) in which
   the folders to hide (the course's tests, the hidden tests, the grader's
   own folder) are empty, and closed folders on the way to Python (such as
   a ``/root`` of mode 0700 holding pyenv) are opened with only the entries
   Python needs;
2. drops to the sandbox user (no supplementary groups);
3. starts over as that user: ``server.serve`` sets the limits and serves.

No submitted code runs before step 3.
"""
from __future__ import annotations

import ctypes
import os
import stat
import sys
from pathlib import Path

_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_MNT_DETACH = 2


def libc():
    # This file runs as a script before the sandbox is set up: it imports nothing of toyllm (whose
    # package would pull in torch), so it keeps its own two-line handle on the C library.
    return ctypes.CDLL(None, use_errno=True)


def _needed_paths() -> list[Path]:
    """What the sandbox's Python must reach: the interpreter, its standard library, torch and toyllm."""
    import importlib.util
    import sysconfig

    return [Path(sys.executable).resolve(), Path(sys.executable).absolute().parent,
            Path(sysconfig.get_paths()["stdlib"]).resolve(),
            Path(importlib.util.find_spec("torch").origin).resolve().parent, Path(__file__).resolve().parents[1]]


def closed_folders() -> dict[Path, set[str]]:
    """{folder other users cannot enter: {its entries the sandbox needs}} (e.g. {/root: {".pyenv"}})."""
    closed: dict[Path, set[str]] = {}
    for path in _needed_paths():
        for part in reversed(path.parents):
            if part != path and not part.stat().st_mode & stat.S_IXOTH:
                closed.setdefault(part, set()).add(path.relative_to(part).parts[0])
                break
    return closed


_namespace_probe: bool | None = None


def namespaces_work() -> bool:
    """Can this (root) process make a private mount namespace? Tried once, in a throwaway child."""
    global _namespace_probe
    if _namespace_probe is None:
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if libc().unshare(_CLONE_NEWNS) == 0 else 1)
            except BaseException:
                os._exit(1)
        _namespace_probe = os.waitpid(pid, 0)[1] == 0
    return _namespace_probe


def _mount(source, target, fstype, flags, data=None) -> None:
    c = libc()
    enc = lambda x: None if x is None else str(x).encode()
    if c.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _private_view(hide: list[Path], scratch: Path) -> None:
    """In a new mount namespace: empty the folders to hide; open closed folders on the way to Python.

    A closed folder such as /root (mode 0700) is covered by an empty
    tmpfs that anyone may enter, holding only the entries Python needs
    (bound back from the original), so the rest stays out of sight.
    """
    c = libc()
    if c.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE)
    for i, (folder, entries) in enumerate(sorted(closed_folders().items())):
        stage = scratch / f".stage{i}"
        stage.mkdir()
        _mount(folder, stage, None, _MS_BIND | _MS_REC)
        _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
        for entry in entries:
            (folder / entry).mkdir()
            _mount(stage / entry, folder / entry, None, _MS_BIND | _MS_REC)
        c.umount2(str(stage).encode(), _MNT_DETACH)
        stage.rmdir()
    for folder in hide:
        if folder.is_dir():
            _mount("tmpfs", folder, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=0,size=4k")




def main() -> None:
    fd, reference, parent_pid, limits, user, hide = sys.argv[1:7]
    if user != "-" and os.geteuid() == 0:
        uid, gid = (int(x) for x in user.split(","))
        if namespaces_work():
            _private_view([Path(p) for p in hide.split(os.pathsep) if p], Path.cwd())
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    os.execv(sys.executable, [sys.executable, "-c", "from toyllm.grading.server import serve; serve()",
                              fd, reference, parent_pid, limits])


if __name__ == "__main__":
    main()
