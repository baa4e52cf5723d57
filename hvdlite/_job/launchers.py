"""Where am I? Reads the launcher's environment and turns it into a topology and a rendezvous.

Precedence, most explicit first: the variables hvdliterun sets (HVDLITE_*), torchrun's
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Open MPI's
(OMPI_COMM_WORLD_*), MPICH/PMI's (PMI_RANK, PMI_SIZE), SLURM's (SLURM_PROCID, ...). With none of
them the process is a job of one rank. Pure functions of the environment mapping: no side effects.
"""

import dataclasses
import os
import re

from ..exceptions import LaunchEnvironmentError
from .place import Place
from .rendezvous import Rendezvous

DEFAULT_PORT = 29500


@dataclasses.dataclass(frozen=True)
class Topology(Place):
    """A rank's place (Note [Cross ranks] in place.py) and the launcher it came from."""

    source: str  # "hvdliterun", "torchrun", "mpi", "slurm", "single" or "torch.distributed"
    # The host as the launcher knows it, where it says ("" elsewhere: the machine's name is
    # used). Note [Cross ranks] groups ranks by it: hvdliterun's host name, torchrun's node
    # rank, SLURM's node id.
    node: str = ""


def is_elastic_worker(env):
    """An elastic hvdliterun started this process as a worker without a rank (Note [Elastic
    rendezvous] in _runtime/elastic_worker.py): its place comes from the launcher at each init()."""
    return env.get("HVDLITE_ELASTIC") == "1"


def _int(env, name, minimum=0):
    value = env.get(name)
    if value is None:
        raise LaunchEnvironmentError(f"hvdlite.init(): {name} is not set")
    try:
        parsed = int(value)
    except ValueError:
        raise LaunchEnvironmentError(f"hvdlite.init(): {name}={value!r} is not an integer") from None
    if parsed < minimum:
        raise LaunchEnvironmentError(f"hvdlite.init(): {name}={value!r} must be >= {minimum}")
    return parsed


def _opt_int(env, name, default):
    return _int(env, name) if env.get(name) not in (None, "") else default


