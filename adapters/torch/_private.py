"""The torch internals joinkit's adapters rely on, and the check that they are there.

Theory of operation
-------------------
To shadow DDP, ZeroRedundancyOptimizer and FSDP2 correctly, the adapters use
members of torch that torch does not promise to keep: DDP's join-hook methods,
which ``_joinables`` and ``_ddp_replay`` replace on the object for
the length of a call; reducer methods; FSDP2's state and parameter groups;
torch's own ``_JoinConfig``. A torch release may rename or change any of them,
and some changes would be *silent*: DDP's join hook calling a renamed
``_match_all_reduce_for_bwd_pass`` would skip joinkit's replacement, and
ZeroRedundancyOptimizer would step a joined rank's shard with a stale
gradient again; an attribute FSDP renamed would be set by joinkit and read by
nobody.

So every such member is listed here, in :data:`GROUPS` (the format of
``adapters._guards``, whose checker this module uses), with what joinkit
does with it: that it exists; for a function, the parameters joinkit calls it
with (``inspect.signature`` names; for torch's C++ bindings, their number);
for an instance attribute, that the class's own code still names it, and,
for one joinkit sets, that it is not a property without a setter; for a
method joinkit replaces on the object, that the torch code which should call
the replacement still calls it by that name.

The groups follow the *features* that need them, not the objects: DDP's
plain use and DDP in ``Join(on_rank_loss="finish")`` are two groups, and so
are ZeRO's, FSDP2's, and FSDP2's summed reductions
(``divide_by_initial_world_size=False``). :func:`check` runs when an adapter
adapts an object (its plain groups), and again where a Join enters a feature
(its feature's groups: finish mode on entry), once per group and process,
before any collective; it raises :class:`joinkit.adapters.UnsupportedTorchError`
naming this torch version, the feature refused, and every member that
changed: a torch release that lacks what one feature needs refuses that
feature alone. Nothing is checked per iteration.

Where torch changed an internal between the releases joinkit supports (a
rename, a list that was one object, an attribute that became a read-only
property), ``_compat`` resolves the spelling once per process and the table
lists the spelling it resolved.

The torch-bearing extras in ``pyproject.toml`` say the same range as
:data:`SUPPORTED_TORCH` (a test keeps them equal).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._errors import UnsupportedTorchError
from .._guards import Member, Need, member, problems, version
from . import _compat

__all__ = ["SUPPORTED_TORCH", "TESTED_TORCH", "GROUPS", "FINISH", "SUM_REDUCTIONS", "check",
           "fsdp_cpu_refusal", "fsdp_gloo_refusal", "refused_features"]

#: The torch versions this joinkit release supports (a pip specifier), and the
#: releases its tests ran on (one per minor: the compatibility matrix).
#: ``pyproject.toml``'s torch-bearing extras say the same range.
SUPPORTED_TORCH = ">=2.6"
TESTED_TORCH = ("2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0",
                "2.14.1", "2.15.0")


_DDP = "torch.nn.parallel.distributed"
_C10D = "torch._C._distributed_c10d"
_DIST = "torch.distributed.distributed_c10d"
_JOIN = "torch.distributed.algorithms.join"
_ZERO = "torch.distributed.optim.zero_redundancy_optimizer"
_FSDP = "torch.distributed.fsdp._fully_shard"
_DDP_HOOK = f"{_DDP}:_DDPJoinHook.main_hook"
_DDP_FORWARD = f"{_DDP}:DistributedDataParallel._pre_forward"


_m = member


_CALL, _ATTR, _SET = Need.CALLABLE, Need.ATTRIBUTE, Need.SETTABLE

#: Members every torch Joinable's adapter relies on (``adapters.torch``).
JOIN_MEMBERS = (
    _m(_JOIN, "_JoinConfig", Need.FIELDS,
       "the adapter writes torch's join config onto the object",
       ("enable", "throw_on_early_termination", "is_first_joinable")),
    _m(_JOIN, "Joinable._join_config", _ATTR,
       "the config torch's joinables read, set by Joinable.__init__"),
    _m(_JOIN, "Join.notify_join_context", Need.STATICMETHOD,
       "replaced by a router while a joinkit Join holds torch joinables"),
    _m(_DIST, "_get_default_group", _CALL,
       "the group of a joinable built before init_process_group"),
    _m(_ZERO, "ZeroRedundancyOptimizer", Need.EXISTS,
       "where the adapters look for ZeRO: a ZeRO not found there would step "
       "joined ranks' shards with stale gradients"),
)

#: Members the DDP adapter relies on (``adapters.torch``, ``adapters._ddp_replay``).
DDP_MEMBERS = (
    _m(_DDP, "DistributedDataParallel._match_all_reduce_for_bwd_pass", _CALL,
       "replaced on a joined rank to keep the averaged gradient for "
       "ZeroRedundancyOptimizer's shadow step", ("self",), called_by=(_DDP_HOOK,)),
    _m(_DDP, "DistributedDataParallel._check_global_requires_backward_grad_sync", _CALL,
       "replaced while the Join lasts by the check fused with the heartbeat",
       ("self", "is_joined_rank"), called_by=(_DDP_HOOK, _DDP_FORWARD)),
    _m(_DDP, "DistributedDataParallel._find_common_rank", _CALL,
       "answered from the fused heartbeat while no rank joined (asked again when one "
       "did), and in a replay so that a joined rank never sources the buffers",
       ("self", "input_rank", "rank_cond"),
       called_by=(f"{_DDP}:DistributedDataParallel._sync_buffers",
                  f"{_DDP}:DistributedDataParallel._check_and_sync_module_buffers")),
    _m(_DDP, "DistributedDataParallel._join_config", _SET,
       "DDP's forward reads the join config the adapter writes"),
    _m(_DDP, "DistributedDataParallel.reducer", _ATTR, "the reducer's buckets"),
    _m(_DDP, "DistributedDataParallel.process_group", _ATTR, "the group of the fused check"),
    _m(_DDP, "DistributedDataParallel.require_backward_grad_sync", _SET,
       "whether this iteration syncs gradients (no_sync)"),
    _m(_DDP, "DistributedDataParallel.device_type", _ATTR, "the replay's device type"),
    _m(_C10D, "Reducer._get_zeros_like_grad_buckets", _CALL,
       "a joined rank's zero buckets, in the reducer's order", ("self",)),
    _m(_C10D, "Reducer._run_comm_hook", _CALL,
       "a joined rank's bucket all-reduce", ("self", "bucket")),
    _m(_C10D, "Reducer._get_local_used_map", _CALL,
       "a joined rank's used-parameter map (find_unused_parameters)", ("self",)),
    _m(_C10D, "Reducer._set_forward_pass_work_handle", _CALL,
       "the reducer forgets the Join's last heartbeat on exit",
       ("self", "work", "divide_by_initial_world_size"), called_by=(_DDP_FORWARD,)),
    _m(_C10D, "_create_work_from_future", _CALL,
       "a Work for the reducer from a future", ("future",)),
)

#: Members DDP in ``Join(on_rank_loss="finish")`` relies on (``adapters._ddp_elastic``).
DDP_FINISH_MEMBERS = (
    _m(_DDP, "DistributedDataParallel._update_process_group", _CALL,
       "finish mode: the model follows the group rebuilt over the survivors",
       ("self", "new_process_group")),
    _m(_DDP, "DistributedDataParallel.register_comm_hook", _CALL,
       "finish mode: each backward's buckets go out as one unit", ("self", "state", "hook")),
    _m(_DDP, "DistributedDataParallel._comm_hooks", _ATTR,
       "finish mode: a model with a comm hook of its own is refused"),
    _m(_DDP, "DistributedDataParallel._has_rebuilt_buckets", _SET,
       "finish mode: whether the bucket rebuild is still due"),
    _m(_C10D, "Reducer._rebuild_buckets", _CALL,
       "finish mode: the bucket rebuild (a broadcast on DDP's group) is put off "
       "while the Join lasts", ("self",),
       called_by=(_DDP_HOOK, _DDP_FORWARD)),
    _m(_C10D, "Reducer._reset_state", _CALL,
       "finish mode: the parameters pushed for a put-off rebuild are forgotten", ("self",)),
    _m(_DDP, "DistributedDataParallel._check_sync_bufs_pre_fwd", _CALL,
       "finish mode: replaced on the object, so that an active rank's forward always "
       "takes part in the buffer unit", ("self",), called_by=(_DDP_FORWARD,)),
    _m(_DDP, "DistributedDataParallel._sync_buffers", _CALL,
       "finish mode: replaced on the object by the buffer unit (an active rank's "
       "forward)", ("self",), called_by=(_DDP_FORWARD,)),
    _m(_DDP, "DistributedDataParallel._check_and_sync_module_buffers", _CALL,
       "finish mode: replaced on the object by the buffer unit (a joined rank's hook)",
       ("self",), called_by=(_DDP_HOOK,)),
    _m(_DDP, "DistributedDataParallel.will_sync_module_buffers", _CALL,
       "finish mode: whether this rank's forward syncs the buffers (not after a forward "
       "without gradients)", ("self",)),
    _m(_DDP, "DistributedDataParallel._assign_modules_buffers", _CALL,
       "finish mode: the buffer unit reads the model's current buffers", ("self",)),
    _m(_DDP, "DistributedDataParallel.modules_buffers", _ATTR,
       "finish mode: the buffers the buffer unit sends and takes"),
    _m(_DDP, "DistributedDataParallel.buffer_hook", _ATTR,
       "finish mode: a model with a buffer comm hook is refused"),
)

#: Members the ZeroRedundancyOptimizer adapter relies on (``adapters.torch``).
ZERO_MEMBERS = (
    _m(_ZERO, "ZeroRedundancyOptimizer.step", _CALL,
       "ZeRO's join hook steps with the .grad the adapter puts in place",
       ("self",), called_by=(f"{_ZERO}:_ZeROJoinHook.main_hook",)),
)

#: Members ZeRO beside DDP in ``Join(on_rank_loss="finish")`` relies on
#: (``adapters._zero_elastic``).
ZERO_FINISH_MEMBERS = (
    _m(_ZERO, "ZeroRedundancyOptimizer._sync_params", _CALL,
       "finish mode: the parameter broadcasts after a step are skipped (every rank "
       "steps every parameter)", ("self",), called_by=(f"{_ZERO}:ZeroRedundancyOptimizer.step",)),
    _m(_ZERO, "ZeroRedundancyOptimizer.optim", _SET,
       "finish mode: the local optimizer, swapped for one over every parameter"),
    _m(_ZERO, "ZeroRedundancyOptimizer._optim_constructor", _ATTR,
       "finish mode: the optimizer class, for the optimizer over every parameter"),
    _m(_ZERO, "ZeroRedundancyOptimizer._optim_defaults", _ATTR,
       "finish mode: the optimizer's arguments"),
    _m(_ZERO, "ZeroRedundancyOptimizer._overlap_with_ddp", _ATTR,
       "finish mode: overlap_with_ddp=True is refused"),
    _m(_ZERO, "ZeroRedundancyOptimizer.parameters_as_bucket_view", _ATTR,
       "finish mode: parameters_as_bucket_view=True is refused"),
    _m(_ZERO, "ZeroRedundancyOptimizer.process_group", _SET,
       "finish mode: ZeRO follows the group rebuilt over the survivors"),
    _m(_ZERO, "ZeroRedundancyOptimizer.rank", _SET, "finish mode: the rebuilt group"),
    _m(_ZERO, "ZeroRedundancyOptimizer.world_size", _SET, "finish mode: the rebuilt group"),
    _m(_ZERO, "ZeroRedundancyOptimizer.global_rank", _SET, "finish mode: the rebuilt group"),
    _m(_ZERO, "ZeroRedundancyOptimizer._all_state_dicts", _SET,
       "finish mode: consolidated states of the old partition are dropped"),
    _m(_ZERO, "ZeroRedundancyOptimizer._clear_cache", _CALL,
       "finish mode: the partition over the survivors is computed afresh", ("self",)),
    _m(_ZERO, "ZeroRedundancyOptimizer._init_local_optimizer", _CALL,
       "finish mode: the local optimizer over this rank's new partition", ("self",)),
    _m(_DIST, "_World.pg_group_ranks", _ATTR,
       "finish mode: the rebuilt group is registered, so that ZeRO's broadcasts "
       "(dist.broadcast(group=...)) and dist.get_rank(group) map its ranks"),
    _m(_DIST, "_world", Need.EXISTS, "finish mode: the registry of process groups"),
    _m(_C10D, "ProcessGroup._set_group_name", _CALL,
       "finish mode: the rebuilt group's name, under which a later Join keeps its keys",
       ("self", "name")),
)

#: Members of torch that a replay relies on (``adapters._replay``: FSDP2, DDP).
REPLAY_MEMBERS = (
    _m("torch.utils._pytree", "tree_map", _CALL, "input specs", ("func", "tree")),
    _m("torch.utils._pytree", "tree_leaves", _CALL, "the zero loss", ("tree",)),
    _m(_DIST, "_get_default_store", _CALL, "where input specs are published"),
    _m("torch.nn.modules.module", "Module._buffers", _ATTR,
       "buffers saved and restored around a replay"),
)

_STATE = f"{_FSDP}._fsdp_state"
_GROUP = f"{_FSDP}._fsdp_param_group"
_PARAM = f"{_FSDP}._fsdp_param"
_COMMON = f"{_FSDP}._fsdp_common"

#: Members the FSDP2 adapter relies on (``adapters.fsdp``); :func:`_fsdp_members`
#: adds those whose spelling ``_compat`` resolves.
FSDP_MEMBERS = (
    _m(f"{_FSDP}._fully_shard", "FSDPModule._get_fsdp_state", _CALL,
       "each unit's FSDP state", ("self",)),
    _m(_STATE, "FSDPState._device", _ATTR, "the model's device"),
    _m(_STATE, "FSDPState._is_root", _ATTR, "Join refuses a non-root module"),
    _m(_STATE, "FSDPState._training_state", _ATTR, "whether FSDP is mid-iteration"),
    _m(_GROUP, "FSDPParamGroup.reduce_grads", _SET,
       "gradient sync (set_requires_gradient_sync), read and set for a replay"),
    _m(_GROUP, "FSDPParamGroup.all_reduce_grads", _SET,
       "HSDP's all-reduce (set_requires_all_reduce), read and set for a replay"),
    _m(_GROUP, "FSDPParamGroup.mesh_info", _ATTR, "the Join's process group"),
    _m(_GROUP, "FSDPParamGroup.fsdp_params", _ATTR, "gradients given back after the Join"),
    _m(_GROUP, "FSDPParamGroup._training_state", _ATTR, "whether FSDP is mid-iteration"),
    _m(_PARAM, "FSDPParam._unsharded_param", _ATTR,
       "FSDP's gradient accumulation, taken and given back"),
    _m(_COMMON, "FSDPMeshInfo.mesh", _ATTR, "the Join's process group"),
    _m(_COMMON, "FSDPMeshInfo.shard_process_group", _ATTR, "the Join's process group"),
    _m(_COMMON, "TrainingState.IDLE", Need.EXISTS, "whether FSDP is mid-iteration"),
    _m("torch.distributed.device_mesh", "DeviceMesh._flatten", _CALL,
       "the Join's group for an HSDP mesh over part of the world", ("self",)),
    _m(_DIST, "_get_default_group", _CALL, "the Join's group for HSDP over the world"),
)


def _fsdp_members() -> tuple[Member, ...]:
    members = [*FSDP_MEMBERS, _m(
        _STATE, f"FSDPState.{_compat.fsdp_param_groups_attribute()}", _ATTR,
        "the units' parameter groups")]
    accumulated = _compat.fsdp_accumulated_grad()
    if accumulated is not None:  # 2.15 and later: none of its own (``_compat``)
        members.append(_m(_PARAM, f"FSDPParam.{accumulated}", _SET,
                          "FSDP's gradient accumulation, taken and given back"))
    why = "a rank that failed mid-iteration resets FSDP before its replay"
    if _compat.fsdp_can_reset():
        members.append(_m(f"{_FSDP}._fully_shard", "FSDPModule.reset_iter_state", _CALL,
                          why, ("self",)))
    else:  # before 2.13: joinkit's reset of the one clean case (``_compat.fsdp_reset``)
        members += [_m(_STATE, "FSDPState._state_ctx", _ATTR, why),
                    _m(_STATE, "FSDPStateContext.iter_forward_root", _SET, why),
                    _m(_STATE, "FSDPState._training_state", _SET, why),
                    _m(_GROUP, "FSDPParamGroup._all_gather_result", _ATTR, why),
                    _m(_COMMON, "TrainingState.FORWARD", Need.EXISTS, why)]
    return tuple(members)


#: Members FSDP2 in ``Join(..., divide_by_initial_world_size=False)`` relies on.
FSDP_SUM_MEMBERS = (
    _m(_GROUP, "FSDPParamGroup.gradient_divide_factor", _SET,
       "divide_by_initial_world_size=False: the reduction divides by the active ranks"),
    _m(_GROUP, "FSDPParamGroup.force_sum_reduction_for_comms", _SET,
       "divide_by_initial_world_size=False: sum reductions (gloo has no PREMUL_SUM)"),
)

#: Members FSDP2 in ``Join(on_rank_loss="finish")`` relies on: unsharded while
#: the Join lasts (``adapters._fsdp_elastic``).
FSDP_FINISH_MEMBERS = (
    _m(_STATE, "FSDPState._lazy_init", _CALL, "finish mode: FSDP's root set up before "
       "the unshard", ("self",)),
    _m(_GROUP, "FSDPParamGroup.reshard_after_backward", _SET,
       "finish mode: no reshard after backward while the Join lasts"),
    _m(_GROUP, "FSDPParamGroup.post_forward_mesh_info", _SET,
       "finish mode: no reshard after forward while the Join lasts"),
    _m(_GROUP, "FSDPParamGroup.device", _ATTR, "finish mode: CPU only"),
    _m(_PARAM, "FSDPParam.mp_policy", _ATTR,
       "finish mode refuses mixed precision, and rebuilds each parameter with its policy"),
    _m(_GROUP, "FSDPParamGroup.offload_policy", _ATTR, "finish mode: the rebuilt shards"),
    _m(_GROUP, "FSDPParamGroup.lazy_init", _CALL, "finish mode: the rebuilt shards",
       ("self",)),
    _m(_GROUP, "FSDPParamGroup._all_gather_result", _SET, "finish mode: the rebuilt shards"),
    _m(_GROUP, "FSDPParamGroup._sharded_state", _SET, "finish mode: the rebuilt shards"),
    _m(_GROUP, "FSDPParamGroup._reset_sharded_params", _ATTR,
       "finish mode: the rebuilt shards"),
    _m(_PARAM, "FSDPParam", _CALL, "finish mode: FSDP re-sharded over the survivors",
       ("param", "module_info", "mesh_info", "post_forward_mesh_info", "device",
        "shard_placement_fn", "mp_policy", "offload_policy")),
    _m(_PARAM, "FSDPParam.sharded_param", _SET, "finish mode: shards written on exit"),
    _m(_PARAM, "FSDPParam.fsdp_placement", _ATTR, "finish mode refuses Shard(d > 0)"),
    _m(_PARAM, "FSDPParam.offload_to_cpu", _ATTR, "finish mode refuses CPU offload"),
    _m(_PARAM, "FSDPParam.padded_sharded_param_size", _ATTR,
       "finish mode: a rank's slice of a full parameter"),
    _m(_PARAM, "FSDPParam.mesh_info", _ATTR, "finish mode: a rank's slice"),
    _m(_PARAM, "FSDPParam._module_info", _ATTR, "finish mode: the rebuilt shards"),
    _m(_PARAM, "FSDPParam._param_fqn", _SET, "finish mode: the rebuilt shards"),
    _m(_PARAM, "FSDPParam._post_load_hook_handle", _ATTR, "finish mode: the rebuilt shards"),
    _m(_PARAM, "FSDPParam.to_sharded_dtensor", _CALL,
       "finish mode: a shard's gradient on exit", ("self", "tensor")),
    _m(_PARAM, "FSDPParam._setattr_on_modules", _CALL,
       "finish mode: the rebuilt shard on its module", ("self", "param")),
    _m(_PARAM, "ShardedState.SHARDED", Need.EXISTS, "finish mode: the rebuilt shards"),
    _m(_COMMON, "FSDPMeshInfo.shard_mesh_rank", _ATTR, "finish mode: a rank's slice"),
    _m(_DIST, "_register_process_group", _CALL,
       "finish mode: the survivors' mesh resolves its group by name",
       ("group_name", "group")),
    _m(_C10D, "ProcessGroup._set_group_name", _CALL,
       "finish mode: the survivors' group gets a name for its mesh", ("self", "name")),
    # Set on the rebuilt groups (mesh_info, fsdp_params) and on every group while
    # the Join lasts (reduce_grads).
    _m(_GROUP, "FSDPParamGroup.mesh_info", _SET, "finish mode: the rebuilt shards"),
    _m(_GROUP, "FSDPParamGroup.fsdp_params", _SET, "finish mode: the rebuilt shards"),
)


_FSDP1 = "torch.distributed.fsdp.fully_sharded_data_parallel"
_FSDP1_MODULE = f"{_FSDP1}:FullyShardedDataParallel"
_FLAT = "torch.distributed.fsdp._flat_param"

#: Members the FSDP1 adapter relies on (``adapters.torch.fsdp1``).
FSDP1_MEMBERS = (
    _m(_FSDP1, "FullyShardedDataParallel.fsdp_modules", _CALL,
       "the FSDP1 modules of the root's tree", ("module", "root_only")),
    _m(_FSDP1, "FullyShardedDataParallel._sync_gradients", _SET,
       "gradient sync (no_sync), read for the step check and set for a replay",
       called_by=(f"{_FSDP1_MODULE}.no_sync",)),
    _m(_FSDP1, "FullyShardedDataParallel._is_root", _ATTR, "Join refuses a non-root module"),
    _m(_FSDP1, "FullyShardedDataParallel._handle", _ATTR,
       "each unit's flat parameter, whose gradient a joined rank sets aside"),
    _m(_FSDP1, "FullyShardedDataParallel.training_state", _ATTR,
       "whether FSDP1 is mid-iteration"),
    _m(_FSDP1, "FullyShardedDataParallel.compute_device", _ATTR, "the step check's device"),
    _m(_FSDP1, "FullyShardedDataParallel.process_group", _ATTR, "the Join's process group"),
    _m(_FSDP1, "FullyShardedDataParallel._inter_node_pg", _ATTR,
       "HYBRID_SHARD: whether the model spans the world"),
    _m(_FSDP1, "FullyShardedDataParallel.sharding_strategy", _ATTR,
       "HYBRID_SHARD is joined over the whole world only"),
    _m(_FSDP1, "FullyShardedDataParallel.cpu_offload", _ATTR,
       "parameter CPU offload is refused"),
    _m(_FSDP1, "FullyShardedDataParallel._comm_hook", _ATTR,
       "a communication hook with divide_by_initial_world_size=False is refused"),
    _m(_FLAT, "FlatParamHandle.flat_param", _ATTR,
       "the unit's gradient, set aside by a joined rank"),
    _m(_FLAT, "FlatParamHandle._training_state", _ATTR, "whether FSDP1 is mid-iteration"),
    _m("torch.distributed.fsdp._common_utils", "TrainingState.IDLE", Need.EXISTS,
       "whether FSDP1 is mid-iteration"),
)

#: Members FSDP1 in ``Join(..., divide_by_initial_world_size=False)`` relies on.
FSDP1_SUM_MEMBERS = (
    _m(_FSDP1, "FullyShardedDataParallel._gradient_predivide_factor", _SET,
       "divide_by_initial_world_size=False: no division before the reduction"),
    _m(_FSDP1, "FullyShardedDataParallel._gradient_postdivide_factor", _SET,
       "divide_by_initial_world_size=False: the reduction divides by the active ranks"),
)


def _fsdp_finish_members() -> tuple[Member, ...]:
    buffer = _compat.fsdp_all_gather_buffer()
    if buffer is None:  # before 2.9: none to empty (``_compat``)
        return FSDP_FINISH_MEMBERS
    return (*FSDP_FINISH_MEMBERS, _m(_GROUP, f"FSDPParamGroup.{buffer}", _SET,
                                     "finish mode: the rebuilt shards"))


def _ddp_members() -> tuple[Member, ...]:
    flag = _compat.ddp_buffer_sync_flag()
    why = ("whether DDP's forward broadcasts the buffers (the heartbeat in the gradients "
           "and finish mode cannot carry that broadcast)")
    return (*DDP_MEMBERS, _m(_DDP, f"DistributedDataParallel.{flag}", _ATTR, why),
            _m(_DDP, "DistributedDataParallel.modules_buffers", _ATTR, why))


#: The features a group serves beyond its object's plain use, as :func:`check`
#: takes them: ``Join(on_rank_loss="finish")``, and FSDP2's summed reductions
#: (``Join(..., divide_by_initial_world_size=False)``).
FINISH = "in finish mode (Join(on_rank_loss='finish'))"
SUM_REDUCTIONS = "with Join(divide_by_initial_world_size=False)"


class _Groups(Mapping[str, tuple[Member, ...]]):
    """Group name -> its members, each built once (some spellings are ``_compat``'s)."""

    def __init__(self, builders: dict[str, Callable[[], tuple[Member, ...]]]) -> None:
        self._builders = builders
        self._built: dict[str, tuple[Member, ...]] = {}

    def __getitem__(self, name: str) -> tuple[Member, ...]:
        if name not in self._built:
            self._built[name] = self._builders[name]()
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)


