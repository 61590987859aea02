"""The sandbox's seccomp filter, read as the kernel reads it: for x86_64 and aarch64 alike, on any
machine. A small classic-BPF interpreter runs struct seccomp_data for each architecture through the
program ``_seccomp.build()`` makes, so the aarch64 half is checked on an x86_64 CI machine too. The
syscall tables are checked against the kernel's headers where the machine has them, and against
numbers known independently everywhere. No Ray, no sandbox process."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import pytest

from envs.code import _bpf, _seccomp, _syscalls

ALLOW, KILL = 0x7FFF0000, 0x80000000
EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
ARCHES = ("x86_64", "aarch64")
AUDIT_ARCH_I386, AUDIT_ARCH_ARM, AUDIT_ARCH_RISCV64 = 0x40000003, 0x40000028, 0xC00000F3
PROGRAM = _seccomp.build()


def run_filter(arch: int, nr: int, *args: int) -> int:
    """The program's verdict on one call: struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * 6)[:6])
    insns = [struct.unpack_from("=HBBI", PROGRAM, at) for at in range(0, len(PROGRAM), 8)]
    tests = {_bpf.JEQ: lambda a, k: a == k, _bpf.JGT: lambda a, k: a > k, _bpf.JGE: lambda a, k: a >= k,
             _bpf.JSET: lambda a, k: bool(a & k)}
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == _bpf.LOAD:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code == _bpf.GOTO:
            pc += 1 + k
        elif code in tests:
            pc += 1 + (jt if tests[code](acc, k) else jf)
        elif code == _bpf.RET:
            return k
        else:
            raise AssertionError(f"opcode {code:#x} at {pc} is not one the filter should emit")


def numbers(arch: str) -> dict[str, int]:
    return _syscalls.TABLES[arch].NUMBERS


def audit(arch: str) -> int:
    return _syscalls.TABLES[arch].AUDIT_ARCH


def test_the_program_passes_the_checks_the_kernel_makes_before_loading_it():
    """What seccomp_check_filter and bpf_check_classic require: at most 4096 instructions, only
    aligned word loads inside struct seccomp_data (64 bytes), jumps that land inside, a return last."""
    insns = [struct.unpack_from("=HBBI", PROGRAM, at) for at in range(0, len(PROGRAM), 8)]
    assert len(PROGRAM) % 8 == 0 and len(insns) <= 4096
    assert insns[-1][0] == _bpf.RET
    for at, (code, jt, jf, k) in enumerate(insns):
        assert code in (_bpf.LOAD, _bpf.GOTO, _bpf.JEQ, _bpf.JGT, _bpf.JGE, _bpf.JSET, _bpf.RET)
        if code == _bpf.LOAD:
            assert k % 4 == 0 and k < 64
        reach = [k] if code == _bpf.GOTO else [jt, jf] if code != _bpf.RET and code != _bpf.LOAD else []
        assert all(at + 1 + offset < len(insns) for offset in reach), at


@pytest.mark.parametrize("arch", ARCHES)
def test_each_architecture_allows_exactly_its_allowlist(arch):
    """Every number from 0 to past the table's end, with zero arguments: the allowlisted calls are
    allowed, clone3 and numbers past the table answer ENOSYS, every other call EPERM. The calls
    whose arguments are checked are left to the tests below."""
    allowed = _seccomp.allowed_on(arch)
    checked = {check.syscall for check in _seccomp.CHECKS}
    name_of = {number: name for name, number in numbers(arch).items()}
    last = max(numbers(arch).values())
    verdicts = {}
    for nr in range(last + 40):
        name = name_of.get(nr)
        if name in checked:
            continue
        want = ENOSYS if nr > last or name in _seccomp.FALLBACK else ALLOW if name in allowed else EPERM
        verdicts[nr] = (name, run_filter(audit(arch), nr), want)
    wrong = {nr: v for nr, v in verdicts.items() if v[1] != v[2]}
    assert not wrong, wrong
    assert sum(1 for _, got, _ in verdicts.values() if got == ALLOW) == len(allowed)
    assert not checked & set(_seccomp.ALLOWED)  # a checked call allowed outright would skip its check


