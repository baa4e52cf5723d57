"""The rank program of the cross-host benchmark (bench/multihost.py starts it on test hosts).

    hvdliterun -H hvta:1,hvtb:1 python bench/cross_host.py [--rounds 5] [--json FILE]

ResNet-50's gradient shapes allreduced across hosts, in one job: the flat bound (copy, one
torch.distributed allreduce, copy), torch.distributed async per tensor, hvdlite grouped, and
hvdlite grouped, the same bytes as one tensor out of place (hvd.allreduce), and hvdlite
grouped with fp16 compression (half the bytes on the wire; its result is checked
against the fp32 sum with fp16's tolerance), out of place as hvd.grouped_allreduce returns it
and in place as DistributedOptimizer reduces gradients (the engine casts as it copies, Note
[Casting on the wire] in csrc/executor.h). Every method's result is checked before timing.

Two bounds from the link itself, in the same job: the link-rate limit (computed: the bytes a
ring allreduce sends per host, 2 (N - 1) / N of the gradients, divided by --rate-bits, which
bench/multihost.py passes as BENCH_RATE_BITS), and the TCP ring bound (measured, interleaved
with the rest: every rank sends those bytes to the next rank over plain sockets, 4 streams,
while receiving as many from the one before; what TCP itself carries over this link, headers
and all). The second table gives every method as a ratio to the link-rate limit, fp16 against
its own (half the bytes).
"""
import argparse
import os
import socket
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import collectives  # noqa: E402
import linkprofile  # noqa: E402
import hvdlite as hvd  # noqa: E402
from hvdlite import ops  # noqa: E402

FLAT = "tight bound (cat, 1 allreduce, foreach copy)"


LIMIT = "link-rate limit (ring bytes / rate, computed)"
LIMIT_FP16 = "link-rate limit, fp16 (computed)"
TCP = "TCP ring bound (plain sockets, 4 streams)"
IN_PLACE_FP16 = "hvdlite grouped in place, fp16 on the wire (DistributedOptimizer's path)"
NATIVE_FP16 = "hvdlite grouped in place, float16 tensors (the same bytes, no cast)"
ONE = "hvdlite one tensor of the same bytes, out of place (hvd.allreduce)"
WARMUP = 1  # untimed calls of every method before the timed rounds


