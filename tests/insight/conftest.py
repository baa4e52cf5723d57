"""Seeing-inside-a-job tests: every test has a hard timeout, so a bug fails it instead of hanging CI."""
from tests.harness import hard_timeout_fixture

_hard_timeout = hard_timeout_fixture(180)
