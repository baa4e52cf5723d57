"""The Gloo channels' staged schedule (Note [Pipelined fusion over channels] and Note
[Prefaulting outputs while the link works], csrc/cpu_route.h), on channels that move no data.

The k-th scripted chunk says it has ended after probes[k % len(probes)] looks (its wait always
ends it), so the same buffer is driven through schedules where chunks end at once, soon, only
when waited for, or some of each. The events come back in the order they happened; every rule of the schedule is checked
against them.
"""

import pytest

import hvdlite  # noqa: F401  (imports torch, then the extension)
from hvdlite import _core

MIB = 1 << 20
ELEMENTS = 24 * MIB + 7  # 96 MiB of float32 (never touched): several chunks per channel, a short last one


def schedule(channels, probes, prefault, elements=ELEMENTS, buffer_elements=0):
    return _core._staged_schedule(elements, channels, probes, prefault, buffer_elements)


def covering(ranges, n):
    """The ranges are consecutive, in order, from 0 to n."""
    at = 0
    for begin, end in ranges:
        assert begin == at and end > begin, (begin, end, at)
        at = end
    assert at == n


NEVER = 10**9  # a chunk that ends only when waited for


@pytest.mark.parametrize("channels", [2, 3, 4])
@pytest.mark.parametrize("probes", [[0], [1], [3], [NEVER], [0, 40, 3, 400, 1], [NEVER, 2, 60]])
@pytest.mark.parametrize("prefault", [False, True])
def test_chunks_move_in_order_one_per_channel_and_outputs_are_mapped_ahead(channels, probes, prefault):
    events = schedule(channels, probes, prefault)
    copies = {kind: [tuple(ev[1:3]) for ev in events if ev[0] == kind] for kind in ("in", "out", "prefault")}
    covering(copies["in"], ELEMENTS)
    covering(copies["out"], ELEMENTS)
    first_out = next(i for i, ev in enumerate(events) if ev[0] == "out")
    last_in = max(i for i, ev in enumerate(events) if ev[0] == "in")
    assert last_in < first_out  # every chunk is copied in before the first is copied out

    starts = sorted(((ev[2], i, ev) for i, ev in enumerate(events) if ev[0] == "start"))  # by offset
    ends = {ev[2:]: i for i, ev in enumerate(events) if ev[0] == "end"}
    assert len(ends) == len(starts) >= 2 * channels  # every chunk started is waited for
    chunks = [ev[2:] for _, _, ev in starts]
    covering(chunks, ELEMENTS)  # the buffer cut without gaps
    assert chunks[0][1] - chunks[0][0] == (chunks[1][1] - chunks[1][0]) // 4  # the short first chunk
    for c, (_, i, (_, channel, begin, end)) in enumerate(starts):
        assert channel == c % channels
        filled = max(n for n, ev in enumerate(events[:i]) if ev[0] == "in")
        assert events[filled][2] >= end, "a chunk started before it was copied in"
        if c >= channels:  # one chunk at a time per channel: the one before it has ended
            assert ends[chunks[c - channels]] < i
        outs = [n for n, ev in enumerate(events) if ev[0] == "out" and begin <= ev[1] < end]
        assert min(outs) > ends[(begin, end)], "copied out before its chunk ended"

    mapped = copies["prefault"]
    if not prefault or probes == [0]:  # nothing to map, or no chunk ever found travelling
        assert mapped == []
        return
    # Mapped in order, never twice, never behind the copy out.
    assert all(a[1] <= b[0] for a, b in zip(mapped, mapped[1:]))
    # Never behind the copy out, and only while the chunk copied out next is still travelling
    # (its latest probe said so): an ended chunk is copied out first.
    copied_out, latest = 0, {}
    for ev in events:
        if ev[0] == "probe":
            latest[ev[2:4]] = ev[4]
        elif ev[0] == "out":
            copied_out = ev[2]
        elif ev[0] == "prefault":
            assert ev[1] >= copied_out, (ev, copied_out)
            following = next(chunk for chunk in chunks if chunk[0] <= copied_out < chunk[1])
            assert latest.get(following) is False, (ev, following)
    if probes == [NEVER]:  # chunks end only when waited for: everything is mapped before the first wait
        covering(mapped, ELEMENTS)
        first_end = min(ends.values())
        last_map = max(i for i, ev in enumerate(events) if ev[0] == "prefault")
        assert last_map < first_end


