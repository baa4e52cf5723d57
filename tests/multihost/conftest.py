"""The test hosts fixture: three hosts in network namespaces with real sshd (tests/multihost/hosts.py).

Without root or namespaces the tests skip with the reason; with HVDLITE_REQUIRE_TEST_HOSTS=1
(.ci/run sets it) they fail instead, so CI cannot pass without having run them.
"""
import os

import pytest

from tests.multihost import hosts as hostlib


# One set of hosts per module, not per session: a module that makes hosts of its own
# (test_many_hosts.py) clears every test namespace first, which would take a session's from
# under the modules after it.
@pytest.fixture(scope="module")
def hosts():
    reason = hostlib.unavailable()
    if reason:
        if os.environ.get("HVDLITE_REQUIRE_TEST_HOSTS") == "1":
            pytest.fail(f"test hosts are required here (HVDLITE_REQUIRE_TEST_HOSTS=1): {reason}")
        pytest.skip(reason)
    with hostlib.TestHosts(["hvta", "hvtb", "hvtc"]) as made:
        yield made
