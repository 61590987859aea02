"""The seccomp filter of sandboxed executions: an allowlist of the syscalls a Python interpreter
running candidate code needs, for x86_64 and aarch64 (standard library only).

The sandbox's namespaces already hide the machine; the filter keeps the kernel's surface to what
Python's standard library uses on files, memory, time, signals, threads and child processes. So
tracing, mounts, new namespaces, sockets, exec, keyrings, eBPF, perf, io_uring, memory that no rlimit
counts (memfd, System V IPC, message queues), file locks (a channel between sandboxes through the
read-only files they share) and every syscall added to the kernel later stay out without being named.

The program reads the architecture field first and checks the call against that architecture's
table (``_syscalls_*.py``, generated from the kernel's headers). Any other architecture or ABI
(i386, x32, 32-bit arm) is killed: its numbers name other calls. A refused call fails with EPERM, or
ENOSYS where libc then falls back: clone3 (glibc uses clone, whose namespace flags are checked)
and numbers past the table (newer calls, which libc tries before their older forms).
"""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass

from envs.code._bpf import JEQ, JGE, JGT, JSET, assemble, goto, jump, load, ret
from envs.code._syscalls import TABLES, native, syscall_number

ALLOWED = frozenset({
    # Memory.
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "msync",
    # Files and folders: its read-only root and its own /tmp.
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
    "lseek", "open", "openat", "close", "close_range", "stat", "fstat", "lstat", "newfstatat", "statx",
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getdents64", "getcwd", "chdir", "fchdir",
    "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
    "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "truncate", "ftruncate", "fallocate", "fsync",
    "fdatasync", "utimensat", "umask", "statfs", "fstatfs", "sendfile", "copy_file_range",
    "dup", "dup2", "dup3", "pipe", "pipe2",
    # Reading extended attributes: shutil.copy2 and copytree list them and fail on EPERM.
    "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr",
    # Waiting on descriptors (select, selectors).
    "poll", "ppoll", "select", "pselect6", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait",
    # Time, signals and timers.
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait", "rt_sigsuspend",
    "sigaltstack", "restart_syscall", "kill", "tgkill", "tkill", "pause", "alarm", "setitimer", "getitimer",
    # Processes and threads, inside its own PID namespace and under its rlimits.
    "wait4", "waitid", "exit", "exit_group", "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid",
    "getegid", "getresuid", "getresgid", "getgroups", "setsid", "setpgid", "getpgid", "getpgrp", "getsid",
    "set_tid_address", "set_robust_list", "rseq", "sched_yield", "sched_getaffinity", "getcpu",
    "getpriority", "setpriority", "getrlimit", "setrlimit", "prlimit64", "getrusage", "times",
    # What the machine is, and randomness.
    "uname", "sysinfo", "getrandom",
})
"""Calls allowed whatever their arguments; ``CHECKS`` holds those allowed with some arguments only."""
ABSENT = {
    "x86_64": frozenset(),
    "aarch64": frozenset({"open", "stat", "lstat", "access", "readlink", "mkdir", "rmdir", "unlink", "rename",
                          "link", "symlink", "chmod", "dup2", "pipe", "poll", "select", "epoll_wait", "pause",
                          "alarm", "getpgrp", "time"}),
}
"""Allowed calls an architecture lacks: aarch64's libc uses the *at forms, ppoll, pselect6,
epoll_pwait, rt_sigsuspend and setitimer instead."""
FALLBACK = ("clone3",)
"""Refused with ENOSYS, so that glibc falls back: on clone, whose flags the filter can read (clone3's
are behind a pointer)."""


@dataclass(frozen=True)
class ArgumentCheck:
    """A call allowed only with some values of one argument (its low 32 bits: all the kernel reads
    of ioctl's and fcntl's commands, and where every namespace flag of clone lies)."""

    syscall: str
    arg: int
    one_of: frozenset[int] = frozenset()
    """Allowed values (empty: any value without a bit of ``none_of``)."""
    none_of: int = 0
    """Bits the argument must not have."""
    any_with: int = 0
    """Bits any of which allows the call whatever the rest of the argument (checked before ``one_of``)."""

    def program(self, allow: str, refuse: str) -> list:
        program = [load(_ARG0 + 8 * self.arg)]
        if self.none_of:
            return program + [jump(JSET, self.none_of, then=refuse, otherwise=allow)]
        if self.any_with:
            program.append(jump(JSET, self.any_with, then=allow))
        return program + [jump(JEQ, value, then=allow) for value in sorted(self.one_of)] + [goto(refuse)]


# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
CHECKS = (
    ArgumentCheck("clone", 0, none_of=CLONE_NAMESPACES),
    # TCGETS (isatty), TIOCGWINSZ, FIONREAD, FIONBIO, FIONCLEX and FIOCLEX (os.set_inheritable raises
    # unless they answer); the same numbers on both architectures (asm-generic/ioctls.h).
    ArgumentCheck("ioctl", 1, one_of=frozenset({0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451})),
    # F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_DUPFD_CLOEXEC: no record or open-file locks
    # (refused like flock), leases, notifications or signal owners.
    ArgumentCheck("fcntl", 1, one_of=frozenset({0, 1, 2, 3, 4, 1030})),
    # Any private futex (FUTEX_PRIVATE_FLAG); of shared ones, waits only (FUTEX_WAIT, FUTEX_WAIT_BITSET,
    # either with FUTEX_CLOCK_REALTIME): glibc's pthread_join waits on a shared futex the kernel wakes.
    # A shared wake would reach another sandbox waiting at the same offset of a file both map (libc's
    # own pages): a channel between sandboxes, like file locks.
    ArgumentCheck("futex", 1, any_with=0x80, one_of=frozenset({0, 9, 0x100, 0x109})),
)
FOREIGN_ABI_FROM = {"x86_64": 0x40000000}
"""Numbers from here on belong to another ABI under the same audit architecture (x32): killed."""

_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_CHAIN = 200  # comparisons between two "allow" returns: a conditional jump reaches 255 ahead
_PR_SET_NO_NEW_PRIVS, _SECCOMP_SET_MODE_FILTER = 38, 1


class SeccompError(OSError):
    """The filter cannot be built or installed: full isolation does not start."""


def allowed_on(arch: str) -> dict[str, int]:
    """The allowlist's numbers on ``arch``, by name."""
    numbers, names = TABLES[arch].NUMBERS, ALLOWED - ABSENT[arch]
    missing = sorted(name for name in names if name not in numbers)
    if missing:
        raise SeccompError(f"allowed syscalls missing from the {arch} table: {missing}")
    return {name: numbers[name] for name in names}


def build() -> bytes:
    """The filter program, for every architecture with a table; refuses to build on a machine
    whose own architecture has none (its every call would be killed)."""
    native()
    program: list = [load(_ARCH)]
    for arch, table in TABLES.items():
        program += [jump(JEQ, table.AUDIT_ARCH, otherwise=f"not {arch}"), goto(arch), f"not {arch}"]
    program.append(ret(_RET_KILL_PROCESS))
    for arch in TABLES:
        program += _arch_program(arch)
    return assemble(program)


def _arch_program(arch: str) -> list:
    """The checks of one architecture's calls, starting at the label ``arch``."""
    numbers = TABLES[arch].NUMBERS
    at = (lambda label: f"{arch} {label}")
    program: list = [arch, load(_NR)]
    if arch in FOREIGN_ABI_FROM:
        program.append(jump(JGE, FOREIGN_ABI_FROM[arch], then=at("kill")))
    program.append(jump(JGT, max(numbers.values()), then=at("enosys")))
    program += [jump(JEQ, numbers[name], then=at("enosys")) for name in FALLBACK]
    program += [jump(JEQ, numbers[check.syscall], then=at(check.syscall)) for check in CHECKS]
    program.append(goto(at("list")))
    for check in CHECKS:
        program += [at(check.syscall), *check.program(allow=at("allow"), refuse=at("eperm"))]
    program += [at("kill"), ret(_RET_KILL_PROCESS), at("enosys"), ret(_RET_ERRNO | errno.ENOSYS),
                at("eperm"), ret(_RET_ERRNO | errno.EPERM), at("allow"), ret(_RET_ALLOW), at("list")]
    listed = sorted(allowed_on(arch).values())
    for start in range(0, len(listed), _CHAIN):
        allow, after = at(f"allow {start}"), at(f"after {start}")
        program += [jump(JEQ, number, then=allow) for number in listed[start:start + _CHAIN]]
        program += [goto(after), allow, ret(_RET_ALLOW), after]
    return program + [ret(_RET_ERRNO | errno.EPERM)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None, use_errno=True)


def install(program: bytes) -> None:
    """Apply ``program`` to this thread and its future children, for good (no new privileges
    either, so nothing exec'd later could drop it)."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise SeccompError(err, f"prctl(PR_SET_NO_NEW_PRIVS) failed: {errno.errorcode.get(err, err)}")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if _libc.syscall(syscall_number("seccomp"), _SECCOMP_SET_MODE_FILTER, 0, ctypes.byref(fprog)) != 0:
        err = ctypes.get_errno()
        raise SeccompError(err, f"installing the seccomp filter failed ({errno.errorcode.get(err, err)}): "
                                "the kernel needs CONFIG_SECCOMP_FILTER, and the container's own seccomp "
                                "profile must allow the seccomp() system call")
