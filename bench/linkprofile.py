"""Where a cross-host collective's time goes on a rate-limited link.

A sampler process reads this host's transmit counters (bytes and packets of every interface but
lo, and the TCP segments sent, from which it counts the bytes on the link as the shaper does:
every frame with its headers) every `period` seconds; the rank marks when each timed call
began and ended. For one call that put B bytes on the link at rate R:

    time = start-up    (from the call to its first byte on the link)
         + busy        (B * 8 / R: the link sending this call's frames, payload and overhead)
         + stalls      (between the first and the last byte, time the link was not sending)
         + tail        (from the last byte on the link to the call's return)

and busy splits into the payload the algorithm must send (the link-rate limit) and the
overhead: TCP/IP and Ethernet headers, the acknowledgements this host sends for what it
receives, and the transport's own framing. The shaper's burst (tbf's bucket, 256 KB in
tests/multihost/hosts.py) lets a call that starts after an idle gap send about 2 ms of bytes
faster than the rate, so stalls can come out slightly negative.
"""
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

_SAMPLER = r"""
import os, signal, struct, sys, time
period = float(sys.argv[2])
devices = sys.argv[3:]
tx = [os.open(f"/sys/class/net/{d}/statistics/tx_bytes", os.O_RDONLY) for d in devices]
packets = [os.open(f"/sys/class/net/{d}/statistics/tx_packets", os.O_RDONLY) for d in devices]
snmp = os.open("/proc/net/snmp", os.O_RDONLY)
lines = os.pread(snmp, 1 << 16, 0).decode().splitlines()
heading = [line for line in lines if line.startswith("Tcp:")][0].split()
column = heading.index("OutSegs")
out = open(sys.argv[1], "wb", buffering=1 << 20)
signal.signal(signal.SIGTERM, lambda *_: (out.flush(), os._exit(0)))
while True:
    t = time.monotonic_ns()
    sent = sum(int(os.pread(fd, 32, 0)) for fd in tx)
    skbs = sum(int(os.pread(fd, 32, 0)) for fd in packets)
    tcp = [line for line in os.pread(snmp, 1 << 16, 0).decode().splitlines() if line.startswith("Tcp:")][1]
    out.write(struct.pack("qqqq", t, sent, skbs, int(tcp.split()[column])))
    time.sleep(period)
"""
# Ethernet (14), IPv4 (20) and TCP with timestamps (32) bytes: what every segment carries.
HEADERS = 66


def _devices():
    return [dev for dev in sorted(os.listdir("/sys/class/net")) if dev != "lo"]


class LinkSampler:
    """Samples this host's transmit counters in a separate process while the rank runs."""

    def __init__(self, period=0.0005):
        self.devices = _devices()
        handle, self.path = tempfile.mkstemp(prefix="hvdlite-link-", suffix=".bin")
        os.close(handle)
        self.proc = subprocess.Popen([sys.executable, "-c", _SAMPLER, self.path, str(period), *self.devices])
        self.windows = []  # (method, start ns, end ns)
        time.sleep(0.2)  # the sampler's first samples precede the first call

    def wrap(self, name, fn):
        def marked():
            begin = time.monotonic_ns()
            fn()
            self.windows.append((name, begin, time.monotonic_ns()))
        return marked

    def stop(self):
        time.sleep(0.05)
        self.proc.terminate()
        self.proc.wait(timeout=10)
        with open(self.path, "rb") as f:
            data = f.read()
        os.unlink(self.path)
        return [struct.unpack_from("qqqq", data, i) for i in range(0, len(data) - 31, 32)]


def breakdown(samples, begin, end, rate_bits):
    """One call's parts in seconds (and the bytes it put on the link), from the sampler's
    (ns, device bytes, device packets, TCP segments) samples and the call's window.

    The device counts a segmentation-offloaded packet (up to 64 KB) once, with one set of
    headers; the shaper counts every segment it becomes, headers and all. So the bytes on the
    link are the device's plus HEADERS for every TCP segment beyond the packets it counted."""
    before = [s for s in samples if s[0] <= begin]
    inside = [s for s in samples if begin < s[0] <= end]
    after = [s for s in samples if s[0] > end]
    if not before or not inside:
        raise ValueError("the sampler has no samples around this call")
    base, last = before[-1], after[0] if after else inside[-1]
    final = last[1]
    moved = [s for s in inside + after[:1] if s[1] > base[1]]
    sent = final - base[1] + HEADERS * max(0, (last[3] - base[3]) - (last[2] - base[2]))
    if not moved or sent <= 0:
        return {"start-up": (end - begin) / 1e9, "busy": 0.0, "stalls": 0.0, "tail": 0.0, "bytes": 0}
    # the first byte went out between the last sample still at the base and the first above it;
    # the last between the last sample below `final` and the first at it (half a period either way)
    first = moved[0][0]
    previous = max(s[0] for s in before + inside if s[0] < first)
    first_byte = (previous + first) / 2
    reached = min(s[0] for s in inside + after[:1] if s[1] >= final)
    last_before = max([s[0] for s in before + inside if s[0] < reached and s[1] < final] or [begin])
    last_byte = min(end, (last_before + reached) / 2)
    busy = sent * 8 / rate_bits
    start_up = max(0.0, (first_byte - begin) / 1e9)
    tail = max(0.0, (end - last_byte) / 1e9)
    return {"start-up": start_up, "busy": busy, "stalls": (end - begin) / 1e9 - start_up - busy - tail,
            "tail": tail, "bytes": sent}


def summarize(samples, windows, rate_bits):
    """{method: {part: median seconds}} over the method's calls."""
    parts = {}
    for name, begin, end in windows:
        parts.setdefault(name, []).append(breakdown(samples, begin, end, rate_bits))
    return {name: {key: statistics.median(p[key] for p in calls) for key in calls[0]}
            for name, calls in parts.items()}
