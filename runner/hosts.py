"""Hosts and slots: parse `-H`/`--hostfile` and assign ranks to slots.

Everything here is pure (no sockets, no environment), so it is tested in one process. A *slot*
is one place a rank can run; a host offers some number of slots. Ranks are assigned host by host
in the order the hosts were given: the first host's slots get ranks 0, 1, ..., then the next host.
"""
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from hvdlite._job.place import Place, places
from hvdlite.exceptions import HostSpecError


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class SlotInfo(Place):
    """Where one rank runs (its host) and its place in the job; the launcher turns it into the
    rank's environment (hvdlite/_job/place.environment)."""

    hostname: str = ""


def _check_name(name: str, where: str) -> str:
    if not name or any(c.isspace() for c in name) or "," in name or "=" in name:
        raise HostSpecError(f"{where}: bad host name {name!r}")
    return name


def _parse_slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise HostSpecError(f"{where}: slot count {text!r} is not a whole number") from None
    if slots < 1:
        raise HostSpecError(f"{where}: slot count must be at least 1, got {slots}")
    return slots


def parse_host_list(text: str) -> List[Host]:
    """Parse `-H host1:4,host2:2`; a host without `:N` has one slot.

    Repeated host names are an error: their slots would silently merge in surprising order.
    """
    hosts: List[Host] = []
    if not text or not text.strip():
        raise HostSpecError("empty host list")
    for item in text.split(","):
        item = item.strip()
        where = f"host {item!r}"
        if not item:
            raise HostSpecError(f"empty entry in host list {text!r}")
        # rsplit so an IPv6 literal in brackets keeps its colons: [::1]:2
        if item.startswith("["):
            close = item.find("]")
            if close < 0:
                raise HostSpecError(f"{where}: missing ']'")
            name, rest = item[1:close], item[close + 1:]
            if rest and not rest.startswith(":"):
                raise HostSpecError(f"{where}: expected ':SLOTS' after ']'")
            slots = _parse_slots(rest[1:], where) if rest else 1
        elif item.count(":") > 1:
            raise HostSpecError(f"{where}: expected HOST or HOST:SLOTS (write IPv6 as [addr]:N)")
        elif ":" in item:
            name, slot_text = item.split(":")
            slots = _parse_slots(slot_text, where)
        else:
            name, slots = item, 1
        hosts.append(Host(_check_name(name, where), slots))
    _check_unique(hosts)
    return hosts


def parse_hostfile(text: str, filename: str = "hostfile") -> List[Host]:
    """Parse hostfile contents: one `host [slots=N]` per line, `#` starts a comment."""
    hosts: List[Host] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{filename}:{lineno}"
        fields = line.split()
        name = _check_name(fields[0], where)
        slots = 1
        for field in fields[1:]:
            key, sep, value = field.partition("=")
            if not sep or key not in ("slots", "max_slots"):
                raise HostSpecError(f"{where}: expected 'HOST slots=N', got {line!r}")
            if key == "slots":
                slots = _parse_slots(value, where)
        hosts.append(Host(name, slots))
    if not hosts:
        raise HostSpecError(f"{filename}: no hosts listed")
    _check_unique(hosts)
    return hosts


def slurm_allocation(env) -> Optional[List[Host]]:
    """The hosts of the SLURM allocation this process runs in (salloc, sbatch), or None.

    Slots per host are the allocation's tasks per node when tasks were asked for (-n), else its
    CPUs per node."""
    from hvdlite._job.launchers import expand_slurm_nodelist, slurm_counts
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    names = expand_slurm_nodelist(nodelist)
    per_node = (env.get("SLURM_TASKS_PER_NODE") if env.get("SLURM_NTASKS") else None) \
        or env.get("SLURM_JOB_CPUS_PER_NODE") or ""
    counts = slurm_counts(per_node) if per_node else None
    if not counts or len(counts) != len(names):
        counts = [1] * len(names)
    return [Host(name, count) for name, count in zip(names, counts)]


def _check_unique(hosts: Sequence[Host]) -> None:
    seen = set()
    for host in hosts:
        if host.name in seen:
            raise HostSpecError(f"host {host.name!r} is listed twice")
        seen.add(host.name)


def assign_slots(hosts: Sequence[Host], np: Optional[int]) -> List[SlotInfo]:
    """Give each of `np` ranks a slot, filling hosts in order; `np=None` uses every slot.

    Returns one SlotInfo per rank, in rank order. Hosts that get no rank are left out of the
    cross sizes. Raises HostSpecError when the hosts have fewer slots than `np`.
    """
    total = sum(h.slots for h in hosts)
    if np is None:
        np = total
    if np < 1:
        raise HostSpecError(f"the number of ranks must be at least 1, got {np}")
    if np > total:
        listing = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise HostSpecError(f"{np} ranks requested but the hosts {listing} have only {total} slots")

    names = []  # each rank's host, host by host
    for host in hosts:
        names.extend([host.name] * min(host.slots, np - len(names)))
        if len(names) == np:
            break
    # Local and cross ranks by the one rule (Note [Cross ranks] in hvdlite/_job/place.py).
    return [SlotInfo(**asdict(p), hostname=name) for name, p in zip(names, places(names))]
