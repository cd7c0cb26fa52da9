"""The DeepSpeed internals joinkit's DeepSpeed adapter relies on, and their check.

Theory of operation
-------------------
``Join([engine])`` replays a DeepSpeed engine's step on a joined rank through
the engine's public ``forward``, ``backward`` and ``step``, but it also reads
members DeepSpeed does not promise to keep: the engine's data-parallel group
and world size (the Join's group, the divisor), its configuration accessors
(what it refuses: pipeline parallelism, MoE, NVMe offload...), its micro-step
counter and the accumulation boundary flag it keeps in
``_is_gradient_accumulation_boundary`` (a joined rank replays with the
counter's boundary), and it replaces ``step`` and
``set_gradient_accumulation_boundary`` on the engine object while a Join lasts.
A release that renamed one of them could make a joined rank replay a
different step than the active ranks run, which is a hang at best and wrong
gradients at worst. So each member is listed here, in the format of
``adapters._guards`` (whose checker this module uses), and
:func:`check` runs once per process when an engine is first adapted. It raises
:class:`UnsupportedDeepSpeedError` naming this DeepSpeed's version and every
member it lacks or changed. The table decides what runs, not the version
number: the ``[deepspeed]`` extra says :data:`SUPPORTED_DEEPSPEED`, the oldest
release current a year before this joinkit and up, with no upper bound; the
replay's behaviour (which collectives a micro-step runs) is what the adapter's
tests check, on the oldest and the newest of :data:`TESTED_DEEPSPEED`
(docs/compat.md). Nothing is checked per iteration.

*What differs between supported releases* is resolved here, once per process,
from the release's own code (not its version number):
:func:`managed_accumulation` (a setting 0.18.3 added),
:func:`zero2_keeps_last_micro_step` and :func:`no_sync_skips_accumulation_scaling`
(two accumulation bugs 0.18.3 fixed, in releases below the range) and
:func:`zero2_offload_drops_middle_micro_steps` (one 0.19.0 fixed, in 0.18.2 to 0.18.9),
which the adapter refuses rather than train wrongly, and :func:`zero12_step_raises_on_cpu`
(0.18.7 to 0.18.9, fixed in 0.19.0), refused rather than let every rank raise at its
first optimizer step.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Any

from .._guards import Member, Need, problems, refusal, supported_spec

__all__ = ["SUPPORTED_DEEPSPEED", "TESTED_DEEPSPEED", "UnsupportedDeepSpeedError",
           "ENGINE_MEMBERS", "OPTIONAL_MEMBERS", "check", "is_engine", "managed_accumulation",
           "no_sync_skips_accumulation_scaling", "zero2_keeps_last_micro_step",
           "zero12_step_raises_on_cpu", "zero2_offload_drops_middle_micro_steps",
           "zero3_gather_races_on_cpu"]

#: The DeepSpeed releases joinkit's tests passed on: the oldest supported and the
#: dev pin (``constraints.txt``).
TESTED_DEEPSPEED = ("0.18.3", "0.19.8")
#: The ``[deepspeed]`` extra's range (no upper bound: :data:`ENGINE_MEMBERS` decides).
SUPPORTED_DEEPSPEED = supported_spec(TESTED_DEEPSPEED)


class UnsupportedDeepSpeedError(RuntimeError):
    """This DeepSpeed lacks or changed an internal the adapter relies on
    (``joinkit.adapters.deepspeed._private``).

    Raised when ``Join`` adapts an engine, once per process, before any collective.
    """
_ENGINE = "deepspeed.runtime.engine"
_PIPE = "deepspeed.runtime.pipe.engine"
_BASE = "deepspeed.runtime.base_optimizer"
_STAGE12 = "deepspeed.runtime.zero.stage_1_and_2"
_STAGE3 = "deepspeed.runtime.zero.stage3"
_PARTITION = "deepspeed.runtime.zero.partition_parameters"


def _m(module: str, name: str, need: Need, why: str, params: tuple[str, ...] = (),
       called_by: tuple[str, ...] = ()) -> Member:
    return Member(module=module, name=name, need=need, params=params, called_by=called_by,
                  why=why)


def _config(name: str, why: str) -> Member:
    return _m(_ENGINE, f"DeepSpeedEngine.{name}", Need.CALLABLE, why, ("self",))


def _attribute(name: str, why: str) -> Member:
    return _m(_ENGINE, f"DeepSpeedEngine.{name}", Need.ATTRIBUTE, why)


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` is a DeepSpeed engine (never imports DeepSpeed)."""
    module = sys.modules.get(_ENGINE)
    cls = getattr(module, "DeepSpeedEngine", None)
    return isinstance(cls, type) and isinstance(obj, cls)


