"""hvdlite.runner.run(fn, host_discovery_script=...): the elastic job from Python, with the
final generation's results."""
import os
import tempfile

import torch

import hvdlite as hvd
from hvdlite.runner import run


def elastic_sum(steps):
    """Adds up, over `steps` committed steps, the allreduced sum of 1 from every rank; the
    workers of host 127.0.0.2 die at step 5. Returns (rank, size, total, sizes seen)."""
    hvd.init()
    state = hvd.elastic.ObjectState(step=0, total=0.0, sizes=[])

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            if os.environ["HVDLITE_HOSTNAME"] == "127.0.0.2" and state.step == 5:
                os._exit(3)
            got = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ones").item()
            state.total += got
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            state.commit()
        return hvd.rank(), hvd.size(), state.total, state.sizes

    return train(state)


def test_run_with_a_discovery_script_returns_the_final_ranks_results():
    with tempfile.NamedTemporaryFile("w", suffix=".hosts", delete=False) as f:
        f.write("127.0.0.1:2\n127.0.0.2:1\n")
    try:
        results = run(elastic_sum, args=(12,), np=3, host_discovery_script=f"cat {f.name}",
                      min_np=1, env={"OMP_NUM_THREADS": "1"})
    finally:
        os.unlink(f.name)
    assert [(r, s) for r, s, _, _ in results] == [(0, 2), (1, 2)], results
    for _, _, total, sizes in results:
        # Five steps on three ranks, then (after rolling back to the commit at step 5) seven on two.
        assert sizes == [3] * 5 + [2] * 7, sizes
        assert total == sum(sizes)
