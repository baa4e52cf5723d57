"""Every Lightning test starts ranks as processes: a hard timeout ends a hang as a failure."""
from tests.harness import hard_timeout_fixture

_hard_timeout = hard_timeout_fixture(240)
