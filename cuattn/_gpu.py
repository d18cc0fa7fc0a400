"""The GPU backend: CuPy calls planned and launched on the current stream.

A forward call's plan (:func:`forward`) is its dispatch choice (``_dispatch``), its layout
and its parameter block (``_launch``), kept per call signature, so that a repeated call
skips validation, dispatch and packing and only writes its pointers
(:func:`repeated_call`); a decoding call's plan is its split into key chunks and their
merge, replayed the same way. The backward is :mod:`cuattn._gpu_backward`.
"""
from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np

from . import _dispatch, _split
from ._checks import (
    AttentionCall,
    byte_span,
    loaded_cupy,
    lse_dtype,
)
from ._gpu_plan import (
    _forward_arrays,
    _forward_plan,
    _MagnitudesLaunch,
    _prepared_plan,
)
from ._launch import LaunchLoop, device_limits, sm_count
from .families._common import DENSE, KEY_LENGTHS, PACKED, PAGED
from .merge import stacked_plan

__all__ = ["forward", "forward_parts", "repeated_call"]

#: Forward launch plans by call signature (:func:`_plan_key`): callables of the call's
#: pointers (:func:`_plan`) holding kernels, grids, shared memory and parameter blocks. A
#: repeated signature skips dispatch, layout and packing, which is most of the Python time
#: of a call; a split call's plan holds its parts' plans and the merge.
_forward_plans: dict = {}
_MAX_PLANS = 512


def _signature(x):
    return None if x is None else (x.shape, x.strides, x.dtype)


def _plan_key(call: AttentionCall, device_id: int, kernel, tiles, chunks: int, lse):
    """Everything a forward launch plan depends on, pointers aside: shapes, strides and
    dtypes of every array (``lse``, the array the lse goes to, included), the scalar
    arguments, where q, k and v start within 16 bytes (the aligned copy path, also of a
    split call's views at offsets), the device, the forced family and tiles, the key
    chunks, and the environment variables that choose a family or the kernel sources."""
    q, k, v = call.q, call.k, call.v
    return (device_id, _signature(q), _signature(k), _signature(v), _signature(call.mask),
            _signature(call.bias), _signature(call.out), _signature(lse),
            _signature(call.k_lengths), call.k_lengths_from, call.k_lengths_step,
            None if call.pages is None else call.pages.key(), call.scale,
            call.softcap, call.window_left, call.window_right, call.precision, call.return_lse,
            q.data.ptr % 16, k.data.ptr % 16, v.data.ptr % 16, kernel, tiles, chunks,
            os.environ.get("CUATTN_KERNEL"), os.environ.get("CUATTN_KERNEL_DIR"))