@pytest.mark.parametrize("arch", ARCHES)
def test_what_the_old_denylist_refused_is_still_refused(arch):
    """The x86_64 denylist this allowlist replaced, by name: each call that exists on the architecture
    is refused with EPERM (sockets, exec, tracing, mounts, namespaces, kexec, modules, keyrings, bpf,
    perf, userfaultfd, io_uring, pidfd, memfd, System V IPC, message queues, flock, and the rest)."""
    old_denylist = (
        "ptrace process_vm_readv process_vm_writev pidfd_open pidfd_getfd pidfd_send_signal kcmp mount umount2 "
        "pivot_root chroot unshare setns open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr "
        "name_to_handle_at open_by_handle_at kexec_load kexec_file_load reboot init_module finit_module "
        "delete_module swapon swapoff acct quotactl quotactl_fd keyctl add_key request_key bpf perf_event_open "
        "userfaultfd io_uring_setup io_uring_enter io_uring_register socket socketpair execve execveat "
        "settimeofday clock_settime adjtimex clock_adjtime sethostname setdomainname iopl ioperm personality "
        "uselib syslog fanotify_init lookup_dcookie mknod mknodat process_madvise process_mrelease migrate_pages "
        "move_pages get_robust_list memfd_create memfd_secret shmget shmat shmctl shmdt semget semop semctl "
        "semtimedop msgget msgsnd msgrcv msgctl mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify "
        "mq_getsetattr flock").split()
    present = [name for name in old_denylist if name in numbers(arch)]
    assert len(present) > 70
    assert {name: run_filter(audit(arch), numbers(arch)[name]) for name in present} == dict.fromkeys(present, EPERM)


@pytest.mark.parametrize("arch", ARCHES)
def test_clone_is_allowed_for_threads_and_fork_but_never_with_a_namespace_flag(arch):
    clone = numbers(arch)["clone"]
    threads, fork = 0x003D0F00, 0x01200011  # glibc's pthread_create and fork flags
    assert run_filter(audit(arch), clone, threads) == run_filter(audit(arch), clone, fork) == ALLOW
    for bit in range(32):
        flag = 1 << bit
        if flag & _seccomp.CLONE_NAMESPACES:
            assert run_filter(audit(arch), clone, fork | flag) == EPERM, hex(flag)
    assert run_filter(audit(arch), clone, (1 << 40) | 0x10000000) == EPERM  # high bits do not hide CLONE_NEWUSER
    assert run_filter(audit(arch), numbers(arch)["clone3"], 0) == ENOSYS  # glibc falls back to clone


@pytest.mark.parametrize("arch", ARCHES)
def test_a_futex_shared_with_another_sandbox_may_be_waited_on_but_never_woken(arch):
    """A shared futex at an offset of a file every sandbox maps (libc) would carry bits from one
    sandbox to another; private futexes (threads, locks) and shared waits (pthread_join) stay."""
    futex = numbers(arch)["futex"]
    for op in (0, 9, 0x100, 0x109):  # FUTEX_WAIT, FUTEX_WAIT_BITSET, with FUTEX_CLOCK_REALTIME
        assert run_filter(audit(arch), futex, 0x1000, op) == ALLOW
    for cmd in range(14):  # every futex command, private
        assert run_filter(audit(arch), futex, 0x1000, cmd | 0x80) == ALLOW
    for op in (1, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 0x101):  # wake, requeue, wake_op, PI, wake_bitset, ... shared
        assert run_filter(audit(arch), futex, 0x1000, op) == EPERM, hex(op)


@pytest.mark.parametrize("arch", ARCHES)
def test_ioctl_and_fcntl_take_only_the_commands_python_uses(arch):
    ioctl, fcntl = numbers(arch)["ioctl"], numbers(arch)["fcntl"]
    for request in (0x5401, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451):  # TCGETS ... FIOCLEX
        assert run_filter(audit(arch), ioctl, 1, request) == ALLOW
        assert run_filter(audit(arch), ioctl, 1, request | 1 << 32) == ALLOW  # the kernel reads 32 bits of it
    for request in (0x5412, 0x540E, 0x4B32, 0x80045430):  # TIOCSTI, TIOCSCTTY, KDSETLED, TIOCGPTN
        assert run_filter(audit(arch), ioctl, 1, request) == EPERM
    for command in (0, 1, 2, 3, 4, 1030):  # F_DUPFD ... F_SETFL, F_DUPFD_CLOEXEC
        assert run_filter(audit(arch), fcntl, 3, command) == ALLOW
    for command in (5, 6, 7, 36, 37, 38, 8, 10, 1024, 1026, 1031, 1033):  # locks, owner, signal, lease, notify ...
        assert run_filter(audit(arch), fcntl, 3, command) == EPERM


