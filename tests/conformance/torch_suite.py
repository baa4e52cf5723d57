"""torch's own backend test suite, run against a backend chosen by BACKEND (hvdlite or gloo).

    BACKEND=hvdlite python -m pytest tests/conformance/torch_suite.py [-k ...]
    BACKEND=gloo    python -m pytest tests/conformance/torch_suite.py [-k ...]

torch ships the suite in torch/testing/_internal/distributed/distributed_test.py: every test
spawns WORLD_SIZE processes that call init_process_group(BACKEND) and check collectives, DDP
and more. This module binds it to a backend (as torch's own test_distributed_spawn.py does);
`import hvdlite` registers "hvdlite" in the parent and in every spawned rank.
tests/conformance/test_conformance.py runs a chosen subset under both backends in the suite;
bench/conformance.py runs all of it and lists what differs.

The ranks are forked from this process, which has imported torch, the suite and hvdlite but
made no process group, instead of spawned (torch's default here): a spawned rank imports all
of that again, about 7 s of each test's 9 here, against under 1 s forked. The test bodies are
the same either way (torch ran this suite both ways, in test_distributed_fork and _spawn);
HVDLITE_TORCH_SUITE_START=spawn spawns them.
"""

import os
import sys
import tempfile

os.environ.setdefault("BACKEND", "hvdlite")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="hvdlite-torch-suite-"))

import torch  # noqa: E402
import hvdlite  # noqa: E402,F401  (registers the backend)
from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)

torch.set_num_threads(1)
_START = os.environ.get("HVDLITE_TORCH_SUITE_START", "fork")


class TestBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if _START == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context(_START).Process)


if __name__ == "__main__":
    run_tests()
