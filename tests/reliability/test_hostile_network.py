"""A stranger floods the rendezvous server while a job rendezvouses and runs (Note [Bounded
handshakes] in hvdlite/_job/server.py): idle connections, garbage, oversized length prefixes,
forged and replayed handshakes, a byte-a-moment sender. The job finishes with exact results,
the server's threads and file descriptors stay under a fixed bound throughout, and nothing a
stranger sent is stored or answered."""
import json
import os
import subprocess
import sys
import threading
import time

import torch

import hvdlite as hvd
from hvdlite._job.server import MAX_PENDING
from hvdlite._job.wire import HANDSHAKE_DEADLINE, MAGIC, _mac, recv_frame, send_frame
from hvdlite.runner.rendezvous import RendezvousServer, new_secret
from tests.harness import REPO, Job

FLOOD = os.path.join(REPO, "tests", "reliability", "flood.py")


def _train():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ok = True
    for step in range(20):
        got = hvd.allreduce(torch.arange(1000.0) * (rank + 1) + step, op=hvd.Sum, name=f"step.{step}")
        expected = torch.arange(1000.0) * sum(r + 1 for r in range(size)) + step * size
        ok = ok and torch.equal(got, expected)
        time.sleep(0.05)  # the job runs while the flood goes on
    hvd.shutdown()
    return ok


def _counts():
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def test_a_flood_of_strangers_leaves_the_server_bounded_and_the_job_exact():
    server = RendezvousServer(new_secret()).start()
    try:
        # a handshake reply that was valid once, for a nonce that will never come again
        sock = __import__("socket").create_connection((server.addr, server.port), timeout=5)
        magic, nonce = recv_frame(sock)
        assert magic == MAGIC
        replay = ["0", _mac(server.secret, nonce, b"0").hex()]
        send_frame(sock, [b"0", bytes.fromhex(replay[1])])
        assert recv_frame(sock) == [b"OK"]
        sock.close()
        time.sleep(0.2)
        threads0, fds0 = _counts()
        peak = [threads0, fds0]
        sampling = threading.Event()

        def sample():
            while not sampling.is_set():
                t, f = _counts()
                peak[0], peak[1] = max(peak[0], t), max(peak[1], f)
                time.sleep(0.02)
        sampler = threading.Thread(target=sample)
        sampler.start()
        spec = {"idle": 1500, "garbage": 150, "oversized": 50, "forged": 50, "replay": replay,
                "slow": True, "seconds": 1}
        flood = subprocess.Popen([sys.executable, FLOOD, server.addr, str(server.port), json.dumps(spec)],
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the idle connections are in
        job = Job(2, __name__, "_train", env={"HVDLITE_RENDEZVOUS_PORT": str(server.port),
                                              "HVDLITE_RENDEZVOUS_SECRET": server.secret})
        results = job.wait(timeout=120)
        out, _ = flood.communicate(timeout=120)
        sampling.set()
        sampler.join()
        report = json.loads(out.strip().splitlines()[-1])
        print(f"flood: {report}; peak threads +{peak[0] - threads0}, fds +{peak[1] - fds0}, "
              f"refused {server.refused_connections}")
        assert results == [True, True]
        assert report["answered"] == 0, report          # no stranger got anything but the greeting
        assert server.get("evil") is None               # nor stored anything
        # the slow sender was cut at the handshake deadline, not when it finished trickling
        assert report["slow_kept_s"] < HANDSHAKE_DEADLINE + 2, report
        # of 1,500 idle connections the server kept at most MAX_PENDING open
        assert report["idle"] - report["idle_closed"] <= MAX_PENDING, report
        # bounded: no thread per stranger; descriptors for at most MAX_PENDING of them, plus
        # the job's own connections (two ranks, a few pooled connections each)
        assert peak[0] - threads0 <= 12, (peak, threads0)
        assert peak[1] - fds0 <= MAX_PENDING + 24, (peak, fds0)
        assert server.refused_connections >= 1500
    finally:
        server.stop()


def test_the_discovery_probe_port_answers_its_peers_through_a_flood():
    # runner/task_service.py: strangers get no answer, cannot starve a peer's probe, and cost a
    # bounded number of descriptors and no threads
    import socket
    from runner import task_service
    secret = new_secret()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    threads0, fds0 = _counts()
    server = threading.Thread(target=task_service._serve, args=(listener, secret, 3), daemon=True)
    server.start()
    idle, answered = [], 0
    try:
        for _ in range(400):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        for i in range(60):  # challenges with a forged prober's proof, and oversized ones
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(os.urandom(16) + os.urandom(32 if i % 2 else 32 + 16))
                s.settimeout(3)
                try:
                    answered += len(s.recv(64)) > 0
                except OSError:
                    pass
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        slow.send(b"x")  # a byte, then nothing: held at most PROBE_TIMEOUT
        started = time.monotonic()
        peer_ok = [task_service.probe("127.0.0.1", port, secret, 3) for _ in range(5)]
        wrong = task_service.probe("127.0.0.1", port, secret, 4)  # a different task's index
        threads, fds = _counts()
        slow.settimeout(task_service.PROBE_TIMEOUT + 2)
        try:
            slow_closed = slow.recv(1) == b""
        except OSError:
            slow_closed = False
        held = time.monotonic() - started
    finally:
        for s in idle:
            s.close()
        listener.close()
        server.join(timeout=5)
    assert peer_ok == [True] * 5 and not wrong
    assert answered == 0
    assert slow_closed and held < task_service.PROBE_TIMEOUT + 1.5, held
    # the server's own: one thread, and descriptors for at most MAX_PENDING connections (the
    # test's 401 client sockets live in this process too)
    served = fds - fds0 - len(idle) - 1
    assert threads - threads0 <= 1 and served <= task_service.MAX_PENDING + 8, (threads - threads0, served)
