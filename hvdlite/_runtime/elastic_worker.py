"""A worker's side of elastic training: asking the launcher for a place in each generation,
and hearing that the hosts changed.

Note [Elastic rendezvous]
Under ``hvdliterun --host-discovery-script`` (runner/elastic.py) a worker process is started
without a rank: HVDLITE_ELASTIC=1 and HVDLITE_ELASTIC_WORKER=<id>, an id that stays the same
for the life of the process. Every hvd.init() of such a process is one request, numbered
0, 1, 2, ... by the process, through the launcher's store:
  1. the worker sets ``elastic/ready/<id>/<n>`` to {"reason", "lost"}: why it asks (it is
     starting, it lost a peer, the hosts changed) and which ranks it saw fail;
  2. the launcher waits until every live worker has asked (or exited), decides the next
     generation and answers each under ``elastic/assign/<id>/<n>``: {"action": "run", the
     generation, rank, size, local and cross rank and size, "restore"} or {"action": "exit"}
     (the worker is no longer wanted: its host left the discovery output, or the job has more
     workers than --max-np) or {"action": "abort", "why"} (the job stops: reset limit, too few
     slots for too long);
  3. init() then runs as under the plain launcher, with that topology, under the key prefix
     ``hvdlite/e<generation>/``.
"restore" is the launcher's verdict, the same for every worker: true when a worker of the
previous generation failed, so every survivor rolls its state back to its last commit. After a
change of hosts alone every rank stopped at the same operation (below), so the state is
consistent everywhere and is kept, uncommitted progress included.

Note [Hosts updated]
When the discovery script reports new hosts, the launcher starts their workers, waits until
they have asked for a place (they have imported torch by then), and only then sets
``elastic/notice/<generation>`` to "hosts". Every worker of that generation waits on that key
in a helper thread (one blocking GET on its own connection); on "hosts" it asks its engine to
shut down as a reset (HOSTS_UPDATED its words). Shutdown is negotiated (Note [Fatal errors] in
csrc/engine.h), so every engine stops after the same round: the operations completed before
it completed on every rank, and every later one fails on every rank with the status code
kReset, which exceptions._from_status turns into HostsUpdatedInterrupt (the words are never
parsed). So the interrupt comes within one step of the notice and at the same
operation on every rank, not only at commit(). The launcher sets the key to "end" when it
forms the next generation, which releases the helper threads of the old one.
"""

import json
import os
import threading

from . import state as _state
from .._job import keys
from .._job.launchers import is_elastic_worker
from .._job.place import Place, environment
from .._job.rendezvous import LauncherStore
from ..exceptions import ElasticAbort, WorkerRemoved


_ASSIGN_SLACK_SECONDS = 60.0

# Why the engines shut down when the hosts change (Note [Hosts updated]): the other ranks'
# messages quote it; the reset itself travels as a status code (kReset in csrc/status.h).
HOSTS_UPDATED = "updating the job's hosts (elastic training; every rank resets)"



def enabled(environ=None):
    return is_elastic_worker(os.environ if environ is None else environ)


def assignment():
    """The launcher's answer to the latest request (None before the first)."""
    return _state.process.elastic.assignment


def set_reason(reason, lost=()):
    """What the next request tells the launcher: "failure" (with the ranks seen lost) or
    "hosts"."""
    _state.process.elastic.reason = {"reason": reason, "lost": sorted(set(int(r) for r in lost))}


def _launcher():
    return LauncherStore.from_env(os.environ)


def _connection():
    worker = _state.process.elastic
    if worker.client is None:
        worker.client = _launcher().client()
    return worker.client


def _timeout_ms():
    seconds = float(os.environ.get("HVDLITE_ELASTIC_TIMEOUT", "600"))
    return int((seconds + _ASSIGN_SLACK_SECONDS) * 1000)


def request_place():
    """Steps 1 and 2 of Note [Elastic rendezvous]: returns the worker's place in the next
    generation, which hvd.init() takes as a value, on "run". Raises WorkerRemoved or
    ElasticAbort otherwise. The place is also written to the environment (HVDLITE_RANK,
    HOROVOD_RANK, ..., HVDLITE_ELASTIC_GENERATION) for scripts and tools that read it; hvdlite
    itself does not read it back."""
    elastic = _state.process.elastic
    with elastic.lock:
        n, elastic.requests = elastic.requests, elastic.requests + 1
        worker = os.environ["HVDLITE_ELASTIC_WORKER"]
        client = _connection()
        client.call(b"SET", [keys.elastic_ready(worker, n).encode(), json.dumps(elastic.reason).encode()])
        key = keys.elastic_assign(worker, n).encode()
        reply = json.loads(client.call(b"GET", [key, str(_timeout_ms()).encode()], _timeout_ms())[0])
        elastic.assignment = reply
        set_reason("failure")  # until told otherwise, the next request follows a failure
    action = reply.get("action")
    if action == "exit":
        raise WorkerRemoved(reply.get("why", ""))
    if action != "run":
        raise ElasticAbort(f"hvdliterun stopped the elastic job: {reply.get('why', action)}")
    place = Place(*(reply[field] for field in ("rank", "size", "local_rank", "local_size",
                                               "cross_rank", "cross_size")))
    elastic.generation = int(reply["generation"])
    os.environ.update(environment(place, os.environ.get("HVDLITE_HOSTNAME", "")))
    os.environ["HVDLITE_ELASTIC_GENERATION"] = str(elastic.generation)
    return place


def generation():
    """The launcher's number of the generation this worker was last placed in (Note [Elastic
    rendezvous]); None outside elastic mode or before the first place. Not init()'s own count
    (State.init_number), which also counts the inits of a non-elastic process."""
    return _state.process.elastic.generation if enabled() else None


def record_durable_copy(path, commit):
    """Tells the launcher that `path` holds the state of this rank 0's commit number `commit`
    (Note [No survivor] in runner/elastic.py); a no-op outside elastic mode."""
    if not enabled():
        return
    value = json.dumps({"path": path, "commit": commit,
                        "generation": -1 if generation() is None else generation()})
    with _state.process.elastic.lock:
        _connection().call(b"SET", [keys.ELASTIC_DURABLE.encode(), value.encode()])


def hosts_updated():
    """True once the current generation's hosts-updated notice arrived."""
    return enabled() and generation() in _state.process.elastic.notified


def watch_hosts(generation, engines):
    """Note [Hosts updated]: a helper thread that shuts the engines `engines()` returns down
    with HOSTS_UPDATED when the launcher announces new hosts during elastic generation
    `generation`."""
    def run():
        from .._job.wire import RendezvousError
        try:
            client = _launcher().client()
            value = client.call(b"GET", [keys.elastic_notice(generation).encode(), b"0"], 0)[0]
            client.close()
        except RendezvousError:
            return  # the launcher went away; the engines will notice their peers
        if value == b"hosts":
            _state.process.elastic.notified.add(generation)
            for engine in engines():
                engine.shutdown(HOSTS_UPDATED, reset=True)

    thread = threading.Thread(target=run, name=f"hvdlite-elastic-notice-{generation}", daemon=True)
    thread.start()
    return thread