def test_below_two_stripes_the_buffer_goes_whole():
    events = schedule(4, [NEVER], True, elements=4 * MIB - 1)  # 16 MiB less 4 bytes: one stripe
    kinds = [ev[0] for ev in events]
    assert kinds == ["in", "start", "end", "out"], kinds


# Note [Streaming a batch through its buffer]: buffers of two to five times the largest chunk (16 MiB)
# for 96 MiB (8 or 12 MiB chunks) and 320 MiB (16 MiB chunks).
SLOT = 4 * MIB  # float32 elements in 16 MiB


def chunks_of(events):
    """[(begin, end, where, index of its "in" event)] in order, from the copies in."""
    return [(ev[1], ev[2], ev[3], i) for i, ev in enumerate(events) if ev[0] == "in"]


@pytest.mark.parametrize("elements,buffer_elements", [(ELEMENTS, 5 * SLOT), (ELEMENTS, 2 * SLOT),
                                                      (80 * MIB + 5, 2 * SLOT), (80 * MIB + 5, 3 * SLOT + 7)])
@pytest.mark.parametrize("channels", [2, 4])
@pytest.mark.parametrize("probes", [[0], [3], [NEVER], [0, 40, 3, 400, 1]])
@pytest.mark.parametrize("prefault", [False, True])
def test_a_batch_streams_through_a_smaller_buffer_slot_by_slot(elements, buffer_elements, channels, probes, prefault):
    events = schedule(channels, probes, prefault, elements, buffer_elements)
    whole = schedule(channels, [0], False, elements)  # the same elements in a buffer that holds them all
    chunks = chunks_of(events)
    assert [c[:2] for c in chunks] == [c[:2] for c in chunks_of(whole)]  # the same cut, whatever the buffer
    covering([c[:2] for c in chunks], elements)
    covering([tuple(ev[1:3]) for ev in events if ev[0] == "out"], elements)
    per = chunks[1][1] - chunks[1][0]
    slots = buffer_elements // per
    assert slots >= 2
    starts = {}  # chunk index -> (event index, channel)
    ends = {}
    last_out = {}  # chunk index -> index of its last copy out
    for c, (begin, end, where, _) in enumerate(chunks):
        assert where == (c % slots) * per and where + (end - begin) <= buffer_elements
        outs = [i for i, ev in enumerate(events) if ev[0] == "out" and begin <= ev[1] < end]
        assert all(events[i][3] == where + events[i][1] - begin for i in outs)  # out of its own slot
        last_out[c] = max(outs)
    for i, ev in enumerate(events):
        if ev[0] in ("start", "end"):
            # the chunk in that slot now: the latest copied in at that offset
            c = max(k for k, chunk in enumerate(chunks) if chunk[2] == ev[2] and chunk[3] < i)
            assert ev[3] - ev[2] == chunks[c][1] - chunks[c][0]
            (starts if ev[0] == "start" else ends)[c] = (i, ev[1])
    assert sorted(starts) == sorted(ends) == list(range(len(chunks)))  # every chunk started and waited for
    for c, (begin, end, where, filled) in enumerate(chunks):
        i, channel = starts[c]
        assert channel == c % channels and filled < i
        if c >= channels:
            assert ends[c - channels][0] < i  # one chunk at a time per channel
        if c >= slots:
            assert last_out[c - slots] < filled  # its slot was emptied before it was filled
        first_out = min(n for n, ev in enumerate(events) if ev[0] == "out" and begin <= ev[1] < end)
        assert first_out > ends[c][0], "copied out before its chunk ended"
    mapped = [tuple(ev[1:3]) for ev in events if ev[0] == "prefault"]
    assert all(a[1] <= b[0] for a, b in zip(mapped, mapped[1:]))  # in order, never twice
    if not prefault:
        assert mapped == []


def test_a_buffer_too_small_to_stream_through_is_refused():
    with pytest.raises(RuntimeError, match="cannot stream"):
        schedule(4, [0], False, ELEMENTS, 2 * SLOT - 1)  # not two of the largest chunks
    with pytest.raises(RuntimeError, match="stages everything at once"):
        schedule(1, [0], False, ELEMENTS, 5 * SLOT)  # one channel: one allreduce of everything
