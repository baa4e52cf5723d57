"""Connections that grow with log N (Note [Connections on first use] in
hvdlite/_runtime/groups.py, Note [Control link] in csrc/control_link.h): with the control plane
on the control link and the data on Gloo (HVDLITE_SHARED_MEMORY=0, as between hosts), a rank
that ran a training loop's collectives holds TCP connections to its hypercube partners, its ring
neighbours and the broadcast's tree, not to every peer of every group. Counted from the
kernel's table of the process's own sockets; every collective's result is checked too.
"""

import math
import os

import pytest
import torch

import hvdlite as hvd
from hvdlite._runtime import state as _state
from tests.harness import run_ranks

# The control plane over the control link (Note [Control link] in csrc/control_link.h), the
# data over Gloo
GLOO_EVERYWHERE = {"HVDLITE_SHARED_MEMORY": "0", "HVDLITE_CPU_CHANNELS": "1"}


def _established_tcp():
    """TCP connections in state ESTABLISHED that this process holds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "01" and fields[9] in inodes:
                        count += 1
        except OSError:
            pass
    return count


def _training_loop_job():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    before = _established_tcp()
    params = [torch.full((1000,), float(rank + i)) for i in range(3)]
    hvd.broadcast_parameters({f"p{i}": p for i, p in enumerate(params)}, root_rank=0)
    for i, p in enumerate(params):
        assert torch.equal(p, torch.full((1000,), float(i))), (rank, i)
    for step in range(5):
        grads = [torch.full((4096,), float(rank * step + i)) for i in range(4)]
        handles = [hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        for i, h in enumerate(handles):
            want = sum(r * step + i for r in range(size))
            assert torch.equal(hvd.synchronize(h), torch.full((4096,), float(want))), (rank, step, i)
        small = hvd.allreduce(torch.tensor([float(rank)]), name="loss", op=hvd.Sum)
        assert small.item() == size * (size - 1) / 2
    gathered = hvd.allgather(torch.tensor([rank]), name="ranks")
    assert gathered.tolist() == list(range(size))
    after = _established_tcp()
    groups = _state.current().sets[0].groups
    link = groups.link
    sent, received = link.frames
    connections = link.connections  # before shutdown, after which peers close theirs
    hvd.shutdown()
    return before, after, groups.control is None, link.partners, connections, sent, received


@pytest.mark.slow
@pytest.mark.parametrize("size", [8, 16])
def test_a_training_loop_connects_log_n_peers_not_every_peer(size):
    results = run_ranks(size, __name__, "_training_loop_job", env=GLOO_EVERYWHERE, timeout=240)
    log = math.ceil(math.log2(size))
    # control partners (log2 N) + ring neighbours (2) + a broadcast tree (log2 N), plus the
    # connection to the rendezvous store; a full mesh of the two groups alone would be 2 (N - 1)
    bound = 2 * log + 2 + 2
    for rank, (before, after, no_gloo_control, partners, connections, sent, received) in enumerate(results):
        assert after <= bound, (rank, before, after, bound)
        assert after < 2 * (size - 1), (rank, after)
        # negotiation went over the control link only: no Gloo group for it, one connection
        # per hypercube partner, and frames both ways
        assert no_gloo_control, rank
        assert 1 <= len(partners) <= log + 1 and connections == len(partners), (rank, partners, connections)
        assert sent > 0 and received > 0, (rank, sent, received)
