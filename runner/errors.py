"""How a job ends, and the lines that explain a failure.

Note [Root cause]
Ranks report their own failures (Note [Failure reports] in hvdlite/_runtime/failure.py), each marked as
a consequence when a peer caused it. The root cause of a failed job is the earliest failure
that is not a consequence; if every report is a consequence, the rank they point at (which may
have died without a word: killed, lost with its host, exited without an exception); without
any report, the first rank the launcher saw exit non-zero. Failures with the same error on
several ranks at once (a mismatch) are reported together. One more line names the ranks that
failed because of it. A job can also fail before any rank does (ranks that never reach the
rendezvous), or be stopped by a signal to the launcher.
"""
import signal
from dataclasses import dataclass, field
from typing import Dict, List, Optional


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


SSH_LOST = 255  # ssh's own exit status: the connection to the host failed or was lost


@dataclass(frozen=True)
class RankExit:
    rank: int
    hostname: str
    returncode: int
    remote: bool = False
    host_says: str = ""  # the name the host gave itself, when it differs from `hostname`

    def describe(self) -> str:
        host = self.hostname if not self.host_says or self.host_says == self.hostname \
            else f"{self.hostname} ({self.host_says})"
        if self.remote and self.returncode == SSH_LOST:
            return f"rank {self.rank} (host {host}) was lost: the ssh connection to {host} closed"
        return f"rank {self.rank} (host {host}) {describe_exit(self.returncode)}"


@dataclass
class JobResult:
    """The outcome of a job; `exit_code` is what the launcher process exits with."""

    exits: List[RankExit] = field(default_factory=list)
    root_cause: Optional[RankExit] = None  # first rank the launcher saw fail
    lost_contact: Optional[dict] = None    # what that rank said about peers it lost (census)
    stopped: List[int] = field(default_factory=list)  # ranks the launcher stopped
    failures: Dict[int, dict] = field(default_factory=dict)  # ranks' own reports
    pids: Dict[int, int] = field(default_factory=dict)       # pids known to the launcher
    missing_ranks: List[int] = field(default_factory=list)  # never reached the rendezvous
    start_timeout: Optional[float] = None
    stopped_by_signal: Optional[int] = None
    launch_error: Optional[str] = None
    elastic_events: List[str] = field(default_factory=list)    # what the elastic driver did
    elastic_failures: List[RankExit] = field(default_factory=list)  # workers lost on the way

    @property
    def ok(self) -> bool:
        return (self.root_cause is None and not self.missing_ranks
                and self.stopped_by_signal is None and self.launch_error is None)

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        if self.stopped_by_signal is not None:
            return 128 + self.stopped_by_signal
        cause = self.cause_exit()
        if cause is not None and 0 < cause.returncode < 256:
            return cause.returncode
        return 1

    # -- Note [Root cause]
    def _exit_of(self, rank: int) -> Optional[RankExit]:
        if self.root_cause is not None and self.root_cause.rank == rank:
            return self.root_cause
        return next((e for e in self.exits if e.rank == rank), None)

    def cause_ranks(self) -> List[int]:
        """The ranks whose failure started it (several when they failed at once)."""
        primary = sorted((r for r in self.failures.values() if r.get("consequence_of") is None),
                         key=lambda r: r["time"])
        if primary:
            first = primary[0]
            return sorted(r["rank"] for r in primary
                          if (r["type"], r["message"]) == (first["type"], first["message"]))
        pointed = sorted({p for r in self.failures.values() for p in r.get("consequence_of") or []})
        if self.lost_contact:  # the first rank to exit named the peers it lost
            pointed = sorted(set(pointed) | set(self.lost_contact.get("ranks") or []))
        silent = [p for p in pointed if p not in self.failures]
        if silent:
            return silent[:1]
        return [self.root_cause.rank] if self.root_cause is not None else []

    def cause_exit(self) -> Optional[RankExit]:
        ranks = self.cause_ranks()
        found = self._exit_of(ranks[0]) if ranks else None
        return found or self.root_cause

    def _who(self, rank: int) -> str:
        record = self.failures.get(rank, {})
        exit_ = self._exit_of(rank)
        host = exit_.hostname if exit_ else record.get("host", "?")
        says = record.get("host") or (exit_.host_says if exit_ else "")
        if says and says != host:
            host = f"{host} ({says})"
        pid = record.get("pid") or self.pids.get(rank)
        return f"rank {rank} (host {host}{f', pid {pid}' if pid else ''})"

    def _cause_line(self) -> str:
        ranks = self.cause_ranks()
        records = [self.failures[r] for r in ranks if r in self.failures]
        if records:
            first = records[0]
            error = f"{first['type']}: {first['message']}"
            where = first.get("where")
            if where:
                error += f" ({where['file']}, line {where['line']})"
            if len(records) > 1:
                return f"ranks {', '.join(map(str, ranks))} failed at once: {error}"
            exit_ = self._exit_of(ranks[0])
            tail = f"; it {describe_exit(exit_.returncode)}" if exit_ and exit_.returncode else ""
            return f"{self._who(ranks[0])} failed first: {error}{tail}"
        rank = ranks[0]
        exit_ = self._exit_of(rank)
        if rank in self.stopped and rank != self.root_cause.rank:
            return f"{self._who(rank)} stopped answering: the others lost contact with it"
        if exit_ is not None and exit_.remote and exit_.returncode == SSH_LOST:
            return f"{self._who(rank)} was lost: the ssh connection to its host closed"
        if exit_ is not None and exit_.returncode > 0:
            return f"{self._who(rank)} failed first: it {describe_exit(exit_.returncode)} without an exception"
        if exit_ is not None and exit_.returncode < 0:
            return f"{self._who(rank)} failed first: it {describe_exit(exit_.returncode)}"
        return f"{self._who(rank)} stopped answering; the others lost contact with it"

    def _consequence_line(self) -> Optional[str]:
        causes = set(self.cause_ranks())
        after = sorted((r for r in self.failures.values() if r["rank"] not in causes),
                       key=lambda r: r["rank"])
        if not after:
            return None
        kinds = ", ".join(sorted({r["type"] for r in after}))
        ranks = ", ".join(str(r["rank"]) for r in after)
        noun = "rank" if len(after) == 1 else "ranks"
        return f"then {noun} {ranks} failed because of it ({kinds}: {after[0]['message']})"

    def message(self) -> Optional[str]:
        """One line naming the root cause, or None when the job succeeded."""
        if self.launch_error is not None:
            return self.launch_error
        if self.root_cause is not None:
            lines = [self._cause_line()]
            consequences = self._consequence_line()
            if consequences:
                lines.append(consequences)
            elif self.lost_contact and self.root_cause.rank not in self.cause_ranks():
                lines.append(f"then rank {self.root_cause.rank} failed because of it (it had "
                             f"{self.lost_contact.get('text', 'lost contact with its peers')})")
            return "\n".join(lines)
        if self.missing_ranks:
            ranks = ", ".join(str(r) for r in self.missing_ranks)
            noun = "rank" if len(self.missing_ranks) == 1 else "ranks"
            return (f"{noun} {ranks} did not reach the rendezvous within the start timeout of "
                    f"{self.start_timeout:g} s (--start-timeout); stopped the job")
        if self.stopped_by_signal is not None:
            return f"stopped every rank on {signal.Signals(self.stopped_by_signal).name}"
        return None


