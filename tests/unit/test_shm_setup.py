"""Setting up the shared-memory channel (hvdlite/_runtime/groups.py, Note [Shared-memory allreduce]) in
one process: a segment is mapped and its name unlinked at once, and a member whose pid this
process cannot see (another pid namespace) turns the channel off instead of looking dead."""
import glob
import os

import torch.distributed as dist

from hvdlite._runtime import groups as _groups


def _segments():
    """This process's segments (groups.segment_name_prefix): other workers of a parallel run
    make and unlink their own meanwhile."""
    return glob.glob(f"/dev/shm/{_groups.segment_name_prefix(os.getpid())}*")


def test_a_segment_is_mapped_and_its_name_unlinked():
    before = _segments()
    channel, words = _groups._segment(dist.HashStore(), "t/shm", 0, 1, [0], [os.getpid()], probe=True)
    assert channel is not None
    address, value = channel.probe_word()
    assert words == [f"{address}:{value}"]
    assert _segments() == before


def test_a_member_whose_pid_is_not_visible_here_turns_the_channel_off():
    invisible = 2 ** 22 + 12345  # above PID_MAX_LIMIT: no process anywhere has this pid
    before = _segments()
    assert _groups._segment(dist.HashStore(), "t/shm", 0, 1, [0], [invisible]) == (None, None)
    assert _segments() == before