def _static(members: tuple[Member, ...]) -> Callable[[], tuple[Member, ...]]:
    return lambda: members


#: Every group of members, by the feature that relies on it (a feature never
#: needs a group another feature alone uses); :func:`check` decides which
#: groups an object and its Join's features need.
GROUPS: Mapping[str, tuple[Member, ...]] = _Groups({
    "torch Joinable": _static(JOIN_MEMBERS),
    "DistributedDataParallel": _ddp_members,
    f"DistributedDataParallel {FINISH}": _static(DDP_FINISH_MEMBERS),
    "ZeroRedundancyOptimizer": _static(ZERO_MEMBERS),
    f"ZeroRedundancyOptimizer {FINISH}": _static(ZERO_FINISH_MEMBERS),
    "replay": _static(REPLAY_MEMBERS),
    "FSDP2": _fsdp_members,
    f"FSDP2 {SUM_REDUCTIONS}": _static(FSDP_SUM_MEMBERS),
    f"FSDP2 {FINISH}": _fsdp_finish_members,
    "FSDP1": _static(FSDP1_MEMBERS),
    f"FSDP1 {SUM_REDUCTIONS}": _static(FSDP1_SUM_MEMBERS),
})

# The groups that passed in this process: each is checked once.
_checked: set[str] = set()


