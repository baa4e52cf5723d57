"""hvdlite on a Ray cluster: RayExecutor runs a function on N Ray actors that form one job.

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4, cpus_per_worker=1)
    executor.start()
    results = executor.run(train, kwargs={"epochs": 5})   # every rank's return value, in rank order
    executor.shutdown()

Inside the function, ``hvd.init()`` needs no arguments: every actor gets the variables
hvdliterun would set (Note [Ray placement]). ``ray`` is imported by this package only
(``pip install hvdlite[ray]``). Under Ray Train's ``TorchTrainer``, which sets up
torch.distributed itself, no executor is needed: ``hvd.init()`` in the training loop builds
hvdlite's groups beside Ray's.

Note [Ray placement]
The workers are actors in a placement group of one bundle each (PACK by default: as few nodes
as possible; SPREAD: as many). Where Ray put them decides the ranks: the nodes in the order of
their first worker, ranks handed out node by node, so local ranks and sizes follow each node's
workers and cross ranks number the nodes that have a worker of the same local rank (as
hvdliterun does). The executor's process hosts the job's secret-protected rendezvous store
(the launcher's, hvdlite/_job/server.py) on the driver node's address, or on 127.0.0.1
when driver and workers share one node.
"""

import dataclasses
import os
import socket
import time

import ray

from .._job import place as _place
from .._job.rendezvous import LauncherStore
from ..exceptions import RayWorkerError
from .._job.server import RendezvousServer, new_secret

__all__ = ["RayExecutor", "RayWorkerError"]


@dataclasses.dataclass
class Settings:
    """What ``RayExecutor.create_settings`` returns (horovod.ray's name): the start timeout
    and the environment every worker gets on top of its own."""
    timeout_s: float = 120.0
    placement_group_timeout_s: float = 100.0
    env_vars: dict = dataclasses.field(default_factory=dict)


@ray.remote
class _Worker:
    """One rank: an actor process that keeps its state (and hvdlite's) between calls."""

    def __init__(self):
        self.executable = None

    def where(self):
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def setup(self, env, executable_cls=None, args=(), kwargs=None):
        os.environ.update(env)
        if executable_cls is not None:
            self.executable = executable_cls(*args, **(kwargs or {}))

    def execute(self, fn):
        return fn(self.executable)

    def run(self, fn, args, kwargs):
        return fn(*args, **kwargs)


def places(nodes):
    """Ranks for workers placed on `nodes` (one node id per worker): returns, per worker,
    (rank, local_rank, local_size, cross_rank, cross_size), and the workers in rank order
    (Note [Cross ranks] in hvdlite/_job/place.py)."""
    order = list(dict.fromkeys(nodes))
    by_rank = sorted(range(len(nodes)), key=lambda w: (order.index(nodes[w]), w))
    placed = _place.places([nodes[w] for w in by_rank])
    out = {w: (p.rank, p.local_rank, p.local_size, p.cross_rank, p.cross_size)
           for w, p in zip(by_rank, placed)}
    return out, by_rank


