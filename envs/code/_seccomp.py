"""A seccomp filter for sandboxed executions, built as classic BPF with the standard library alone.

The sandbox's namespaces already hide the machine; the filter removes the kernel surface that
candidate code never needs and that an attacker would use to leave them or to reach across them:
tracing, mounting, new namespaces, module and kexec loading, keyrings, eBPF, io_uring (whose
operations bypass seccomp), raw and network sockets, and exec. Each refused call fails with EPERM
(clone3 with ENOSYS, so libc falls back to clone, whose namespace flags are checked). A process of
another architecture (x32, i386 ABI) is killed: its syscall numbers are not the ones checked here.

The module is also used by tests to build filters that make the sandbox's own setup fail.
"""

from __future__ import annotations

import ctypes
import errno
import struct

# x86_64 syscall numbers.
DENIED = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_open": 434, "pidfd_getfd": 438,
    "pidfd_send_signal": 424, "kcmp": 312,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "kexec_load": 246, "kexec_file_load": 320, "reboot": 169, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "quotactl_fd": 443,
    "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "socket": 41, "socketpair": 53, "execve": 59, "execveat": 322,
    "settimeofday": 164, "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173, "personality": 135,
    "uselib": 134, "syslog": 103, "fanotify_init": 300, "lookup_dcookie": 212, "mknod": 133, "mknodat": 259,
    "statmount": 457, "listmount": 458, "process_madvise": 440, "process_mrelease": 448, "migrate_pages": 256,
    "move_pages": 279, "get_robust_list": 274,
    # Memory no rlimit counts, kept by the kernel after the execution ends, and shared between
    # executions: memfd, System V IPC, POSIX message queues. And flock, a channel between sandboxes
    # through the read-only files they share.
    "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67,
    "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
    "msgctl": 71, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243,
    "mq_notify": 244, "mq_getsetattr": 245, "flock": 73,
}
_CLONE, _CLONE3 = 56, 435
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000

_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0 = 0, 4, 16
_PR_SET_NO_NEW_PRIVS, _SYS_SECCOMP, _SECCOMP_SET_MODE_FILTER = 38, 317, 1


_libc = ctypes.CDLL(None, use_errno=True)


class SeccompError(OSError):
    pass


def build(denied: dict[str, int] | None = None, refuse_new_namespaces: bool = True) -> bytes:
    """The filter program: ``denied`` syscalls fail with EPERM, everything else is allowed."""
    denied = DENIED if denied is None else denied
    # Instructions as (code, jump-if-true label, jump-if-false label, k); labels resolved below.
    program: list[tuple[int, str | None, str | None, int]] = [
        (_LD_ABS_W, None, None, _OFFSET_ARCH),
        (_JEQ, None, "kill", _AUDIT_ARCH_X86_64),
        (_LD_ABS_W, None, None, _OFFSET_NR),
        (_JGE, "eperm", None, _X32_BIT),
    ]
    program += [(_JEQ, "eperm", None, number) for number in sorted(set(denied.values()))]
    if refuse_new_namespaces:
        program += [(_JEQ, "enosys", None, _CLONE3),
                    (_JEQ, None, "allow", _CLONE),
                    (_LD_ABS_W, None, None, _OFFSET_ARG0),
                    (_JSET, "eperm", "allow", _CLONE_NAMESPACES)]
    labels = {"allow": _RET_ALLOW, "eperm": _RET_ERRNO | errno.EPERM, "enosys": _RET_ERRNO | errno.ENOSYS,
              "kill": _RET_KILL_PROCESS}
    ends = {name: len(program) + i for i, name in enumerate(labels)}
    program += [(_RET, None, None, k) for k in labels.values()]

    def offset(at: int, label: str | None) -> int:
        return 0 if label is None else ends[label] - at - 1

    return b"".join(struct.pack("HBBI", code, offset(i, jt), offset(i, jf), k)
                    for i, (code, jt, jf, k) in enumerate(program))


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(program: bytes) -> None:
    """Apply ``program`` to this thread and its future children, for good (no new privileges
    either, so nothing exec'd later can drop it)."""
    libc = _libc
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise SeccompError(err, f"prctl(PR_SET_NO_NEW_PRIVS) failed: {errno.errorcode.get(err, err)}")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.syscall(_SYS_SECCOMP, _SECCOMP_SET_MODE_FILTER, 0, ctypes.byref(fprog)) != 0:
        err = ctypes.get_errno()
        raise SeccompError(err, f"installing the seccomp filter failed ({errno.errorcode.get(err, err)}): "
                                "the kernel needs CONFIG_SECCOMP_FILTER, and the container's own seccomp "
                                "profile must allow the seccomp() system call")