def check(obj: Any, *features: str) -> None:
    """Check the torch members that adapting ``obj`` relies on; once per group and process.

    Args:
        obj: an object an adapter is about to adapt (a torch Joinable, a
            ``fully_shard`` module).
        *features: the features of its Join beyond plain use that need groups of
            their own (:data:`FINISH`, :data:`SUM_REDUCTIONS`); a feature that
            does not apply to ``obj`` checks nothing.

    Raises:
        UnsupportedTorchError: a member is missing or changed; the message names
            this torch version, the feature refused, each such member, and the
            torch versions this joinkit supports.
    """
    groups = [name for name in _groups_for(obj, features) if name not in _checked]
    if not groups:
        return
    found = [(name, problem) for name in groups for problem in problems(GROUPS[name])]
    if found:
        raise UnsupportedTorchError(_message(found))
    _checked.update(groups)


def _groups_for(obj: Any, features: tuple[str, ...]) -> list[str]:
    def is_instance(module: str, name: str) -> bool:
        cls = getattr(sys.modules.get(module), name, None)
        return isinstance(cls, type) and isinstance(obj, cls)

    if is_instance("torch.distributed.fsdp", "FSDPModule"):
        base = ["FSDP2", "replay"]
    elif is_instance("torch.distributed.fsdp", "FullyShardedDataParallel"):
        base = ["FSDP1", "replay"]
    else:
        base = ["torch Joinable"]
        if is_instance(_DDP, "DistributedDataParallel"):
            base += ["DistributedDataParallel", "replay"]
        elif is_instance("torch.distributed.optim", "ZeroRedundancyOptimizer"):
            base.append("ZeroRedundancyOptimizer")
    featured = [f"{name} {feature}" for name in base for feature in features]
    return base + [name for name in featured if name in GROUPS]


