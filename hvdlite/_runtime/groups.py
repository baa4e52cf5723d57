"""The process groups behind one engine, and starting the engine on them.

Each engine (the global one, and one per process set) gets a Gloo group for negotiation,
HVDLITE_CPU_CHANNELS Gloo groups for CPU data (large allreduces are striped over them, Note
[CPU channels] in csrc/cpu_route.h; one where another route carries them), an NCCL group where
CUDA is available, and, when all its ranks run on one host, a shared-memory channel for CPU
allreduces (Note [Shared-memory allreduce] in csrc/shm_channel.h), or, with
HVDLITE_HIERARCHICAL_ALLREDUCE=1 across hosts, one channel per host and a Gloo group among each
host's first rank (Note [Hierarchical allreduce] in csrc/cpu_route.h). The settings mapping is
the same on every rank for the job-wide variables (Note [Job-wide settings] in csrc/config.h),
so every rank creates the same groups.
"""

import datetime
import os
import secrets
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import liveness as _liveness
from .._job import netif as _netif
from . import recorder as _recorder
from .group_store import GroupStore, broadcast_peers, ring_peers
from .native import _core
from .._job.launchers import is_elastic_worker
from ..exceptions import RankFailureError

# Note [Process group timeout]: the engine only starts a data collective once negotiation has
# shown every rank is ready, and an idle engine still joins a negotiation round every heartbeat,
# so a collective waiting this long means a peer process is frozen, not slow, or unreachable: a
# host whose link is cut sends nothing, not even a reset, so this timeout is how the others
# notice it. HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS shortens it where that must be quicker.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=300)


def _gloo_devices(loopback):
    """Where Gloo listens and what it tells its peers.

    Note [Connections on first use]
    Every device is lazy: a Gloo group publishes one address at creation and connects a pair
    of ranks the first time they exchange, instead of a connection to every peer up front
    (the addresses travel in two store requests whatever N: Note [Group addresses in two
    requests] in group_store.py). The paths training uses touch few peers: Gloo's ring
    allreduce and allgather two, and the control plane's Gloo group, where the control link
    does not carry negotiation (HVDLITE_CONTROL_LINK=0), every peer up to
    HVDLITE_CONTROL_ALLTOALL_MAX ranks (16) and log2(N) + 1 beyond (Note [Control exchange by
    hypercube] in csrc/hypercube.h); an alltoall connects every pair it needs when a user calls
    one. (The control link connects its log2(N) + 1 partners itself: Note [Control link] in
    csrc/control_link.h.) The cost: an address that does not reach a peer shows at the first
    exchange with it, not at init; the first round already exchanges with every hypercube
    partner, and hvdliterun's network discovery has checked the interface between every pair
    of hosts. Connecting lazily also loses what a full mesh gave for free: a peer that dies
    closes its connections, which fails at once whoever waits on it, but a rank still trying to
    reach a dead peer it never connected to waits for the process-group timeout. So each
    engine connects the pairs its regular paths use before init() returns: the control
    plane's partners (the control link's connect, or one exchange of the Gloo group in
    MakeEngine), each CPU channel's ring neighbours (Gloo's
    ring allreduce and allgather) and the first channel's broadcast tree from rank 0, by a word
    each way with each of them at once (_data_peers and _connect_data below). What else a job calls (a broadcast from another root, an alltoall)
    connects its pairs on first use.

    GLOO_SOCKET_IFNAME (hvdliterun sets it from network discovery, Note [Network discovery] in
    runner/task_service.py; users may set it themselves) names the interfaces, as it does for
    torch.distributed's own Gloo groups. Without it, Gloo's default follows this host's name,
    which on many machines resolves to an address other hosts cannot reach.
    """
    if loopback:
        return [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=True)]
    names = _interfaces()
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=name, lazy_init=True) for name in names]
    return [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]


def _interfaces():
    """GLOO_SOCKET_IFNAME's interfaces: a Gloo group has a device for each (one at least)."""
    return [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]


def _timeout():
    """Note [Process group timeout]; HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS shortens it."""
    value = os.environ.get("HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS")
    if not value:
        return PROCESS_GROUP_TIMEOUT
    try:
        seconds = float(value)
        if not seconds > 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"invalid HVDLITE_PROCESS_GROUP_TIMEOUT_SECONDS={value!r}: expected seconds > 0") from None
    return datetime.timedelta(seconds=seconds)


