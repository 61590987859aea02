"""Syscall numbers of the architectures full isolation runs on (standard library only).

The tables are generated from the kernel's headers (``_syscalls_generate.py``); this machine's is
the one its processes use. Any other architecture has no table, so full isolation cannot start on it.
"""

from __future__ import annotations

import os
import struct
from types import ModuleType

import envs.code._syscalls_aarch64 as aarch64
import envs.code._syscalls_x86_64 as x86_64

TABLES: dict[str, ModuleType] = {"x86_64": x86_64, "aarch64": aarch64}


class UnknownArchitecture(RuntimeError):
    """This machine's syscalls are not in any table here."""


def native() -> ModuleType:
    """This machine's table (``NUMBERS``, ``AUDIT_ARCH``, ``SOURCE``)."""
    machine = os.uname().machine
    if machine not in TABLES or struct.calcsize("P") != 8:
        bits = struct.calcsize("P") * 8
        raise UnknownArchitecture(f"the seccomp filter has syscall tables for {sorted(TABLES)} (64-bit) only; "
                                  f"this is {machine} running a {bits}-bit Python, so full isolation cannot start")
    return TABLES[machine]


def syscall_number(name: str) -> int:
    """``name``'s syscall number on this machine."""
    return native().NUMBERS[name]