def _message(found: list[tuple[str, str]]) -> str:
    torch_version = version("torch")
    joinkit_version = version("joinkit")
    features = ", ".join(dict.fromkeys(group for group, _ in found))
    lines = "\n".join(f"  - {problem}" for _, problem in found)
    return (
        f"joinkit {joinkit_version} supports torch {SUPPORTED_TORCH} (tested with "
        f"{', '.join(TESTED_TORCH)}), but this process runs torch {torch_version}, which "
        f"lacks or changed torch internals that joinkit needs for: {features}.\n{lines}\n"
        "Going on could silently train on wrong gradients or mismatch collectives, so "
        f"joinkit refuses {features} on torch {torch_version} before any collective. "
        "Use the feature on a torch release that has these internals, or a joinkit "
        f"release that supports them on torch {torch_version}."
    )


def fsdp_cpu_refusal() -> str | None:
    """Why joinkit refuses FSDP2 on the CPU on this torch, or ``None`` where it runs there."""
    if _compat.fsdp_runs_on_cpu():
        return None
    return (f"joinkit refuses FSDP2 on the CPU on torch {version('torch')}: this torch's "
            "FSDP2 cannot run on the CPU itself (its all-gather records an event on a "
            "torch.cpu.Stream, which has no record_event before torch 2.7). Run FSDP2 on "
            "CUDA, or on torch 2.7 or later")