#: Members of the engine (and around it) that the adapter reads or replaces.
ENGINE_MEMBERS = (
    _m(_ENGINE, "DeepSpeedEngine", Need.EXISTS, "the class Join adapts"),
    _m(_ENGINE, "DeepSpeedEngine.forward", Need.CALLABLE,
       "a joined rank's replay calls the engine on an empty batch (wrapped by "
       "DeepSpeed's instrumentation: no signature to check)"),
    _m(_ENGINE, "DeepSpeedEngine.backward", Need.CALLABLE,
       "a joined rank's replay runs backward from a zero loss (wrapped like forward)"),
    _m(_ENGINE, "DeepSpeedEngine.step", Need.CALLABLE,
       "a joined rank's replay steps; replaced on the engine while a Join lasts to see "
       "the active rank's step", ("self",)),
    _m(_ENGINE, "DeepSpeedEngine.set_gradient_accumulation_boundary", Need.CALLABLE,
       "replaced on the engine while a Join lasts: a boundary a joined rank cannot "
       "replay is refused", ("self", "is_boundary")),
    _attribute("_is_gradient_accumulation_boundary",
               "the boundary set from outside, which a replay sets aside (it replays the "
               "micro-step counter's boundary, as every active rank runs it)"),
    _attribute("micro_steps", "the micro-step counter that decides the boundary"),
    _config("gradient_accumulation_steps", "the boundary; the divisor"),
    _attribute("data_parallel_group", "the Join's process group (its heartbeat)"),
    _attribute("seq_data_parallel_group", "ZeRO's group, which must be the Join's"),
    _attribute("dp_world_size", "the divisor of DeepSpeed's gradient average"),
    _attribute("device", "the Join's device"),
    _attribute("gradient_average", "whether DeepSpeed averages or sums gradients"),
    _attribute("inside_no_sync_ctxt",
               "no_sync() and coalesce_grad_reduction() are refused (a joined rank "
               "cannot tell such a micro-step)"),
    _attribute("optimizer", "Join refuses the engine's optimizer listed beside it"),
    _attribute("basic_optimizer", "Join refuses the engine's optimizer listed beside it"),
    _attribute("client_optimizer", "Join refuses the engine's optimizer listed beside it"),
    _attribute("lr_scheduler", "Join refuses the engine's scheduler listed beside it"),
    _attribute("client_lr_scheduler", "Join refuses the engine's scheduler listed beside it"),
    _attribute("has_moe_layers", "MoE is refused"),
    _attribute("pipeline_parallelism", "pipeline parallelism is refused"),
    _attribute("sequence_parallel_size", "sequence parallelism is refused"),
    _attribute("mp_world_size", "model parallelism (mpu) is refused"),
    _attribute("zenflow", "ZenFlow is refused"),
    _config("zero_optimization_stage", "the stage, for messages and refusals"),
    _config("zero_offload_optimizer", "offload to NVMe is refused"),
    _config("zero_offload_param", "offload to NVMe is refused"),
    _config("is_deepcompile_enabled", "DeepCompile is refused"),
    _config("autotp_size", "AutoTP is refused"),
    _config("zero_hpz_partition_size", "ZeRO++ is refused"),
    _config("zero_quantized_weights", "ZeRO++ is refused"),
    _config("zero_quantized_gradients", "ZeRO++ is refused"),
    _m(_STAGE12, "DeepSpeedZeroOptimizer.dp_process_group", Need.ATTRIBUTE,
       "the group ZeRO-1/2 reduce on: the Join's group (its collective counter)"),
    _m(_STAGE3, "DeepSpeedZeroOptimizer_Stage3.dp_process_group", Need.ATTRIBUTE,
       "the group ZeRO-3 gathers and reduces on: the Join's group"),
    _m(_PIPE, "PipelineEngine", Need.EXISTS, "pipeline parallelism is refused"),
    _m(_BASE, "DeepSpeedOptimizer", Need.EXISTS,
       "an engine's optimizer listed in Join is refused with a message"),
)

#: Members that only some supported releases have: each is checked where present, and
#: :func:`managed_accumulation` says what its absence means (one place per member).
OPTIONAL_MEMBERS = (
    _config("managed_gradient_accumulation", "unmanaged accumulation is refused"),
)


def managed_accumulation(engine: Any) -> bool:
    """Whether ``engine`` counts the micro-steps and runs the boundary itself.

    The ``managed_gradient_accumulation`` setting came in DeepSpeed 0.18.3; before
    it (0.18.2, below the range) every engine manages its accumulation.
    """
    setting = getattr(engine, "managed_gradient_accumulation", None)
    return True if setting is None else bool(setting())