def _cross(rank, size, local_rank, local_size, node_rank=None, nodes=None):
    # Provisional: init() replaces the cross rank and size by the rule of Note [Cross ranks]
    # (place.py) once it has read every rank's host, which an environment cannot tell.
    cross_size = nodes if nodes is not None else max(1, -(-size // max(local_size, 1)))
    cross_rank = node_rank if node_rank is not None else rank // max(local_size, 1)
    return cross_rank, cross_size


def _check(topology):
    if not 0 <= topology.rank < topology.size:
        raise LaunchEnvironmentError(
            f"hvdlite.init(): rank {topology.rank} is outside a job of size {topology.size} "
            f"(from {topology.source})")
    if not 0 <= topology.local_rank < topology.local_size:
        raise LaunchEnvironmentError(
            f"hvdlite.init(): local rank {topology.local_rank} is outside a local size of "
            f"{topology.local_size} (from {topology.source})")
    return topology


def _split_top_level(text):
    """'a[1,2],b' -> ['a[1,2]', 'b']: commas outside brackets separate hosts."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchEnvironmentError(f"hvdlite.init(): unbalanced ']' in SLURM node list {text!r}")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise LaunchEnvironmentError(f"hvdlite.init(): unbalanced '[' in SLURM node list {text!r}")
    return parts + [current]


def _expand_host(item, nodelist):
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, body, tail = item[:match.start()], match.group(1), item[match.end():]
    hosts = []
    for part in body.split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not bounds:
            raise LaunchEnvironmentError(f"hvdlite.init(): cannot read {part!r} in SLURM node list {nodelist!r}")
        lo, hi = bounds.group(1), bounds.group(2) or bounds.group(1)
        for value in range(int(lo), int(hi) + 1):
            hosts.extend(_expand_host(head + str(value).zfill(len(lo)) + tail, nodelist))
    return hosts


def expand_slurm_nodelist(nodelist):
    """SLURM's compressed host list, expanded: 'node[01-03,07],gpu[1-2]-ib' -> ['node01',
    'node02', 'node03', 'node07', 'gpu1-ib', 'gpu2-ib']; zero padding is kept, and several
    bracket groups in one name expand to every combination (as SLURM does)."""
    hosts = []
    for item in _split_top_level(nodelist.strip()):
        if item.strip():
            hosts.extend(_expand_host(item.strip(), nodelist))
    return hosts


def first_slurm_host(nodelist):
    """'node[03-05,7],gpu1' -> 'node03'."""
    hosts = expand_slurm_nodelist(nodelist) if nodelist.strip() else []
    return hosts[0] if hosts else ""


def slurm_counts(value):
    """SLURM's '4(x2),3' compressed list of numbers -> [4, 4, 3] (None if unreadable)."""
    counts = []
    for part in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _tasks_per_node(value, node):
    """SLURM's '4(x2),3' compressed list -> tasks on node index `node`."""
    counts = slurm_counts(value) or []
    return counts[node] if node < len(counts) else None


def slurm_port(env):
    """The rendezvous port of a SLURM job step without MASTER_PORT: from the job id and the
    step id, so that concurrent steps of one job (up to 10) and jobs sharing nodes differ."""
    job = _opt_int(env, "SLURM_JOB_ID", _opt_int(env, "SLURM_JOBID", 0))
    step = _opt_int(env, "SLURM_STEP_ID", 0) if env.get("SLURM_STEP_ID", "").isdigit() else 0
    return 20000 + (job * 10 + step % 10) % 20000


def detect(env=None, place=None):
    """Returns (Topology, Rendezvous) for this process. `place`: an elastic worker's place in
    its new generation, handed over by value (the launcher's store then is the rendezvous)."""
    env = os.environ if env is None else env
    if place is not None or "HVDLITE_RANK" in env:
        if place is None:
            rank, size = _int(env, "HVDLITE_RANK"), _int(env, "HVDLITE_SIZE", 1)
            place = Place(rank, size, _opt_int(env, "HVDLITE_LOCAL_RANK", rank),
                          _opt_int(env, "HVDLITE_LOCAL_SIZE", size), _opt_int(env, "HVDLITE_CROSS_RANK", 0),
                          _opt_int(env, "HVDLITE_CROSS_SIZE", 1))
        topology = Topology(place.rank, place.size, place.local_rank, place.local_size, place.cross_rank,
                            place.cross_size, "hvdliterun", env.get("HVDLITE_HOSTNAME", ""))
        if "HVDLITE_RENDEZVOUS_ADDR" not in env:
            raise LaunchEnvironmentError("hvdlite.init(): HVDLITE_RANK is set but HVDLITE_RENDEZVOUS_ADDR is not")
        rendezvous = Rendezvous(env["HVDLITE_RENDEZVOUS_ADDR"], _int(env, "HVDLITE_RENDEZVOUS_PORT", 1),
                                env.get("HVDLITE_RENDEZVOUS_SECRET", ""), host_store=False)
        return _check(topology), rendezvous

    if "RANK" in env and "WORLD_SIZE" in env:
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE", 1)
        local_rank = _opt_int(env, "LOCAL_RANK", rank)
        local_size = _opt_int(env, "LOCAL_WORLD_SIZE", size)
        node_rank = _opt_int(env, "GROUP_RANK", None) if "GROUP_RANK" in env else None
        cross_rank, cross_size = _cross(rank, size, local_rank, local_size, node_rank)
        topology = Topology(rank, size, local_rank, local_size, cross_rank, cross_size, "torchrun",
                            "" if node_rank is None else f"torchrun node {node_rank}")
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        rendezvous = Rendezvous(env.get("MASTER_ADDR", "127.0.0.1"), _opt_int(env, "MASTER_PORT", DEFAULT_PORT),
                                host_store=(rank == 0 and not agent_store))
        return _check(topology), rendezvous

    mpi = None
    if "OMPI_COMM_WORLD_RANK" in env:
        mpi = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_RANK" in env:
        mpi = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if mpi:
        rank, size = _int(env, mpi[0]), _int(env, mpi[1], 1)
        local_rank = _opt_int(env, mpi[2], rank)
        local_size = _opt_int(env, mpi[3], size)
        cross_rank, cross_size = _cross(rank, size, local_rank, local_size)
        topology = Topology(rank, size, local_rank, local_size, cross_rank, cross_size, "mpi")
        addr = env.get("MASTER_ADDR")
        if not addr:
            if local_size != size:
                raise LaunchEnvironmentError(
                    "hvdlite.init() under mpirun across hosts needs MASTER_ADDR (the address of "
                    "rank 0's host) and optionally MASTER_PORT; or start the job with hvdliterun")
            addr = "127.0.0.1"
        return _check(topology), Rendezvous(addr, _opt_int(env, "MASTER_PORT", DEFAULT_PORT),
                                            host_store=(rank == 0))

    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        rank = _int(env, "SLURM_PROCID")
        size = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS", 1)
        node = _opt_int(env, "SLURM_NODEID", 0)
        nodes = _opt_int(env, "SLURM_STEP_NUM_NODES", _opt_int(env, "SLURM_NNODES", 1))
        local_rank = _opt_int(env, "SLURM_LOCALID", 0)
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        local_size = _tasks_per_node(per_node, node) or max(1, size // max(nodes, 1))
        topology = Topology(rank, size, local_rank, local_size, node, nodes, "slurm", f"slurm node {node}")
        addr = env.get("MASTER_ADDR") or first_slurm_host(
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "") or "127.0.0.1"
        return _check(topology), Rendezvous(addr, _opt_int(env, "MASTER_PORT", slurm_port(env)),
                                            host_store=(rank == 0))

    return Topology(0, 1, 0, 1, 0, 1, "single"), Rendezvous()
