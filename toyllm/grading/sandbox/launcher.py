"""Starts the sandbox process: its private view of the files, then the sandbox user.

Run as a script (``python launcher.py FD REFERENCE PARENT_PID LIMITS USER
HIDE``) by ``sandbox.Sandbox``, with the grader's rights; it imports only
the standard library, so it starts fast. As root, where the kernel allows
namespaces, it

1. makes new PID, mount, IPC, network and UTS namespaces. The first
   process in them (PID 1, the namespace's init) only reaps orphans; the
   sandbox runs as its child. When init ends, the kernel kills every
   process left in the namespace, however it forked or detached, so
   nothing a submission starts can outlive its sandbox. Init dies with the
   launcher, and the launcher with the grader's test process. SysV shared
   memory, semaphores, message queues and POSIX message queues are the
   namespace's own and vanish with it; the network is a loopback of its
   own (brought up for the engine's ranks on 127.0.0.1), so no listener of
   the host or of another sandbox can be reached;
2. in that view: the folders to hide (the course's tests and model answers,
   the hidden tests, the grader's own folder) are empty; closed folders on
   the way to Python (such as a ``/root`` of mode 0700 holding pyenv) are
   opened with only the entries Python needs; every mount is read-only,
   and every folder anyone may write in (``/tmp``, ``/var/tmp``,
   ``/dev/shm``, ``/run/lock``, and whatever else the scan in
   ``writable_folders`` finds) is a fresh size-limited memory file system,
   and so is the scratch folder (a copy of what the grader put there):
   whatever the submission writes vanishes with the namespace, and no
   sandbox sees what another one wrote;
3. drops to the sandbox user (no supplementary groups): as root, by
   default a user id of its own that no account and no process has
   (``unused_id``), so its process limit counts only this sandbox;
4. starts over as that user: ``server.serve`` sets the limits and serves,
   in a fresh Python (``execv``), or, in a copy forked by ``zygote``
   (which imported torch once for every sandbox), in this same process.

Without namespaces (not root, or a kernel that refuses them) only steps
3-4 happen (3 only as root): the grader then ends strays by walking the
process tree (``sandbox.Sandbox.kill``), which a process that keeps
re-forking can outrun. No submitted code runs before step 4.
"""
from __future__ import annotations

import ctypes
import os
import stat
import sys
from pathlib import Path

_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWIPC, _CLONE_NEWNET, _CLONE_NEWUTS = \
    0x00020000, 0x20000000, 0x08000000, 0x40000000, 0x04000000
_NAMESPACES = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWNET | _CLONE_NEWUTS
_PR_SET_PDEATHSIG = 1
TEMP_SIZE = "256m"          # each private writable folder (/tmp, /dev/shm, ...) and the scratch folder
# Folders anyone may write in on common systems; writable_folders() adds what its scan finds.
KNOWN_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")
SCAN_DEPTH = 4              # folder levels below / searched for world-writable folders (about 0.1 s)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
# The per-mount flags a read-only remount must keep: {statvfs flag: mount flag}. Linux's names; where
# Python has none of them (macOS lacks most, Windows all) the namespaces are never made anyway.
_KEPT_FLAGS = {getattr(os, st): flag for st, flag in
               (("ST_NOSUID", _MS_NOSUID), ("ST_NODEV", _MS_NODEV), ("ST_NOEXEC", _MS_NOEXEC),
                ("ST_NOATIME", 1024), ("ST_NODIRATIME", 2048), ("ST_RELATIME", 1 << 21)) if hasattr(os, st)}
# Namespaces, the kernel's process options and /proc are Linux's: elsewhere the sandbox runs as a plain
# process of the grader's user (the module docstring's last paragraph).
LINUX = sys.platform.startswith("linux")
_MNT_DETACH = 2
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
# Sandbox user ids come from here (as root, no user named): far above any account a system creates.
ID_RANGE = range(2_000_000_000, 2_100_000_000)


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
            Path(importlib.util.find_spec("torch").origin).resolve().parent, Path(__file__).resolve().parents[2]]


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
    """Can this (root) process make the sandbox's namespaces (``_NAMESPACES``)? Tried once, in a throwaway
    child."""
    global _namespace_probe
    if not LINUX or not hasattr(os, "fork"):
        return False
    if _namespace_probe is None:
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if libc().unshare(_NAMESPACES) == 0 else 1)
            except BaseException:
                os._exit(1)
        _namespace_probe = os.waitpid(pid, 0)[1] == 0
    return _namespace_probe