def _gloo_group(store, rank, size, loopback):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _timeout()
    options._devices = _gloo_devices(loopback)
    # One worker thread, not Gloo's default two: the engine has at most one operation in flight
    # per group (a WorkWindow lane per CPU channel, Note [CPU channels] in csrc/cpu_route.h;
    # the control group runs one exchange at a time), so a second worker would only wait.
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, size, options)


def _data_peers(rank, size, plan, members):
    """{group: peers} of the pairs the data paths use (Note [Connections on first use]), by
    the group's key suffix: every CPU channel's ring neighbours (Gloo's ring allreduce and
    allgather), the first channel's broadcast tree from rank 0, the group of first ranks' ring.
    Each relation is symmetric: a rank is its peers' peer."""
    peers = {}
    for i in range(plan.cpu_channels):
        mine = set(ring_peers(rank, size))
        if i == 0:
            mine.update(broadcast_peers(rank, size))
        peers[f"cpu{i}"] = sorted(mine)
    if plan.cross is not None:
        hosts = list(dict.fromkeys(m["host"] for m in members))
        peers["cross"] = ring_peers(hosts.index(members[rank]["host"]), len(hosts))
    return peers


def _connect_data(groups, peers):
    """Note [Connections on first use]: the pairs the data paths use, connected now, every one
    at once: a word each way with each peer (both ends send and receive, so the order of
    connecting does not matter). A collective would connect the same pairs, but in its own
    steps: a ring allreduce's 2(N - 1) of them in turn."""
    works, words = [], []
    for name, group in groups.items():
        for peer in peers.get(name, ()):
            out, into = torch.zeros(1), torch.zeros(1)
            words += [out, into]
            works += [group.send([out], peer, 0), group.recv([into], peer, 0)]
    for work in works:
        work.wait()


def _nccl_group(store, rank, size):
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _timeout()
    return dist.ProcessGroupNCCL(store, rank, size, options)


# Note [Frozen peers]
# A peer that is alive but frozen (SIGSTOP, a debugger, a kernel hang) keeps its sockets open
# and its pid alive, so nothing fails by itself; the others wait in the next negotiation round,
# which it never joins. Every idle engine joins a round every heartbeat (Note [Process group
# timeout]), so a peer missing from a round for the stall shutdown time is frozen, not slow:
# the shared-memory barriers and the control exchange across hosts both give up after the
# process-group timeout or the stall shutdown time, whichever is shorter, and the failure census
# (Note [Failure census] in liveness.py) names the peer that did not answer. Data collectives
# keep the process-group timeout: they start only once negotiation has shown every rank ready,
# and a rank that fails in one exits, which closes its connections and fails the others at once.
# Under elastic training a failed rank does not exit (it resets), and the chaos test saw
# survivors wait in an allreduce for peers that had gone to the next generation, until the
# launcher killed them; there data collectives get the same bound as the control exchange.
# The cost: with a stall shutdown time, a round may not wait longer than it for a peer still
# finishing the previous collective (a broadcast's receivers finish after its root); set the
# stall shutdown time above the longest single collective, as for a stalled tensor.
def _channel_timeout(options):
    """How long a negotiation round waits for a peer (Note [Frozen peers])."""
    seconds = _timeout().total_seconds()
    stall = options.get("stall_shutdown_seconds", 0.0)
    return min(seconds, stall) if stall > 0 else seconds


def segment_name_prefix(pid):
    """How every shared-memory segment process `pid` makes is named (in /dev/shm): a check for
    segments left behind looks for a job's own by its ranks' pids."""
    return f"hvdlite.{pid}."


