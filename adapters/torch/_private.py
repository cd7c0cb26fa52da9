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
needs of it: that it exists; for a function, the parameters joinkit calls it
with (``inspect.signature`` names; for torch's C++ bindings, their number);
for an instance attribute, that the class's own code still names it; for a
method joinkit replaces on the object, that the torch code which should call
the replacement still calls it by that name. :func:`check` runs when an
adapter adapts an object, once per group of members and process, and raises
:class:`joinkit.adapters.UnsupportedTorchError` naming this torch version,
every member that changed, and the torch versions this joinkit supports.
Nothing is checked per iteration.

The ``[torch]`` extra in ``pyproject.toml`` pins the same range as
:data:`SUPPORTED_TORCH` (a test keeps them equal).
"""

from __future__ import annotations

import sys
from typing import Any

from .. import UnsupportedTorchError
from .._guards import Member, Need, member, problems, version

__all__ = ["SUPPORTED_TORCH", "TESTED_TORCH", "GROUPS", "check"]

#: The torch versions this joinkit release supports (a pip specifier), and the
#: one its tests ran on. ``pyproject.toml``'s ``[torch]`` extra says the same.
SUPPORTED_TORCH = ">=2.13,<2.14"
TESTED_TORCH = "2.13.0"


_DDP = "torch.nn.parallel.distributed"
_C10D = "torch._C._distributed_c10d"
_DIST = "torch.distributed.distributed_c10d"
_JOIN = "torch.distributed.algorithms.join"
_ZERO = "torch.distributed.optim.zero_redundancy_optimizer"
_FSDP = "torch.distributed.fsdp._fully_shard"
_DDP_HOOK = f"{_DDP}:_DDPJoinHook.main_hook"
_DDP_FORWARD = f"{_DDP}:DistributedDataParallel._pre_forward"


_m = member


_CALL, _ATTR = Need.CALLABLE, Need.ATTRIBUTE

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
       "replaced in a replay so that a joined rank never sources the buffers",
       ("self", "input_rank", "rank_cond"),
       called_by=(f"{_DDP}:DistributedDataParallel._sync_buffers",
                  f"{_DDP}:DistributedDataParallel._check_and_sync_module_buffers")),
    _m(_DDP, "DistributedDataParallel._join_config", _ATTR,
       "DDP's forward reads the join config the adapter writes"),
    _m(_DDP, "DistributedDataParallel.reducer", _ATTR, "the reducer's buckets"),
    _m(_DDP, "DistributedDataParallel.process_group", _ATTR, "the group of the fused check"),
    _m(_DDP, "DistributedDataParallel.require_backward_grad_sync", _ATTR,
       "whether this iteration syncs gradients (no_sync)"),
    _m(_DDP, "DistributedDataParallel.device_type", _ATTR, "the replay's device type"),
    _m(_C10D, "Reducer._get_zeros_like_grad_buckets", _CALL,
       "a joined rank's zero buckets, in the reducer's order", ("self",)),
    _m(_C10D, "Reducer._run_comm_hook", _CALL,
       "a joined rank's bucket all-reduce", ("self", "bucket")),
    _m(_C10D, "Reducer._set_forward_pass_work_handle", _CALL,
       "the reducer forgets the Join's last heartbeat on exit",
       ("self", "work", "divide_by_initial_world_size"), called_by=(_DDP_FORWARD,)),
    _m(_C10D, "_create_work_from_future", _CALL,
       "a Work for the reducer from a future", ("future",)),
    # on_rank_loss="finish" (adapters._ddp_elastic).
    _m(_DDP, "DistributedDataParallel._update_process_group", _CALL,
       "finish mode: the model follows the group rebuilt over the survivors",
       ("self", "new_process_group")),
    _m(_DDP, "DistributedDataParallel.register_comm_hook", _CALL,
       "finish mode: each backward's buckets go out as one unit", ("self", "state", "hook")),
    _m(_DDP, "DistributedDataParallel._comm_hooks", _ATTR,
       "finish mode: a model with a comm hook of its own is refused"),
    _m(_DDP, "DistributedDataParallel._has_rebuilt_buckets", _ATTR,
       "finish mode: whether the bucket rebuild is still due"),
    _m(_DDP, "DistributedDataParallel.forward_sync_buffers", _ATTR,
       "finish mode: buffers broadcast in forward are refused"),
    _m(_DDP, "DistributedDataParallel.modules_buffers", _ATTR,
       "finish mode: buffers broadcast in forward are refused"),
    _m(_C10D, "Reducer._rebuild_buckets", _CALL,
       "finish mode: the bucket rebuild (a broadcast on DDP's group) is put off "
       "while the Join lasts", ("self",),
       called_by=(_DDP_HOOK, _DDP_FORWARD)),
    _m(_C10D, "Reducer._reset_state", _CALL,
       "finish mode: the parameters pushed for a put-off rebuild are forgotten", ("self",)),
)

#: Members the ZeroRedundancyOptimizer adapter relies on (``adapters.torch``).
ZERO_MEMBERS = (
    _m(_ZERO, "ZeroRedundancyOptimizer.step", _CALL,
       "ZeRO's join hook steps with the .grad the adapter puts in place",
       ("self",), called_by=(f"{_ZERO}:_ZeROJoinHook.main_hook",)),
    # on_rank_loss="finish" beside DDP (adapters._zero_elastic).
    _m(_ZERO, "ZeroRedundancyOptimizer._sync_params", _CALL,
       "finish mode: the parameter broadcasts after a step are skipped (every rank "
       "steps every parameter)", ("self",), called_by=(f"{_ZERO}:ZeroRedundancyOptimizer.step",)),
    _m(_ZERO, "ZeroRedundancyOptimizer.optim", _ATTR,
       "finish mode: the local optimizer, swapped for one over every parameter"),
    _m(_ZERO, "ZeroRedundancyOptimizer._optim_constructor", _ATTR,
       "finish mode: the optimizer class, for the optimizer over every parameter"),
    _m(_ZERO, "ZeroRedundancyOptimizer._optim_defaults", _ATTR,
       "finish mode: the optimizer's arguments"),
    _m(_ZERO, "ZeroRedundancyOptimizer._overlap_with_ddp", _ATTR,
       "finish mode: overlap_with_ddp=True is refused"),
    _m(_ZERO, "ZeroRedundancyOptimizer.parameters_as_bucket_view", _ATTR,
       "finish mode: parameters_as_bucket_view=True is refused"),
    _m(_ZERO, "ZeroRedundancyOptimizer.process_group", _ATTR,
       "finish mode: ZeRO follows the group rebuilt over the survivors"),
    _m(_ZERO, "ZeroRedundancyOptimizer.rank", _ATTR, "finish mode: the rebuilt group"),
    _m(_ZERO, "ZeroRedundancyOptimizer.world_size", _ATTR, "finish mode: the rebuilt group"),
    _m(_ZERO, "ZeroRedundancyOptimizer.global_rank", _ATTR, "finish mode: the rebuilt group"),
    _m(_ZERO, "ZeroRedundancyOptimizer._all_state_dicts", _ATTR,
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

#: Members the FSDP2 adapter relies on (``adapters.fsdp``).
FSDP_MEMBERS = (
    _m(f"{_FSDP}._fully_shard", "FSDPModule._get_fsdp_state", _CALL,
       "each unit's FSDP state", ("self",)),
    _m(f"{_FSDP}._fully_shard", "FSDPModule.reset_iter_state", _CALL,
       "a rank that failed mid-iteration resets FSDP before its replay", ("self",)),
    _m(_STATE, "FSDPState._device", _ATTR, "the model's device"),
    _m(_STATE, "FSDPState._is_root", _ATTR, "Join refuses a non-root module"),
    _m(_STATE, "FSDPState._fsdp_param_groups", _ATTR, "the units' parameter groups"),
    _m(_STATE, "FSDPState._training_state", _ATTR, "whether FSDP is mid-iteration"),
    _m(_GROUP, "FSDPParamGroup.reduce_grads", _ATTR,
       "gradient sync (set_requires_gradient_sync), read and set for a replay"),
    _m(_GROUP, "FSDPParamGroup.all_reduce_grads", _ATTR,
       "HSDP's all-reduce (set_requires_all_reduce), read and set for a replay"),
    _m(_GROUP, "FSDPParamGroup.gradient_divide_factor", _ATTR,
       "divide_by_initial_world_size=False"),
    _m(_GROUP, "FSDPParamGroup.force_sum_reduction_for_comms", _ATTR,
       "divide_by_initial_world_size=False (sum reductions)"),
    _m(_GROUP, "FSDPParamGroup.mesh_info", _ATTR, "the Join's process group"),
    _m(_GROUP, "FSDPParamGroup.fsdp_params", _ATTR, "gradients given back after the Join"),
    _m(_GROUP, "FSDPParamGroup._training_state", _ATTR, "whether FSDP is mid-iteration"),
    _m(_PARAM, "FSDPParam.unsharded_accumulated_grad", _ATTR,
       "FSDP's gradient accumulation, taken and given back"),
    _m(_PARAM, "FSDPParam._unsharded_param", _ATTR,
       "FSDP's gradient accumulation, taken and given back"),
    _m(_COMMON, "FSDPMeshInfo.mesh", _ATTR, "the Join's process group"),
    _m(_COMMON, "FSDPMeshInfo.shard_process_group", _ATTR, "the Join's process group"),
    _m(_COMMON, "TrainingState.IDLE", Need.EXISTS, "whether FSDP is mid-iteration"),
    _m("torch.distributed.device_mesh", "DeviceMesh._flatten", _CALL,
       "the Join's group for an HSDP mesh over part of the world", ("self",)),
    _m(_DIST, "_get_default_group", _CALL, "the Join's group for HSDP over the world"),
    # Join(on_rank_loss="finish"): unsharded while the Join lasts (adapters._fsdp_elastic).
    _m(_STATE, "FSDPState._lazy_init", _CALL, "finish mode: FSDP's root set up before "
       "the unshard", ("self",)),
    _m(_GROUP, "FSDPParamGroup.reshard_after_backward", _ATTR,
       "finish mode: no reshard after backward while the Join lasts"),
    _m(_GROUP, "FSDPParamGroup.post_forward_mesh_info", _ATTR,
       "finish mode: no reshard after forward while the Join lasts"),
    _m(_GROUP, "FSDPParamGroup.device", _ATTR, "finish mode: CPU only"),
    _m(_GROUP, "FSDPParamGroup.mp_policy", _ATTR, "finish mode refuses mixed precision"),
    _m(_GROUP, "FSDPParamGroup.offload_policy", _ATTR, "finish mode: the rebuilt shards"),
    _m(_GROUP, "FSDPParamGroup.lazy_init", _CALL, "finish mode: the rebuilt shards",
       ("self",)),
    _m(_GROUP, "FSDPParamGroup._all_gather_output", _ATTR, "finish mode: the rebuilt shards"),
    _m(_GROUP, "FSDPParamGroup._all_gather_result", _ATTR, "finish mode: the rebuilt shards"),
    _m(_GROUP, "FSDPParamGroup._sharded_state", _ATTR, "finish mode: the rebuilt shards"),
    _m(_GROUP, "FSDPParamGroup._reset_sharded_params", _ATTR,
       "finish mode: the rebuilt shards"),
    _m(_PARAM, "FSDPParam", _CALL, "finish mode: FSDP re-sharded over the survivors",
       ("param", "module_info", "mesh_info", "post_forward_mesh_info", "device",
        "shard_placement_fn", "mp_policy", "offload_policy")),
    _m(_PARAM, "FSDPParam.sharded_param", _ATTR, "finish mode: shards written on exit"),
    _m(_PARAM, "FSDPParam.fsdp_placement", _ATTR, "finish mode refuses Shard(d > 0)"),
    _m(_PARAM, "FSDPParam.offload_to_cpu", _ATTR, "finish mode refuses CPU offload"),
    _m(_PARAM, "FSDPParam.padded_sharded_param_size", _ATTR,
       "finish mode: a rank's slice of a full parameter"),
    _m(_PARAM, "FSDPParam.mesh_info", _ATTR, "finish mode: a rank's slice"),
    _m(_PARAM, "FSDPParam._module_info", _ATTR, "finish mode: the rebuilt shards"),
    _m(_PARAM, "FSDPParam._param_fqn", _ATTR, "finish mode: the rebuilt shards"),
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
)

#: Every group of members, by the adapter that relies on it; :func:`check`
#: decides which groups an object needs.
GROUPS: dict[str, tuple[Member, ...]] = {
    "torch Joinable": JOIN_MEMBERS,
    "DistributedDataParallel": DDP_MEMBERS,
    "ZeroRedundancyOptimizer": ZERO_MEMBERS,
    "replay": REPLAY_MEMBERS,
    "FSDP2": FSDP_MEMBERS,
}

# The groups that passed in this process: each is checked once.
_checked: set[str] = set()


def check(obj: Any) -> None:
    """Check the torch members that adapting ``obj`` relies on; once per group and process.

    Args:
        obj: an object an adapter is about to adapt (a torch Joinable, a
            ``fully_shard`` module).

    Raises:
        UnsupportedTorchError: a member is missing or changed; the message names
            this torch version, each such member, and the torch versions this
            joinkit supports.
    """
    groups = [name for name in _groups_for(obj) if name not in _checked]
    if not groups:
        return
    found = [(name, problem) for name in groups for problem in problems(GROUPS[name])]
    if found:
        raise UnsupportedTorchError(_message(found))
    _checked.update(groups)


def _groups_for(obj: Any) -> list[str]:
    def is_instance(module: str, name: str) -> bool:
        cls = getattr(sys.modules.get(module), name, None)
        return isinstance(cls, type) and isinstance(obj, cls)

    if is_instance("torch.distributed.fsdp", "FSDPModule"):
        return ["FSDP2", "replay"]
    groups = ["torch Joinable"]
    if is_instance(_DDP, "DistributedDataParallel"):
        groups += ["DistributedDataParallel", "replay"]
    elif is_instance("torch.distributed.optim", "ZeroRedundancyOptimizer"):
        groups.append("ZeroRedundancyOptimizer")
    return groups


def _message(found: list[tuple[str, str]]) -> str:
    torch_version = version("torch")
    joinkit_version = version("joinkit")
    adapters = ", ".join(dict.fromkeys(group for group, _ in found))
    lines = "\n".join(f"  - {problem}" for _, problem in found)
    short = ".".join(torch_version.split("+")[0].split(".")[:2])
    return (
        f"joinkit {joinkit_version} supports torch {SUPPORTED_TORCH} (tested with "
        f"{TESTED_TORCH}), but this process runs torch {torch_version}, in which "
        f"internals that joinkit's adapters ({adapters}) rely on changed:\n{lines}\n"
        "Going on could silently train on wrong gradients or mismatch collectives, so "
        f"joinkit stops here. Install a supported torch (pip install 'torch{SUPPORTED_TORCH}'), "
        f"or a joinkit release that supports torch {short}."
    )


