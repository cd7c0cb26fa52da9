"""Layout audit of every tensor that reaches a torch.distributed collective.

Active only when the environment variable AUDIT_LAYOUT_DIR is set (then every
python process that has this directory on PYTHONPATH imports torch.distributed
at startup and installs the hooks below). Three layers are hooked:

  py  : the python functions of torch.distributed.distributed_c10d (all_reduce,
        broadcast, ...) and torch.distributed._functional_collectives, replaced
        in every module that already holds a reference to them;
  pg  : the pybind methods of ProcessGroup, Backend and ProcessGroupGloo
        (allreduce, broadcast, ...), replaced at class level;
  op  : the dispatcher ops c10d::* (what every ProcessGroup method, DDP's C++
        reducer and the functional collectives' C++ kernels end in) and
        _c10d_functional::*, via a python kernel at the BackendSelect key (in
        every dispatch, inference_mode included) that checks and then
        redispatches below it.

A tensor is a finding when it is not contiguous, has a dimension of size > 1
with stride 0, torch._debug_has_internal_overlap(t) != 0, or its byte extent
data_ptr + numel * element_size passes the end of its untyped storage.

Output in $AUDIT_LAYOUT_DIR, per process id:
  calls.<pid>.log        one line per hooked call: "<layer> <name>" (crash-proof count)
  findings.<pid>.jsonl   one JSON object per bad tensor
  xoverlap.<pid>.jsonl   first few calls whose distinct tensors share memory (info)
  meta.<pid>.json        argv, ppid
  summary.<pid>.json     call counts per function, written at exit
  errors.<pid>.log       exceptions inside the hooks (never raised into the program)
  wrapped.txt            what was hooked (rewritten by every process)

Usage
-----
A diagnostic, not part of the test suite: nothing imports this directory.
Python's ``site`` module imports a module named ``sitecustomize`` from sys.path
at interpreter startup, before the script's own directory is added, so this
file is loaded only by a process that has this directory on PYTHONPATH, and
then does nothing unless AUDIT_LAYOUT_DIR is set as well. Give both as
absolute paths: the test jobs start their workers in other directories.
PYTHONDONTWRITEBYTECODE=1 keeps a __pycache__ out of this directory.

    PYTHONPATH=$PWD/benchmarks/layout_audit AUDIT_LAYOUT_DIR=/tmp/out \\
        PYTHONDONTWRITEBYTECODE=1 \\
        .venv/bin/python -m pytest tests/adapters/torch/test_fsdp.py -q -p no:cacheprovider
    .venv/bin/python benchmarks/layout_audit/analyze.py /tmp/out

The proof that the hooks see a bad layout (2 gloo ranks; sets both variables
for its ranks itself; OUT must be absent or empty; exits 1 if the expectation
fails: findings at the py, pg and op layers for "strided", none for
"contiguous"):

    .venv/bin/python benchmarks/layout_audit/proof.py strided /tmp/proof_strided
    .venv/bin/python benchmarks/layout_audit/proof.py contiguous /tmp/proof_contiguous
"""

from __future__ import annotations

import os
from typing import Any

_DIR = os.environ.get("AUDIT_LAYOUT_DIR")

# The pybind methods of ProcessGroup, Backend and ProcessGroupGloo (layer "pg").
_PG_METHODS = [
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
    "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "gather", "scatter", "alltoall_base", "alltoall", "send", "recv",
    "recv_anysource", "barrier", "monitored_barrier", "all_gather_single",
    "all_gather_single_coalesced", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "all_to_all_single",
]
# The python functions of torch.distributed.distributed_c10d (layer "py").
_C10D_FUNCTIONS = [
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_coalesced", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_single", "reduce_scatter_single",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "gather",
    "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
    "all_gather_object", "gather_object", "broadcast_object_list",
    "scatter_object_list", "send_object_list", "recv_object_list",
]
# The python functions of torch.distributed._functional_collectives (layer "py").
_FUNCOL_FUNCTIONS = [
    "broadcast", "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd",
    "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced", "all_to_all_single",
    "all_to_all_single_autograd", "permute_tensor",
]
# Dispatcher ops (layer "op") that move no tensor data worth checking.
_SKIPPED_OPS = ("check_for_nan", "wait_tensor", "_wrap_tensor_autograd")


