"""Writes ``_syscalls_x86_64.py`` and ``_syscalls_aarch64.py``: each architecture's syscall numbers
and audit architecture, read from the kernel's own headers as Debian ships them, never typed by hand.

    python envs/code/_syscalls_generate.py

Needs Debian's ``apt-get download`` and ``dpkg-deb``, and gcc (its preprocessor resolves the
headers' aliases and conditionals, as a compiler for that architecture would). The sandbox never
runs this; the tables it writes are committed, and ``tests/test_seccomp.py`` checks them.
"""

from __future__ import annotations

import functools
import operator
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# architecture -> (Debian package, its include folders, header, what a compiler for it predefines)
SOURCES = {
    "x86_64": ("linux-libc-dev:amd64", ("usr/include/x86_64-linux-gnu", "usr/include"), "asm/unistd_64.h",
               "__x86_64__"),
    "aarch64": ("linux-libc-dev-arm64-cross", ("usr/aarch64-linux-gnu/include",), "asm/unistd.h", "__aarch64__"),
}
# Macros named like syscalls that are not ones: a count and the start of a range.
_NOT_SYSCALLS = {"syscalls", "arch_specific_syscall"}
_HERE = Path(__file__).resolve().parent


def _unpack(package: str, into: Path) -> str:
    """Download ``package`` with apt-get into ``into``, unpack it there; its name and version."""
    subprocess.run(["apt-get", "download", package], cwd=into, check=True, capture_output=True)
    deb = next(into.glob(package.split(":")[0] + "_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into / "root")], check=True)
    fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version", "Architecture"], check=True,
                            capture_output=True, text=True).stdout
    name, version, arch = (line.split(": ", 1)[1] for line in fields.splitlines())
    return f"{name} {version} ({arch})"


def _macros(includes: list[Path], header: str, predefined: str) -> dict[str, str]:
    """Every macro the header and linux/audit.h define, as gcc sees them for that architecture."""
    source = f"#include <{header}>\n#include <linux/audit.h>\n"
    folders = [arg for include in includes for arg in ("-isystem", str(include))]
    out = subprocess.run(["gcc", "-E", "-dM", "-nostdinc", "-undef", f"-D{predefined}", *folders, "-x", "c", "-"],
                         input=source, check=True, capture_output=True, text=True).stdout
    found = (re.match(r"#define (\w+) (.+)", line) for line in out.splitlines())
    return {m[1]: m[2].strip() for m in found if m}


def _value(macros: dict[str, str], name: str) -> int:
    """A macro's number, through aliases (``__NR_fcntl`` -> ``__NR3264_fcntl`` -> 25) and ``|``."""
    text = macros[name].strip("()")
    if "|" in text:
        return functools.reduce(operator.or_, (_value(macros, part.strip()) for part in text.split("|")))
    return int(text, 0) if text[0].isdigit() else _value(macros, text)


def _module(arch: str, package: str, header: str, numbers: dict[str, int], audit_arch: int) -> str:
    lines = [f'"""{arch} syscall numbers, written by envs/code/_syscalls_generate.py: do not edit.', "",
             f"From Debian's {package}:", f"{header} and linux/audit.h, read through gcc -E -dM.", '"""', "",
             f'SOURCE = "{package}: {header}"', f"AUDIT_ARCH = {audit_arch:#x}", "NUMBERS = {"]
    lines += [f'    "{name}": {number},' for name, number in sorted(numbers.items(), key=lambda item: item[1])]
    return "\n".join(lines + ["}", ""])


def from_headers(arch: str, includes: list[Path]) -> tuple[dict[str, int], int]:
    """``arch``'s syscall numbers by name and its audit architecture, from headers under ``includes``."""
    _, _, header, predefined = SOURCES[arch]
    macros = _macros(includes, header, predefined)
    numbers = {name[len("__NR_"):]: _value(macros, name) for name in macros
               if name.startswith("__NR_") and name[len("__NR_"):] not in _NOT_SYSCALLS}
    if len(set(numbers.values())) != len(numbers):
        raise SystemExit(f"two syscalls share a number in {header}")
    return numbers, _value(macros, f"AUDIT_ARCH_{arch.upper()}")


def generate(arch: str, workdir: Path) -> str:
    package, includes, header, _ = SOURCES[arch]
    described = _unpack(package, workdir)
    numbers, audit_arch = from_headers(arch, [workdir / "root" / include for include in includes])
    return _module(arch, described, f"{includes[0]}/{header}", numbers, audit_arch)


def main() -> None:
    for arch in SOURCES:
        with tempfile.TemporaryDirectory() as workdir:
            text = generate(arch, Path(workdir))
        (_HERE / f"_syscalls_{arch}.py").write_text(text)
        print(f"wrote _syscalls_{arch}.py", file=sys.stderr)


if __name__ == "__main__":
    main()
