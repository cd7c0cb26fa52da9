#!/usr/bin/env bash
# The CUDA-gated tests, run by hand on a machine with a GPU (CI has none); each run
# is recorded in docs/cuda.md with its date. It uses that machine's python3 and torch
# and joinkit from a wheel in .whl/ (python -m build --wheel --outdir .whl here).
# Logs go to $OUT (or /tmp).
set -u
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi -L
[ -d /tmp/site/joinkit ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
if [ "${GPU_CHECK_UNGUARDED:-0}" = 1 ]; then
    # Only for a machine whose torch is outside joinkit's range (its guard refuses the
    # adapters there): every process skips the guard, so the tests show what else breaks.
    cat > /tmp/site/sitecustomize.py <<'PY'
import joinkit.adapters.torch._private as _guard
_guard.check = lambda obj: None
PY
fi
python3 - <<'PY'
import sys, torch, torch.distributed as dist, joinkit
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0),
      "nccl", dist.is_nccl_available() and torch.cuda.nccl.version(), "joinkit", joinkit.__file__)
PY
python3 -m pip list 2>/dev/null | grep -iE "^(pytest|pytest-timeout|hypothesis|torchmetrics|pytorch-lightning|mpi4py|numpy|attrs) "
[ $# -gt 0 ] || set -- \
    tests/adapters/test_gather_cuda.py \
    tests/adapters/torch/test_side_cuda.py \
    tests/elastic/test_elastic_torch.py::test_nccl_is_refused_on_entry \
    tests/elastic/test_elastic_fsdp.py::test_a_cuda_model_is_refused \
    tests/adapters/torch/test_fsdp.py::test_real_sync_batch_norm_on_cuda \
    tests/adapters/torch/test_fsdp.py::test_fsdp_over_nccl \
    tests/adapters/lightning/test_lightning_unit.py::test_fabric_fsdp1_is_refused_with_the_way_out \
    tests/adapters/torch/test_ddp_eval.py::test_over_nccl \
    tests/adapters/torch/test_ddp_round.py::test_over_nccl \
    tests/adapters/deepspeed/test_deepspeed.py::test_the_training_cells_on_nccl
timeout "${GPU_CHECK_SECONDS:-420}" python3 -m pytest -p no:cacheprovider -rA -v --timeout 400 \
    --durations=10 "$@" 2>&1 | tee "$out/pytest${GPU_CHECK_UNGUARDED:-}.log"
echo "PYTEST RC ${PIPESTATUS[0]}"
