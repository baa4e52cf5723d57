"""What elastic training carries across resets: State, ObjectState, TorchState.

A state holds the training objects (model, optimizer, sampler, plain attributes such as epoch
and batch). ``commit()`` saves a copy of them; after a rank fails, every survivor
``restore()``s that copy; after every reset, ``sync()`` makes every rank's objects equal to
rank 0's (rank 0 of a new generation is always a survivor, so a new worker receives the
job's state). Committed copies of tensors live in host memory: a CUDA model does not double
its device memory.
"""

import copy
import os

import torch

from .. import basics, functions
from .._runtime import elastic_worker as _elastic_worker
from ..exceptions import HostsUpdatedInterrupt
from .sampler import ElasticSampler


class State:
    """Base class: subclasses implement ``save``, ``restore`` and ``sync``."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called (no arguments) after every reset, before the state is synced:
        e.g. scaling the learning rate with the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state; a failure later rolls every rank back to here. Collective when the
        state holds an ElasticSampler (its processed samples are gathered first)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt when the launcher announced a change of hosts. With
        several ranks the notice already stops every rank inside its next collective (Note
        [Hosts updated]); a job of one rank may run no collective at all (the optimizer has
        nothing to reduce), so it hears of new hosts here, at commit()."""
        if _elastic_worker.hosts_updated() and basics.is_initialized() and basics.size() == 1:
            raise HostsUpdatedInterrupt("the job's hosts changed (noticed at commit())")

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """Plain picklable attributes given as keyword arguments (``epoch=0, batch=0``); rank 0's
    values win at ``sync()``."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__()
        self._bcast_object = bcast_object or (lambda obj: functions.broadcast_object(
            obj, 0, name="hvdlite.elastic.state.objects"))
        self._saved_state = {}
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._object_names = list(kwargs)
        ObjectState.save(self)

    def save(self):
        self._saved_state = {n: copy.deepcopy(getattr(self, n)) for n in self._object_names}

    def restore(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self):
        if self._object_names:
            values = self._bcast_object({n: getattr(self, n) for n in self._object_names})
            for name, value in values.items():
                setattr(self, name, value)


def _to_host(obj):
    """A deep copy of a state_dict with every tensor copied to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


class TorchState(ObjectState):
    """A model, an optimizer and any other attributes (an ElasticSampler is recognized and
    kept with the committed samples; see Note [Processed samples])."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self._model = model
        self._optimizer = optimizer
        self._samplers = {n: v for n, v in kwargs.items() if isinstance(v, ElasticSampler)}
        objects = {n: v for n, v in kwargs.items() if n not in self._samplers}
        self._saved_model = self._saved_optimizer = None
        self._saved_samplers = {}
        self._durable_path = None
        super().__init__(**objects)
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        self._save_tensors(gathered=None)

    def keep_durable_copy(self, path):
        """From now on every ``commit()`` also writes the committed state to ``path`` (on rank
        0, atomically: a crash mid-write leaves the previous copy). Should every worker of the
        job be lost at once, the launcher's new workers then resume from it instead of the job
        stopping (Note [No survivor] in runner/elastic.py). ``path`` must be readable where the
        next rank 0 runs (a shared file system across hosts)."""
        self._durable_path = os.path.abspath(path)
        self._commits = 0
        return self

    def _write_durable_copy(self):
        if self._durable_path is None or not basics.is_initialized() or basics.rank() != 0:
            return
        self._commits += 1
        tmp = f"{self._durable_path}.{os.getpid()}.tmp"
        torch.save({"model": self._saved_model, "optimizer": self._saved_optimizer,
                    "objects": self._saved_state, "samplers": self._saved_samplers}, tmp)
        os.replace(tmp, self._durable_path)
        _elastic_worker.record_durable_copy(self._durable_path, self._commits)

    def restore_durable_copy(self, path):
        """Loads a copy written by ``keep_durable_copy`` as the committed state and restores it
        (the launcher's verdict after Note [No survivor]; rank 0's copy is then synced)."""
        if basics.is_initialized() and basics.rank() != 0:
            return  # rank 0's state reaches every rank in sync()
        saved = torch.load(path, weights_only=False)
        self._saved_model, self._saved_optimizer = saved["model"], saved["optimizer"]
        self._saved_state, self._saved_samplers = saved["objects"], saved["samplers"]
        self.restore()

    @property
    def model(self):
        return self._model

    @property
    def optimizer(self):
        return self._optimizer

    def save(self):
        # Any collective first (a sampler fed through record_indices): if a rank fails or the
        # hosts change during it, nothing has been saved anywhere.
        gathered = {n: s._global_state() for n, s in self._samplers.items()}
        super().save()
        self._save_tensors(gathered)
        self._write_durable_copy()

    def _save_tensors(self, gathered):
        if self._model is not None:
            self._saved_model = _to_host(self._model.state_dict())
        if self._optimizer is not None:
            self._saved_optimizer = _to_host(self._optimizer.state_dict())
        for name, sampler in self._samplers.items():
            self._saved_samplers[name] = (gathered or {}).get(name) or _to_host(sampler.state_dict())

    def restore(self):
        super().restore()
        if self._model is not None and self._saved_model is not None:
            self._model.load_state_dict(self._saved_model)
        if self._optimizer is not None and self._saved_optimizer is not None:
            self._optimizer.load_state_dict(_to_host(self._saved_optimizer))
        self._forget_reductions()
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._saved_samplers[name])

    def _forget_reductions(self):
        forget = getattr(self._optimizer, "_forget_reductions", None)
        if forget is not None:
            forget()

    def sync(self):
        self._forget_reductions()
        if self._model is not None:
            functions.broadcast_parameters(self._model.state_dict(), root_rank=0)
        if self._optimizer is not None:
            functions.broadcast_optimizer_state(self._optimizer, root_rank=0)
        super().sync()
        for sampler in self._samplers.values():
            sampler._sync()
