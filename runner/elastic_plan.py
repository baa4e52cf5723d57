"""The decisions of the elastic launcher that need no processes: reading the discovery
script's output, the blacklist and its cooldown, and each generation's ranks.

Pure (no sockets, no subprocesses; the clock and the random draw are passed in), so it is
unit-tested in one process. runner/elastic.py carries the decisions out.
"""
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from hvdlite._job.place import Place, places
from hvdlite.exceptions import DiscoveryOutputError

from .hosts import Host, HostSpecError, parse_host_list


def parse_discovery_output(text: str, slots_per_host: int) -> List[Host]:
    """One ``host`` or ``host:slots`` per line (``[v6addr]:slots`` for IPv6); blank lines and
    ``#`` comments are skipped; a host without slots gets ``slots_per_host``."""
    hosts: List[Host] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            (host,) = parse_host_list(line)
        except (HostSpecError, ValueError) as exc:
            raise DiscoveryOutputError(f"line {lineno}: {exc}") from None
        has_slots = ":" in (line.rsplit("]", 1)[-1] if line.startswith("[") else line)
        hosts.append(host if has_slots else Host(host.name, slots_per_host))
    names = [h.name for h in hosts]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DiscoveryOutputError(f"host {duplicates[0]!r} is listed twice")
    return hosts


@dataclass
class Blacklist:
    """Hosts whose workers failed. Without a cooldown range a host stays out for good; with
    (lo, hi) it comes back after a cooldown drawn from that range, doubled for every earlier
    blacklisting of the same host (capped at hi), so a flapping host is tried less and less."""

    cooldown_range: Optional[Tuple[float, float]] = None
    until: Dict[str, float] = field(default_factory=dict)   # host -> time it may return
    strikes: Dict[str, int] = field(default_factory=dict)

    def add(self, host: str, now: float, draw=random.uniform) -> float:
        """Blacklists `host`; returns the cooldown in seconds (inf: for good)."""
        self.strikes[host] = self.strikes.get(host, 0) + 1
        if self.cooldown_range is None:
            self.until[host] = float("inf")
            return float("inf")
        lo, hi = self.cooldown_range
        cooldown = min(hi, draw(lo, hi) * 2 ** (self.strikes[host] - 1))
        self.until[host] = now + cooldown
        return cooldown

    def blocked(self, host: str, now: float) -> bool:
        return self.until.get(host, float("-inf")) > now


def plan_generation(survivors: Sequence[Tuple[int, str]], newcomers: Sequence[Tuple[int, str]],
                    max_np: Optional[int]) -> Tuple[Dict[int, Place], List[int]]:
    """Ranks for the next generation.

    `survivors` are (worker id, host) of workers that had a rank, in the order of their old
    ranks; `newcomers` (worker id, host) in the order they were started. Survivors keep their
    relative order and come first, so the new rank 0 is a survivor (it holds the state the
    others sync from). Beyond `max_np`, the last workers are left out. Local ranks count the
    workers of each host in rank order; cross ranks by Note [Cross ranks] (hvdlite/_job/place.py),
    as hvdliterun's fixed jobs.
    Returns ({worker id: Place}, [left-out worker ids]).
    """
    ordered = list(survivors) + list(newcomers)
    if max_np is not None:
        ordered, left_out = ordered[:max_np], [w for w, _ in ordered[max_np:]]
    else:
        left_out = []
    placed = places([h for _, h in ordered])  # Note [Cross ranks] in hvdlite/_job/place.py
    by_worker = {worker: place for (worker, _), place in zip(ordered, placed)}
    return by_worker, left_out
