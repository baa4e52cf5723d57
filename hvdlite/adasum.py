"""Adasum: allreduce with op=Adasum, as horovod.torch has it (CPU; a power-of-two set size).

Adasum combines two gradients a and b as
    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
(a coefficient is 1 when its squared norm is below sqrt(DBL_MIN), about 1.5e-154, as in
Horovod: only a vector that is numerically zero, so tiny gradients are combined like any other),
applied pairwise up a binary
tree over the ranks: level k combines the results of the blocks of 2^k ranks starting at
multiples of 2^(k+1), the lower block's result as `a`.

Note [Adasum by vector halving]
The tree is computed by recursive vector halving, distance doubling, as Horovod does. At level
k each rank pairs with the rank 2^k away; of the segment both hold copies of (the same
positions of their two blocks' vectors), the lower rank keeps the first half and the higher the
second, sending the other half to its partner (an alltoall in which only partners exchange).
The dot product and norms of the two whole vectors are the sums of every rank's partial sums
over its piece, within the group of 2^(k+1) ranks: every rank's three partial sums travel in
one small allgather and each rank adds its group's. After the last level every rank holds one
piece of the result; an allgather puts the pieces back in place. The arithmetic is done in
float64 and the result cast back to the tensor's dtype.
"""
import math
import sys

import torch

from .exceptions import HvdliteNotImplementedError


def _check(fn, size):
    if size & (size - 1):
        raise HvdliteNotImplementedError(f"{fn}: op=Adasum needs a power-of-two number of ranks in the set, got {size}")


# Below this a squared norm counts as zero (its coefficient is 1): sqrt of the smallest normal
# double, Horovod's rule. The sums are float64, so a norm of 1e-30 (squared 1e-60) is not zero.
_ZERO_SQUARED_NORM = math.sqrt(sys.float_info.min)


def _combine(a, b, dot, anorm, bnorm):
    acoeff = 1.0 - dot / (2.0 * anorm) if anorm >= _ZERO_SQUARED_NORM else 1.0
    bcoeff = 1.0 - dot / (2.0 * bnorm) if bnorm >= _ZERO_SQUARED_NORM else 1.0
    return acoeff * a + bcoeff * b


def adasum(tensor, name, rank, size, exchange, gather):
    """The Adasum of every rank's `tensor` over a set of `size` ranks (synchronizes).

    The set's collectives come as functions (ops.py passes them): `exchange(rows, splits,
    name)` is an alltoall returning the rows received, `gather(tensor, name)` an allgather."""
    fn = "allreduce(op=Adasum)"
    _check(fn, size)
    if tensor.device.type != "cpu":
        raise HvdliteNotImplementedError(f"{fn}: Adasum runs on CPU tensors in hvdlite")
    flat = tensor.detach().reshape(-1).to(torch.float64)
    start, piece = 0, flat  # the positions this rank is responsible for, and its vector there
    distance, level = 1, 0
    while distance < size:
        partner = rank ^ distance
        lower = rank < partner
        half = piece.numel() // 2
        keep, give = (piece[:half], piece[half:]) if lower else (piece[half:], piece[:half])
        splits = [0] * size
        splits[partner] = give.numel()
        received = exchange(give.contiguous().reshape(-1, 1), splits, f"{name}.adasum.{level}").reshape(-1)
        mine_is_a = (rank // distance) % 2 == 0  # this rank's block is the lower one at this level
        a, b = (keep, received) if mine_is_a else (received, keep)
        partial = torch.stack([(a * b).sum(), (a * a).sum(), (b * b).sum()])
        everyone = gather(partial.reshape(1, 3), f"{name}.adasum.dot.{level}")
        group = rank // (2 * distance)
        dot, anorm, bnorm = everyone[group * 2 * distance:(group + 1) * 2 * distance].sum(0).tolist()
        piece = _combine(a, b, dot, anorm, bnorm)
        if not lower:
            start += half
        distance, level = distance * 2, level + 1
    # every rank holds result[start:start + len(piece)]: put the pieces back together
    mine = torch.cat([torch.tensor([float(start)], dtype=torch.float64), piece]).reshape(1, -1) \
        if piece.numel() else torch.tensor([[float(start)]], dtype=torch.float64)
    lengths = gather(torch.tensor([piece.numel()]), f"{name}.adasum.lengths").tolist()
    padded = torch.zeros(1, 1 + max(lengths), dtype=torch.float64)
    padded[0, :mine.numel()] = mine.reshape(-1)
    pieces = gather(padded, f"{name}.adasum.pieces")
    result = torch.empty_like(flat)
    for row, length in zip(pieces, lengths):
        at = int(row[0].item())
        result[at:at + length] = row[1:1 + length]
    return result.to(tensor.dtype).reshape(tensor.shape)
