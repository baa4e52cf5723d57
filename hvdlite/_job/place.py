"""A rank's place in a job, and the one rule that computes it (torch-free: the launchers use it).

Note [Cross ranks]
Ranks are numbered host by host. A rank's local rank counts the ranks before it on its host,
its local size is the number of ranks on its host. The cross communicator of a rank groups the
ranks that share its local rank, one per host (horovod.torch's rule): its cross size is the
number of hosts that have a rank with that local rank, and its cross rank is its position
among those ranks in rank order (as an MPI split by local rank keyed by rank; with ranks
numbered host by host, the host's position). On hosts with different slot
counts these differ from "host index" and "number of hosts": with -H a:2,b:1, local rank 0 has
cross size 2 (a and b), local rank 1 cross size 1 (only a).
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class Place:
    """Where one rank is in one job (what its hvd.init() gets)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def places(hosts: Sequence[str], local_ranks: Optional[Sequence[int]] = None) -> List[Place]:
    """The place of every rank, in rank order, from `hosts[r]` (rank r's host) by Note [Cross
    ranks]. `local_ranks`, when given, are the launcher's local ranks; otherwise they count
    each host's ranks in rank order."""
    hosts = list(hosts)
    if local_ranks is None:
        counted = {}
        local_ranks = []
        for host in hosts:
            local_ranks.append(counted.get(host, 0))
            counted[host] = local_ranks[-1] + 1
    local_ranks = list(local_ranks)
    if len(local_ranks) != len(hosts):
        raise ValueError(f"{len(hosts)} hosts but {len(local_ranks)} local ranks")
    with_local = {}  # local rank -> the hosts that have a rank with it, in rank order
    for host, local in zip(hosts, local_ranks):
        peers = with_local.setdefault(local, [])
        if host not in peers:
            peers.append(host)
    return [Place(rank, len(hosts), local, hosts.count(host), with_local[local].index(host),
                  len(with_local[local]))
            for rank, (host, local) in enumerate(zip(hosts, local_ranks))]


# The launcher's side of the contract: the names each rank's place is given under. hvd.init()
# reads the HVDLITE_ ones; Horovod scripts read horovodrun's (HOROVOD_), torch code torchrun's.
def environment(place: Place, hostname: str) -> dict:
    """The variables that give a rank its place, under hvdlite's, horovodrun's and torchrun's
    names (every launcher of hvdlite, and an elastic worker at each new place, sets them)."""
    values = {"RANK": place.rank, "SIZE": place.size, "LOCAL_RANK": place.local_rank,
              "LOCAL_SIZE": place.local_size, "CROSS_RANK": place.cross_rank,
              "CROSS_SIZE": place.cross_size, "HOSTNAME": hostname}
    env = {}
    for prefix in ("HVDLITE_", "HOROVOD_"):
        env.update({prefix + name: str(value) for name, value in values.items()})
    env.update({"RANK": str(place.rank), "WORLD_SIZE": str(place.size),
                "LOCAL_RANK": str(place.local_rank), "LOCAL_WORLD_SIZE": str(place.local_size),
                # what horovodrun tells a Gloo job's ranks about their controller
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"})
    return env


PLACE_VARIABLES = tuple(environment(Place(0, 1, 0, 1, 0, 1), ""))
