"""The suite's shared configuration: the import path, the `slow` marker and how a parallel run
(`python -m pytest -n 3 tests`, pytest-xdist) shares the tests between its workers.

Note [Running the suite in parallel]
Most of the suite's time is spent waiting: for ranks to start, for a stall or a timeout to be
seen, for an elastic job to re-form (a serial run used about 0.55 of this machine's two cores).
The README's command, `-n 3`, runs it on three workers. Each module runs whole on one worker, in
order, so its module-scoped fixtures (one job that many tests read) are made once; the tests
that build network-namespace hosts or a SLURM cluster (tests/multihost, tests/slurm) share names
on this machine (the hvt-* namespaces, the bridge, slurmctld's port) and so run on one worker,
one after another. Everything else a test starts takes ports and folders of its own, chosen at
run time. Three workers keep both cores busy (the suite's CPU, summed over every process, was
1,220 s in a serial run of 18 minutes), so its time is its CPU: what took it from 18 minutes to
under 10 was CPU taken out of tests (references computed in place, no spinning job under a
dump, Note [Test processes skip the last collection] in tests/_site/sitecustomize.py). The load
stretches every test about twice, so a test must wait on an event, never on a fixed time that
happened to suffice when it ran alone (the ones that did were fixed: a rank killed right after
init(), a dump of a job that could end first, a launcher that reported a rank's exit before its
last lines). `-n 0` runs it one test at a time.

`-m "not slow"` leaves out the end-to-end scenarios (elastic re-forming, hosts, clusters,
frameworks, examples, floods) and the multi-rank tests that take seconds: the edit-test loop.
"""
import gc
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
# Tests import the harness as tests.harness and rank functions as tests.multirank.<module>.
sys.path.insert(0, os.path.dirname(TESTS))
# Every process a test starts imports tests/_site/sitecustomize.py: Note [Test processes skip
# the last collection] there.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [os.path.join(TESTS, "_site")] + [p for p in [os.environ.get("PYTHONPATH")] if p])

# Folders whose every test is an end-to-end scenario of several seconds.
SLOW_FOLDERS = {"conformance", "elastic", "examples", "lightning", "multihost", "ray", "reliability", "slurm"}
# Folders whose tests share machine-wide names: one worker, one test at a time.
SHARED_HOSTS = {"multihost", "slurm"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: an end-to-end scenario or a multi-rank test of seconds "
                                       "(left out by -m 'not slow'; Note [Running the suite in parallel])")


# The longest groups first, so that no worker starts one near the end (the rest keep their order).
FIRST = ["multihost", "slurm", "elastic", "examples", "reliability", "multirank"]


def _folder(path):
    return os.path.relpath(str(path), TESTS).split(os.sep)[0]


def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", None) is not None:  # a worker of `-n N`: the long groups first
        items.sort(key=lambda item: FIRST.index(_folder(item.path)) if _folder(item.path) in FIRST else len(FIRST))
    for item in items:
        if _folder(item.path) in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """What collection imported (torch, hvdlite, every test module) lives as long as the run: its
    collections need not walk it, nor those of the ranks forked from this process
    (tests/multihost/forked.py). The rank zygotes freeze theirs too (tests/zygote.py)."""
    gc.freeze()


def _group(nodeid):
    """Note [Running the suite in parallel]: what one worker runs together."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
    return "shared-hosts" if folder in SHARED_HOSTS else path


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `-n N`: whole groups (_group) per worker, in collection order."""
    if config.getvalue("dist") not in ("load", "loadfile", "loadscope"):
        return None  # another mode asked for by name
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return _group(nodeid)

    return GroupScheduling(config, log)
