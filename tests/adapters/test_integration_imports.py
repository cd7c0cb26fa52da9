"""The integrations (``joinkit.adapters.ray``, ``.accelerate``, ``.transformers``) import
their framework only when used, and say which extra to install when it is missing.

Runs in the main job (both frameworks installed) and in the no-torch job
(.ci/notorch.sh: neither installed), each in a fresh interpreter.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.launches

FRAMEWORKS = {"ray": "ray", "accelerate": "accelerate", "transformers": "transformers"}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd="/")


def test_importing_joinkit_and_the_integrations_imports_no_framework() -> None:
    done = _python(
        "import sys, joinkit, joinkit.adapters, joinkit.adapters.ray, "
        "joinkit.adapters.accelerate, joinkit.adapters.transformers\n"
        "print(sorted(m for m in ('ray', 'accelerate', 'torch', 'transformers', 'trl')"
        " if m in sys.modules))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("adapter", sorted(FRAMEWORKS))
def test_a_missing_framework_names_the_extra(adapter: str) -> None:
    # Missing for real in the no-torch job; here, made unimportable.
    block = "" if importlib.util.find_spec(FRAMEWORKS[adapter]) is None else (
        f"import sys; sys.modules[{FRAMEWORKS[adapter]!r}] = None\n")
    call = {
        "ray": "from joinkit.adapters.ray import report; report({'loss': 1.0})",
        "accelerate": "from joinkit.adapters.accelerate import unwrap; unwrap(object())",
        "transformers": ("from joinkit.adapters.transformers import uneven_inputs; "
                         "uneven_inputs(object())"),
    }[adapter]
    done = _python(block + call)
    assert done.returncode == 1
    assert f"pip install 'joinkit[{adapter}]'" in done.stderr, done.stderr