class RayExecutor:
    """Runs hvdlite jobs on Ray actors (the shape of horovod.ray.RayExecutor).

    ``num_workers`` ranks (or ``num_hosts`` x ``num_workers_per_host``), each an actor with
    ``cpus_per_worker`` CPUs (and ``gpus_per_worker`` GPUs when ``use_gpu``), placed with
    ``placement_strategy`` "PACK" or "SPREAD" (Note [Ray placement]); ``env_vars`` (and the
    settings' ``env_vars``) go into every worker's environment.
    """

    @staticmethod
    def create_settings(timeout_s=120.0, placement_group_timeout_s=100.0, env_vars=None, **_ignored):
        """Settings for the executor; horovod.ray's other settings (ssh, NICs) do not apply."""
        return Settings(timeout_s, placement_group_timeout_s, dict(env_vars or {}))

    def __init__(self, settings=None, num_workers=None, cpus_per_worker=1, use_gpu=False,
                 gpus_per_worker=None, num_hosts=None, num_workers_per_host=1, env_vars=None,
                 placement_strategy="PACK"):
        if num_workers is None:
            if num_hosts is None:
                raise ValueError("RayExecutor: give num_workers (or num_hosts and num_workers_per_host)")
            num_workers = num_hosts * num_workers_per_host
            placement_strategy = "STRICT_SPREAD" if num_workers_per_host == 1 else placement_strategy
        if num_workers < 1:
            raise ValueError(f"RayExecutor: num_workers must be at least 1, got {num_workers}")
        if placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"RayExecutor: unknown placement_strategy {placement_strategy!r}")
        self.settings = settings or Settings()
        self.num_workers = num_workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.env_vars = {**self.settings.env_vars, **(env_vars or {})}
        self.placement_strategy = placement_strategy
        self.workers = []      # in rank order
        self.nodes = []        # where each rank runs: {"node_id", "host", "ip", "pid"}
        self._group = None
        self._server = None

    # -- lifecycle
    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None,
              extra_env_vars=None):
        """Places the workers, ranks them by node and gives each its environment."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if not ray.is_initialized():
            ray.init()
        bundle = {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.gpus_per_worker else {})}
        self._group = placement_group([dict(bundle) for _ in range(self.num_workers)],
                                      strategy=self.placement_strategy)
        try:
            ray.get(self._group.ready(), timeout=self.settings.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(f"RayExecutor: the cluster did not offer {self.num_workers} x {bundle} "
                               f"({self.placement_strategy}) within {self.settings.placement_group_timeout_s:g} s")
        actors = [_Worker.options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=i),
        ).remote() for i in range(self.num_workers)]
        where = ray.get([a.where.remote() for a in actors], timeout=self.settings.timeout_s)
        ranks, by_rank = places([w["node_id"] for w in where])
        self.workers = [actors[i] for i in by_rank]
        self.nodes = [where[i] for i in by_rank]
        driver_ip = ray.util.get_node_ip_address()
        one_node = all(w["ip"] == driver_ip for w in where)
        addr = "127.0.0.1" if one_node else driver_ip
        self._server = RendezvousServer(new_secret(), host=addr if one_node else "0.0.0.0", addr=addr).start()
        setups = []
        for i, actor in enumerate(actors):
            rank, local_rank, local_size, cross_rank, cross_size = ranks[i]
            place = _place.Place(rank, self.num_workers, local_rank, local_size, cross_rank, cross_size)
            env = {**self.env_vars, **(extra_env_vars or {}),
                   **_place.environment(place, where[i]["host"]),
                   **LauncherStore(addr, self._server.port, self._server.secret).to_env()}
            setups.append(actor.setup.remote(env, executable_cls, tuple(executable_args or ()),
                                             executable_kwargs))
        ray.get(setups, timeout=self.settings.timeout_s)
        return self

    def shutdown(self):
        """Kills every worker actor and removes the placement group; safe to call twice."""
        from ray.util.placement_group import remove_placement_group
        for actor in self.workers:
            ray.kill(actor, no_restart=True)
        self.workers = []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    # -- running
    def run(self, fn, args=None, kwargs=None, callbacks=None):
        """``fn(*args, **kwargs)`` on every worker; their results in rank order. Raises
        RayWorkerError naming the rank and node of the first failure."""
        return self._gather([w.run.remote(fn, tuple(args or ()), dict(kwargs or {})) for w in self.workers])

    def execute(self, fn, callbacks=None):
        """``fn(executable)`` on every worker (the object ``start(executable_cls)`` built
        there, else None); results in rank order."""
        return self._gather([w.execute.remote(fn) for w in self.workers])

    def execute_single(self, fn):
        """``fn(executable)`` on rank 0 only."""
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    def run_remote(self, fn, args=None, kwargs=None):
        """Like run(), but returns the Ray object refs without waiting."""
        return [w.run.remote(fn, tuple(args or ()), dict(kwargs or {})) for w in self.workers]

    def _gather(self, refs):
        if not refs:
            raise RuntimeError("RayExecutor: call start() first")
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results, errors, died = [None] * len(refs), {}, []
        settle = None
        while pending and (settle is None or time.monotonic() < settle):
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    died.append(rank)
                    errors[rank] = f"the worker process died ({type(exc).__name__})"
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                    errors[rank] = f"{type(cause).__name__}: {cause}"
                if errors and settle is None:
                    settle = time.monotonic() + 5.0  # let the others report what they saw
        if not errors:
            return results
        first = died[0] if died else self._cause(errors)
        node = self.nodes[first]
        raise RayWorkerError(
            f"hvdlite.ray: rank {first} (node {node['host']} {node['ip']}, pid {node['pid']}) failed: "
            f"{errors[first]}" + (f"; then ranks {sorted(r for r in errors if r != first)} failed "
                                  "because of it" if len(errors) > 1 else ""),
            rank=first, node=node["ip"], errors=errors)

    @staticmethod
    def _cause(errors):
        """The failure that is not a consequence (a peer's failure or shutdown), else the first."""
        consequences = ("RankFailureError", "ShutdownError")
        primary = [r for r, text in sorted(errors.items()) if not text.startswith(consequences)]
        return primary[0] if primary else min(errors)
