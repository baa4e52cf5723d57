"""ElasticSampler: a distributed sampler that remembers which samples of the epoch were
processed, so that a reset neither drops nor repeats any.

Note [Processed samples]
The sampler keeps the set of dataset indices processed this epoch. The indices not yet
processed are shuffled (from the seed and the epoch, the same on every rank) and dealt to the
ranks, rank r taking every size-th index from position r (the last round padded as torch's
DistributedSampler pads); each rank walks its share in order and ``record_batch`` marks the next
``batch_size`` of them processed. Every rank records the same number of batches between two
collectives (a step's gradients are reduced together), so every rank knows what every other
rank has processed: the set at the last deal plus, for each rank, the first `cursor` indices of
its share. That global view, computed locally, is what is committed, restored and synced:
  - ``commit()`` needs no collective, and a rank that dies later takes nothing with it;
  - after a failure every rank rolls back to its committed view (all equal), as the model does;
  - after a change of hosts alone nothing rolls back (every rank stopped at the same
    operation, Note [Hosts updated]), and the current view already counts the work of workers
    that are leaving, whose gradients are in the model.
The sync then takes rank 0's view and deals the rest over the new size. A script that records
with ``record_indices`` instead (any indices) breaks the lock-step reasoning, so then commit and
sync gather every rank's set (collectives). A pass over the epoch ends when a rank has walked
its whole share (every rank does so at the same step); iterating again without ``set_epoch``
starts the same epoch over, in the same order, as horovod.torch's sampler and torch's
DistributedSampler do (a new shuffle needs ``set_epoch``). ``set_epoch`` with the current epoch
keeps what was processed: a loop that calls it at the top of every epoch, as Horovod's
examples do, does not repeat the first part of an epoch after a reset in its middle.

With ``record_batch`` the processed samples are always the first ``processed_num`` of the
epoch's order (each deal hands out the rest in that order, round robin), so horovod.torch's
state form, ``{"epoch", "processed_num"}``, says exactly what was processed; ``state_dict()``
holds both forms and ``load_state_dict`` takes either.
"""

import math

import torch

from .. import basics, functions


class ElasticSampler(torch.utils.data.Sampler):
    """Samples ``dataset`` across the ranks of an elastic job; see Note [Processed samples].

    ``shuffle`` and ``seed`` as torch's DistributedSampler. Call ``record_batch(batch_idx,
    batch_size)`` after each batch is processed (or ``record_indices``), and keep the sampler in
    a ``TorchState`` so it is committed, restored and synced with the model.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices = []
        self.indices = []        # this rank's share, in the order it is yielded
        self._dealt_from = set()  # processed (by every rank) when the share was dealt
        self._shares = []        # every rank's share
        self._cursor = 0         # how much of the share has been recorded processed
        self._own = set()        # what record_indices marked, when the script uses it
        self.reset()

    # -- Horovod's interface
    @property
    def processed_indices(self):
        """The indices processed this epoch by any rank (Note [Processed samples]); with
        ``record_indices``, only this rank's and what was known at the last deal."""
        if self._own:
            return self._dealt_from | self._own
        done = set(self._dealt_from)
        for share in self._shares:
            done.update(share[:self._cursor])
        return done

    @property
    def processed_num(self):
        """How many samples of this epoch every rank together has processed (horovod.torch's
        count)."""
        return len(self.processed_indices)

    def set_epoch(self, epoch):
        """Starts epoch ``epoch`` (a new shuffle, nothing processed); the current epoch again
        keeps what was processed (Note [Processed samples])."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._deal(set())
        else:
            self._deal(self.processed_indices)

    def record_batch(self, batch_idx, batch_size):
        """Marks the next ``batch_size`` indices of this rank's share processed. ``batch_idx``
        is accepted for Horovod's signature; the sampler counts the batches itself, so any
        numbering (``enumerate(loader, start=state.batch)``) works."""
        self._cursor = min(self._cursor + batch_size, len(self.indices))

    def record_indices(self, indices):
        """Marks ``indices`` processed by this rank; commit and sync then gather every rank's."""
        indices = [int(i) for i in indices]
        self._own.update(indices)
        self._cursor = min(self._cursor + len(indices), len(self.indices))

    def get_indices(self, batch_idx, batch_size):
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self):
        processed = self.processed_indices
        return {"epoch": self.epoch, "processed_num": len(processed),
                "processed_indices": sorted(processed), "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state_dict):
        """Takes this sampler's ``state_dict()`` or horovod.torch's ``{"epoch", "processed_num"}``
        (the first ``processed_num`` samples of the epoch's order were processed)."""
        self.epoch = int(state_dict["epoch"])
        if "processed_indices" in state_dict:
            self._deal(set(int(i) for i in state_dict["processed_indices"]))
        else:
            self._deal(set(self._epoch_order()[:int(state_dict["processed_num"])]))

    def reset(self):
        """Deals the indices not yet processed over the job's current ranks."""
        self._deal(self.processed_indices)

    def _deal(self, processed):
        if basics.is_initialized():
            self.num_replicas, self.rank = basics.size(), basics.rank()
        self._dealt_from, self._own, self._cursor = set(processed), set(), 0
        self.remaining_indices = [i for i in self._epoch_order() if i not in self._dealt_from]
        padded = list(self.remaining_indices)
        if padded:
            total = math.ceil(len(padded) / self.num_replicas) * self.num_replicas
            padded += padded[:total - len(padded)]  # padding, as torch's DistributedSampler
        self._shares = [padded[r::self.num_replicas] for r in range(self.num_replicas)]
        self.indices = self._shares[self.rank]

    def __iter__(self):
        if self._cursor >= len(self.indices):  # this rank walked its share: the same epoch again
            self._deal(set())
        return iter(self.indices[self._cursor:])

    def __len__(self):
        if self._cursor >= len(self.indices):
            return math.ceil(len(self.dataset) / self.num_replicas)
        return len(self.indices) - self._cursor

    # -- what TorchState does with it (Note [Processed samples])
    def _epoch_order(self):
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def _global_state(self):
        """state_dict() with every rank's processed indices (a collective only when the script
        records with record_indices)."""
        state = self.state_dict()
        if self._own and basics.is_initialized() and basics.size() > 1:
            sets = functions.allgather_object(state["processed_indices"],
                                              name="hvdlite.elastic.sampler.processed")
            state["processed_indices"] = sorted(set().union(*map(set, sets)))
        return state

    def _sync(self):
        state = functions.broadcast_object(self._global_state(), 0, name="hvdlite.elastic.sampler.sync")
        self.load_state_dict(state)