def tcp_ring(rank, size, streams=4):
    """A function that sends `nbytes` to the next rank while receiving as many from the one
    before, over `streams` TCP connections each way (the hosts' names as hvdliterun knows
    them resolve on every test host)."""
    listener = socket.create_server(("0.0.0.0", 0))
    peers = hvd.allgather_object((socket.gethostname(), listener.getsockname()[1]))
    name, port = peers[(rank + 1) % size]
    out = []

    def connect():
        for _ in range(streams):
            out.append(socket.create_connection((name, port)))

    connector = threading.Thread(target=connect)
    connector.start()
    incoming = [listener.accept()[0] for _ in range(streams)]
    connector.join()
    listener.close()
    buffers = [bytearray(4 << 20) for _ in range(2 * streams)]

    def pump(sock, nbytes, buf, send):
        view = memoryview(buf)
        while nbytes > 0:
            n = sock.send(view[:min(nbytes, len(buf))]) if send else sock.recv_into(view, min(nbytes, len(buf)))
            if n == 0:
                raise ConnectionError("peer closed the TCP ring bound's socket")
            nbytes -= n

    def run(nbytes):
        share = nbytes // streams
        threads = [threading.Thread(target=pump, args=(s, share, buffers[i], True)) for i, s in enumerate(out)]
        threads += [threading.Thread(target=pump, args=(s, share, buffers[streams + i], False))
                    for i, s in enumerate(incoming)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return run


def profile(sampler, limits, rate_bits, hosts):
    """Prints, for every host (its first rank's sampler), where each method's median call went."""
    calls = sampler.windows[WARMUP * len(limits):]  # every method ran WARMUP times first
    mine = linkprofile.summarize(sampler.stop(), calls, rate_bits)
    everyone = hvd.allgather_object((hvd.cross_rank(), hvd.local_rank(), mine))
    if hvd.rank() != 0:
        return
    for host, local, parts in sorted(everyone):
        if local != 0:
            continue
        print(f"\nwhere the time goes on host {host} of {hosts} (medians in ms; bytes sent by this host, headers "
              f"and acknowledgements included; bench/linkprofile.py)")
        print(f"  {'method':<58}{'call':>8}{'limit':>8}{'overhead':>10}{'start-up':>10}{'stalls':>8}{'tail':>8}")
        for name, p in parts.items():
            total = p["start-up"] + p["busy"] + p["stalls"] + p["tail"]
            extra = p["busy"] - limits[name]
            print(f"  {name[:57]:<58}{total * 1e3:>8.1f}{limits[name] * 1e3:>8.1f}{extra * 1e3:>10.1f}"
                  f"{p['start-up'] * 1e3:>10.2f}{p['stalls'] * 1e3:>8.1f}{p['tail'] * 1e3:>8.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rate-bits", type=float, default=float(os.environ.get("BENCH_RATE_BITS", "0")),
                        help="the link's rate in bit/s, for the link-rate limit (0: not reported)")
    parser.add_argument("--link-profile", action="store_true",
                        help="also sample this host's transmit counter and split each method's time into "
                             "start-up, bytes on the link, stalls and tail (bench/linkprofile.py)")
    args = parser.parse_args()
    rank, size = _common.setup()
    shapes = _common.resnet50_shapes()
    tensors = [torch.zeros(s) for s in shapes]
    all_methods = collectives.methods_for(tensors, rank, size)
    methods = {name: all_methods[name] for name in
               (FLAT, "torch.distributed async per tensor", "hvdlite grouped")}
    collectives.check(methods, shapes, rank, size, tensors)

    def hvd_grouped_fp16():  # the call a user makes: new tensors back, the inputs as they were
        return hvd.grouped_allreduce(tensors, name="fp16", op=hvd.Sum, compression=hvd.Compression.fp16)

    for i, t in enumerate(tensors):
        t.fill_(float((rank + 1) * (i % 7 + 1)) / 7)
    want = sum(range(1, size + 1))
    for i, o in enumerate(hvd_grouped_fp16()):
        assert torch.allclose(o, torch.full_like(o, want * (i % 7 + 1) / 7), rtol=1e-3), i
    methods["hvdlite grouped, fp16 compression"] = hvd_grouped_fp16

    def hvd_in_place_fp16():  # DistributedOptimizer's path under Compression.fp16
        hvd.synchronize(ops.allreduce_on_wire_async_(tensors, torch.float16, "fp16.in_place", hvd.Sum, 1.0, 1.0,
                                                     hvd.global_process_set, grouped=True))

    for i, t in enumerate(tensors):
        t.fill_(float((rank + 1) * (i % 7 + 1)) / 7)
    hvd_in_place_fp16()
    for i, t in enumerate(tensors):
        assert torch.allclose(t, torch.full_like(t, want * (i % 7 + 1) / 7), rtol=1e-3), i
    methods[IN_PLACE_FP16] = hvd_in_place_fp16
    halves = [t.half() for t in tensors]
    methods[NATIVE_FP16] = lambda: hvd.grouped_allreduce_(halves, name="fp16.native", op=hvd.Sum)
    flat = torch.full((sum(t.numel() for t in tensors),), float(rank + 1))
    assert torch.equal(hvd.allreduce(flat, name="one", op=hvd.Sum), torch.full_like(flat, float(want)))
    methods[ONE] = lambda: hvd.allreduce(flat, name="one", op=hvd.Sum)
    hosts = hvd.cross_size()
    ring_bytes = 2 * (hosts - 1) * sum(t.numel() * 4 for t in tensors) // hosts  # per host, fp32
    if hvd.size() == hosts:  # one rank per host: the ranks' ring is the hosts' ring
        send = tcp_ring(rank, size)
        methods[TCP] = lambda: send(ring_bytes)
    sampler = None
    if args.link_profile and args.rate_bits > 0:
        sampler = linkprofile.LinkSampler()
        methods = {name: sampler.wrap(name, fn) for name, fn in methods.items()}
    times = _common.interleaved(methods, args.rounds, warmup=WARMUP)
    mode = "hierarchical" if os.environ.get("HVDLITE_HIERARCHICAL_ALLREDUCE") == "1" else "flat"
    title = (f"ResNet-50 gradients, {size} ranks on {hosts} hosts, hvdlite {mode} "
             f"({os.environ.get('BENCH_LINK', 'unshaped')})")
    _common.report(title, times, FLAT, {"hvdlite grouped": 1.10}, args.json)
    if args.rate_bits > 0:
        limit = ring_bytes * 8 / args.rate_bits
        fp16 = "hvdlite grouped, fp16 compression"
        vs_link = {LIMIT: [limit] * args.rounds, **{n: v for n, v in times.items() if n not in (fp16, IN_PLACE_FP16, NATIVE_FP16)}}
        _common.report(f"{title}, against the link-rate limit ({ring_bytes / 1e6:.1f} MB per host "
                       f"at {args.rate_bits / 1e9:g} Gbit/s)", vs_link, LIMIT,
                       {"hvdlite grouped": 1.05 if mode == "hierarchical" else 1.03}, args.json)
        _common.report(f"{title}, fp16 against its own link-rate limit",
                       {LIMIT_FP16: [limit / 2] * args.rounds, fp16: times[fp16], IN_PLACE_FP16: times[IN_PLACE_FP16],
                        NATIVE_FP16: times[NATIVE_FP16]},
                       LIMIT_FP16, {fp16: 1.10, IN_PLACE_FP16: 1.10},
                       args.json)
    if sampler is not None:
        halved = (fp16, IN_PLACE_FP16, NATIVE_FP16)
        limits = {name: limit / 2 if name in halved else limit for name in methods}
        profile(sampler, limits, args.rate_bits, hosts)
    hvd.shutdown()


if __name__ == "__main__":
    main()
