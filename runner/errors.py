"""How a job ends, and the one line that explains a failure.

The root cause of a failed job is the first rank that exited non-zero by itself: once the
launcher starts stopping the others, their exits are consequences and are not reported as
causes. A job can also fail before any rank does (ranks that never reach the rendezvous), or be
stopped by a signal to the launcher.
"""
import signal
from dataclasses import dataclass, field
from typing import List, Optional


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
    root_cause: Optional[RankExit] = None  # first rank to fail by itself
    lost_contact: Optional[str] = None     # what the root cause said about peers it lost
    missing_ranks: List[int] = field(default_factory=list)  # never reached the rendezvous
    start_timeout: Optional[float] = None
    stopped_by_signal: Optional[int] = None
    launch_error: Optional[str] = None

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
        if self.root_cause is not None and 0 < self.root_cause.returncode < 256:
            return self.root_cause.returncode
        return 1

    def message(self) -> Optional[str]:
        """One line naming the root cause, or None when the job succeeded."""
        if self.launch_error is not None:
            return self.launch_error
        if self.root_cause is not None:
            if self.lost_contact:
                return (f"{self.root_cause.describe()} after it {self.lost_contact}; "
                        f"the other ranks were stopped")
            return (f"{self.root_cause.describe()}: the first rank to fail; "
                    f"the other ranks were stopped")
        if self.missing_ranks:
            ranks = ", ".join(str(r) for r in self.missing_ranks)
            noun = "rank" if len(self.missing_ranks) == 1 else "ranks"
            return (f"{noun} {ranks} did not reach the rendezvous within the start timeout of "
                    f"{self.start_timeout:g} s (--start-timeout); stopped the job")
        if self.stopped_by_signal is not None:
            return f"stopped every rank on {signal.Signals(self.stopped_by_signal).name}"
        return None


class RankFailedError(RuntimeError):
    """Raised by hvdlite.runner.run() when a rank fails; names the rank and why."""

    def __init__(self, message: str, rank: Optional[int] = None,
                 result: Optional[JobResult] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.result = result