def _method_source(module: str, owner: str, method: str) -> str:
    """The source of DeepSpeed's ``owner.method`` in ``module`` (the compat checks
    read it once per process), or ``""`` where it cannot be read."""
    cls = getattr(importlib.import_module(module), owner, None)
    try:
        return inspect.getsource(getattr(cls, method))
    except (AttributeError, OSError, TypeError):
        return ""


#: ZeRO-1/2's end of a backward, where a window's gradient is summed (0.18.2's
#: spelling of the test that restarts the sum: :func:`zero2_keeps_last_micro_step`).
_EPILOGUE = "independent_gradient_partition_epilogue"
_RESTARTS_EACH_MICRO_STEP = ("if not i in self.averaged_gradients or "
                             "self.averaged_gradients[i] is None:")


@functools.cache
def zero2_keeps_last_micro_step() -> bool:
    """Whether this DeepSpeed's ZeRO-2 steps on a window's last micro-step alone.

    DeepSpeed 0.18.2 (fixed in 0.18.3) sums a window's gradient in
    ``DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue`` after every
    backward, but starts the sum again whenever ``averaged_gradients[i]`` is ``None``,
    which it is on every micro-step before the boundary: under ZeRO-2 without
    optimizer offload and with ``gradient_accumulation_steps > 1``, the optimizer
    steps on the boundary micro-step's gradient only, with or without a Join (0.18.3
    tests ``all_grad_tensors[i]`` instead). Read once per process from that method's
    source: its 0.18.2 line; a release without it (or whose source cannot be read)
    sums the whole window.
    """
    source = _method_source(_STAGE12, "DeepSpeedZeroOptimizer", _EPILOGUE)
    return _RESTARTS_EACH_MICRO_STEP in source


#: The engine's backward prologue, where a micro-step's loss is divided by the
#: accumulation steps (0.18.2's gate: :func:`no_sync_skips_accumulation_scaling`).
_PROLOGUE = "_backward_prologue"
_SCALES_OUTSIDE_NO_SYNC = ("not self.inside_no_sync_ctxt",
                           "if do_gradient_reduction and self.gradient_accumulation_steps() > 1")


@functools.cache
def no_sync_skips_accumulation_scaling() -> bool:
    """Whether this DeepSpeed leaves a micro-step under ``engine.no_sync()`` undivided.

    DeepSpeed 0.18.2 (fixed in 0.18.3) divides a micro-step's loss by
    ``gradient_accumulation_steps`` in ``DeepSpeedEngine._backward_prologue`` only when
    the backward reduces, so a micro-step inside ``engine.no_sync()`` (Accelerate's
    ``accumulate()`` under ZeRO 0 and 1) adds ``gradient_accumulation_steps`` times its
    share to the window's gradient, with or without a Join (0.18.3 divides every
    micro-step). Read once per process from that method's source: 0.18.2's gate; a
    release without it (or whose source cannot be read) divides every micro-step.
    """
    source = _method_source(_ENGINE, "DeepSpeedEngine", _PROLOGUE)
    return all(line in source for line in _SCALES_OUTSIDE_NO_SYNC)


#: ZeRO-1/2's copy of a micro-step's gradient to the CPU under optimizer offload
#: (0.18.3-0.18.9's branch: :func:`zero2_offload_drops_middle_micro_steps`).
_OFFLOAD_ACCUMULATION = "async_accumulate_grad_in_cpu_via_gpu"
_SAVES_THE_FIRST_MICRO_STEP_ONLY = "accumulate_gradients() else: copy_gradients_to_cpu()"


@functools.cache
def zero2_offload_drops_middle_micro_steps() -> bool:
    """Whether this DeepSpeed's ZeRO-2 with optimizer offload drops a window's middle
    micro-steps.

    DeepSpeed 0.18.2 to 0.18.9 (fixed in 0.19.0) keep a window's gradient sum on the
    CPU in ``DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu``: each
    micro-step after the first adds that sum to its own gradient, but only the first
    copies the result back (``if micro_step_id > 0: accumulate_gradients() else:
    copy_gradients_to_cpu()``), so with ``gradient_accumulation_steps > 2`` the
    optimizer steps on the first and the last micro-step's gradients alone, with or
    without a Join (ZeRO-2 reduces every micro-step; ZeRO-1 reduces at the boundary
    only and never reaches the branch before it). Read once per process from that
    method's source, whitespace aside; a release without the branch (or whose
    source cannot be read) sums the whole window.
    """
    source = _method_source(_STAGE12, "DeepSpeedZeroOptimizer", _OFFLOAD_ACCUMULATION)
    return _SAVES_THE_FIRST_MICRO_STEP_ONLY in " ".join(source.split())


