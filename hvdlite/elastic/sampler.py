"""ElasticSampler: a distributed sampler that remembers which samples of the epoch were
processed, so that a reset neither drops nor repeats any.

Note [Processed samples]
The sampler keeps the set of dataset indices processed this epoch. Between resets, the indices
not yet processed are shuffled (from the seed and the epoch, the same on every rank) and dealt
to the ranks, rank r taking every size-th index from position r; each rank walks its share in
order and ``record_batch`` marks the next ``batch_size`` of them processed. The set goes through
three hands:
  - ``commit()`` (through TorchState) first gathers every rank's set, so the committed set is
    the union over the job: a rank that dies later takes nothing with it;
  - after a failure every survivor rolls back to that committed union, and the sync takes rank
    0's (all equal), matching the model, which also rolled back;
  - after a change of hosts alone nothing rolled back (every rank stopped at the same
    operation, Note [Hosts updated]), so the sync takes the union of every rank's current set.
The indices left are then dealt again over the new size. An epoch ends when a rank has walked
its whole share (every rank does so at the same step: the shares differ in length by at most
one, and the last one is padded as torch's DistributedSampler pads); the next iteration starts
the next epoch, so a loop that does not call ``set_epoch`` still gets a fresh shuffle.
``set_epoch`` with the current epoch keeps what was processed: a loop that calls it at the top
of every epoch, as Horovod's examples do, does not repeat the first half of an epoch after a
reset in its middle.
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
        self.processed_indices = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices = []
        self.indices = []        # this rank's share, in the order it is yielded
        self._cursor = 0         # how much of the share record_batch has marked processed
        self.reset()

    # -- Horovod's interface
    def set_epoch(self, epoch):
        """Starts epoch ``epoch`` (a new shuffle, nothing processed); the current epoch again
        keeps what was processed (Note [Processed samples])."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Marks the next ``batch_size`` indices of this rank's share processed. ``batch_idx``
        is accepted for Horovod's signature; the sampler counts the batches itself, so any
        numbering (``enumerate(loader, start=state.batch)``) works."""
        self.record_indices(self.indices[self._cursor:self._cursor + batch_size])

    def record_indices(self, indices):
        indices = [int(i) for i in indices]
        self.processed_indices.update(indices)
        self._cursor += len(indices)

    def get_indices(self, batch_idx, batch_size):
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices),
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state_dict):
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(int(i) for i in state_dict["processed_indices"])
        self.reset()

    def reset(self):
        """Deals the indices not yet processed over the job's current ranks."""
        if basics.is_initialized():
            self.num_replicas, self.rank = basics.size(), basics.rank()
        order = self._epoch_order()
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        share = list(self.remaining_indices)
        if share:
            total = math.ceil(len(share) / self.num_replicas) * self.num_replicas
            share += share[:total - len(share)]  # padding, as torch's DistributedSampler
        self.indices = share[self.rank::self.num_replicas]
        self._cursor = 0

    def __iter__(self):
        if self._cursor >= len(self.indices):  # this rank walked its share: the epoch is over
            self.set_epoch(self.epoch + 1)
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

    def _gather_processed(self):
        """The union of every rank's processed set (collective)."""
        sets = functions.allgather_object(sorted(self.processed_indices),
                                          name="hvdlite.elastic.sampler.processed")
        return {"epoch": self.epoch, "processed_indices": sorted(set().union(*map(set, sets)))}

    def _sync(self, restored):
        if restored:
            state = functions.broadcast_object(self.state_dict(), 0,
                                               name="hvdlite.elastic.sampler.sync")
        else:
            epoch = functions.broadcast_object(self.epoch, 0, name="hvdlite.elastic.sampler.epoch")
            if epoch != self.epoch:
                self.epoch, self.processed_indices = epoch, set()
            state = self._gather_processed()
        self.load_state_dict(state)
