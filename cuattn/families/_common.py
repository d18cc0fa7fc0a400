"""What every kernel family module shares: the request a family answers, the choices it
returns, its kernels' template signatures and the first-fit rule of the tile tables."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .._kernels import c_type_name

#: threads per block of the kernels that do not say otherwise
THREADS = 256

#: a forward instance's RAGGED mode (common.cuh's enum Ragged): a dense call, packed
#: sequences (q_offsets, k_offsets) in one grid, key lengths read by the kernel, or key
#: lengths over paged keys and values (block_table) read in place
DENSE, PACKED, KEY_LENGTHS, PAGED = 0, 1, 2, 3


@dataclass(frozen=True)
class Request:
    """What a family's choice depends on: a call reduced to the values dispatch reads."""
    dtype: np.dtype
    head_dim: int
    head_dim_v: int
    bias_dtype: np.dtype | None
    has_mask: bool
    aligned: bool              # q, k, v may be copied in 16-byte chunks
    cc: tuple[int, int]
    smem_limit: int            # opt-in shared memory per block
    precision: str | None = None
    #: the backward's gradient storage types (dK and dV, dQ)
    grad_dtypes: tuple[np.dtype, np.dtype] | None = None
    #: the backward's: the forward's products read TF32 operands (a "tf32" family served
    #: it), so a backward that recomputes the scores rounds its operands the same way
    tf32_forward: bool = False
    #: packed sequences, key lengths or paged keys (PACKED, KEY_LENGTHS, PAGED): a family
    #: with instances of that mode returns one (KernelChoice.ragged); the others their
    #: dense instance
    ragged: int = DENSE

    @property
    def head(self) -> int:
        return max(self.head_dim, self.head_dim_v)

    def what(self) -> str:
        """The request in words, for an error."""
        return f"{np.dtype(self.dtype).name} with head dims {self.head_dim}, {self.head_dim_v}"


class Kernel:
    """A ``__global__`` template's signature: its name and template parameter names in
    declaration order (as in the ``.cu`` file). Called with every parameter by name, it
    returns the instance's name expression, e.g. ``attention_fwd_mma<__half, ...>``.
    ``defaults`` names trailing parameters the C++ template defaults, left out when equal."""

    def __init__(self, name: str, params: str, defaults: dict | None = None):
        self.name = name
        self.params = tuple(params.split())
        self.defaults = defaults or {}

    def __call__(self, **args) -> str:
        if set(args) != set(self.params):
            missing = sorted(set(self.params) - set(args))
            extra = sorted(set(args) - set(self.params))
            raise TypeError(f"{self.name}: missing {missing}, unknown {extra}")
        values = [args[p] for p in self.params]
        while values and self.params[len(values) - 1] in self.defaults \
                and values[-1] == self.defaults[self.params[len(values) - 1]]:
            values.pop()
        return f"{self.name}<{', '.join(template_arg(v) for v in values)}>"


def template_arg(value) -> str:
    """One C++ template argument: bools as true/false, dtypes as their C++ types, None as
    the absent bias (cuattn::NoBias), ints as they are."""
    if value is None:
        return "cuattn::NoBias"
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return _c_type(value)


@functools.lru_cache(maxsize=64)
def _c_type(dtype) -> str:  # dispatch and the gate ask for a few dtypes very often
    return c_type_name(dtype)


@dataclass(frozen=True)
class BlockTiles:
    """The block decomposition a forward instance was built for: query rows per block
    (``block_m``), keys per tile (``block_n``), and the head-dim tiles."""
    block_m: int
    block_n: int
    d_tile: int
    dv_tile: int
    min_blocks: int


