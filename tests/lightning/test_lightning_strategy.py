"""HvdliteStrategy (hvdlite/lightning.py, Note [Lightning strategy]) under a real Trainer, 2
ranks started by hvdliterun or torchrun: the final parameters equal one process on the combined
batch (tests/lightning/fit_job.py's reference_fit), and the strategy's collectives give every
rank the values computed here."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install hvdlite[lightning])")

from tests.lightning.fit_job import reference_fit  # noqa: E402
from tests.lightning.test_lightning_ddp import JOB, launch, results  # noqa: E402

HVDLITERUN = [sys.executable, "-m", "hvdlite.runner.launch", "-np", "2"]


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_params(got, expected, atol=1e-6):
    for a, b in zip(got["params"], expected):
        assert torch.allclose(a, b, atol=atol), (got["rank"], (a - b).abs().max())


# One launch fits every case below in turn (tests/lightning/fit_job.py --case): a launch costs
# seconds of process start, a fit of this model a fraction of one.
FIT_CASES = {"fit": "", "adam": "--optimizer adam", "accumulate": "--accumulate 2", "clip": "--clip 0.05",
             "clip_value": "--clip-value 0.02", "lr_scheduler": "--scheduler", "fp16": "--option fp16",
             "predivide": "--option predivide", "sum": "--option sum", "manual": "--manual",
             "bf16": "--precision bf16-mixed"}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The launch's folder: <tag>.rank<r>.pt per case, and two.ckpt, written by the case "first"."""
    out = tmp_path_factory.mktemp("fits")
    cases = {**FIT_CASES, "first": f"--save {out / 'two.ckpt'}", "stages": "--stages", "dev": "--fast-dev-run"}
    launch(HVDLITERUN + [sys.executable, JOB, str(out), "-", "hvdlite",
                         *(f"--case={tag}={options}" for tag, options in cases.items())], out, timeout=300)
    return out


@pytest.mark.parametrize("tag,reference", [
    ("fit", {}),
    ("adam", {"optimizer_name": "adam"}),
    ("accumulate", {"accumulate": 2}),
    ("clip", {"clip": 0.05}),
    ("clip_value", {"clip_value": 0.02}),
    ("lr_scheduler", {"scheduler": True}),
], ids=["sgd", "adam", "accumulate", "clip", "clip_value", "lr_scheduler"])
def test_a_fit_equals_one_process_on_the_combined_batch(fitted, tag, reference):
    expected = reference_fit(2, **reference)
    for r, got in enumerate(results(fitted, tag, 2)):
        assert (got["rank"], got["size"]) == (r, 2)
        _assert_params(got, expected)


@pytest.mark.parametrize("option,atol", [("fp16", 1e-3), ("predivide", 1e-6)])
def test_the_strategys_options_reach_the_distributed_optimizer(fitted, option, atol):
    expected = reference_fit(2)
    runs = results(fitted, option, 2)
    for got in runs:
        _assert_params(got, expected, atol=atol)
    if option == "fp16":  # the gradients went over the wire as float16: not bitwise the reference
        assert any(not torch.equal(a, b) for a, b in zip(runs[0]["params"], expected))


def test_op_sum_sums_the_gradients(fitted):
    # HvdliteStrategy(op=hvd.Sum): with 2 ranks, the step of one process on twice the loss
    from tests.lightning.fit_job import _orders, PER_RANK, SAMPLES, one_process
    steps = [[order[k * PER_RANK:(k + 1) * PER_RANK] for order in _orders(2, epoch)]
             for epoch in range(2) for k in range(SAMPLES // (PER_RANK * 2))]
    expected = one_process(steps, scale=2.0)  # the sum of the two ranks' mean losses
    for got in results(fitted, "sum", 2):
        _assert_params(got, expected, atol=1e-5)


def test_manual_optimization_with_two_optimizers_equals_one_process(fitted):
    from tests.lightning.fit_job import reference_manual
    expected = reference_manual(2)
    for got in results(fitted, "manual", 2):
        assert len(got["params"]) == len(expected) == 6
        _assert_params(got, expected)


def test_logging_and_the_strategys_collectives_agree_on_every_rank(fitted):
    runs = results(fitted, "fit", 2)
    assert runs[0]["loss"] == runs[1]["loss"]  # self.log(..., sync_dist=True): one value
    for r, got in enumerate(runs):
        assert got["rank_mean"] == 0.5, got  # the mean of the ranks' 0 and 1
        seen = got["seen"]
        assert seen["all_gather"] == [[1.0, 0.0], [2.0, 10.0]]
        assert seen["sum"] == [3.0, 10.0] and seen["mean"] == [1.5, 5.0]
        assert seen["max"] == [2.0, 10.0] and seen["min"] == [1.0, 0.0]
        assert seen["broadcast"] == {"from": 1}
        # all_gather(sync_grads=True): both ranks' sum of x*x depends on x, so 2 * 2x, as DDP's
        assert seen["grad"] == [4.0 * (r + 1)] * 2, seen


def test_a_checkpoint_written_by_rank_0_resumes_on_two_ranks(fitted, tmp_path):
    ckpt = fitted / "two.ckpt"
    assert [got["written"] for got in results(fitted, "first", 2)] == [True, True]  # after its barrier
    launch(HVDLITERUN + [sys.executable, JOB, str(tmp_path), "resumed", "hvdlite", "--resume", str(ckpt),
                         "--epochs", "3"], tmp_path)
    expected = reference_fit(2, epochs=3)  # an uninterrupted run of three epochs
    for got in results(tmp_path, "resumed", 2):
        _assert_params(got, expected)


def test_bf16_mixed_trains_alike_on_both_ranks(fitted):
    runs = results(fitted, "bf16", 2)
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))
    _assert_params(runs[0], reference_fit(2), atol=0.05)  # bfloat16 forward, fp32 updates


