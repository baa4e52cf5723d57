"""Shared helpers for the hvdliterun end-to-end tests.

Every test gets a hard per-test alarm, and every subprocess a timeout, so nothing can hang CI.
The launcher is always run as `python -m hvdlite.runner.launch`, from a temporary directory
(so a source checkout in the working directory cannot shadow the installed package).
"""
import os
import subprocess

import pytest

from launcher_helpers import LAUNCH
from tests.harness import hard_timeout_fixture

TEST_HARD_TIMEOUT = 90
_hard_timeout = hard_timeout_fixture(TEST_HARD_TIMEOUT)


@pytest.fixture
def hvdliterun(tmp_path):
    """Run the launcher to completion; returns a CompletedProcess with text output."""

    def run(*args, timeout=30, extra_env=None, env=None, cwd=None):
        full_env = dict(os.environ if env is None else env)
        full_env.update(extra_env or {})
        return subprocess.run(LAUNCH + [str(a) for a in args], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=cwd or tmp_path)

    return run