def test_other_architectures_and_abis_are_killed():
    """A 32-bit process (i386 on x86_64, arm on aarch64), the x32 ABI (x86_64's audit arch with bit
    30 in the number) and an architecture without a table: their numbers name other calls."""
    for arch in (AUDIT_ARCH_I386, AUDIT_ARCH_ARM, AUDIT_ARCH_RISCV64):
        assert {run_filter(arch, nr) for nr in (0, 1, 56, 59, 63, 220, 435)} == {KILL}
    x32_read = 0x40000000
    assert run_filter(audit("x86_64"), x32_read) == KILL
    assert run_filter(audit("x86_64"), 0) == ALLOW  # the same call in the 64-bit ABI


@pytest.mark.parametrize("arch", ARCHES)
def test_the_allowlist_names_calls_each_table_has_or_says_which_it_lacks(arch):
    """An allowlisted name missing from a table is a typo or a call that architecture does not have;
    the latter must be listed as absent (aarch64 has only the *at forms), and what is listed as
    absent must really be absent."""
    table = numbers(arch)
    assert not sorted(name for name in _seccomp.ALLOWED - _seccomp.ABSENT[arch] if name not in table)
    assert not sorted(name for name in _seccomp.ABSENT[arch] if name in table)
    assert _seccomp.ABSENT[arch] <= _seccomp.ALLOWED
    assert len(set(table.values())) == len(table)  # no number twice


def test_the_tables_hold_numbers_known_independently():
    """A few anchors from the kernel's syscall tables (arch/x86/entry/syscalls/syscall_64.tbl,
    include/uapi/asm-generic/unistd.h), and the audit architectures of linux/audit.h, so a table
    generated from the wrong header fails here without any header on the machine."""
    assert {name: numbers("x86_64")[name] for name in ("read", "write", "clone", "execve", "seccomp", "clone3")} == {
        "read": 0, "write": 1, "clone": 56, "execve": 59, "seccomp": 317, "clone3": 435}
    assert {name: numbers("aarch64")[name] for name in ("io_setup", "openat", "clone", "execve", "seccomp")} == {
        "io_setup": 0, "openat": 56, "clone": 220, "execve": 221, "seccomp": 277}
    assert audit("x86_64") == 62 | 0x80000000 | 0x40000000 and audit("aarch64") == 183 | 0x80000000 | 0x40000000
    for arch in ARCHES:
        assert re.match(r"linux-libc-dev\S* \S+ \((amd64|all)\): \S+unistd\S*\.h$", _syscalls.TABLES[arch].SOURCE)


_HEADERS = {"x86_64": ["/usr/include/x86_64-linux-gnu", "/usr/include"], "aarch64": ["/usr/aarch64-linux-gnu/include"]}


@pytest.mark.parametrize("arch", ARCHES)
def test_the_tables_match_the_kernel_headers_on_this_machine(arch):
    """Where linux-libc-dev (x86_64) or linux-libc-dev-arm64-cross (aarch64) is installed: every
    number in the committed table is the header's (a newer header may add calls the table lacks)."""
    from envs.code._syscalls_generate import SOURCES, from_headers

    includes = [Path(folder) for folder in _HEADERS[arch]]
    if shutil.which("gcc") is None or not (includes[0] / SOURCES[arch][2]).exists():
        pytest.skip(f"no {arch} kernel headers or gcc here (CI installs only PyPI packages)")
    found, audit_arch = from_headers(arch, includes)
    assert audit_arch == audit(arch)
    assert {name: found.get(name) for name in numbers(arch)} == numbers(arch)


def test_a_jump_the_program_cannot_encode_is_refused_not_misplaced():
    far = [_bpf.jump(_bpf.JEQ, 1, then="end"), *[_bpf.ret(0)] * 300, "end", _bpf.ret(1)]
    with pytest.raises(ValueError, match="label 'end' is 300 instructions"):
        _bpf.assemble(far)
    with pytest.raises(ValueError, match="no label 'nowhere'"):
        _bpf.assemble([_bpf.goto("nowhere")])
    assert len(_bpf.assemble([_bpf.goto("end"), *[_bpf.ret(0)] * 300, "end", _bpf.ret(1)])) == 302 * 8