def unused_id() -> int | None:
    """A number in ``ID_RANGE`` that no account, no group and no running process has, to be one sandbox's
    user and group id: the sandbox's process limit then counts its own processes only, and nothing on the
    system belongs to it. None where this user namespace cannot switch to ids of that range (a container
    with a short id map)."""
    if not LINUX:
        return None
    import grp
    import pwd
    import random

    for kind in ("uid", "gid"):
        spans = [line.split() for line in Path(f"/proc/self/{kind}_map").read_text().splitlines() if line.strip()]
        if not any(int(first) <= ID_RANGE.start and ID_RANGE.stop <= int(first) + int(count)
                   for first, _, count in spans):
            return None
    in_use = set()                                 # real, effective, saved and file-system ids of each process
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    in_use.update(int(x) for line in f if line.startswith(("Uid:", "Gid:")) for x in line.split()[1:])
            except OSError:                        # it ended meanwhile
                pass
    def named(lookup, number: int) -> bool:
        try:
            lookup(number)
            return True
        except KeyError:
            return False

    pick = random.SystemRandom()          # two gradings starting together draw different ids
    for _ in range(100):
        candidate = pick.choice(ID_RANGE)
        if candidate not in in_use and not named(pwd.getpwuid, candidate) and not named(grp.getgrgid, candidate):
            return candidate
    return None


def _mount(source, target, fstype, flags, data=None) -> None:
    c = libc()
    enc = lambda x: None if x is None else str(x).encode()
    if c.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _private_view(hide: list[Path], scratch: Path) -> None:
    """In the new mount namespace: empty the folders to hide; open closed folders on the way to Python.

    A closed folder such as /root (mode 0700) is covered by an empty
    tmpfs that anyone may enter, holding only the entries Python needs
    (bound back from the original), so the rest stays out of sight.
    """
    c = libc()
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




def _mounts() -> list[tuple[Path, str]]:
    """[(mount point, file system type)] of this mount namespace, in mount order (a later one covers an
    earlier one on the same point)."""
    import re

    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])     # spaces come as \040
        mounts.append((Path(point), fields[fields.index("-") + 1]))
    return mounts


def writable_folders() -> list[Path]:
    """The topmost folders the sandbox could write in, other than its own: ``KNOWN_WRITABLE`` (where they
    exist, links followed), and every world-writable folder (mode o+w, sticky or not) among the mount
    points and the folders up to ``SCAN_DEPTH`` levels below / that others may reach. A deeper one stays
    read-only (``_read_only``)."""
    found = {Path(p).resolve() for p in KNOWN_WRITABLE if Path(p).is_dir()}

    def scan(folder: str, depth: int) -> None:
        try:
            with os.scandir(folder) as it:
                entries = [e for e in it if e.is_dir(follow_symlinks=False) and e.path not in ("/proc", "/sys")]
        except OSError:
            return
        for entry in entries:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:                # gone meanwhile, or a file system that refuses
                continue
            if mode & stat.S_IWOTH:
                found.add(Path(entry.path))
            elif depth > 1 and mode & stat.S_IXOTH:
                scan(entry.path, depth - 1)

    scan("/", SCAN_DEPTH)
    for point, fstype in _mounts():
        try:
            if fstype not in ("proc", "sysfs") and point.is_dir() and point.stat().st_mode & stat.S_IWOTH:
                found.add(point)
        except OSError:                    # under a folder that is hidden now
            pass
    return sorted(p for p in found if not any(q in p.parents for q in found))


def _read_only() -> None:
    """Make every mount of this namespace read-only but its own /proc: a world-writable folder that
    ``writable_folders`` missed then carries nothing from one sandbox to another. MS_BIND changes the
    flags of this namespace's copy of a mount only, never the file system the host sees."""
    import errno

    for point, fstype in _mounts():
        if fstype == "proc":
            continue
        try:
            kept = os.statvfs(point).f_flag
            _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY |
                   sum(flag for st, flag in _KEPT_FLAGS.items() if kept & st))
        except OSError as e:
            # Gone from sight (under a hidden folder), or covered by a later mount, which gets its own turn.
            if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EINVAL):
                raise


def _loopback_up() -> None:
    """Bring up the loopback of this (new) network namespace, which starts down: the engine's ranks meet on
    127.0.0.1 inside the sandbox."""
    import fcntl
    import socket
    import struct

    ifreq = "16sH22x"                      # struct ifreq: the interface's name, then its flags
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(ifreq, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(ifreq, b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(ifreq, b"lo", flags | _IFF_UP))


def _kept_paths() -> list[Path]:
    """Folders the sandbox's Python must still see if they sit under a folder that gets a fresh tmpfs."""
    import sysconfig

    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(__file__).resolve().parents[2],
             Path(sys.executable).absolute().parent, Path(sysconfig.get_paths()["stdlib"]).resolve()}
    paths |= {Path(p).resolve() for p in sys.path if p and os.path.isdir(p)} - {Path.cwd().resolve()}
    paths = {p for p in paths if p.is_dir()}
    return sorted(p for p in paths if not any(q != p and q in p.parents for q in paths))


