"""GroupStore (Note [Group addresses in two requests] in hvdlite/_runtime/group_store.py): the
groups' writes held until one publish, the addresses read in one prefetch, everything else
passed through; and the peers the prefetch predicts for Gloo's ring and broadcast."""
import datetime

import torch.distributed as dist

from hvdlite._runtime.group_store import GroupStore, broadcast_peers, ring_peers


class CountingStore(dist.Store):
    """A HashStore that counts the requests it is sent, by operation."""

    def __init__(self):
        super().__init__()
        self.inner = dist.HashStore()
        self.calls = []
        super().set_timeout(datetime.timedelta(seconds=5))

    def set(self, key, value):
        self.calls.append("set")
        self.inner.set(key, value)

    def get(self, key):
        self.calls.append("get")
        return self.inner.get(key)

    def wait(self, keys, timeout=None):
        self.calls.append("wait")
        self.inner.wait(keys)

    def check(self, keys):
        self.calls.append("check")
        return self.inner.check(keys)

    def multi_get(self, keys):
        self.calls.append("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self.calls.append("multi_set")
        self.inner.multi_set(keys, values)

    def add(self, key, value):
        self.calls.append("add")
        return self.inner.add(key, value)


def test_writes_wait_for_publish_and_go_in_one_request():
    base = CountingStore()
    store = GroupStore(base)
    store.set("g1/0/0", b"a")
    store.set("g2/0/0", "b")
    assert base.calls == [] and not base.inner.check(["g1/0/0"])
    store.publish()
    assert base.calls == ["multi_set"]
    assert base.inner.get("g1/0/0") == b"a" and base.inner.get("g2/0/0") == b"b"
    store.set("late", b"c")  # after publishing, writes go straight through
    assert base.calls[-1] == "set" and base.inner.get("late") == b"c"


def test_prefetched_addresses_answer_wait_and_get_without_a_request():
    base = CountingStore()
    for peer in range(4):
        base.inner.set(f"g/0/{peer}", f"address {peer}")
    store = GroupStore(base)
    store.publish()
    store.prefetch([f"g/0/{p}" for p in (1, 3)] + ["g/0/1"])
    assert base.calls == ["multi_get"]
    store.wait(["g/0/3"])
    assert store.get("g/0/3") == b"address 3" and store.check(["g/0/1"])
    assert base.calls == ["multi_get"]
    # a key not predicted reads the store, as a group would without the GroupStore
    assert store.get("g/0/2") == b"address 2"
    assert base.calls == ["multi_get", "get"]
    store.forget()
    assert store.get("g/0/3") == b"address 3" and base.calls[-1] == "get"


def test_a_process_group_over_it_rendezvouses_in_one_process():
    """A Gloo group of one rank writes its address through the GroupStore and works."""
    import torch
    base = CountingStore()
    store = GroupStore(base)
    group = dist.ProcessGroupGloo(dist.PrefixStore("pg", store), 0, 1, datetime.timedelta(seconds=10))
    store.publish()
    tensor = torch.ones(3)
    group.allreduce([tensor]).wait()
    assert tensor.tolist() == [1.0, 1.0, 1.0]
    assert base.calls.count("set") == 0 and base.calls.count("multi_set") <= 1


def _binomial_edges(size):
    """Edges of the binomial broadcast tree from rank 0, built top-down as a reference: in
    round k every rank that has the data (ranks < 2^k) sends to rank + 2^k."""
    edges = set()
    step = 1
    while step < size:
        for sender in range(step):
            if sender + step < size:
                edges.add((sender, sender + step))
        step *= 2
    return edges


def test_broadcast_peers_are_the_binomial_tree_from_the_root():
    for size in (2, 3, 5, 6, 8, 13, 32):
        for root in (0, size - 1):
            edges = {((a + root) % size, (b + root) % size) for a, b in _binomial_edges(size)}
            for rank in range(size):
                expected = sorted({b for a, b in edges if a == rank} | {a for a, b in edges if b == rank})
                assert broadcast_peers(rank, size, root) == expected, (size, root, rank)


def test_ring_peers():
    assert ring_peers(0, 1) == []
    assert ring_peers(0, 2) == [1]
    assert ring_peers(0, 5) == [1, 4] and ring_peers(4, 5) == [0, 3]
