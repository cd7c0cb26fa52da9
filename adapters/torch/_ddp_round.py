"""DDP's heartbeat in its gradient all-reduce: no collective of joinkit's own per iteration.

Theory of operation
-------------------
With join enabled, torch's DDP sends two 1-element all-reduces per forward
besides its gradients (the heartbeat and its gradient-sync check); the fused
check (``_joinables._FusedCheck``) makes them one. Here they are none: the
heartbeat rides in DDP's gradient all-reduce, one more element in one bucket
per backward, which the core calls a *round heartbeat* (``joinkit._machine``'s
module doc). A *round* is one backward's bucket all-reduces, in bucket order;
its *carrier* is its first bucket of at most :data:`CARRIER_BYTES` (DDP caps its
first bucket at 1 MiB, so it is nearly always bucket 0), else its last one: a
rule both an active rank (bucket by bucket) and a joined one (from the
layout) apply alike.

- *Active rank, per forward* (:meth:`RoundHeartbeat.notify`): the Join counts
  the input (``Join.fused_heartbeat``, which raises ``PeerAborted`` if the
  latest round showed a failed peer) and nothing is sent; DDP's
  gradient-sync check is replaced, while the Join lasts, by one that sends
  nothing (:meth:`RoundHeartbeat.check`). Under ``no_sync()`` or without a
  backward, no round goes out; the next backward that syncs is the next round.
- *Active rank, per bucket* (:meth:`RoundHeartbeat.hook`, the route of joinkit's
  comm hook, ``_ddp_hook``): the bucket is multiplied by ``1 / world size``
  (``divide_by_initial_world_size=True``, as DDP's reducer does without a
  hook) and all-reduced in DDP's own buffer; the carrier is sent in one
  all-reduce with one more element holding the heartbeat value (:class:`_Slot`:
  on the CPU a copy into a buffer one element longer, one pass over that one
  small bucket and no allocation, whose head DDP gets back as the bucket's
  result and copies into the gradients as it does any hook's; on CUDA a
  coalesced all-reduce of the bucket and a 1-element tensor, one NCCL group
  and no copy of the gradients). Every bucket's future is completed in the
  round's last bucket's hook, so no callback runs on the communication thread
  (:meth:`RoundHeartbeat._complete_round`). The carrier's extra element sums to
  the number of active ranks in this round (failed ranks' weights aside, which
  ``decode_tally`` reads): the next forward hands it to the Join's failure
  check (``Join.record_heartbeat_total``), and with
  ``divide_by_initial_world_size=False`` every bucket of the round is divided
  by it once the round's all-reduces completed. The futures DDP gets back do
  nothing else (an all-reduce's error reaches DDP through its bucket's).
- *Joined rank, per round* (the hook's :meth:`RoundHeartbeat.shadow_first`, the
  Join's count, then :meth:`RoundHeartbeat.shadow_rest`, its main hook): what
  torch's join hook does, less what this path rules out (buffers, unused
  parameters): the bucket rebuild if due (a broadcast, once, after the first
  backward, at the same place as an active rank's next forward), the same
  all-reduces from zeros with the drain's value in the carrier, and the
  rebuilt parameters pushed. The carrier's sum is the count: nobody active
  means every rank has joined and issued the same buckets up to the carrier,
  and they all stop there.
- *A rank failing midway through a round* (a bucket's all-reduce out, not the
  last): :meth:`RoundHeartbeat.round_open` says so; its completion round
  (:meth:`RoundHeartbeat.shadow_rest`) sends the rest from zeros.
- *The post hook*: DDP syncs the final model from the highest of its last
  joiners; torch's are the ranks with the most inputs, while a round
  heartbeat's ``is_last_joiner`` holds for every rank that left after the last
  round (the same model unless a rank stepped on its own gradients under
  ``no_sync()`` since). One MAX all-reduce of the inputs per Join
  (:meth:`RoundHeartbeat.most_inputs`) gives DDP torch's.
- *A forward with gradients and no backward* told no joined rank anything
  here, but the Join's rules are the same on every path: before this rank's
  next forward (or as it leaves its loop) :meth:`RoundHeartbeat.settle` finds
  that no bucket went out since and raises ``LocalProtocolError``; the rank's
  drain then matches the joined ranks' round.

Where this path cannot be used (:func:`refusal`) the Join takes the
one-collective path: a CUDA model (for now: ``ON_CUDA``), a comm hook of the
user's, ``find_unused_parameters`` (its extra all-reduce of the used-parameter
map), ``static_graph``, buffers broadcast in forward (their source rank is
agreed by a collective in each forward, before anything of the round is
known), ``mixed_precision``, a model shadowed by replay (collectives in
forward), parameters that are not float32 or float64, and sparse gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from joinkit import Join, LocalProtocolError
from joinkit.lowlevel import ALARM, NOBODY_ACTIVE_BELOW

from . import _compat, _ddp_hook

__all__ = ["RoundHeartbeat", "refusal"]

_SUM: Any = dist.ReduceOp.SUM
_MAX: Any = dist.ReduceOp.MAX
_FLOATS = (torch.float32, torch.float64)
#: Whether a CUDA model may take this path. Its CUDA branch (:class:`_Slot`'s
#: coalesced all-reduce) is written but has not run on a GPU yet, so CUDA
#: models keep the one-collective path; ``tests/adapters/torch/test_ddp_round.py``'s nccl test
#: turns it on where two GPUs exist.
ON_CUDA = False


def refusal(ddp: Any, replays: bool) -> str | None:
    """Why ``ddp``'s gradient all-reduce cannot carry the heartbeat, or ``None``.

    Args:
        ddp: the DistributedDataParallel model.
        replays: whether joined ranks shadow it by replaying its forward.

    Returns:
        What rules the path out (the Join then sends one collective per
        iteration), or ``None`` when the heartbeat can ride in the gradients.
    """
    hook = _ddp_hook.foreign_hook(ddp)
    if hook is not None:
        return f"it has a comm hook of its own ({hook})"
    if ddp.find_unused_parameters:
        return "find_unused_parameters=True"
    if getattr(ddp, "static_graph", False):
        return "static_graph=True"
    if _compat.ddp_syncs_buffers_in_forward(ddp):
        return "its buffers are broadcast in forward (broadcast_buffers=True)"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "mixed_precision"
    if replays:
        return "joined ranks replay its forward (collectives in forward)"
    if torch.device(ddp.join_device).type != "cpu" and not ON_CUDA:
        return "a CUDA model (this path has run on gloo and the CPU only so far)"
    if getattr(ddp, "_use_python_reducer", False) or getattr(
            ddp, "_delay_all_reduce_all_params", False):
        return "it runs without DDP's C++ reducer"
    dtypes = {p.dtype for p in ddp.parameters() if p.requires_grad}
    if not dtypes <= set(_FLOATS):
        return f"parameters of dtype {', '.join(sorted(map(str, dtypes - set(_FLOATS))))}"
    for module in ddp.module.modules():
        if getattr(module, "sparse", False) is True:
            return f"sparse gradients ({type(module).__name__})"
    return None


def _plain_wait(work: Any) -> Any:
    return work.wait()


def _count(total: float) -> int:
    """A bucket's divisor from its heartbeat sum: the active ranks (1 when it reads none)."""
    return round(total) if NOBODY_ACTIVE_BELOW <= total < ALARM else 1