def fsdp_gloo_refusal() -> str | None:
    """Why joinkit refuses FSDP2 over gloo on this torch, or ``None`` where it runs there."""
    if _compat.gloo_reduce_scatter_averages():
        return None
    return (f"joinkit refuses FSDP2 over gloo on torch {version('torch')}: this torch's "
            "gloo reduce_scatter returns the sum where FSDP2 asks for the average "
            "(ReduceOp.AVG; torch 2.6 to 2.8, fixed in 2.9), so FSDP2 over gloo trains on "
            "gradients world-size times too large on this torch, with or without joinkit, "
            "and no Join can make the steps outside it right. Use nccl (unaffected), or "
            "torch 2.9 or later")


#: The groups that stand for a whole feature, by that feature's name in the
#: compatibility matrix (``.ci/matrix.py``'s rows); every other group is part
#: of a feature and keeps its own name.
_FEATURE_OF_GROUP = {
    "DistributedDataParallel": "DDP",
    "ZeroRedundancyOptimizer": "ZeroRedundancyOptimizer",
    "FSDP2": "FSDP2",
    "FSDP1": "FSDP1",
    "replay": "replayed step",
}


def refused_features() -> dict[str, str]:
    """What joinkit refuses on this torch by design, as the matrix runs it (CPU, gloo).

    Asked by the compatibility matrix of each torch's venv (``.ci/matrix.py``):
    a whole feature under its row's name (``"FSDP2"``, ``"FSDP1"``, ``"DDP"``, ...), a part
    of one (finish mode of one object, FSDP2's summed reductions, ...) under its
    group's name here. Each reason names this torch's version and what it lacks.

    Returns:
        feature -> why it is refused; empty where this torch runs everything.
    """
    refused: dict[str, str] = {}
    fsdp = [why for why in (fsdp_cpu_refusal(), fsdp_gloo_refusal()) if why is not None]
    if fsdp:
        refused["FSDP2"] = "; ".join(fsdp)
    for name in GROUPS:
        found = problems(GROUPS[name])
        if found:
            feature = _FEATURE_OF_GROUP.get(name, name)
            why = (f"torch {version('torch')} lacks or changed what joinkit needs for {name}: "
                   + "; ".join(found))
            refused[feature] = "; ".join(filter(None, [refused.get(feature), why]))
    if not _compat.fsdp_can_reset():
        refused.setdefault(
            "FSDP2: a rank that failed mid-iteration, shadowed",
            f"torch {version('torch')} has no FSDPModule.reset_iter_state (torch 2.13 and "
            "later): joinkit resets only an exception right after the root's pre-forward "
            "and refuses a failure later in the iteration")
    return refused