def test_an_exception_in_training_step_on_rank_1_fails_the_job_naming_it(tmp_path):
    command = HVDLITERUN + [sys.executable, JOB, str(tmp_path), "fail", "hvdlite", "--fail-rank", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLITE_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    # hvdliterun's root-cause report: rank 1 first, with its exception; rank 0 because of it
    assert "rank 1 (host" in output and "failed first: ValueError: training_step failed on purpose" in output, \
        output[-3000:]
    assert "then rank 0 failed because of it" in output and "rank 1" in output.split("then rank 0")[-1], \
        output[-3000:]


def test_the_strategy_under_torchrun(tmp_path):
    launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(_free_port()), JOB, str(tmp_path), "torchrun", "hvdlite"], tmp_path)
    expected = reference_fit(2)
    for r, got in enumerate(results(tmp_path, "torchrun", 2)):
        assert (got["rank"], got["size"]) == (r, 2)
        _assert_params(got, expected)


FABRIC_JOB = os.path.join(os.path.dirname(JOB), "fabric_job.py")


FABRIC_CASES = {"plain": ("", {}), "no_backward_sync": ("--accumulate 2", {"accumulate": 2}),
                "clip_gradients": ("--clip 0.05", {"clip": 0.05}),
                "clip_by_value": ("--clip-value 0.02", {"clip_value": 0.02})}


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric")  # one launch, one Fabric, a loop per case
    launch(HVDLITERUN + [sys.executable, FABRIC_JOB, str(out), "-",
                         *(f"--case={tag}={options}" for tag, (options, _) in FABRIC_CASES.items())], out)
    return out


@pytest.mark.parametrize("tag", list(FABRIC_CASES))
def test_a_fabric_loop_equals_one_process_on_the_combined_batch(fabric_runs, tag):
    from tests.lightning.fabric_job import reference as fabric_reference
    expected = fabric_reference(2, **FABRIC_CASES[tag][1])
    for r, got in enumerate(results(fabric_runs, tag, 2)):
        assert (got["rank"], got["size"], got["mean"]) == (r, 2, 0.5)
        _assert_params(got, expected)


def test_the_references_of_the_cases_differ():
    # clipping, accumulation and the scheduler change the references, so the tests above see
    # each of them work
    from tests.lightning.fabric_job import reference as fabric_reference
    for plain, other in ((reference_fit(2), reference_fit(2, clip=0.05)),
                         (reference_fit(2), reference_fit(2, accumulate=2)),
                         (reference_fit(2), reference_fit(2, scheduler=True)),
                         (reference_fit(2), reference_fit(2, clip_value=0.02)),
                         (fabric_reference(2), fabric_reference(2, clip_value=0.02)),
                         (fabric_reference(2), fabric_reference(2, clip=0.05)),
                         (fabric_reference(2), fabric_reference(2, accumulate=2))):
        assert max((a - b).abs().max().item() for a, b in zip(plain, other)) > 1e-3


def test_validate_and_predict_after_fit_and_fast_dev_run(fitted):
    from tests.lightning.fit_job import dataset, model
    net = model()
    x, y = dataset().tensors
    runs = results(fitted, "stages", 2)
    for r, got in enumerate(runs):
        for p, trained in zip(net.parameters(), got["params"]):
            p.data.copy_(trained)
        with torch.no_grad():
            # each rank validates its half (every other sample); sync_dist averages the halves
            expected = sum(torch.nn.functional.mse_loss(net(x[k::2]), y[k::2]) for k in range(2)) / 2
            assert abs(got["stages"]["val_loss"] - expected.item()) < 1e-6, (r, got["stages"]["val_loss"])
            assert torch.allclose(got["stages"]["predicted"], net(x[r::2]), atol=1e-6)  # its own half
    assert [got["rank"] for got in results(fitted, "dev", 2)] == [0, 1]
