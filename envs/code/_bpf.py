"""Classic BPF, as much as the sandbox's seccomp filter uses, assembled with the standard library.

A program is a list of instructions and labels (strings). A jump names the label it goes to;
``assemble`` turns labels into the offsets the kernel reads. Conditional jumps reach at most 255
instructions ahead (8-bit offsets), so ``assemble`` refuses a program where one would not: the
filter then fails to build, it never jumps somewhere else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# Opcodes (linux/bpf_common.h): BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JA and BPF_JMP|<op>|BPF_K, BPF_RET|BPF_K.
LOAD, GOTO, JEQ, JGT, JGE, JSET, RET = 0x20, 0x05, 0x15, 0x25, 0x35, 0x45, 0x06
MAX_JUMP = 255


@dataclass(frozen=True)
class Insn:
    code: int
    k: int | str = 0
    """The constant; for GOTO, the label to go to."""
    then: str | None = None
    """For a conditional jump, the label to go to when it holds (None: the next instruction)."""
    otherwise: str | None = None
    """For a conditional jump, the label to go to when it does not (None: the next instruction)."""


def load(offset: int) -> Insn:
    """The 32-bit word at ``offset`` of struct seccomp_data."""
    return Insn(LOAD, offset)


def ret(value: int) -> Insn:
    return Insn(RET, value)


def goto(label: str) -> Insn:
    return Insn(GOTO, label)


def jump(op: int, k: int, then: str | None = None, otherwise: str | None = None) -> Insn:
    return Insn(op, k, then, otherwise)


def assemble(program: list[Insn | str]) -> bytes:
    """struct sock_filter[] for ``program``; raises ValueError for an unknown or out-of-reach label."""
    labels: dict[str, int] = {}
    insns: list[Insn] = []
    for item in program:
        if isinstance(item, str):
            if item in labels:
                raise ValueError(f"label {item!r} is defined twice")
            labels[item] = len(insns)
        else:
            insns.append(item)

    def offset(at: int, label: str | None, limit: int) -> int:
        if label is None:
            return 0
        if label not in labels:
            raise ValueError(f"no label {label!r}")
        distance = labels[label] - at - 1
        if not 0 <= distance <= limit:
            raise ValueError(f"label {label!r} is {distance} instructions from instruction {at}")
        return distance

    out = []
    for at, insn in enumerate(insns):
        if insn.code == GOTO:
            out.append(struct.pack("=HBBI", GOTO, 0, 0, offset(at, insn.k, 2**31)))
        else:
            jt, jf = offset(at, insn.then, MAX_JUMP), offset(at, insn.otherwise, MAX_JUMP)
            out.append(struct.pack("=HBBI", insn.code, jt, jf, insn.k))
    return b"".join(out)