@dataclass(frozen=True)
class KernelChoice:
    """A forward instance and how to launch it."""
    family: str
    filename: str
    name_expression: str
    tiles: object   # the family's tile record, or a BlockTiles
    d_tile: int
    dv_tile: int    # output columns per block: the grid splits wider Dv
    shared_mem: int
    threads: int = THREADS
    #: sm90_tf32: the instance that reads prepared operands (prepare is True there), and
    #: the query length from which it is chosen (Sm90Tiles.prepare_from)
    prepared: KernelChoice | None = None
    prepare_from: int = 0
    prepare: bool = False
    #: a kernel run first that writes the largest magnitudes of each batch entry's q, k and
    #: v into a zeroed float[batch][5] (sm90_3xf16: the split's scales)
    magnitudes: str | None = None
    #: the kernel reads q, k and v through tensor maps (FwdTmaParams; cuattn/_tma.py), and
    #: the instance that serves the call where the driver refuses a map
    tma: bool = False
    fallback: KernelChoice | None = None
    #: the fewest keys for which the piped instance is taken over its fallback (a causal or
    #: window band needs twice as many)
    tma_from: int = 0
    #: a grid of one block per SM at most, each taking the call's work units in turn
    #: (FwdTmaParams.units)
    persistent: bool = False
    #: the RAGGED mode of the instance: packed sequences in one grid (AttnParams.packed),
    #: key lengths (AttnParams.k_lengths), or those over paged keys (AttnParams.pages);
    #: sequence_unit and key_rows in common.cuh
    ragged: int = DENSE


@dataclass(frozen=True)
class BackwardChoice:
    """The backward's three instances (delta, dK/dV, dQ) and how to launch them."""
    family: str
    filename: str
    delta: str        # name expressions of the three kernels
    dkdv: str
    dq: str
    dkdv_rows: int    # keys per dK/dV block
    dq_rows: int      # query rows per dQ block
    col_tile: int     # output columns per dK/dV block (the grid splits wider head dims)
    dq_col_tile: int  # output columns per dQ block
    smem_dkdv: int
    smem_dq: int
    threads_dkdv: int = THREADS
    threads_dq: int = THREADS
    threads_delta: int = THREADS
    # blocks per dK/dV column tile: 2 when dK and dV run in separate blocks (sm90_3xf16's
    # dkdv_roles=2 form; blocks own every column: grid column tile 0 dV, 1 dK)
    dkdv_roles: int = 1
    # a kernel run before delta that writes the largest magnitudes of each batch entry's q,
    # k, v, dout and out into a zeroed float[batch][5] (sm90_3xf16: the split's scales)
    magnitudes: str | None = None
    # the RAGGED mode of the dK/dV and dQ kernels: PACKED runs a packed call in one grid
    # each (backward_unit in common.cuh)
    ragged: int = DENSE


#: the delta kernel of every backward (backward.cuh): rowsum(dout * out) per query row
DELTA = Kernel("attention_bwd_delta", "T")


def candidates(table, req: Request, tiles=None):
    """The candidate tiles of a table whose rows are (largest head dim, candidates,
    reason): the first row the request's head dims fit, or just ``tiles`` when given."""
    if tiles is not None:
        return (tiles,)
    return next(c for max_d, c, _ in table if req.head <= max_d)


def first_fit(candidates, smem_of, req: Request, family: str):
    """The first candidate tiles whose shared memory fits, with that shared memory.
    ``smem_of(tiles)`` is a byte count, or a tuple of counts (one per kernel) that must all
    fit; the error names ``family`` and the request."""
    for tiles in candidates:
        smem = smem_of(tiles)
        if max(smem if isinstance(smem, tuple) else (smem,)) <= req.smem_limit:
            return tiles, smem
    raise NotImplementedError(f"no {family} tile configuration fits {req.smem_limit} bytes "
                              f"of shared memory for {req.what()}")


def ceil_to(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


def pow2_at_least(n: int, lo: int) -> int:
    """The smallest power-of-two multiple of ``lo`` that is at least n."""
    p = lo
    while p < n:
        p *= 2
    return p


def itemsize(dtype) -> int:
    """Bytes per element of a dtype; 0 for an absent one (no bias)."""
    return 0 if dtype is None else np.dtype(dtype).itemsize


#: shared memory of an sm_90 SM (228 KB), of which each resident block also takes 1 KB
SM90_SMEM_PER_SM = 233472


def resident_cap(min_blocks: int, smem: int) -> int:
    """A kernel's register cap for ``min_blocks`` blocks per SM buys only as many blocks as
    their shared memory lets in together (a staged mask or bias can lower that): the
    smaller of the two, at least 1."""
    return max(1, min(min_blocks, SM90_SMEM_PER_SM // (smem + 1024)))
