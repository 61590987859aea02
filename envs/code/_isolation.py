"""Namespaces, the filesystem view and capabilities of the sandbox (Linux, standard library only).

The same steps run whether the host is root or not, because they need no privilege the kernel
does not give an unprivileged user: a new user namespace (in which the sandbox is "root" with
capabilities over its own namespaces only) with new mount, network, IPC, UTS and PID namespaces.
The host maps that "root" to an unprivileged uid outside (its own uid, or as root a dedicated one),
so nothing in the sandbox holds a privilege on the machine. Every step that fails raises
:class:`IsolationUnavailable` naming the step, the error and what would make it work.
"""

from __future__ import annotations

import ctypes
import errno
import os

from envs.code._syscalls import syscall_number

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4
# statvfs flag -> mount flag, for the flags a bind remount inside a user namespace must keep.
_KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

# Device files Python (and candidate code) may open; os.urandom itself uses getrandom().
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
REMEDY = ("To get it: on Kubernetes run the env pool's pods with seccompProfile and appArmorProfile "
          "'Unconfined' (cluster/*.yaml does; the default container profiles refuse user namespaces "
          "and mounts); on a host allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
          "and on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0). Or score with Together's Code "
          "Interpreter (env.options.code.backend: together), or, on your own machine only, opt out with "
          "env.options.code.isolation: none.")

ROOT_WITHOUT_CAPS = ("root without CAP_SETUID and CAP_SETGID cannot give the sandbox an unprivileged uid of its "
                     "own (and root's would lift the process limit); run the env pool as a non-root user "
                     "(runAsNonRoot) or keep those two capabilities")

_libc = ctypes.CDLL(None, use_errno=True)


class IsolationUnavailable(RuntimeError):
    """The sandbox cannot provide the isolation it was asked for."""


def _check(result: int, step: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise IsolationUnavailable(f"{step} failed ({errno.errorcode.get(err, err)}: {os.strerror(err)}). {REMEDY}")


def unshare(flags: int, step: str) -> None:
    _check(_libc.unshare(flags), step)


def setns(fd: int, flags: int, step: str) -> None:
    _check(_libc.setns(fd, flags), step)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(encode(source), target.encode(), encode(fstype), flags, encode(data)),
           f"mount of {source or fstype or target} on {target}")


def die_with_parent() -> None:
    _check(_libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def undumpable() -> None:
    """No process of the same uid may trace this one or read its memory."""
    _check(_libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def view_sources() -> list[str]:
    """What Python needs, read-only: its installation and the system's shared libraries."""
    import sys

    paths = [sys.base_prefix, "/usr/lib", "/usr/lib64", "/lib", "/lib64", *DEVICES]
    kept: list[str] = []
    for path in paths:  # a path inside one already bound comes with it
        if os.path.lexists(path) and not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


def open_sources(paths: list[str]) -> list[tuple[str, int | str]]:
    """Each path with an O_PATH descriptor (or, for a symbolic link, its target text), opened while
    this process can still traverse directories private to the host's user (a Python under /root)."""
    opened: list[tuple[str, int | str]] = []
    for path in paths:
        if os.path.islink(path):
            opened.append((path, os.readlink(path)))
        else:
            opened.append((path, os.open(path, os.O_PATH)))
    return opened


def _remount_read_only(target: str, extra: int = 0) -> None:
    kept = os.statvfs(target).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | extra
    flags |= sum(ms for st, ms in _KEPT_FLAGS if kept & st)
    mount(None, target, None, flags)


def build_root(new_root: str, sources: list[tuple[str, int | str]]) -> None:
    """Make ``new_root`` (a fresh tmpfs) this mount namespace's ``/``: the sources bound read-only at
    their own paths, an empty ``/tmp`` to mount each execution's own on, nothing else (no /proc,
    /sys, /dev/shm, /etc, home or data directories). The old root is detached."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing here propagates back to the host
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=256")
    for path, source in sources:
        target = new_root + path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if isinstance(source, str):
            os.symlink(source, target)
            continue
        if os.path.isdir(f"/proc/self/fd/{source}"):
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            open(target, "w").close()
        mount(f"/proc/self/fd/{source}", target, None, MS_BIND | MS_REC)
        device = path in DEVICES
        _remount_read_only(target, 0 if device else MS_NOSUID | MS_NODEV)
        os.close(source)
    os.makedirs(new_root + "/tmp", mode=0o755)
    os.chdir(new_root)
    _check(_libc.syscall(syscall_number("pivot_root"), b".", b"."), "pivot_root")  # no libc wrapper
    _check(_libc.umount2(b".", _MNT_DETACH), "detaching the old root")
    os.chdir("/")
    _remount_read_only("/", MS_NOSUID | MS_NODEV)


def private_tmp(disk_mb: int, max_files: int) -> None:
    """This execution's own mount namespace and an empty, size-limited /tmp as its working directory;
    both vanish with its last process, so nobody ever cleans up (or follows) what it left there."""
    unshare(CLONE_NEWNS, "unshare(CLONE_NEWNS) for the execution")
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"mode=0700,size={disk_mb}m,nr_inodes={max_files}")
    os.chdir("/tmp")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """No capability left, even inside the sandbox's own namespaces (so no mount, no remount)."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.syscall(syscall_number("capset"), ctypes.byref(header), ctypes.byref(data)),
           "capset (dropping capabilities)")