def _segment(store, key, index, count, ranks, pids, options=None, chunk_bytes=0, probe=False):
    """One shared-memory segment among `count` processes on this host (this one is `index`;
    `ranks` name them in messages): index 0 creates it and publishes its name under `key`,
    each maps it and answers under `key/<index>`, and once all have answered index 0 unlinks
    the name (the mappings stay), so nothing is left in /dev/shm whatever happens next.
    Returns (channel, words): the channel if every one of them mapped it, else None (the same
    on each), and with `probe` every member's single-copy probe word ("address:value", Note
    [Single-copy allreduce]), read in the same request as the answers."""
    if index == 0:
        name = f"/{segment_name_prefix(os.getpid())}{secrets.token_hex(6)}"
        name = "" if _core.ShmChannel.create(name, count, chunk_bytes) else name
        store.set(key, name)
    else:
        name = store.get(key).decode()  # get and multi_get wait for the key, on every store
    channel = None
    # The channel watches its peers by pid (Note [Shared-memory allreduce]): processes that share
    # /dev/shm and a host name but not a pid namespace (two containers of one pod, say) must
    # not use it, or a peer would look dead.
    if name and all(_liveness.running(pid) for pid in pids):
        try:
            channel = _core.ShmChannel(name, index, count, ranks, pids, _channel_timeout(options or {}), chunk_bytes)
        except RuntimeError:
            channel = None
    answer = "0"
    if channel is not None:
        answer = "1 {}:{}".format(*channel.probe_word()) if probe else "1"
    store.set(f"{key}/{index}", answer)
    answers = [v.decode() for v in store.multi_get([f"{key}/{i}" for i in range(count)])]
    if index == 0 and name:
        _core.ShmChannel.unlink(name)
    if not all(a.startswith("1") for a in answers):
        return None, None
    return channel, [a.partition(" ")[2] for a in answers]


def _single_copy(store, key, index, count, pids, channel, words):
    """Note [Single-copy allreduce] (csrc/shm_channel.h): on for every member of `channel` when
    each can read and write every other's memory through process_vm_readv/writev, else for
    none. Each has published the address of its probe word (`words`, by index); each tries
    every peer's."""
    # HVDLITE_TEST_REFUSE_SINGLE_COPY: a test hook (per rank), as if the kernel refused this one
    mine = os.environ.get("HVDLITE_TEST_REFUSE_SINGLE_COPY") != "1"
    for i, word in enumerate(words):
        if i != index:
            peer_address, peer_value = (int(part) for part in word.split(":"))
            mine = mine and _core.ShmChannel.can_reach(pids[i], peer_address, peer_value)
    if _agree(store, f"{key}/cma/ok", index, count, mine):
        channel.enable_single_copy()


def _agree(store, key, rank, size, mine):
    """True when every rank of the engine says True (each publishes its own answer)."""
    store.set(f"{key}/{rank}", "1" if mine else "0")
    return all(v == b"1" for v in store.multi_get([f"{key}/{r}" for r in range(size)]))


def _first_addresses(base, rank, size, options, plan, members, loopback, link):
    """Note [Group addresses in two requests]: the store keys of the addresses this rank reads
    before init() returns (Note [Connections on first use]): the control plane's partners,
    unless shared memory carries it (the control link's, or the Gloo control group's); every
    CPU channel's ring neighbours and the first channel's broadcast tree from rank 0; the group
    of first ranks' ring."""
    devices = range(1 if loopback else max(1, len(_interfaces())))
    wanted = dict(_data_peers(rank, size, plan, members))
    if link is None and _control_across_hosts(plan):
        wanted["control"] = _core.control_peers(rank, size, options["control_alltoall_max"])
    keys = [f"{base}{name}/{d}/{peer}" for name, peers in wanted.items() for peer in peers for d in devices]
    return keys + [_link_key(base, peer) for peer in (link.partners if link is not None else ())]


def _control_across_hosts(plan):
    """Whether negotiation travels between hosts (no segment carries it for every rank)."""
    return plan.shm is None or plan.route == "hierarchical"


def _link_key(base, rank):
    return f"{base}link/{rank}"


def _control_link(rank, size, options, plan, loopback):
    """Note [Control link] (csrc/control_link.h): the control plane's own connections, listening
    now so that its address goes out with the Gloo groups'; None where shared memory carries
    negotiation, on one rank, or with HVDLITE_CONTROL_LINK=0. It is reached where the Gloo
    groups are: at the IPv4 addresses of GLOO_SOCKET_IFNAME's interfaces (of every interface
    but loopback without it, or where those have none; a connector tries them all and keeps
    the first that answers), or at 127.0.0.1 when every rank is on this host."""
    if size < 2 or not options["control_link"] or not _control_across_hosts(plan):
        return None
    if loopback:
        return _core.ControlLink(rank, size, "127.0.0.1", ["127.0.0.1"], _channel_timeout(options))
    table = _netif.interface_addresses()
    published = [table[n] for n in _interfaces() if n in table] or \
        [a for a in table.values() if not a.startswith("127.")]
    if not published:
        raise RuntimeError(f"rank {rank} has no IPv4 address other ranks could reach its control link at "
                           "(interfaces: " + (", ".join(sorted(table)) or "none") +
                           "); HVDLITE_CONTROL_LINK=0 negotiates through a Gloo group instead")
    return _core.ControlLink(rank, size, "0.0.0.0", published, _channel_timeout(options))