#: ZeRO-1/2's flattening of a parameter group where it lives, in the optimizer's
#: constructor (0.18.7-0.18.9's spelling, without ``.detach()``:
#: :func:`zero12_step_raises_on_cpu`).
_CONSTRUCTOR = "__init__"
_KEEPS_THE_FLAT_BUFFER_IN_AUTOGRAD = (
    "use_cpu_data=False) self.bit16_groups_flat.append(flattened_buffer)")


@functools.cache
def zero12_step_raises_on_cpu() -> bool:
    """Whether this DeepSpeed's ZeRO-1/2 raises at its first optimizer step on the CPU.

    DeepSpeed 0.18.7 to 0.18.9 (fixed in 0.19.0; 0.18.6 and older flatten a copy on the
    CPU) flatten each parameter group where it lives when there is memory for it, in
    ``DeepSpeedZeroOptimizer.__init__``: ``torch.cat`` of the parameters, which require
    grad, kept as the flat buffer without ``.detach()``, so the buffer is part of an
    autograd graph. The optimizer step all-gathers the updated partitions into that
    buffer; gloo (the CPU accelerator) writes each rank's part into a view from
    ``split``, which autograd forbids modifying in place: with torch 2.13 the first
    step raises ``RuntimeError: Output 0 of Split is a view and is being modified
    inplace`` on every rank of a world of 2 or more, with or without a Join and with or
    without optimizer offload (measured on the plain engine, 0.18.7 to 0.18.9; 0.18.6
    and 0.19.0 step). NCCL writes the buffer in place, without views; no GPU run was
    made. Read once per process from that constructor's source, whitespace aside: the
    flattened buffer appended as it is; a release that detaches it (or whose source
    cannot be read) steps.
    """
    source = _method_source(_STAGE12, "DeepSpeedZeroOptimizer", _CONSTRUCTOR)
    return _KEEPS_THE_FLAT_BUFFER_IN_AUTOGRAD in " ".join(source.split())


#: ZeRO-3's gather of several partitioned parameters at once (0.18.3-0.19.7's wait:
#: :func:`zero3_gather_races_on_cpu`).
_COALESCED_GATHER = "_allgather_params_coalesced"
_WAITS_ON_THE_LAST_GATHER_ONLY = "launch_handles[-1].wait()"


@functools.cache
def zero3_gather_races_on_cpu() -> bool:
    """Whether this DeepSpeed's ZeRO-3 reads parameters gathered on the CPU before
    the gathers end.

    DeepSpeed 0.18.2 to 0.19.7 (fixed in 0.19.8) gather several parameters at once in
    ``Init._allgather_params_coalesced`` (after each optimizer step, the persistent
    parameters: every parameter under ``param_persistence_threshold``; and in
    ``GatheredParameters``) with one asynchronous all-gather each, then wait on the
    last handle alone (``launch_handles[-1].wait()``) and read them all. On a GPU the
    gathers run in order on one stream, so the last one's end is everyone's; on the
    CPU (gloo) each handle completes on its own, so a parameter may be read before its
    gather ended: the model then trains on stale or partial values now and then, with
    or without a Join (measured on the plain engine: about one ZeRO-3 cell in twenty
    ends 0.01 off the float64 reference). Read once per process from that method's
    source; a release without that wait (or whose source cannot be read) waits on
    every gather.
    """
    source = _method_source(_PARTITION, "Init", _COALESCED_GATHER)
    return _WAITS_ON_THE_LAST_GATHER_ONLY in source


_checked: list[bool] = []


def check() -> None:
    """Check :data:`ENGINE_MEMBERS` in this DeepSpeed; once per process.

    Raises:
        UnsupportedDeepSpeedError: a member is missing or changed; the message names
            the version found and each member.
    """
    if _checked:
        return
    engine = importlib.import_module(_ENGINE).DeepSpeedEngine  # Join adapts one: imported
    present = [m for m in OPTIONAL_MEMBERS if hasattr(engine, m.name.rsplit(".", 1)[-1])]
    found = problems((*ENGINE_MEMBERS, *present))
    if found:
        raise UnsupportedDeepSpeedError(refusal(
            "deepspeed", "DeepSpeed", found, TESTED_DEEPSPEED,
            "A joined rank replays the engine's step, and a DeepSpeed whose step runs other "
            "collectives would hang or train on wrong gradients"))
    _checked.append(True)
