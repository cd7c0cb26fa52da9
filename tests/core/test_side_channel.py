"""``SideChannel`` on the threads harness, and its pure protocol (``joinkit._side_protocol``).

The cases (``side_channel_cases.py``) run for worlds of 1 to 4 ranks (uneven
inputs, a rank with none); each rank's result is compared with what the inputs
alone say (plain Python). Misuse gives ``CollectiveMismatch`` or a clear error,
never a hang (every spawn has a timeout).
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import numpy as np
import pytest
import side_channel_cases as cases
from hypothesis import given
from hypothesis import strategies as st

from joinkit import Join, LocalProtocolError, SideChannel
from joinkit import _side_protocol as p
from joinkit.backends.threads import spawn

WORLDS = (1, 2, 3, 4)


@pytest.mark.parametrize(("name", "world"), list(itertools.product(cases.CASES, WORLDS)))
def test_case_on_threads(name: str, world: int) -> None:
    run, expected = cases.CASES[name]
    got = spawn(run, world, timeout=20.0)
    assert cases.normalize(got) == cases.normalize([expected(world, r) for r in range(world)])


# -- the pure protocol ---------------------------------------------------------------------


def _present(window: int = 0, **fields: Any) -> p.Header:
    defaults = {"kind": p.Kind.ALL_REDUCE, "op": 0, "dtype": p.DTYPES.index("float64") + 1,
                "size": 2, "fingerprint": 7}
    return p.Header(present=True, window=window, **{**defaults, **fields})


def test_every_header_absent_is_the_stop() -> None:
    assert p.decide([p.absent_header(3), p.absent_header(0)]) == p.Stop()


def test_a_reduction_names_the_neutral_element_of_its_op() -> None:
    plan = p.decide([_present(op=p.OPS.index("min")), p.absent_header(0)])
    assert plan == p.ReducePlan(present=(0,), op="min", dtype="float64", size=2,
                                neutral=p.Neutral.HIGHEST)
    assert p.neutral("sum", "int8") is p.Neutral.ZERO
    assert p.neutral("prod", "float32") is p.Neutral.ONE
    assert p.neutral("band", "bool") is p.Neutral.ONE
    assert p.neutral("band", "int32") is p.Neutral.ALL_ONES
    assert p.neutral("max", "float64") is p.Neutral.LOWEST
    with pytest.raises(ValueError, match="unknown reduce op"):
        p.neutral("avg", "float64")


def test_a_gather_takes_every_present_ranks_size_and_rows() -> None:
    headers = [_present(kind=p.Kind.ALL_GATHER, size=48, rows=2, op=-1), p.absent_header(0),
               _present(kind=p.Kind.ALL_GATHER, size=0, rows=0, op=-1)]
    plan = p.decide(headers)
    assert plan == p.GatherPlan(present=(0, 2), sizes=(48, 0, 0), rows=(2, 0, 0))
    assert plan.padded == 48


def test_a_small_gather_is_all_in_the_headers() -> None:
    """Up to INLINE_BYTES per rank: the headers carry the bytes, no data collective."""
    small, other = bytes(range(1, 17)), b"\xff" * p.INLINE_BYTES
    headers = [_present(kind=p.Kind.ALL_GATHER, size=16, rows=2, op=-1,
                        inline=p.pack_inline(small)),
               p.absent_header(0),
               _present(kind=p.Kind.ALL_GATHER, size=len(other), rows=1, op=-1,
                        inline=p.pack_inline(other))]
    plan = p.decide([p.Header.decode(h.encode()) for h in headers])
    assert isinstance(plan, p.GatherPlan)
    assert plan.inline == (small, b"", other)
    assert plan.padded == 0  # nothing more on the wire
    # One byte more on any rank: the data collective, as before.
    big = [headers[0], _present(kind=p.Kind.ALL_GATHER, size=p.INLINE_BYTES + 1, rows=1, op=-1)]
    plan = p.decide(big)
    assert isinstance(plan, p.GatherPlan) and plan.inline is None
    assert plan.padded == p.INLINE_BYTES + 1
    with pytest.raises(ValueError, match="do not fit"):
        p.pack_inline(bytes(p.INLINE_BYTES + 1))


def test_present_ranks_that_disagree_get_a_table_of_the_ranks() -> None:
    plan = p.decide([_present(size=2), _present(size=3)])
    assert isinstance(plan, p.Mismatch)
    assert "rank 0: all_reduce" in plan.message and "elements=3" in plan.message


def test_ranks_in_different_iterations_mismatch() -> None:
    plan = p.decide([_present(window=1), _present(window=2)])
    assert isinstance(plan, p.Mismatch) and "different iterations" in plan.message


def test_a_rank_that_left_after_more_iterations_did_not_make_the_call() -> None:
    plan = p.decide([_present(window=2), p.absent_header(5)])
    assert isinstance(plan, p.Mismatch) and "rank 1 left the loop" in plan.message
    # Left in this window or before: it simply has joined.
    assert isinstance(p.decide([_present(window=2), p.absent_header(2)]), p.ReducePlan)


def test_a_broadcast_from_a_joined_rank_is_refused() -> None:
    plan = p.decide([_present(kind=p.Kind.BROADCAST, root=1, op=-1), p.absent_header(0)])
    assert isinstance(plan, p.Refused) and "rank 1" in plan.message
    plan = p.decide([_present(kind=p.Kind.BROADCAST, root=0, size=8, op=-1),
                     _present(kind=p.Kind.BROADCAST, root=0, size=0, op=-1)])
    assert plan == p.BroadcastPlan(present=(0, 1), root=0, size=8)


_headers = st.builds(
    p.Header, present=st.booleans(), window=st.integers(-1, 5),
    kind=st.sampled_from(list(p.Kind)), op=st.integers(-1, len(p.OPS) - 1),
    dtype=st.integers(1, len(p.DTYPES)), size=st.integers(0, 64), rows=st.integers(0, 8),
    root=st.integers(-1, 3), fingerprint=st.integers(-(2**63), 2**63 - 1),
    inline=st.tuples(*[st.integers(-(2**63), 2**63 - 1)] * p.INLINE_WORDS))


@given(st.lists(_headers, min_size=1, max_size=5))
def test_every_rank_decides_the_same_from_the_same_headers(headers: list[p.Header]) -> None:
    encoded = [h.encode() for h in headers]
    assert [p.Header.decode(e) for e in encoded] == headers
    assert all(-(2**63) <= v < 2**63 for e in encoded for v in e)  # int64 on the wire
    plan = p.decide([p.Header.decode(e) for e in encoded])
    again = p.decide(list(headers))
    assert plan == again
    if not any(h.present for h in headers):
        assert plan == p.Stop()


# -- the shell's edges ----------------------------------------------------------------------


class _NoSide:
    """A join backend without a side wire (a third party's)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        self.heartbeat, self.count = group.heartbeat, group.count
        self.all_gather_object = group.all_gather_object


def test_a_backend_without_a_side_wire_is_refused_on_entry() -> None:
    from support import AllReducer

    from joinkit import backends

    class Plain(AllReducer):
        pass

    backends.register(lambda g: isinstance(g, _Marked), lambda g, d: _NoSide(g.inner))

    def rank_fn(group: Any) -> str:
        side = SideChannel()
        model = Plain(_Marked(group))
        try:
            with Join([model, side]):
                pass
        except TypeError as error:
            return str(error)
        return "entered"

    messages = spawn(rank_fn, 2, timeout=10.0)
    assert all("no side_wire()" in m and "writing-a-backend" in m for m in messages)


class _Marked:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size

    def all_reduce(self, buf: Any, op: str = "sum") -> Any:
        return self.inner.all_reduce(buf, op)

    def broadcast(self, buf: Any, src: int) -> Any:
        return self.inner.broadcast(buf, src)


def test_bad_arguments_raise_before_any_collective() -> None:
    def rank_fn(group: Any) -> list[str]:
        side = SideChannel(group)
        out = []
        for call in (lambda: side.all_reduce(np.ones(1), "avg"),
                     lambda: side.all_reduce([1.0]),
                     lambda: side.all_reduce(np.ones(1, dtype=np.float16)),
                     lambda: side.mean(np.ones(1, dtype=np.int64)),
                     lambda: side.broadcast(np.ones(1), 5)):
            try:
                call()
            except (TypeError, ValueError) as error:
                out.append(type(error).__name__)
        side.barrier()  # nothing was sent: the ranks are still in step
        return out

    assert spawn(rank_fn, 2, timeout=10.0) == [["ValueError", "TypeError", "TypeError",
                                                "TypeError", "ValueError"]] * 2


def test_a_following_channel_needs_a_group_before_any_join() -> None:
    def rank_fn(group: Any) -> str:
        try:
            SideChannel().barrier()
        except LocalProtocolError as error:
            return str(error)
        return "sent"

    assert all("before any Join" in m for m in spawn(rank_fn, 2, timeout=10.0))


def test_throw_mode_ends_without_a_hang() -> None:
    from support import AllReducer

    def rank_fn(group: Any) -> str:
        side = SideChannel()
        model = AllReducer(group)
        try:
            with Join([model, side], throw_on_early_termination=True):
                for _ in range(group.rank + 1):
                    model()
                    side.all_reduce(np.ones(1))
        except RuntimeError as error:
            return type(error).__name__
        return "finished"

    assert spawn(rank_fn, 3, timeout=20.0) == ["EarlyTermination"] * 3


@given(st.lists(_headers, min_size=1, max_size=5), st.data())
def test_the_encoded_fast_path_decides_as_decide(headers: list[p.Header], data: Any) -> None:
    # decide_encoded reads the all-present, agreeing gather or reduction from the
    # integers: the same plan as decide, whatever the headers (agreeing or not).
    if data.draw(st.booleans()):  # a training loop's call: every rank present, agreeing
        first = headers[0]
        headers = [attrs.evolve(first, present=True, size=h.size, rows=h.rows, inline=h.inline)
                   for h in headers]
    encoded = [h.encode() for h in headers]
    assert p.decide_encoded(encoded) == p.decide(headers)


def test_inline_bytes_round_trip_through_a_header() -> None:
    for size in range(p.INLINE_BYTES + 1):
        data = bytes(range(256 - size, 256))
        assert p.unpack_inline(p.pack_inline(data), size) == data