def _fresh_tmpfs(folder: Path, keep: list[Path]) -> None:
    """Cover ``folder`` with an empty, size-limited tmpfs, binding back the kept paths that lie inside it."""
    inside = [p for p in keep if folder in p.parents]
    handles = [os.open(p, os.O_PATH) for p in inside]          # opened while they are still in sight
    _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={TEMP_SIZE}")
    for path, fd in zip(inside, handles):
        path.mkdir(parents=True)
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        os.close(fd)


def _copy_tree(src_fd: int, dst: Path, uid: int, gid: int) -> None:
    """Copy the folder open as ``src_fd`` into ``dst`` (files and folders only), owned by uid:gid."""
    for entry in os.scandir(src_fd):
        if entry.is_dir(follow_symlinks=False):
            (dst / entry.name).mkdir()
            sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=src_fd)
            try:
                _copy_tree(sub, dst / entry.name, uid, gid)
            finally:
                os.close(sub)
        elif entry.is_file(follow_symlinks=False):
            src = os.open(entry.name, os.O_RDONLY, dir_fd=src_fd)
            with os.fdopen(src, "rb") as f:
                (dst / entry.name).write_bytes(f.read())
        else:
            continue
        os.chown(dst / entry.name, uid, gid)


def _private_temp(scratch: Path, scratch_fd: int, uid: int, gid: int) -> Path:
    """Every mount read-only, and fresh writable folders (``writable_folders``) that vanish with the
    namespace, the scratch folder copied into the new /tmp (its path there is returned); cd into it."""
    keep = _kept_paths()
    folders = writable_folders()
    queues = {point for point, fstype in _mounts() if fstype == "mqueue"}
    _read_only()
    for folder in folders:
        if folder in queues:        # shows the queues of the namespace that mounts it: this one's, none yet
            _mount("mqueue", folder, "mqueue", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        else:
            _fresh_tmpfs(folder, keep)
    inside = Path("/tmp") / scratch.name
    inside.mkdir(mode=0o700)
    os.chown(inside, uid, gid)
    _copy_tree(scratch_fd, inside, uid, gid)
    os.close(scratch_fd)
    os.chdir(inside)
    return inside


def _mirror(pid: int) -> None:
    """Wait for ``pid`` and end this process the same way (exit code or signal)."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            os._exit(1)
    if os.WIFSIGNALED(status):
        import signal

        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _init(server: int) -> None:
    """PID 1 of the namespace: reap every orphan; when the sandbox ends, end too (the kernel kills the rest)."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == server:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 1)


def _contain(fd: int, hide: list[Path], uid: int, gid: int) -> Path:
    """Steps 1-2 of the module docstring; returns (the scratch folder's new path) only in the process that
    becomes the sandbox."""
    scratch = Path.cwd()
    scratch_fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
    if libc().unshare(_NAMESPACES) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | "
                                          "CLONE_NEWUTS) failed")
    child = os.fork()
    if child:                           # outside the namespace: stand in for the sandbox until it ends
        os.close(fd)                    # the grader must see the socket close when the sandbox dies
        _mirror(child)
    libc().prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)            # the launcher died: init goes, and the namespace
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE)
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)   # this namespace's processes only
    _loopback_up()
    _private_view(hide, scratch)
    inside = _private_temp(scratch, scratch_fd, uid, gid)
    server = os.fork()
    if server:
        os.close(fd)
        _init(server)
    libc().prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)
    return inside


def main(in_process: bool = False) -> list[str]:
    """Steps 1-4. ``in_process`` (a copy forked by ``zygote``, which has torch imported already): steps 1-3
    only, returning the arguments of ``server.serve``, which the caller runs in this same process."""
    fd, reference, parent_pid, limits, user, hide = sys.argv[1:7]
    if user != "-" and os.geteuid() == 0:
        uid, gid = (int(x) for x in user.split(","))
        if namespaces_work():
            old = str(Path.cwd())
            new = str(_contain(int(fd), [Path(p) for p in hide.split(os.pathsep) if p], uid, gid))
            parent_pid = str(os.getppid())         # the namespace's init
            # The same files under their new path: what pointed into the scratch folder points there.
            reference = reference.replace(old, new, 1)
            for name, value in list(os.environ.items()):
                if value.startswith(old):
                    os.environ[name] = new + value[len(old):]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    if in_process:
        return [fd, reference, parent_pid, limits]
    os.execv(sys.executable, [sys.executable, "-c", "from toyllm.grading.sandbox.server import serve; serve()",
                              fd, reference, parent_pid, limits])


if __name__ == "__main__":
    main()