#: The largest bucket (bytes) that may carry a round's heartbeat: a round's
#: first bucket of at most this size carries it, else its last bucket (DDP's
#: first bucket is capped at 1 MiB, ``first_bucket_bytes``).
CARRIER_BYTES = 4 << 20


def carries(elements: int, dtype: torch.dtype, last: bool) -> bool:
    """Whether a bucket carries its round's heartbeat, none before it having done so."""
    return last or elements * dtype.itemsize <= CARRIER_BYTES


def _carrier(layout: list[tuple[int, int, torch.dtype, torch.device]]) -> int:
    """The place in ``layout`` of the bucket that carries a round's heartbeat."""
    for place, (_, elements, dtype, _) in enumerate(layout):
        if carries(elements, dtype, place == len(layout) - 1):
            return place
    raise AssertionError("a bucket layout without buckets")


class _Slot:
    """One bucket's all-reduce buffers (module doc).

    The bucket that carries the heartbeat (``carrier``): on the CPU it is
    copied into a buffer one element longer (the copy also multiplies by
    ``1 / world size`` where that is the divisor), whose last element is the
    heartbeat, read and written through a NumPy view; one all-reduce sends it,
    and the buffer's head is the bucket's result. On CUDA (no copy of the
    gradients, no host read) the bucket and a 1-element heartbeat go in one
    coalesced all-reduce. Every other bucket is all-reduced in DDP's own
    buffer; a joined rank's all-reduces from zeros use ``zeros``.
    """

    __slots__ = ("elements", "dtype", "carrier", "wide", "head", "view", "beat", "zeros")

    def __init__(self, elements: int, dtype: torch.dtype, device: torch.device,
                 carrier: bool) -> None:
        self.elements = elements
        self.dtype = dtype
        self.carrier = carrier
        self.wide: torch.Tensor | None = None
        self.head: torch.Tensor | None = None
        self.view: Any = None
        self.beat: torch.Tensor | None = None
        self.zeros: torch.Tensor | None = None
        if not carrier:
            return
        if device.type == "cpu":
            self.wide = torch.empty(elements + 1, dtype=dtype)
            self.head = self.wide[:elements]
            self.view = self.wide.numpy()
            self.beat = self.wide[elements:]
        else:
            self.beat = torch.zeros(1, dtype=dtype, device=device)

    def total(self) -> float:
        """The heartbeat's sum, once the all-reduce completed."""
        if self.view is not None:
            return float(self.view[self.elements])
        assert self.beat is not None
        return float(self.beat.item())


