"""What the soak's ``--allocator pydebug`` and ``asan`` modes catch, shown once each (issue 30).

Not a timing and not in CI: each probe makes one mistake with CPython's own
allocator (``pymalloc``), in a child process, and prints the child's last
line under glibc alone, under CPython's debug hooks
(``PYTHONMALLOC=pymalloc_debug``) and under AddressSanitizer (``libasan``
preloaded)::

    python benchmarks/pymalloc_probes.py

The mistakes are the two that the earlier detectors of issue 30 could not
see, because they replaced ``pymalloc`` with ``malloc`` (memcheck, ASan) or
left it unwatched (the soaks):

- ``gil``: a Python allocation by a thread that does not hold the GIL (what a
  native thread does when it drops the last reference of a Python object
  without taking the GIL); ``pymalloc`` is not thread-safe, so two at once
  corrupt its pools;
- ``free``: C code freeing a Python block with ``free()`` as if ``malloc``
  had returned it. ``pymalloc``'s arenas come from ``mmap``, and glibc's
  ``free()`` of such memory is one way to issue 30's line (the table in
  ``docs/reliability.md``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_failure_paths import ASAN, rank_env  # noqa: E402

PROBES = {
    "gil": """
import ctypes
lib = ctypes.CDLL(None)  # a CDLL call lets go of the GIL, as a native thread runs without it
lib.PyMem_Malloc.restype = ctypes.c_void_p
lib.PyMem_Malloc.argtypes = [ctypes.c_size_t]
lib.PyMem_Malloc(64)
print("returned")
""",
    "free": """
import ctypes
api = ctypes.pythonapi
api.PyObject_Malloc.restype = ctypes.c_void_p
api.PyObject_Malloc.argtypes = [ctypes.c_size_t]
libc = ctypes.CDLL(None)
libc.free.argtypes = [ctypes.c_void_p]
blocks = [api.PyObject_Malloc(64) for _ in range(8)]
libc.free(blocks[4])
print("returned")
""",
}


def run(code: str, env: dict[str, str]) -> str:
    """The line of the child's output that names what happened, and how it ended."""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    # faulthandler's report of the signal (the soak turns it on) follows what glibc printed
    signal = next((n for n, line in enumerate(lines)
                   if line.startswith(("Fatal Python error: Aborted",
                                       "Fatal Python error: Segmentation fault"))), len(lines))
    said = next((line for line in lines[:signal] if "ERROR: AddressSanitizer" in line
                 or line.startswith("Fatal Python error")),
                lines[signal - 1] if signal else "")
    said = re.sub(r"^==\d+==", "", said.split(": 0x")[0])
    return f"{said} (exit {done.returncode})"


def main() -> None:
    # The soak's own rank environments, so each column is what its mode runs under.
    modes = {"glibc": rank_env("plain"), "pymalloc_debug": rank_env("pydebug")}
    if Path(ASAN).exists():
        modes["asan"] = rank_env("asan")
    print("| probe | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    for name, code in PROBES.items():
        cells = [run(code, env) for env in modes.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
