"""An elastic job whose model counts the samples it was trained on.

The model is one vector with an entry per sample. A batch's loss is minus the sum of its
samples' entries (the sampler's padding repeats weigh nothing: padding_weights), the
gradients are summed over the ranks and SGD with learning rate 1 adds one to the entry of
every sample in every rank's batch. So after E epochs an entry holds the
number of times its sample contributed to the model's committed history (rolled-back work
counts nothing, as it is rolled back with the model): exactly E for each sample when no sample
was lost or repeated. Rank 0 writes the vector and the epochs completed to
$ELASTIC_OUT/counts.json at the end. With ELASTIC_UNTIL the job stops at the first epoch
boundary after the file $ELASTIC_OUT/$ELASTIC_UNTIL appears (tests/multihost/chaos.py).

Every step appends a line to $ELASTIC_OUT/progress.<pid> (time, generation, rank, size,
epoch, batch, host, and the tensor at which a reset was raised), which the tests read to
decide when to kill a worker or change the hosts, and to measure reset times.
"""
import json
import os
import sys
import time

import torch

import hvdlite as hvd

N = int(os.environ.get("ELASTIC_SAMPLES", "192"))
BATCH = 4
EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "2"))
STEP_SECONDS = float(os.environ.get("ELASTIC_STEP_SECONDS", "0.05"))
COMMIT_EVERY = int(os.environ.get("ELASTIC_COMMIT_EVERY", "3"))  # batches (and each epoch's end)
OUT = os.environ["ELASTIC_OUT"]
CRASH_HOST = os.environ.get("ELASTIC_CRASH_HOST")  # its workers exit 3 after two steps
HANG_HOST = os.environ.get("ELASTIC_HANG_HOST")  # its workers stop answering after four steps
BAD_CALL = os.environ.get("ELASTIC_BAD_CALL")  # every rank makes a bad call after two steps
UNTIL = os.environ.get("ELASTIC_UNTIL")  # a file name in OUT: once it exists, stop after the epoch

torch.set_num_threads(1)
hvd.init()
model = torch.nn.Module()
model.counts = torch.nn.Parameter(torch.zeros(N, dtype=torch.float64))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                     named_parameters=model.named_parameters(), op=hvd.Sum)
dataset = torch.utils.data.TensorDataset(torch.arange(N))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
resets = []
crash_countdown = [2]
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
if os.environ.get("ELASTIC_DURABLE"):  # every commit also written there (Note [No survivor])
    state.keep_durable_copy(os.environ["ELASTIC_DURABLE"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import recorder  # noqa: E402

note = recorder(OUT)


@hvd.elastic.run
def train(state):
    note(event="start", rank=hvd.rank(), size=hvd.size(), epoch=state.epoch, batch=state.batch,
         horovod=[os.environ.get(f"HOROVOD_{k}") for k in ("ELASTIC", "RANK", "SIZE", "LOCAL_RANK",
                                                            "CROSS_SIZE", "HOSTNAME")],
         cross=[hvd.cross_rank(), hvd.cross_size()])
    try:
        loop(state)
    except hvd.elastic.HostsUpdatedInterrupt as exc:
        note(event="interrupt", rank=hvd.rank(), tensor=exc.tensor_name, op=exc.op,
             epoch=state.epoch, batch=state.batch)
        raise
    except hvd.HvdliteError as exc:
        note(event="failure", rank=hvd.rank(), error=type(exc).__name__, epoch=state.epoch,
             batch=state.batch)
        raise


def asked_to_stop():
    """Every rank decides alike (at an epoch's end): the file exists for one of them."""
    if not UNTIL:
        return False
    seen = torch.tensor([float(os.path.exists(os.path.join(OUT, UNTIL)))])
    return hvd.allreduce(seen, op=hvd.Max, name="elastic.until").item() > 0


def padding_weights(first, n):
    """1 for each of the batch's samples, 0 for the sampler's padding (Note [Processed samples]
    in hvdlite/elastic/sampler.py: when the samples left do not divide by the ranks, the last
    round repeats the first few, as torch's DistributedSampler does). `first` is the batch's
    position in this rank's share; a position past the samples left is a repeat, and its
    original is processed at the same step or before, in the same deal."""
    positions = sampler.rank + sampler.num_replicas * torch.arange(first, first + n)
    return (positions < len(sampler.remaining_indices)).to(torch.float64)


def loop(state):
    while state.epoch < EPOCHS:
        start = None
        for state.batch, (idx,) in enumerate(loader, start=state.batch):
            if start is None:  # the share was dealt when the pass began: where it starts in it
                start = len(sampler.indices) - len(sampler), state.batch
            first = start[0] + (state.batch - start[1]) * BATCH
            optimizer.zero_grad()
            loss = -(model.counts[idx] * padding_weights(first, len(idx))).sum()
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(state.batch, BATCH)
            note(event="step", rank=hvd.rank(), size=hvd.size(), epoch=state.epoch, batch=state.batch,
                 n=len(idx))
            crash_countdown[0] -= 1
            if CRASH_HOST == os.environ.get("HVDLITE_HOSTNAME") and crash_countdown[0] <= 0:
                os._exit(3)
            if BAD_CALL and crash_countdown[0] <= 0:
                hvd.reducescatter(torch.ones(hvd.size(), 2), op=hvd.Adasum)
            if HANG_HOST == os.environ.get("HVDLITE_HOSTNAME") and crash_countdown[0] <= -2:
                time.sleep(3600)
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
            time.sleep(STEP_SECONDS)
        state.epoch += 1
        state.batch = 0
        state.commit()
        if asked_to_stop():
            break


try:
    train(state)
except hvd.elastic.HostsUpdatedInterrupt as exc:  # never expected outside run()
    note(event="interrupt-escaped", error=str(exc))
    raise
if hvd.rank() == 0:
    with open(os.path.join(OUT, "counts.json"), "w") as f:
        json.dump({"counts": model.counts.detach().tolist(), "epochs": state.epoch, "size": hvd.size()}, f)
note(event="done", rank=hvd.rank(), size=hvd.size(), resets=resets)
hvd.shutdown()
