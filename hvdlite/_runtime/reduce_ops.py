"""The reduce-op vocabulary: horovod.torch's names and values (csrc/types.h exports them), and
how a call's ``op=`` and deprecated ``average=`` resolve to one of them.

``hvdlite.Average``, ``Sum``, ``Min``, ``Max``, ``Product`` and ``Adasum`` are these values;
the engine receives them as they are.
"""

from .native import _core
from ..exceptions import HvdliteValueError

Average = _core.REDUCE_OPS["Average"]
Sum = _core.REDUCE_OPS["Sum"]
Adasum = _core.REDUCE_OPS["Adasum"]
Min = _core.REDUCE_OPS["Min"]
Max = _core.REDUCE_OPS["Max"]
Product = _core.REDUCE_OPS["Product"]
NAMES = {value: name for name, value in _core.REDUCE_OPS.items()}


def resolve(fn, average, op, allowed=(Average, Sum, Min, Max, Product, Adasum)):
    """The op a call of ``fn`` asked for: ``op=`` (default Average) or ``average=`` (True:
    Average, False: Sum), one of ``allowed``; a ValueError naming ``fn`` otherwise."""
    if average is not None:
        if op is not None:
            raise HvdliteValueError(f"{fn}: pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    if op == Adasum and not isinstance(op, bool) and Adasum not in allowed:
        raise HvdliteValueError(f"{fn}: op=Adasum is not supported here (as in horovod.torch); Adasum is "
                                "an allreduce")
    if isinstance(op, bool) or op not in allowed:
        names = ", ".join(NAMES[o] for o in allowed)
        raise HvdliteValueError(f"{fn}: op must be one of {names}; got {op!r}")
    return op
