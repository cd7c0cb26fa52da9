"""DeepSpeed's C++ ops the tests use, built once before the launched jobs.

``DeepSpeedCPUAdam`` (ZeRO-Offload's own optimizer) is a C++ extension that
DeepSpeed JIT-compiles with ninja into ``~/.cache/torch_extensions`` on first
use: about 2.5 minutes on 2 idle cores, once per machine. Inside a launched job
that build would count against the job's timeout, with every rank but one
waiting on its lock file; :func:`build_cpu_adam` builds it in a process of its
own first, or fails the test saying why.

This module imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

#: The build's limit: 2.5 minutes on 2 idle cores, more on loaded ones.
BUILD_TIMEOUT = 1200.0


def build_cpu_adam(env: dict[str, str], cwd: Path) -> None:
    """Build (or load, once built) DeepSpeed's CPU Adam op in a process of its own.

    Args:
        env: the launched jobs' environment (``DS_ACCELERATOR=cpu`` on a CPU machine).
        cwd: where to run it.
    """
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    try:
        subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, check=True,
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"DeepSpeedCPUAdam's build took over {BUILD_TIMEOUT:.0f} s. A build killed "
                    "earlier leaves ~/.cache/torch_extensions/*/cpu_adam/lock behind, and every "
                    f"later one waits on it: delete it when no build runs.\n{error.stdout}")
    except subprocess.CalledProcessError as error:
        pytest.fail("DeepSpeedCPUAdam could not be built (DeepSpeed compiles it with a C++ "
                    f"compiler and ninja):\n{error.stdout[-3000:]}\n{error.stderr[-3000:]}")
