"""mpiflow's collectives on NumPy arrays.

Arrays are float32, float64, int32 or int64. The in-place forms write into C-contiguous,
writeable arrays; the returning forms (and `out=`) only read their input. Every call
agrees with the other ranks on what it is, so ranks that call different things get one
`mpiflow.Error` each, naming both calls, never a hang. The GIL is released while communicating.

Each call is queued, in call order, to the collectives' own thread; the `_async` forms
return its `Handle` at once (`wait()` returns the result or raises the call's error; the
arrays must not be touched until then), the others wait for it. Every rank must issue the
same calls in the same order, as with MPI.
"""
import numpy as _np

from . import _native


def _into(array, out):
    """The output and the input of a reduction of `array` into `out`: `out` alone where it
    is `array` (in place), else `array` too (read where it is, or copied into `out`)."""
    if out is None:
        array = _np.asarray(array)
        out = _np.empty(array.shape, array.dtype)
    return (out, None) if out is array else (out, array)


def allreduce_async(array, op="sum", out=None):
    """`allreduce`, not waiting: its Handle (`wait()` returns the reduced array)."""
    out, source = _into(array, out)
    return _native.allreduce_(out, op, source=source)


def allreduce(array, op="sum", out=None):
    """The reduction of `array` over every rank by `op` ("sum", "mean", "min", "max"),
    the same bits on every rank. Into `out` if given (`out=array` reduces in place), else
    into a new array; `array` itself is only read."""
    out, source = _into(array, out)
    return _native.allreduce_(out, op, blocking=True, source=source)


def allreduce_many_async(arrays, op="sum", inplace=False):
    """`allreduce_many`, not waiting: its Handle (`wait()` returns the list)."""
    return _native.allreduce_many(arrays, op, inplace, False)


# `allreduce_many(arrays, op="sum", inplace=False)`: made in Rust (see its docstring).
allreduce_many = _native.allreduce_many


def broadcast_async(array, root=0):
    """`broadcast`, not waiting: its Handle (`wait()` returns the array)."""
    return _native.broadcast_(array, root)


def broadcast(array, root=0):
    """Copies rank `root`'s `array` into every rank's `array`, in place; returns it."""
    return _native.broadcast_(array, root, blocking=True)


def _gathered(array):
    a = _np.asarray(array)
    return a, _np.empty((_native.size(),) + a.shape, dtype=a.dtype)


def allgather_async(array):
    """`allgather`, not waiting: its Handle (`wait()` returns the gathered array)."""
    return _native.allgather_(*_gathered(array))


def allgather(array):
    """Every rank's `array` (the same shape and dtype on each), stacked in rank order: a
    new array of shape `(size, *array.shape)`."""
    return _native.allgather_(*_gathered(array), blocking=True)


def barrier():
    """Waits until every rank called `barrier()`."""
    _native.barrier_(blocking=True)


def symmetric(shape, dtype="float32"):
    """A NumPy array of zeros in symmetric memory: memory every rank of the node maps, so
    that `allreduce` of an array in it (in place, or into another such array; a view of
    either at the same place on every rank) reduces straight from and into every rank's
    array, with no copy through a buffer. Collective: every rank calls it with the same
    shape and dtype (else an exception on every rank). Where the ranks span nodes it is a
    plain array (`numpy.zeros`). The memory goes when the array and its views do."""
    dtype = _np.dtype(dtype)
    shape = tuple(int(d) for d in _np.atleast_1d(_np.asarray(shape, dtype=_np.int64)))
    # A bad shape still takes part (allocating nothing), so that ranks that differ all
    # raise, none waiting; raised here once they agree.
    bad = any(d < 0 for d in shape)
    nbytes = 0 if bad else int(_np.prod(shape, dtype=_np.int64)) * dtype.itemsize
    raw = _native.symmetric_(nbytes, f"shape={shape} dtype={dtype.str}")
    if bad:
        raise ValueError(f"mpiflow.symmetric: negative dimensions in {shape}")
    if raw is None:
        return _np.zeros(shape, dtype)
    return raw.view(dtype).reshape(shape)


def symmetric_like(array):
    """`symmetric(array.shape, array.dtype)`: zeros, not a copy of `array`."""
    a = _np.asarray(array)
    return symmetric(a.shape, a.dtype)

