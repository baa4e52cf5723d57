"""The negotiation round's slot, sized by the last rounds (Note [Slots sized by the last rounds]
in csrc/control_channel.h): on the control exchange between hosts (HVDLITE_SHARED_MEMORY=0, as
between hosts: over the control link, and over a Gloo group by alltoall and by recursive
doubling with HVDLITE_CONTROL_LINK=0), a step whose requests outgrow 2 KiB pays the second exchange once, then fits; the slot
comes back down after a run of small rounds; a message past the cap still goes through the
second exchange; ranks whose messages differ in length in one round still agree. Every
result is checked against an independent reference, and every rank must report the same slots.
"""

import time

import pytest
import torch

import hvdlite as hvd
from hvdlite._runtime import state as _state
from tests.harness import run_ranks
from tests.multirank._reference import assert_members_close, rank_input

ACROSS_HOSTS = {"HVDLITE_SHARED_MEMORY": "0"}
# Note [Control link] in csrc/control_link.h; Note [Control exchange by alltoall] and, past
# HVDLITE_CONTROL_ALLTOALL_MAX (0 here), Note [Control exchange by hypercube] on a Gloo group
EXCHANGES = {"link": {}, "gloo alltoall": {"HVDLITE_CONTROL_LINK": "0"},
             "gloo hypercube": {"HVDLITE_CONTROL_LINK": "0", "HVDLITE_CONTROL_ALLTOALL_MAX": "0"}}
MIN_SLOT = 2048
ROUND_BYTES = 128 << 10
CALM_ROUNDS = 32


def _grouped(by_rank, rank, name, what):
    mine = [t.clone() for t in by_rank[rank]]
    hvd.grouped_allreduce_(mine, op=hvd.Sum, name=name)
    assert_members_close(mine, by_rank, hvd.Sum, torch.float32, what)


def _slots_job():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = _state.current().sets[0].engine
    assert not engine.shared_memory
    exchanges = lambda: engine._control_exchanges  # (rounds, second exchanges, next slot)
    # A ResNet-like step: 200 members, 60 of them small enough to travel inside the round
    shapes = [(64,) if i % 10 < 3 else (300 + i,) for i in range(200)]
    step = [[rank_input(i, r, s, torch.float32) for i, s in enumerate(shapes)] for r in range(size)]
    _grouped(step, rank, "step", f"step 0 on rank {rank}")  # in full: the second exchange
    _grouped(step, rank, "step", f"step 1 on rank {rank}")  # cached
    _, second_before, grown = exchanges()
    assert grown > MIN_SLOT, grown
    for k in range(2, 8):
        _grouped(step, rank, "step", f"step {k} on rank {rank}")
    _, second_after, slot = exchanges()
    assert second_after == second_before, (second_before, second_after)  # the cached step fits now
    assert slot == grown, (slot, grown)
    # Small rounds in a row bring the slot back down
    one = [[rank_input(1000, r, (1,), torch.float32)] for r in range(size)]
    for k in range(CALM_ROUNDS + 8):
        _grouped(one, rank, "one", f"small round {k} on rank {rank}")
    shrunk = exchanges()[2]
    assert shrunk == MIN_SLOT, shrunk
    # The step again: one second exchange, then it fits again
    for k in range(3):
        _grouped(step, rank, "step", f"step after shrinking {k} on rank {rank}")
    _, second_regrown, regrown = exchanges()
    assert second_regrown == second_after + 1, (second_after, second_regrown)
    assert MIN_SLOT < regrown <= grown, (regrown, grown)  # cached requests: shorter than the first step's
    # Ranks arrive apart: one round carries rank 0's whole step and little from the others
    time.sleep(0.05 * rank)
    _grouped(step, rank, "step", f"skewed step on rank {rank}")
    # Past the cap: 3000 members, never seen before, whose names and shapes travel in full
    cap = max(MIN_SLOT, ROUND_BYTES // size)
    wide = [[rank_input(5000 + i, r, (i % 5 + 1,), torch.float32) for i in range(3000)] for r in range(size)]
    before = exchanges()[1]
    _grouped(wide, rank, "wide", f"3000 members on rank {rank}")
    _, after, capped = exchanges()
    assert after > before, (before, after)
    assert capped == cap, (capped, cap)
    _grouped(step, rank, "step", f"step after the wide call on rank {rank}")
    hvd.shutdown()
    return [grown, shrunk, regrown, capped]


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
@pytest.mark.parametrize("size", [2, 3])
def test_slots_grow_with_the_step_shrink_after_calm_rounds_and_agree(size, exchange):
    # by recursive doubling a longer message takes a second transfer
    env = {**ACROSS_HOSTS, **EXCHANGES[exchange]}
    slots = run_ranks(size, __name__, "_slots_job", env=env, timeout=180)
    assert all(s == slots[0] for s in slots), slots
