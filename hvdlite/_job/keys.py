"""The rendezvous store's key schema: every key a launcher and a rank share, written once.

Keys are str; the store holds bytes. Per-generation keys live under a generation prefix that
init() chooses (``init_prefix``); the launcher-wide ones (failure reports, elastic
requests and answers) do not, since they outlive a generation.
"""


def init_prefix(init_number, torchelastic_restart=None, elastic_generation=None):
    """The prefix of one init()'s keys (Note [Init numbers] in basics.py): hvdliterun's elastic
    generation when there is one, else this process's init() number, kept apart across
    torchrun restarts (its store outlives the processes it restarts)."""
    if elastic_generation is not None:
        return f"hvdlite/e{elastic_generation}/"
    if torchelastic_restart:
        return f"hvdlite/restart{torchelastic_restart}.{init_number}/"
    return f"hvdlite/{init_number}/"


PROC = "proc/"  # + rank, under a generation prefix: the rank's record (host, pid, build, ...)


def proc(rank):
    return f"{PROC}{rank}"


FAILURES = "failures/"  # + rank: a rank's failure report (Note [Failure reports], _runtime/failure.py)


def failure(rank):
    return f"{FAILURES}{rank}"


def is_failure(key):
    return key.startswith(FAILURES)


# Elastic mode (Note [Elastic rendezvous] in _runtime/elastic_worker.py): a worker's n-th request for
# a place and the launcher's answer, the end-of-generation notice, the last durable copy.
def elastic_ready(worker, n):
    return f"elastic/ready/{worker}/{n}"


def elastic_assign(worker, n):
    return f"elastic/assign/{worker}/{n}"


def elastic_notice(generation):
    return f"elastic/notice/{generation}"


ELASTIC_DURABLE = "elastic/durable"


# Note [Dump files] (_runtime/recorder.py): a rank's flight-recorder record for one dump, and
# the id of the newest dump (the launcher's reporter watches it).
def dump(ident, rank):
    return f"dumps/{ident}/{rank}"


DUMP_LATEST = "dumps/latest"
