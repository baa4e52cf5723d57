"""DistributedOptimizer with a torch.compile'd model on 2 ranks (Note [Compiled backward in
buckets] in hvdlite/_runtime/compiled_backward.py): the compiled backward runs in buckets, so the
first reduction is handed to the engine while backward still runs; training equals one process
on the combined batch; hvdlite adds no graph break but the bucket boundaries.

The overlap is checked by order, not by time: a pre-hook on every compiled backward node of the
autograd graph, and a post-accumulate-grad hook on every parameter registered after the
optimizer's (so it runs right after the optimizer's hook has submitted the reduction), append to
one list as they run. Without the split the graph has one compiled backward node and every
reduction comes after it; that case is run too, as the control.
"""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hvdlite as hvd
from tests import harness
from tests.harness import run_ranks

STEPS = 3


class MLP(nn.Module):
    """Large enough that dynamo's buckets (the first of 1 MB) split it: 2, 4 and 2 MB of weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(256, 2048)
        self.fc2 = nn.Linear(2048, 512)
        self.fc3 = nn.Linear(512, 1024)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 256, generator=g), torch.randn(8, 1024, generator=g)


def compiled_nodes(loss):
    """Every compiled backward node reachable from ``loss``."""
    seen, stack, found = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            found.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


def one_step_order(split):
    """One step of a freshly compiled model; the order in which its compiled backward nodes
    started and its reductions were submitted."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = split
    try:
        model = MLP()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        events = []
        handles = [p.register_post_accumulate_grad_hook(
            lambda p, name=name: events.append(("submitted", name)) if p in opt._pending else None)
            for name, p in model.named_parameters()]
        compiled = torch.compile(model)
        x, y = batch(0, hvd.rank())
        loss = F.mse_loss(compiled(x), y)
        nodes = compiled_nodes(loss)
        for i, node in enumerate(nodes):
            node.register_prehook(lambda grads, i=i: events.append(("node", i)))
        loss.backward()
        opt.step()
        for handle in handles:
            handle.remove()
        return len(nodes), events
    finally:
        torch._dynamo.config.optimize_ddp = True


def check_reductions_start_during_compiled_backward():
    nodes, events = one_step_order(split=True)
    assert nodes >= 2, f"the compiled graph was not split: {nodes} compiled backward node(s)"
    first = next(i for i, e in enumerate(events) if e[0] == "submitted")
    last_node = max(i for i, e in enumerate(events) if e[0] == "node")
    assert first < last_node, f"no reduction was submitted before the last backward node ran: {events}"
    assert sum(e[0] == "submitted" for e in events) == 6, events


def check_without_the_split_every_reduction_waits_for_the_end():
    nodes, events = one_step_order(split=False)
    assert nodes == 1, nodes
    assert events[0] == ("node", 0) and sum(e[0] == "submitted" for e in events) == 6, events


def check_compiled_training_equals_one_process():
    torch._dynamo.reset()
    rank, size = hvd.rank(), hvd.size()
    model, ref = MLP(), MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    compiled = torch.compile(model)
    for step in range(STEPS):
        opt.zero_grad()
        F.mse_loss(compiled(batch(step, rank)[0]), batch(step, rank)[1]).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(F.mse_loss(ref(batch(step, r)[0]), batch(step, r)[1]) for r in range(size)) / size).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        assert diff <= 1e-5, f"compiled: parameter {name} differs from one process by {diff:.3g}"


def check_no_graph_break_but_the_buckets():
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for split in (True, False):
        torch._dynamo.reset()
        torch._dynamo.config.optimize_ddp = split
        try:
            explained = torch._dynamo.explain(model)(batch(0, 0)[0])
        finally:
            torch._dynamo.config.optimize_ddp = True
        reasons = [r.reason for r in explained.break_reasons]
        # the bucket boundaries are the only breaks, as a compiled DDP model's are
        assert all(r.startswith("DDPOptimizer intentional graph-break") for r in reasons), reasons
        assert bool(reasons) == split and (explained.graph_break_count > 0) == split, reasons
    del opt


def check_split_only_while_a_reducing_optimizer_lives():
    import gc

    from torch.nn.parallel import DistributedDataParallel
    torch._dynamo.reset()  # the compiled models of the other checks, and their optimizers
    gc.collect()
    assert not DistributedDataParallel._get_active_ddp_module()
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert DistributedDataParallel._get_active_ddp_module().bucket_bytes_cap == 25 << 20
    adasum = hvd.DistributedOptimizer(torch.optim.SGD(MLP().parameters(), lr=0.1), op=hvd.Adasum)
    del opt
    gc.collect()
    assert not DistributedDataParallel._get_active_ddp_module(), "an Adasum optimizer reduces in step()"
    del adasum


CHECKS = [name for name in dir() if name.startswith("check_")]


def _run_checks():
    import torch._inductor.config
    torch._inductor.config.compile_threads = 1  # no compile workers in the ranks
    return harness.run_checks_in_ranks(sys.modules[__name__], CHECKS)


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(2, __name__, "_run_checks", timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_compiled(outcomes, check):
    failures = [o[check] for o in outcomes if o[check]]
    assert not failures, "\n".join(failures)
