"""The examples run end to end: alone and under the launcher, with the results they promise.

Each example runs as a user would start it (`python examples/x.py`, or
`python -m hvdlite.runner.launch -np 2 python examples/x.py`), in a clean environment with one
torch thread per rank, and its printed output is checked.
"""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = [sys.executable, "-m", "hvdlite.runner.launch"]


def run_example(script, *args, np=1, timeout=90, launcher=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVDLITE_", "OMPI_", "PMI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, os.path.join("examples", script), *map(str, args)]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(np),
                   "--master-port", str(_free_port()), *command[1:]]
    elif np > 1:
        command = LAUNCH + ["-np", str(np)] + command
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} exited with {done.returncode}:\n" \
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def number(pattern, text):
    found = re.findall(pattern, text)
    assert found, f"no line matching {pattern!r} in:\n{text[-2000:]}"
    return float(found[-1])


def test_digits_two_ranks_reach_one_rank_accuracy_within_a_point_with_and_without_powersgd():
    alone = run_example("digits.py")
    pair = run_example("digits.py", np=2)
    one = number(r"test accuracy: ([\d.]+)% \(\d+/\d+\) on 1 rank", alone)
    two = number(r"test accuracy: ([\d.]+)% \(\d+/\d+\) on 2 rank", pair)
    assert one >= 95.0, f"1 rank reached only {one}%"
    assert abs(two - one) <= 1.0, f"2 ranks reached {two}%, 1 rank {one}%"
    assert "epoch  30/30 [########################]" in pair, "no progress bar from rank 0"
    assert "[1]<stdout>: epoch" not in pair, "rank 1 printed a progress bar"
    # PowerSGD at rank 2 (Note [PowerSGD]) reaches the uncompressed 2-rank accuracy within a point
    low = number(r"test accuracy: ([\d.]+)% \(\d+/\d+\) on 2 rank",
                 run_example("digits.py", "--powersgd-rank", 2, np=2))
    assert abs(low - two) <= 1.0, f"PowerSGD rank 2 reached {low}%, uncompressed {two}%"


def test_synthetic_benchmark_reports_per_rank_and_total_rates():
    out = run_example("synthetic_benchmark.py", "--batch-size", 8, "--num-iters", 2,
                      "--num-warmup-batches", 1, "--num-batches-per-iter", 2, "--fp16-allreduce",
                      np=2)
    per_rank = number(r"img/sec per rank: ([\d.]+) \+-", out)
    total = number(r"total img/sec on 2 rank\(s\): ([\d.]+)", out)
    assert per_rank > 0 and total > per_rank, out


def test_horovod_port_trains_under_the_launcher():
    out = run_example(os.path.join("horovod_port", "train.py"), "--epochs", 3, np=2)
    assert number(r"Accuracy: ([\d.]+)%", out) > 80.0, out


def test_horovod_port_with_adasum_groups_and_a_timeline(tmp_path):
    trace = tmp_path / "timeline.json"
    out = run_example(os.path.join("horovod_port", "train.py"), "--epochs", 3, "--use-adasum",
                      "--num-groups", 2, "--timeline", trace, np=2)
    assert number(r"Accuracy: ([\d.]+)%", out) > 80.0, out
    assert "ranks: 2, homogeneous: True" in out
    assert (tmp_path / "timeline.rank0.json").stat().st_size > 0


def test_elastic_digits_through_a_kill_and_an_addition_matches_an_uninterrupted_run():
    """examples/elastic_digits.py loses a rank (its host is blacklisted: 4 ranks become 2),
    gains a host (2 become 4) and still reaches the accuracy of a run without either, within a
    point. Driven by bench/elastic_reset.py's run, whose reset times are not asserted here."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("elastic_reset", os.path.join(REPO, "bench", "elastic_reset.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    elastic = bench.one_run(step_seconds=0.02, epochs=20, interrupt=True)
    plain = bench.one_run(step_seconds=0.02, epochs=20, interrupt=False)
    assert elastic["final_size"] == 4 and plain["final_size"] == 4
    assert abs(elastic["accuracy"] - plain["accuracy"]) <= 1.0, (elastic, plain)
    assert plain["accuracy"] > 90.0, plain


def test_ddp_example_trains_over_hvdlite():
    # A plain DDP script whose one hvdlite-specific line is the backend name
    # (examples/ddp_backend.py). Its equality with DDP over Gloo is checked step by step in
    # tests/multirank/test_torch_backend.py; running the script over Gloo here as well would
    # inherit torch's own Gloo teardown, which aborts about one exit in eight on this machine
    # with or without hvdlite imported.
    ours = run_example("ddp_backend.py", np=2)
    assert "over hvdlite" in ours
    assert number(r"test accuracy: ([\d.]+)%", ours) >= 90.0, ours[-500:]


def test_ddp_example_trains_over_hvdlite_under_torchrun():
    # the same script started by torchrun: env:// with torchrun's own store and variables
    ours = run_example("ddp_backend.py", np=2, launcher="torchrun")
    assert "over hvdlite" in ours
    assert number(r"test accuracy: ([\d.]+)%", ours) >= 90.0, ours[-500:]


def test_lightning_digits_two_ranks_reach_one_process_accuracy_within_a_point():
    import pytest
    pytest.importorskip("lightning", reason="lightning is not installed (pip install hvdlite[lightning])")
    alone = number(r"test accuracy: ([\d.]+)%", run_example("lightning_digits.py", timeout=120))
    pair = run_example("lightning_digits.py", np=2, timeout=120)
    assert "on 2 rank(s)" in pair
    assert abs(number(r"test accuracy: ([\d.]+)%", pair) - alone) <= 1.0, (alone, pair[-500:])
    assert alone > 90.0


def test_slow_rank_example_names_the_slow_rank():
    """examples/slow_rank.py, as the README's "Seeing inside a job" runs it (3 ranks; 60 steps)."""
    out = run_example("slow_rank.py", "--slow-rank", 2, "--sleep", 0.05, np=3)
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"rank (\d): last in .*", out)}
    assert sorted(lines) == [0, 1, 2], out[-2000:]
    assert lines[2].endswith("<- straggler"), lines
    assert not lines[0].endswith("<- straggler") and not lines[1].endswith("<- straggler"), lines
    assert 40.0 <= number(r"rank 2: last in \d+% of \d+ rounds, lag median ([\d.]+) ms", out) <= 60.0
