"""Where a rank meets the launcher: hvdliterun's rendezvous address, port and secret, both ways
between a value and the environment, and the client built from it (built here only)."""
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
        """A RendezvousClient (hvdlite/_rendezvous_wire.py) to this store."""
        from .._rendezvous_wire import RendezvousClient
        kwargs = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
        return RendezvousClient(self.addr, self.port, self.secret, rank=rank, **kwargs)
