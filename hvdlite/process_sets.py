"""Process sets: subsets of ranks that run collectives among themselves.

So far only the global process set (every rank) exists; collectives accept
``process_set=global_process_set`` (the default) for horovod.torch compatibility.
"""


class ProcessSet:
    """A set of ranks. ``ranks`` is None for the global set (all ranks)."""

    def __init__(self, ranks=None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    def __repr__(self):
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet(ranks={self.ranks})"


global_process_set = ProcessSet()
