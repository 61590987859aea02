"""Programs that try to forge a code task's reward instead of solving it, shared by the code env's
tests and the arithmetic env's: each must score nothing (or the error reward) where it does not solve."""

from __future__ import annotations

FORGERIES = {
    "equals_everything": "class _Any:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                         "    __hash__ = lambda s: 0\n{defs}",
    "int_subclass": "class _Int(int):\n    __eq__ = lambda s, o: True\n{defs_int}",
    "str_subclass": "class _Str(str):\n    __eq__ = lambda s, o: True\n{defs_str}",
    "list_subclass": "class _List(list):\n    __eq__ = lambda s, o: True\n{defs_list}",
    "forged_line": "import sys\nframe = sys._getframe(1)\nmarker = frame.f_locals['marker']\n"
                   "print(marker + '{{\"loaded\": \"yes\", \"results\": []}}')\n{defs}",
    "forged_line_then_exit": "import sys, os\nframe = sys._getframe(1)\nmarker, calls = frame.f_locals['marker'], "
                             "frame.f_locals['calls']\n"
                             "print('\\n' + marker + __import__('json').dumps({{'loaded': 'yes', 'results': "
                             "[{{'value': 0}} for _ in calls]}}), flush=True)\nos._exit(0)",
    "exits_early": "import os\nos._exit(0)",
    "exits_in_call": "import sys\n{defs_exit}",
    "recursive_value": "{defs_recursive}",
    "huge_value": "{defs_huge}",
    "huge_int": "{defs_bigint}",
    "reads_frames": "import gc, sys\n{defs_frames}",
}
"""Each forgery's program, with the task's function to fill in (``forged``)."""
ENTRY_POINTS = {"gcd": 2, "reverse_words": 1, "primes_below": 1}
"""The bundled tasks a forgery can be written for, and how many arguments each function takes."""


def forged(kind: str, entry_point: str) -> str:
    """The ``kind`` forgery, defining ``entry_point`` as the task asks."""
    params = ", ".join(f"a{i}" for i in range(ENTRY_POINTS[entry_point]))
    body = {"defs": "return _Any()", "defs_int": "return _Int(0)", "defs_str": "return _Str('')",
            "defs_list": "return _List()", "defs_exit": "sys.exit(0)",
            "defs_recursive": "x = []\n    x.append(x)\n    return x", "defs_huge": "return [0] * 10**6",
            "defs_bigint": "return 7 ** 10**5",
            "defs_frames": "f = sys._getframe(1)\n    seen = [f.f_locals, f.f_globals.get('_rf_run')]\n"
                           "    return [repr(o)[:200] for o in gc.get_objects() if isinstance(o, dict) and "
                           "'expected' in o][:5] or repr(seen)[:500]"}
    defs = {key: f"def {entry_point}({params}):\n    {value}" for key, value in body.items()}
    return FORGERIES[kind].format(**defs)