def _local_paths(store, addresses, base, rank, size, options, members, loopback):
    """What carries this engine's CPU allreduces besides Gloo: (shm, cross, hierarchical).

    Note [Shared-memory allreduce]: every rank of the engine on this host -> one segment for all.
    Note [Hierarchical allreduce]: with HVDLITE_HIERARCHICAL_ALLREDUCE=1 and several hosts, one
    segment per host and a Gloo group among each host's first rank. Every rank reaches the same
    verdict (a rank that cannot map its segment turns both off for the whole engine). `options`
    are the engine's parsed settings, `members` the records (host, pid) of its ranks, in order.
    """
    if size < 2 or members is None or not options["shared_memory"]:
        return None, None, False
    hosts = list(dict.fromkeys(m["host"] for m in members))
    if len(hosts) == 1:
        pids = [m["pid"] for m in members]
        channel, words = _segment(store, f"{base}shm", rank, size, list(range(size)), pids, options,
                                  probe=options["single_copy"])
        if channel is not None and options["single_copy"]:
            _single_copy(store, f"{base}shm", rank, size, pids, channel, words)
        return channel, None, False
    if not options["hierarchical_allreduce"]:
        return None, None, False
    host = hosts.index(members[rank]["host"])
    local = [r for r, m in enumerate(members) if m["host"] == hosts[host]]
    channel = None
    if len(local) > 1:
        channel, _ = _segment(store, f"{base}shm.h{host}", local.index(rank), len(local), local,
                              [members[r]["pid"] for r in local], options, _core.ShmChannel.HIERARCHICAL_CHUNK)
    if not _agree(store, f"{base}hierarchical", rank, size, len(local) == 1 or channel is not None):
        return None, None, False
    cross = None
    if local[0] == rank:  # the host's first rank joins the group of first ranks
        cross = _gloo_group(dist.PrefixStore(base + "cross", addresses), host, len(hosts), loopback)
    return channel, cross, True


class TransportPlan(NamedTuple):
    """Note [Transport plan]
    How one engine's CPU reductions travel, decided once at init() and handed to the engine,
    which builds that route (MakeCpuRoute in csrc/cpu_route.cc) and never re-derives it. The
    candidates of Note [CPU routes] (csrc/cpu_route.h), first that applies:
      "hierarchical": HVDLITE_HIERARCHICAL_ALLREDUCE=1 and the ranks span hosts, with every
        host's segment open (or a host of one rank);
      "shared_memory": every rank on one host, with the segment open;
      "gloo_channels": everything else, over `cpu_channels` Gloo groups.
    Every input is the same on every rank (job-wide settings from rank 0, and the channel
    verdicts agreed through the store by _segment and _agree), so every rank makes the same
    plan and the same groups. Only the Gloo channels route stripes over several groups; the
    others make one, which carries what they do not run (alltoall, reducescatter through Gloo):
    each Gloo group brings a loop thread that wakes every 10 ms, a worker thread and a
    connection per peer it exchanges with (measured: docs/performance.md, Design
    measurements)."""
    route: str          # "hierarchical", "shared_memory" or "gloo_channels"
    cpu_channels: int   # Gloo groups for CPU data
    shm: object         # this host's _core.ShmChannel, or None
    cross: object       # hierarchical, on each host's first rank: the group of first ranks


def _plan(options, shm, cross, hierarchical):
    """Note [Transport plan]: the plan for the agreed local paths (_local_paths)."""
    if hierarchical:
        return TransportPlan("hierarchical", 1, shm, cross)
    if shm is not None:
        return TransportPlan("shared_memory", 1, shm, None)
    return TransportPlan("gloo_channels", options["cpu_channels"], None, None)