def _install() -> None:
    import atexit
    import contextlib
    import json
    import sys
    import threading
    import traceback
    from collections import Counter

    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return
    import torch.distributed._functional_collectives as fc
    import torch.distributed.distributed_c10d as c10d
    from torch._C import DispatchKey

    assert _DIR is not None
    out_dir: str = _DIR
    os.makedirs(out_dir, exist_ok=True)
    here = os.path.abspath(__file__)
    lock = threading.RLock()
    state: dict[str, Any] = {"pid": None, "calls": None, "counts": Counter(), "xoverlap": 0}
    local = threading.local()

    def files() -> int:
        """This process's id; (re)opens the output files after a fork."""
        pid = os.getpid()
        if state["pid"] != pid:
            state["pid"] = pid
            state["counts"] = Counter()
            state["xoverlap"] = 0
            # kept open, line-buffered, for the process's life: a crash loses no call
            state["calls"] = open(os.path.join(out_dir, f"calls.{pid}.log"), "a", buffering=1)
            with open(os.path.join(out_dir, f"meta.{pid}.json"), "w") as f:
                json.dump({"pid": pid, "ppid": os.getppid(), "argv": sys.argv}, f)
        return pid

    def stack(limit: int) -> list[traceback.FrameSummary]:
        frames = [f for f in traceback.extract_stack() if os.path.abspath(f.filename) != here]
        return frames[-limit:]

    def callers(frames: list[traceback.FrameSummary]) -> list[str]:
        return [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames]

    def tensors(obj: object, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)) and depth < 4:
            for x in obj:
                tensors(x, out, depth + 1)
        elif isinstance(obj, dict) and depth < 4:
            for x in obj.values():
                tensors(x, out, depth + 1)
        return out

    def problems(t: torch.Tensor) -> dict[str, Any] | None:
        try:
            if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
                # a subclass (DTensor, AsyncCollectiveTensor...): check its plain data if any
                inner = getattr(t, "_local_tensor", None)
                if inner is None:
                    inner = getattr(t, "elem", None)
                if not isinstance(inner, torch.Tensor):
                    return None
                t = inner
            if t.layout != torch.strided or t.device.type == "meta":
                return None
            why = []
            if not t.is_contiguous():
                why.append("non_contiguous")
            if any(size > 1 and st == 0 for size, st in zip(t.shape, t.stride(), strict=False)):
                why.append("stride0_dim")
            overlap = int(torch._debug_has_internal_overlap(t))
            if overlap != 0:
                why.append(f"internal_overlap={overlap}")
            storage = t.untyped_storage()
            end = t.data_ptr() + t.numel() * t.element_size()
            storage_end = storage.data_ptr() + storage.nbytes()
            if t.numel() > 0 and end > storage_end:
                why.append("extent_past_storage")
            if not why:
                return None
            return {
                "why": why,
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "storage_offset": t.storage_offset(),
                "dtype": str(t.dtype),
                "element_size": t.element_size(),
                "storage_nbytes": storage.nbytes(),
                "bytes_past_storage_end": end - storage_end,
                "overlap_code": overlap,
            }
        except Exception as exc:  # never break the program under audit
            return {"why": ["check_failed"], "error": repr(exc)}

    def cross_overlap(ts: list[torch.Tensor]) -> list[list[Any]] | None:
        spans = []
        for t in ts:
            try:
                if t.layout != torch.strided or t.numel() == 0 or t.device.type == "meta":
                    continue
                lo = t.data_ptr()
                hi = lo + t.numel() * t.element_size()
                spans.append((lo, hi, t))
            except Exception:
                pass
        for i in range(len(spans)):
            for j in range(i + 1, len(spans)):
                a, b = spans[i], spans[j]
                if a[0] < b[1] and b[0] < a[1] and not (a[0] == b[0] and a[1] == b[1]):
                    return [[list(a[2].shape), list(a[2].stride()), a[2].storage_offset()],
                            [list(b[2].shape), list(b[2].stride()), b[2].storage_offset()]]
        return None

    def audit(layer: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            ts = tensors(args, [])
            tensors(kwargs, ts)
            with lock:
                pid = files()
                key = f"{layer} {name}"
                state["counts"][key] += 1
                state["calls"].write(key + "\n")

                def record(kind: str, **fields: Any) -> None:
                    frames = stack(40)
                    line = {"pid": pid, "layer": layer, "function": name, **fields,
                            "callers": callers(frames)}
                    if kind == "findings":
                        line["stack"] = "".join(traceback.format_list(frames[-8:]))
                    with open(os.path.join(out_dir, f"{kind}.{pid}.jsonl"), "a") as f:
                        f.write(json.dumps(line) + "\n")

                for index, t in enumerate(ts):
                    bad = problems(t)
                    if bad is not None:
                        record("findings", arg_index=index,
                               thread=threading.current_thread().name, **bad)
                if state["xoverlap"] < 5 and len(ts) > 1:
                    shared = cross_overlap(ts)
                    if shared is not None:
                        state["xoverlap"] += 1
                        record("xoverlap", tensors=shared)
        except Exception as exc:
            with contextlib.suppress(Exception):
                with open(os.path.join(out_dir, f"errors.{os.getpid()}.log"), "a") as f:
                    f.write(f"{layer} {name}: {exc!r}\n")
        finally:
            local.busy = False

    # -- pg: pybind methods, at class level ----------------------------------------------
    ext = torch._C._distributed_c10d
    wrapped = []
    for cls in (ext.ProcessGroup, ext.Backend, getattr(ext, "ProcessGroupGloo", None)):
        if cls is None:
            continue
        for m in _PG_METHODS:
            original = cls.__dict__.get(m)
            if original is None:
                continue

            def make_method(
                original: Any = original, name: str = m, label: str = f"{cls.__name__}.{m}"
            ) -> Any:
                def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                    audit("pg", label, args, kwargs)
                    return original(self, *args, **kwargs)

                method.__name__ = name
                method.__wrapped__ = original
                return method

            try:
                setattr(cls, m, make_method())
                wrapped.append(f"pg {cls.__name__}.{m}")
            except Exception as exc:
                wrapped.append(f"pg {cls.__name__}.{m} FAILED {exc!r}")

    # -- py: python functions, replaced wherever they are referenced ---------------------
    replacements = {}
    modules = ((c10d, _C10D_FUNCTIONS, "c10d"), (fc, _FUNCOL_FUNCTIONS, "funcol"))
    for module, names, label in modules:
        for n in names:
            original = getattr(module, n, None)
            if not callable(original) or id(original) in replacements:
                continue

            def make_function(original: Any = original, tag: str = f"{label}.{n}") -> Any:
                def function(*args: Any, **kwargs: Any) -> Any:
                    audit("py", tag, args, kwargs)
                    return original(*args, **kwargs)

                # as functools.update_wrapper, but without copying __dict__
                for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
                    with contextlib.suppress(Exception):
                        setattr(function, attr, getattr(original, attr))
                function.__wrapped__ = original
                return function

            replacements[id(original)] = make_function()
            wrapped.append(f"py {label}.{n}")
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict) or not getattr(mod, "__name__", "").startswith("torch"):
            continue
        for k, v in list(d.items()):
            if callable(v) and id(v) in replacements:
                with contextlib.suppress(Exception):
                    setattr(mod, k, replacements[id(v)])

    # -- op: dispatcher ops, a python kernel at BackendSelect (inference_mode too) -------
    libs = []
    for namespace in ("c10d", "_c10d_functional"):
        lib = torch.library.Library(namespace, "IMPL")
        libs.append(lib)
        names = sorted(
            n.split("::", 1)[1]
            for n in torch._C._dispatch_get_all_op_names()
            if n.startswith(namespace + "::")
        )
        for n in names:
            if n in _SKIPPED_OPS:
                continue
            packet = getattr(getattr(torch.ops, namespace), n, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                name = n if overload == "default" else f"{n}.{overload}"

                def make_kernel(op: Any = op, tag: str = f"{namespace}::{name}") -> Any:
                    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
                        audit("op", tag, args, kwargs)
                        below = keyset.remove(DispatchKey.BackendSelect)
                        return op.redispatch(below, *args, **kwargs)

                    return kernel

                try:
                    lib.impl(name, make_kernel(), "BackendSelect", with_keyset=True)
                    wrapped.append(f"op {namespace}::{name}")
                except Exception as exc:
                    wrapped.append(f"op {namespace}::{n}.{overload} FAILED {exc!r}")
    state["libs"] = libs  # keep the registrations alive

    def summary() -> None:
        try:
            pid = files()
            with open(os.path.join(out_dir, f"summary.{pid}.json"), "w") as f:
                record = {"pid": pid, "argv": sys.argv, "counts": dict(state["counts"])}
                json.dump(record, f, indent=1)
        except Exception:
            pass

    atexit.register(summary)
    with open(os.path.join(out_dir, "wrapped.txt"), "w") as f:
        f.write("\n".join(wrapped) + "\n")


if _DIR:
    try:
        _install()
    except Exception as _exc:  # report, never break the interpreter
        import sys as _sys

        print(f"[audit sitecustomize] install failed: {_exc!r}", file=_sys.stderr)
