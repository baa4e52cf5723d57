"""The launcher's rendezvous store: the server lives in the library (hvdlite/_job/server.py),
beside its wire protocol, because hvdlite.ray hosts one too; this module is the launcher's name
for it."""
from hvdlite._job.server import (  # noqa: F401
    HANDSHAKE_TIMEOUT, MAGIC, RendezvousClient, RendezvousError, RendezvousServer,
    RendezvousTimeout, connect, new_secret, recv_frame, send_frame)