class EngineGroups(NamedTuple):
    """The process groups of one engine, kept alive as long as the engine."""
    control: object     # negotiation's Gloo group (when no segment carries it), None with the control link
    cpu: list           # CPU data, TransportPlan.cpu_channels of them
    cuda: object        # NCCL for CUDA tensors, or None
    cross: object       # hierarchical only, or None
    # the segment a torch.distributed group's send and recv may go through (every rank on this
    # host, HVDLITE_SHM_POINT_TO_POINT=1: Note [Point-to-point through shared memory] in
    # csrc/shm_point_to_point.h), or None
    messages: object = None
    link: object = None  # Note [Control link] (csrc/control_link.h), or None


def timeline_for(settings, label):
    """`settings` with HVDLITE_TIMELINE naming a file of this engine's own: every engine of a
    process writes its own trace ("trace.json" is the global set's; a process set's is
    "trace.set1.json", a torch.distributed group's "trace.pg0.json"; each then gets its
    ".rank<r>" part), where one path for all would have them truncate each other's file."""
    path = settings.get("HVDLITE_TIMELINE")
    if not path or label is None:
        return settings
    root, ext = os.path.splitext(path)
    return {**settings, "HVDLITE_TIMELINE": f"{root}.{label}{ext or '.json'}"}


def start_engine(context, tag, rank, size, members=None, timeline_label=None):
    """Creates the process groups of one engine over `size` ranks and starts it.

    `context` is (store, key prefix, loopback, settings); `members` the records (host, pid)
    of the engine's ranks, in order; `timeline_label` names its timeline file (timeline_for;
    None: the path as given, the global set's). Returns (engine, groups).
    """
    store, prefix, loopback, settings = context
    settings = timeline_for(settings, timeline_label)
    base = f"{prefix}{tag}/"
    options = _core._parse_config(settings)
    addresses = GroupStore(store)  # Note [Group addresses in two requests]
    try:
        plan = _plan(options, *_local_paths(store, addresses, base, rank, size, options, members, loopback))
        link = _control_link(rank, size, options, plan, loopback)
        # the control link carries negotiation by itself; else a Gloo group, whose exchanges
        # also carry what shared memory's slots do not hold
        control = None if link is not None else \
            _gloo_group(dist.PrefixStore(base + "control", addresses), rank, size, loopback)
        cpu = [_gloo_group(dist.PrefixStore(f"{base}cpu{i}", addresses), rank, size, loopback)
               for i in range(plan.cpu_channels)]
        cuda = _nccl_group(dist.PrefixStore(base + "cuda", store), rank, size)
        if link is not None:
            addresses.set(_link_key(base, rank), link.address)
        addresses.publish()
        addresses.prefetch(_first_addresses(base, rank, size, options, plan, members, loopback, link))
        _connect_data({**{f"cpu{i}": group for i, group in enumerate(cpu)}, "cross": plan.cross},
                      _data_peers(rank, size, plan, members))
        if link is not None:
            link.connect({p: addresses.get(_link_key(base, p)).decode() for p in link.partners})
    except RuntimeError as exc:
        hint = ("; GLOO_SOCKET_IFNAME must name an interface through which every host reaches every "
                "other (hvdliterun finds one by itself)" if not loopback else "")
        raise RankFailureError(f"hvdlite.init(): rank {rank} could not connect its process groups to "
                               f"the other ranks: {exc}{hint}", op="init") from None
    bound = _channel_timeout(options)  # Note [Frozen peers]
    engine = _core.Engine(control, cpu, cuda, rank, size, settings, plan.shm, plan.cross, plan.route,
                          control_timeout=bound, data_timeout=bound if is_elastic_worker(os.environ) else 0.0,
                          link=link)
    # Note [Dump requests] (csrc/recorder.h): its dumps' name; the global engine also tells
    # the other ranks when this process gets a dump signal.
    engine.set_label(timeline_label or tag, tag == "global")
    if not _recorder.enabled():  # HVDLITE_FLIGHT_RECORDER=0 (Note [Dump files] in recorder.py)
        engine.set_recording(False)
    addresses.forget()  # the pairs read are connected; later ones read the store
    messages = plan.shm if plan.route == "shared_memory" and options["shm_point_to_point"] else None
    return engine, EngineGroups(control, cpu, cuda, plan.cross, messages, link)
