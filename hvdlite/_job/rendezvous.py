"""Where the ranks of a job meet: hvdliterun's rendezvous store (address, port and secret),
both ways between a value and the environment, and the client built from it (built here
only); and Rendezvous, the one type for the meeting point as a launcher hands it over and as a
rank reads it back (launchers.detect)."""
from dataclasses import dataclass
from typing import Mapping, Optional

ADDR, PORT, SECRET = "HVDLITE_RENDEZVOUS_ADDR", "HVDLITE_RENDEZVOUS_PORT", "HVDLITE_RENDEZVOUS_SECRET"


@dataclass(frozen=True)
class LauncherStore:
    """hvdliterun's rendezvous store, as a rank reaches it."""

    addr: str
    port: int
    secret: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["LauncherStore"]:
        """The store named by `env`, or None when no hvdliterun started this process."""
        if not (env.get(ADDR) and env.get(PORT) and env.get(SECRET)):
            return None
        return cls(env[ADDR], int(env[PORT]), env[SECRET])

    def to_env(self) -> dict:
        return {ADDR: self.addr, PORT: str(self.port), SECRET: self.secret}

    def client(self, rank: int = -1, connect_timeout: Optional[float] = None):
        """A RendezvousClient (hvdlite/_job/wire.py) to this store."""
        from .wire import RendezvousClient
        kwargs = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
        return RendezvousClient(self.addr, self.port, self.secret, rank=rank, **kwargs)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet. hvdliterun hands it to each rank (runner/environment.py): its
    store, with the job's secret, and rank 0's torch MASTER_ADDR/PORT. A rank reads it back from
    whatever launcher started it (launchers.detect): hvdliterun's store, or torchrun's,
    mpirun's or SLURM's plain TCPStore at addr:port (no secret), which rank 0 hosts itself
    where `host_store` says so."""

    addr: str = ""
    port: int = 0
    secret: str = ""          # hvdliterun's per-job secret; empty: a plain TCPStore
    master_addr: str = ""     # set by hvdliterun for torch.distributed code in the ranks
    master_port: int = 0
    host_store: bool = False  # this process hosts the store (rank 0 under mpirun/SLURM)

    def store(self) -> LauncherStore:
        return LauncherStore(self.addr, self.port, self.secret)

    def to_env(self) -> dict:
        """hvdliterun's variables for a rank: the store's and torch's MASTER_ADDR/PORT."""
        return {**self.store().to_env(), "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
