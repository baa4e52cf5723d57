"""A stranger on the network, for tests/reliability/test_hostile_network.py: floods a rendezvous
server with what someone without the job's secret can send, and reports what came back.

    python tests/launcher/flood.py HOST PORT SPEC_JSON

SPEC_JSON: {"idle": n, "garbage": n, "oversized": n, "forged": n, "replay": [rank, mac_hex],
"slow": true, "seconds": s}. Prints one JSON line: replies other than the server's greeting
(must stay 0), and how long the slow sender was kept.
"""
import json
import os
import socket
import struct
import sys
import threading
import time

_LEN = struct.Struct(">I")


def frame(fields):
    body = b"".join(_LEN.pack(len(f)) + f for f in fields)
    return _LEN.pack(len(body)) + body


def main():
    host, port, spec = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    answered = [0]  # frames beyond the greeting: anything the server said to a stranger
    idle = []

    def connect():
        s = socket.create_connection((host, port), timeout=10)
        s.settimeout(10)
        return s

    def after_greeting(s):
        """Reads what follows the greeting until the server closes; counts any frame."""
        try:
            s.recv(4096)  # the greeting [MAGIC, nonce] (sent before anything is read)
            s.settimeout(10)
            while True:
                data = s.recv(4096)
                if not data:
                    return
                answered[0] += 1
        except OSError:
            return
        finally:
            s.close()

    for _ in range(spec.get("idle", 0)):
        try:
            idle.append(connect())
        except OSError:
            time.sleep(0.01)

    def burst(payload_of, count):
        for i in range(count):
            try:
                s = connect()
                s.sendall(payload_of(i))
                after_greeting(s)
            except OSError:
                continue

    threads = [
        threading.Thread(target=burst, args=(lambda i: os.urandom(64 + i % 200), spec.get("garbage", 0))),
        threading.Thread(target=burst, args=(lambda i: _LEN.pack(0xFFFFFFF0) + b"x" * 16, spec.get("oversized", 0))),
        threading.Thread(target=burst, args=(lambda i: frame([b"0", os.urandom(32)]), spec.get("forged", 0))),
        threading.Thread(target=burst, args=(lambda i: frame([b"SET", b"evil", b"stranger"]), spec.get("forged", 0))),
    ]
    if spec.get("replay"):
        rank, mac = spec["replay"]
        threads.append(threading.Thread(target=burst, args=(
            lambda i: frame([str(rank).encode(), bytes.fromhex(mac)]), spec.get("forged", 0))))
    slow = {}

    def slow_sender():
        s = connect()
        s.recv(4096)
        started = time.monotonic()
        try:
            for byte in frame([b"0", b"\0" * 32]):
                s.send(bytes([byte]))
                time.sleep(0.3)
        except OSError:
            pass
        try:
            s.settimeout(15)
            while s.recv(4096):
                answered[0] += 1
        except OSError:
            pass
        slow["kept_s"] = time.monotonic() - started
    if spec.get("slow"):
        threads.append(threading.Thread(target=slow_sender))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(spec.get("seconds", 0))
    closed = 0
    for s in idle:  # which idle connections the server has closed by now
        s.settimeout(0.2)
        try:
            while True:
                if not s.recv(4096):
                    closed += 1
                    break
        except OSError:
            pass  # still open: nothing more came before the timeout
        s.close()
    print(json.dumps({"answered": answered[0], "slow_kept_s": slow.get("kept_s"), "idle": len(idle),
                      "idle_closed": closed}), flush=True)


if __name__ == "__main__":
    main()