def forward_packed(call: AttentionCall, ragged, out, lse, kernel: str | None = None,
                   tiles=None) -> bool:
    """Run a validated packed CuPy call (``ragged``: its offsets; ``out``, ``lse``: its
    arrays) in one grid where the family that serves it has a packed instance; False
    where none does (the caller runs its sequences as dense calls). ``kernel`` and
    ``tiles`` force a family and its tiles (tests), as for :func:`forward`."""
    cupy = call.xp
    device_id = call.q.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return forward_packed(call, ragged, out, lse, kernel, tiles)
    q_off, k_off = (x if isinstance(x, np.ndarray) else x.get()
                    for x in (ragged.q_offsets, ragged.k_offsets))
    sq, sk = np.diff(q_off), np.diff(k_off)
    # the key count of a typical unit of work: the piped instance's threshold reads it
    keys = int((sq * sk).sum() // max(1, int(sq.sum())))
    cc, smem_limit = device_limits(device_id)
    choice = _dispatch.forward_kernel(call, cc, smem_limit, kernel, tiles, ragged=PACKED,
                                      keys=keys)
    if choice.ragged != PACKED:
        return False
    if call.seqlen_q == 0 or 0 in call.batch_shape:
        return True
    launch, loop = _forward_plan(call, choice, out, lse, packed=(q_off, k_off))
    plan = launch if loop is None else LaunchLoop(launch, loop)
    plan([0 if x is None else x.data.ptr for x in _forward_arrays(call, out, lse)],
         cupy.cuda.get_current_stream().ptr)
    return True


def _ragged_mode(call: AttentionCall) -> int:
    """The RAGGED mode of a dense call's instance: KEY_LENGTHS with key lengths, PAGED with
    paged keys and values read in place, else DENSE."""
    if call.k_lengths is None:
        return DENSE
    return KEY_LENGTHS if call.pages is None else PAGED


def serves_paged(call: AttentionCall, kernel: str | None = None) -> bool:
    """Whether dispatch's family for a validated CuPy call has an instance that reads paged
    keys and values in place (PAGED)."""
    cc, smem_limit = device_limits(call.q.data.device_id)
    return _dispatch.forward_kernel(call, cc, smem_limit, kernel, None, PAGED).ragged == PAGED


def forward_lengths(call: AttentionCall, lengths, kernel: str | None = None, tiles=None):
    """``(out, lse)`` of a validated CuPy call whose batch entries have key lengths
    (``lengths``: host, broadcast to the batch shape, within 0 .. Sk; or a CuPy integer
    array broadcastable to it, clipped by the kernels), read by the kernels
    (KEY_LENGTHS, or PAGED for paged keys and values, call.pages): one dense call, folded
    and split as any other; None where dispatch's family has no such instance (never for
    paged keys, which :func:`serves_paged` checked). ``kernel`` and ``tiles`` as for
    :func:`forward`."""
    cupy = call.xp
    device_id = call.q.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return forward_lengths(call, lengths, kernel, tiles)
    cc, smem_limit = device_limits(device_id)
    mode = KEY_LENGTHS if call.pages is None else PAGED
    choice = _dispatch.forward_kernel(call, cc, smem_limit, kernel, tiles, mode)
    if choice.ragged != mode:
        if mode == PAGED:
            raise NotImplementedError(f"no instance reads paged keys and values in place "
                                      f"for this call ({choice.name_expression})")
        return None
    if isinstance(lengths, np.ndarray):
        # the entries as given (the axes broadcast to the batch shape back to size 1), so
        # that query groups of one length still fold into rows
        given = lengths[tuple(slice(None, 1) if st == 0 else slice(None)
                              for st in lengths.strides)]
        lengths = cupy.asarray(np.ascontiguousarray(given, np.int32))
    elif lengths.dtype not in (np.int32, np.int64):  # unsigned or narrow: as int64
        lengths = lengths.astype(np.int64)
    call = dataclasses.replace(call, k_lengths=lengths, return_lse=True)
    split = kernel is None and tiles is None
    return _run(call, kernel, tiles, split)[:2]


def _plan(call: AttentionCall, device_id: int, kernel, tiles, out, lse, chunks: int):
    """The launch plan of a call's signature in ``chunks`` key chunks (1: no split), kept
    per signature (:func:`_plan_key`): a callable with the call's nine slot pointers
    (FORWARD_SLOTS; 0 for an absent one) and the stream, which runs everything the call
    needs. ``out`` and ``lse``: this call's, for their layout."""
    key = _plan_key(call, device_id, kernel, tiles, chunks, lse)
    plan = _forward_plans.get(key)
    if plan is not None:
        return plan
    if chunks > 1:
        plan = _SplitLaunch(call, chunks, device_id, out, lse)
    else:
        cc, smem_limit = device_limits(device_id)
        ragged = _ragged_mode(call)
        choice = _dispatch.forward_kernel(call, cc, smem_limit, kernel, tiles, ragged)
        if choice.prepare:  # operands prepared per call (tile images), then the kernel
            plan = _prepared_plan(call, choice, out, lse)
        else:
            launch, loop = _forward_plan(call, choice, out, lse)
            if choice.magnitudes is not None:  # every launch after its magnitudes kernel
                launch = _MagnitudesLaunch(call, choice, launch, out, lse)
            plan = launch if loop is None else LaunchLoop(launch, loop)
    if len(_forward_plans) >= _MAX_PLANS:
        _forward_plans.clear()
    _forward_plans[key] = plan
    return plan


#: Repeated calls: the signature of a CuPy call whose arguments were validated and whose
#: launch plan read them in place -> (out shape, dtype, lse shape and dtype or None, plan,
#: spans). The signature holds everything validation and dispatch read: the arrays' type,
#: shapes, strides, dtypes and devices (q, k, v, and mask, bias, out, device key lengths
#: and page table when given), where q, k, v start within 16 bytes, the scalar arguments
#: as given (window sides with their types, since (1.0, 2) is refused where (1, 2) is not)
#: and the environment variables that choose a family or the sources; so a call that
#: matches one needs neither. Device key lengths and tables are never read on the host
#: (the kernels clip their values), so their values are no part of it.
_repeated: dict = {}
#: the plans run by the long way of a call whose signature is being learnt (per thread):
#: a list of (plan, slot pointers) while :func:`remember` is open, else absent
_recorded = threading.local()


@dataclasses.dataclass(frozen=True)
class Unseen:
    """A call eligible for the short way whose signature is not known yet: its key and the
    arrays of its nine slots as given (out, lse: None), for :func:`remember`."""
    key: tuple
    given: tuple


def repeated_call(q, k, v, mask, bias, window, scale, causal, softcap, return_lse, precision,
                  out=None, k_lengths=None, block_table=None):
    """The result of ``attention(q, k, v, ...)`` by a known signature's plan; an
    :class:`Unseen` for a call that may take the short way once its long way (run under
    :func:`remember`) has planned it; None for a call that never does (NumPy arrays, host
    key lengths or tables, an argument that is not hashable, another current device). A
    given ``out`` is part of the signature (shape, strides, dtype, device); that it
    overlaps no input is checked per call, on its addresses."""
    cupy = loaded_cupy()
    if cupy is None:  # nothing has imported CuPy: q is no cupy.ndarray
        return None
    ndarray = cupy.ndarray
    if type(q) is not ndarray or type(k) is not ndarray or type(v) is not ndarray:
        return None
    given = [q, k, v, out, None, mask, bias, k_lengths, block_table]
    extra, pointers = [], []
    for x in given[3:]:
        if x is None:
            extra.append(None)
            pointers.append(0)
            continue
        if type(x) is not ndarray:
            return None
        extra.append((x.shape, x.strides, x.dtype, x.data.device_id))
        pointers.append(x.data.ptr)
    if window is not None:
        if type(window) is not tuple:
            return None
        window_key = tuple((type(side), side) for side in window)
    else:
        window_key = None
    qd, kd, vd = q.data, k.data, v.data
    device = qd.device_id
    key = (q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides,
           v.dtype, device, kd.device_id, vd.device_id, qd.ptr % 16, kd.ptr % 16, vd.ptr % 16,
           *extra, window_key, type(scale), scale, type(causal), causal,
           type(softcap), softcap, type(return_lse), return_lse, precision,
           os.environ.get("CUATTN_KERNEL"), os.environ.get("CUATTN_KERNEL_DIR"))
    try:
        entry = _repeated.get(key)
    except TypeError:  # an unhashable argument: the long way
        return None
    if cupy.cuda.runtime.getDevice() != device:
        return None  # another device is current: the long way enters q's
    if entry is None:
        return Unseen(key, tuple(given))
    out_shape, dtype, lse_shape, lse_dt, launch, spans = entry
    if out is None:
        out = ndarray(out_shape, dtype)
    else:
        at = out.data.ptr
        lo, hi = at + spans[0][0], at + spans[0][1]
        for x, (x_lo, x_hi) in zip([q, k, v] + [x for x in given[5:] if x is not None],
                                   spans[1]):
            ptr = x.data.ptr
            if ptr + x_lo < hi and lo < ptr + x_hi:
                return None  # the long way names the overlap
    # the lse where the plan writes one (key lengths always do), returned if asked for
    lse = None if lse_shape is None else ndarray(lse_shape, lse_dt)
    launch([qd.ptr, kd.ptr, vd.ptr, out.data.ptr, 0 if lse is None else lse.data.ptr,
            *pointers[2:]], cupy.cuda.get_current_stream().ptr)
    return (out, lse) if return_lse else out


class remember:
    """Around the long way of an :class:`Unseen` call (``unseen``; None: nothing to
    learn): records the plans it runs; :meth:`keep` then keeps the signature where exactly
    one plan ran and it read the call's own arrays in place (its slot pointers are the
    given arrays', out's and lse's), so that repeating it cannot skip a conversion or a
    copy."""

    def __init__(self, unseen: Unseen | None):
        self.unseen, self.runs, self.outer = unseen, None, None

    def __enter__(self):
        if self.unseen is not None:
            self.outer = getattr(_recorded, "runs", None)
            self.runs = _recorded.runs = []
        return self

    def __exit__(self, *exc):
        if self.unseen is not None:
            # a call inside another's long way: its plans count for the outer call as well
            _recorded.runs = self.outer
            if self.outer is not None:
                self.outer.extend(self.runs)

    def keep(self, call: AttentionCall, out, lse) -> None:
        """Keep the signature of the call the long way ran (validated ``call``; the ``out``
        and ``lse`` it returned)."""
        if self.unseen is None or self.runs is None or len(self.runs) != 1:
            return
        plan, pointers = self.runs[0]
        given = list(self.unseen.given)
        if given[3] is None:
            given[3] = out
        given[4] = lse
        if [0 if x is None else x.data.ptr for x in given] != pointers:
            return
        if len(_repeated) >= _MAX_PLANS:
            _repeated.clear()
        # a given out's address range against the inputs', per call: their spans from the
        # first element (fixed by the signature), and out's
        inputs = [x for i, x in enumerate(self.unseen.given) if i not in (3, 4)
                  and x is not None]
        spans = None if self.unseen.given[3] is None else (
            byte_span(out), [byte_span(x) for x in inputs])
        _repeated[self.unseen.key] = (
            call.out_shape, call.dtype, None if lse is None else lse.shape,
            None if lse is None else lse.dtype, plan, spans)


def forward(call: AttentionCall, kernel: str | None = None, tiles=None, split: bool = True,
            lse=None):
    """out and lse of a validated CuPy call; ``kernel`` forces a family (tests) and
    ``tiles`` overrides the dispatch table's tile sizes (sweeps); a call that would leave
    most SMs idle runs in key chunks, and query groups that share their keys run as the
    rows of one batch entry (``cuattn._split``), unless ``split`` is False or a family or
    tiles are forced. ``lse``: an array of the call's lse shape and dtype (a view, say) to
    write the lse into, for a call with ``return_lse``."""
    return _run(call, kernel, tiles, split, lse)[:2]


def _run(call: AttentionCall, kernel, tiles, split: bool, lse=None):
    """(out, lse, plan) of :func:`forward`: plan is the kept plan (:func:`_plan`) that ran
    the call, with the call's own pointers, or None where nothing ran (no rows)."""
    cupy = call.xp
    device_id = call.q.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return _run(call, kernel, tiles, split, lse)
    chunks = 1
    if split and kernel is None and tiles is None:
        # query groups as rows: each block reads its keys once for the whole group (its
        # lse folds too: a given lse must take the folded rows' view)
        result = _split.run_folded(
            call, lambda folded, target=None: _run(folded, None, None, True, target), lse)
        if result is not None:
            return result
        if call.seqlen_q and call.seqlen_k:
            chunks = _split.split_count(call, sm_count(device_id))
    # cupy.ndarray rather than cupy.empty: the same allocation, one Python call less
    out = call.out if call.out is not None else cupy.ndarray(call.out_shape, call.dtype)
    if lse is None and call.return_lse:
        lse = cupy.ndarray(call.lse_shape, lse_dtype(call.dtype))
    if call.seqlen_q == 0 or 0 in call.batch_shape:
        return out, lse, None
    plan = _plan(call, device_id, kernel, tiles, out, lse, chunks)
    pointers = [0 if x is None else x.data.ptr for x in _forward_arrays(call, out, lse)]
    plan(pointers, cupy.cuda.get_current_stream().ptr)
    runs = getattr(_recorded, "runs", None)
    if runs is not None:  # a signature being learnt (remember)
        runs.append((plan, pointers))
    return out, lse, plan


#: streams per device on which the dense parts of a packed or key-length call run side by
#: side (:func:`forward_parts`)
PART_STREAMS = 4
_part_streams: dict = {}  # device id -> its PART_STREAMS streams


def forward_parts(parts) -> None:
    """Run the dense parts of one validated CuPy call, each ``(call, lse)`` writing its
    part of the call's out (``call.out``) and of its lse, side by side: in turn on
    PART_STREAMS streams that first wait for the current stream's work so far, and which
    the current stream then waits for. Parts with few blocks (short sequences, one batch
    entry of a key length) so overlap; the current stream sees one call."""
    if len(parts) < 2:
        for part, lse in parts:
            forward(part, lse=lse)
        return
    cupy = parts[0][0].xp
    device = parts[0][0].q.data.device_id
    if cupy.cuda.runtime.getDevice() != device:
        with cupy.cuda.Device(device):
            return forward_parts(parts)
    streams = _part_streams.get(device)
    if streams is None:
        streams = _part_streams[device] = [cupy.cuda.Stream(non_blocking=True)
                                           for _ in range(PART_STREAMS)]
    current = cupy.cuda.get_current_stream()
    forked = current.record()
    for stream in streams:
        stream.wait_event(forked)
    for i, (part, lse) in enumerate(parts):
        with streams[i % len(streams)]:
            forward(part, lse=lse)
    for stream in streams:
        current.wait_event(stream.record())


class _SplitLaunch:
    """The plan of a call in key chunks (``cuattn._split``), called as a Launch with the
    call's nine pointers: new buffers for the partial results (CuPy's pool, on the stream
    of the launches, so reused only after the merge that reads them), the plans of the two
    part calls over offsets of q, k, v and those buffers, then the merge into out and lse
    (a new lse where the call returns none). A mask or bias is read in place, in chunks
    with the keys; key lengths in place too, each part shifting them to its chunks."""

    def __init__(self, call: AttentionCall, n: int, device_id: int, out, lse):
        cupy = call.xp
        outs, lses = _split.buffers(call, n)
        if lse is None:  # the layout of the scratch lse of each call
            lse = cupy.ndarray(call.lse_shape, lses.dtype)
        bases = _forward_arrays(call, outs, lses)
        self._parts = []
        for part, part_lse in _split.parts(call, n, outs, lses):
            arrays = _forward_arrays(part, part.out, part_lse)
            plan = _plan(part, device_id, None, None, part.out, part_lse, 1)
            self._parts.append((plan, [None if x is None else x.data.ptr - b.data.ptr
                                       for x, b in zip(arrays, bases)]))
        self._merge = stacked_plan(outs, lses, out, lse)
        self._shapes = (outs.shape, outs.dtype, lses.shape, lses.dtype, lse.shape)
        self._ndarray = cupy.ndarray

    def __call__(self, pointers, stream_ptr: int) -> None:
        outs_shape, dtype, lses_shape, lse_dt, lse_shape = self._shapes
        outs, lses = self._ndarray(outs_shape, dtype), self._ndarray(lses_shape, lse_dt)
        q, k, v, out, lse, mask, bias, lengths, table = pointers
        if not lse:
            scratch = self._ndarray(lse_shape, lse_dt)
            lse = scratch.data.ptr
        bases = (q, k, v, outs.data.ptr, lses.data.ptr, mask, bias, lengths, table)
        for plan, offsets in self._parts:
            plan([0 if o is None else b + o for b, o in zip(bases, offsets)], stream_ptr)
        self._merge(out, lse, outs.data.ptr, lses.data.ptr, stream_ptr)
