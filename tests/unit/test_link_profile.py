"""bench/linkprofile.py splits a cross-host call's time from sampled transmit counters (the
README's cross-host profile quotes it): checked here on counters made up for a known timeline."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import linkprofile  # noqa: E402

RATE = 1e9  # bit/s: 125 bytes per microsecond
PERIOD_US = 500


def _samples(sending, mss=8948, gso=65536, until_us=60_000):
    """Counters sampled every PERIOD_US for a link that sends at RATE during the given
    (start us, end us) spans: device bytes and packets as segmentation offload counts them
    (one header per `gso` bytes), TCP segments of `mss` bytes."""
    out = []
    for t in range(0, until_us + 1, PERIOD_US):
        payload = sum(max(0, min(t, end) - start) for start, end in sending) * 125
        segments = payload // mss
        packets = payload // gso
        # the device counts each offloaded packet's payload plus one set of headers
        out.append((t * 1000, payload + linkprofile.HEADERS * packets, packets, segments))
    return out


def test_a_call_splits_into_start_up_bytes_stalls_and_tail():
    # called at 10 ms; sends 12-22 ms and 25-27 ms; returns at 30 ms
    samples = _samples([(12_000, 22_000), (25_000, 27_000)])
    parts = linkprofile.breakdown(samples, 10_000_000, 30_000_000, RATE)
    payload = 12_000 * 125
    segments = payload // 8948
    assert parts["bytes"] == pytest.approx(payload + linkprofile.HEADERS * segments, rel=0.01)
    assert parts["busy"] == pytest.approx(parts["bytes"] * 8 / RATE)
    half = PERIOD_US / 2 / 1e6  # each edge is known to half a sampling period
    assert parts["start-up"] == pytest.approx(0.002, abs=half)
    assert parts["tail"] == pytest.approx(0.003, abs=half)
    assert parts["stalls"] == pytest.approx(0.003 - (parts["busy"] - payload * 8 / RATE), abs=2 * half)
    total = parts["start-up"] + parts["busy"] + parts["stalls"] + parts["tail"]
    assert total == pytest.approx(0.020)


def test_headers_of_every_segment_count_once_per_segment():
    samples = _samples([(0, 40_000)], mss=1448)
    parts = linkprofile.breakdown(samples, 0, 40_000_000, RATE)
    payload = 40_000 * 125
    assert parts["bytes"] == pytest.approx(payload + linkprofile.HEADERS * (payload // 1448), rel=0.001)


def test_a_call_that_sent_nothing_is_all_start_up():
    samples = _samples([])
    parts = linkprofile.breakdown(samples, 5_000_000, 9_000_000, RATE)
    assert parts["bytes"] == 0 and parts["start-up"] == pytest.approx(0.004)


def test_summaries_are_medians_per_method():
    samples = _samples([(1_000, 5_000), (11_000, 16_000), (21_000, 24_000)])
    windows = [("a", 0, 10_000_000), ("a", 10_000_000, 20_000_000), ("a", 20_000_000, 30_000_000)]
    summary = linkprofile.summarize(samples, windows, RATE)
    busy = sorted(linkprofile.breakdown(samples, b, e, RATE)["busy"] for _, b, e in windows)
    assert summary["a"]["busy"] == pytest.approx(busy[1])
