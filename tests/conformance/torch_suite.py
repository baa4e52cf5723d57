"""torch's own backend test suite, run against a backend chosen by BACKEND (hvdlite or gloo).

    BACKEND=hvdlite python -m pytest tests/conformance/torch_suite.py [-k ...]
    BACKEND=gloo    python -m pytest tests/conformance/torch_suite.py [-k ...]

torch ships the suite in torch/testing/_internal/distributed/distributed_test.py: every test
spawns WORLD_SIZE processes that call init_process_group(BACKEND) and check collectives, DDP
and more. This module binds it to a backend (as torch's own test_distributed_spawn.py does);
`import hvdlite` registers "hvdlite" in the parent and in every spawned rank.
tests/conformance/test_conformance.py runs a chosen subset under both backends in the suite;
bench/conformance.py runs all of it and lists what differs.
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


class TestBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