class RoundHeartbeat:
    """One DDP model in one Join whose heartbeat rides in its gradients (module doc).

    Args:
        adapter: the model's joinable (the Join's first).
        divide_by_initial_world_size: the Join's argument.
        wait: how to wait for a joined rank's all-reduce (the Join backend's,
            so that a peer's abort ends it), else ``work.wait()``.
    """

    def __init__(self, adapter: Any, divide_by_initial_world_size: bool,
                 wait: Callable[[Any], Any] | None = None) -> None:
        ddp = adapter.obj
        self.adapter = adapter
        self.ddp = ddp
        group = ddp.process_group
        self.allreduce = group.allreduce
        self.opts = dist.AllreduceOptions()
        self.opts.reduceOp = _SUM
        self.allreduce_coalesced = group.allreduce_coalesced
        self.coalesced_opts = dist.AllreduceCoalescedOptions()
        self.coalesced_opts.reduceOp = _SUM
        self.world = group.size()
        # divide_by_initial_world_size: each gradient times 1 / world before
        # the sum, as DDP's reducer does; else divided by the round's count.
        self.scale: float | None = 1.0 / self.world if divide_by_initial_world_size else None
        self.wait: Callable[[Any], Any] = wait or _plain_wait
        self.value = 1.0  # this rank's heartbeat for its next round (Join.fused_heartbeat's)
        self.slots: dict[int, _Slot] = {}  # per bucket index
        # The open round: how many of its buckets went out (0: none open).
        self.sent = 0
        self.issued = 0  # buckets sent in this rank's own rounds (the no-backward check)
        self.inputs = 0  # this rank's forwards in the Join (its notifies)
        self.latest: _Slot | None = None  # the latest bucket sent (CPU: its sum is read)
        # This round's buckets so far (work, result, future), completed by its
        # last (:meth:`_complete_round`), and its carrier once it went out.
        self.pending: list[tuple[Any, torch.Tensor, torch.futures.Future[torch.Tensor]]] = []
        self.carrier: _Slot | None = None
        self.device = torch.device(ddp.join_device)
        self.expect: int | None = None  # ``issued`` after a forward that announced a backward
        # Joined rank: the bucket layout (index, elements, dtype, device), per rebuild.
        self.layout: list[tuple[int, int, torch.dtype, torch.device]] | None = None
        self.layout_rebuilt = False
        # Joined rank: where the rest of the round starts after its count (0: none owed).
        self.owed = 0
        self.state = _ddp_hook.install(ddp)
        self.state.route = self
        ddp._check_global_requires_backward_grad_sync = self.check

    def close(self) -> None:
        """The Join is over: the hook goes back to DDP's own way; DDP gets its check back."""
        if self.state.route is self:
            self.state.route = None
        if self.ddp.__dict__.get("_check_global_requires_backward_grad_sync") == self.check:
            del self.ddp.__dict__["_check_global_requires_backward_grad_sync"]
        self.slots = {}
        self.pending, self.carrier = [], None

    # -- active rank ----------------------------------------------------------------

    def notify(self) -> None:
        """An active rank's forward: count the input; nothing is sent.

        Raises:
            LocalProtocolError: the previous forward announced a backward that
                never came (:meth:`settle`).
            PeerAborted: the latest round showed a failed peer.
        """
        self.settle()
        latest = self.latest
        if latest is not None and latest.view is not None:
            # The latest round's sum (it completed in that backward): the Join's
            # failure check (a peer's alarm) at its fused heartbeat, next.
            Join.record_heartbeat_total(self.adapter, float(latest.view[latest.elements]))
        self.value = Join.fused_heartbeat(self.adapter)
        self.inputs += 1
        ddp = self.ddp
        if ddp.require_backward_grad_sync and torch.is_grad_enabled():
            self.expect = self.issued

    def check(self, is_joined_rank: bool) -> bool | None:
        """DDP's ``_check_global_requires_backward_grad_sync``: nothing to send."""
        return True if is_joined_rank else None

    def hook(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """The comm hook's route: this bucket, and the heartbeat if it carries it."""
        buffer: torch.Tensor = bucket.buffer()
        last = bucket.is_last()
        if self.sent == 0:  # a round that never ended (its backward raised)
            self.pending, self.carrier = [], None
        carrier = self.carrier is None and carries(buffer.numel(), buffer.dtype, last)
        slot = self._slot(bucket.index(), buffer.numel(), buffer.dtype, buffer.device, carrier)
        work = self._send(slot, buffer)
        self.issued += 1
        self.sent = 0 if last else self.sent + 1
        if carrier:
            self.carrier = self.latest = slot
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.pending.append((work, buffer if slot.head is None else slot.head, future))
        if last:
            self._complete_round()
        return future

    def _complete_round(self) -> None:
        """The round's last bucket: wait for its buckets, complete their futures.

        Every bucket got a pending future (:meth:`hook`); they are completed
        here, in the last bucket's hook, once its all-reduce is out. DDP waits
        for every bucket once the backward ends, and the last bucket is ready
        only when the last parameter's gradient is, so this gives up only the
        overlap with what the backward computes after that (gradients of
        inputs, if any), while the earlier buckets' all-reduces still run
        behind the backward. It spares a callback per bucket on the
        communication thread (a future's ``then``: a hand-over of the GIL and a
        Python frame, on every bucket of every iteration); ``Work.wait`` lets go
        of the GIL, so joinkit's status thread keeps publishing. An error of an
        all-reduce reaches DDP through its bucket's future, as from a pending
        one. With ``divide_by_initial_world_size=False`` every bucket is divided
        by the round's count, which its carrier's all-reduce brought.
        """
        carrier, self.carrier = self.carrier, None
        finish: Callable[[torch.Tensor], None] | None = None
        if self.scale is None and carrier is not None:
            if carrier.view is not None:
                def finish(result: torch.Tensor) -> None:
                    result.div_(_count(float(carrier.view[carrier.elements])))
            else:  # CUDA: no host read; the count divides on the device
                beat = carrier.beat
                assert beat is not None

                def finish(result: torch.Tensor) -> None:
                    result.div_(beat.clamp(min=1.0))
        _ddp_hook.complete(self.pending, finish)  # the reducer copies each into the grads

    def _send(self, slot: _Slot, buffer: torch.Tensor | None) -> Any:
        """Start the all-reduce of ``buffer`` (``None``: zeros); a carrier adds ``self.value``."""
        scale = self.scale
        head = slot.head
        if head is not None:  # the carrier, on the CPU
            if buffer is None:
                head.zero_()
            elif scale is not None:
                torch.mul(buffer, scale, out=head)
            else:
                head.copy_(buffer)
            slot.view[slot.elements] = self.value
            return self.allreduce([slot.wide], self.opts)
        if buffer is None:
            if slot.zeros is None:
                slot.zeros = torch.zeros(slot.elements, dtype=slot.dtype, device=self.device)
            else:
                slot.zeros.zero_()
            buffer = slot.zeros
        elif scale is not None:
            buffer.mul_(scale)
        if slot.beat is None:
            return self.allreduce([buffer], self.opts)
        slot.beat.fill_(self.value)  # the carrier, on CUDA
        return self.allreduce_coalesced([buffer, slot.beat], self.coalesced_opts)

    def _slot(self, index: int, elements: int, dtype: torch.dtype,
              device: torch.device, carrier: bool) -> _Slot:
        slot = self.slots.get(index)
        if (slot is None or slot.elements != elements or slot.dtype != dtype
                or slot.carrier != carrier):
            slot = self.slots[index] = _Slot(elements, dtype, device, carrier)
        return slot

    def settle(self) -> None:
        """Before this rank's next forward: refuse a forward that got no backward.

        Raises:
            LocalProtocolError: the last forward had gradients enabled and
                ``require_backward_grad_sync``, and no bucket went out since.
        """
        expect = self.expect
        if expect is None:
            return
        self.expect = None
        if self.issued != expect:
            return  # its backward's buckets went out
        ddp = self.ddp
        if not ddp._has_rebuilt_buckets:
            # The reducer still waits for that backward: its drain's bucket
            # rebuild (when due) needs it to stop waiting.
            ddp.reducer._reset_state()
        raise LocalProtocolError(
            "DistributedDataParallel ran a forward with gradients enabled and no backward "
            "after it (e.g. evaluation in model.eval() without torch.no_grad()): inside a "
            "Join, every forward with gradients must be followed by a backward (joined "
            "ranks shadow its gradient all-reduce). Run forward-only iterations under "
            "`with torch.no_grad():` (or torch.inference_mode(), or model.no_sync()), and "
            "follow every other forward by a backward."
        )

    def round_open(self) -> bool:
        """Whether this rank is midway through a round (some buckets out, not all)."""
        return self.sent > 0

    def most_inputs(self) -> bool:
        """Whether no rank had more inputs than this one (torch's last joiners).

        One MAX all-reduce of the input counts, for DDP's post hook: torch
        syncs the final model from the highest of the ranks with the most
        inputs, while a round heartbeat's ``is_last_joiner`` holds for every
        rank that left after the last round.
        """
        mine = torch.tensor([self.inputs], dtype=torch.int64, device=self.ddp.join_device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _MAX
        self.wait(self.ddp.process_group.allreduce([mine], opts))
        return int(mine.item()) == self.inputs

    # -- joined rank ----------------------------------------------------------------

    def shadow_first(self, heartbeat: float) -> float:
        """A joined rank's count: the round's buckets up to its carrier, from zeros.

        Returns:
            The carrier's heartbeat sum.
        """
        ddp = self.ddp
        if not ddp._has_rebuilt_buckets and ddp.reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True  # as DDP's forward would, at the same place
        layout = self._layout()
        self.value = heartbeat
        carrier = _carrier(layout)
        for bucket in layout[:carrier]:
            self._shadow(bucket, False)
        self.owed = carrier + 1
        return self._shadow(layout[carrier], True)

    def shadow_rest(self) -> None:
        """The rest of the round: after a count, or a failing rank's open round."""
        start = self.owed
        if self.sent:
            start = self.sent
            self.sent = 0
            self.pending, self.carrier = [], None
        self.owed = 0
        if start:
            layout = self._layout()
            carrier = _carrier(layout)
            for place in range(start, len(layout)):
                self._shadow(layout[place], place == carrier)
        self.ddp.reducer._push_all_rebuilt_params()  # torch's hook does, once due

    def _shadow(self, bucket: tuple[int, int, torch.dtype, torch.device],
                carrier: bool) -> float:
        """One bucket's all-reduce from zeros, waited for; its heartbeat sum if it carries it."""
        slot = self._slot(*bucket, carrier)
        self.wait(self._send(slot, None))
        return slot.total() if carrier else 0.0

    def _layout(self) -> list[tuple[int, int, torch.dtype, torch.device]]:
        """The reducer's buckets (index, elements, dtype, device), read once per rebuild."""
        rebuilt = bool(self.ddp._has_rebuilt_buckets)
        if self.layout is None or self.layout_rebuilt != rebuilt:
            buckets = self.ddp.reducer._get_zeros_like_grad_buckets()
            self.layout = [(b.index(), b.buffer().numel(), b.buffer().dtype, b.buffer().device)
                           for b in buckets]
            self.layout_rebuilt = rebuilt
        return self.layout
