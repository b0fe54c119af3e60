"""mpiflow from Python: the cluster and mpiflow's collectives on NumPy arrays.

    import numpy as np, mpiflow
    mpiflow.init()                      # under mpirun or srun (or with TF_CONFIG)
    g = np.ones(1000, np.float32)
    mpiflow.allreduce(g, op="mean", out=g)

Arrays are float32, float64, int32 or int64. The in-place forms write into C-contiguous,
writeable arrays; the returning forms copy first. Every call agrees with the other ranks
on what it is, so ranks that call different things get one `mpiflow.Error` each, naming
both calls, never a hang. The GIL is released while communicating.
"""
import atexit as _atexit
import json as _json

import numpy as _np

from . import _native
from ._native import Error, barrier, local_rank, rank, size

__all__ = [
    "Error",
    "init",
    "rank",
    "size",
    "local_rank",
    "cluster",
    "allreduce",
    "allreduce_many",
    "broadcast",
    "barrier",
]


def init(args=None, ps=0, chief=False, evaluator=False):
    """Initialises MPI and resolves this process's task, as `mpiflow spec` does: from the
    seeds' flags in `args` (--ps_hosts ... --job_name ... --task_index), else TF_CONFIG,
    else the MPI job's ranks mapped onto `ps` ps tasks (and a chief or an evaluator if
    asked). Calling it again does nothing."""
    _native.init(list(args or []), ps, chief, evaluator)


# MPI is finalised once, at exit (MPI_Finalize waits for every rank).
_atexit.register(_native.finalize)


def cluster():
    """This task's view of the cluster, as TF_CONFIG gives it: a dict with "cluster" (job
    name to a list of "host:port"), "task" ({"type": ..., "index": ...}) and
    "is_chief"."""
    return _json.loads(_native.cluster_json())


def allreduce(array, op="sum", out=None):
    """The reduction of `array` over every rank by `op` ("sum", "mean", "min", "max"),
    the same bits on every rank. Into `out` if given (`out=array` reduces in place), else
    into a new array."""
    if out is None:
        out = _np.array(array, copy=True, order="C")
    elif out is not array:
        _np.copyto(out, array)
    _native.allreduce_(out, op)
    return out


def allreduce_many(arrays, op="sum", inplace=False):
    """`allreduce` of every array of the list, fused: one message per dtype (the arrays
    of a dtype back to back), as mpiflow reduces a model's gradients. In place if
    `inplace` (each array C-contiguous and writeable), else into new arrays; the list."""
    outs = list(arrays) if inplace else [_np.array(a, copy=True, order="C") for a in arrays]
    _native.allreduce_many_(outs, op)
    return outs


def broadcast(array, root=0):
    """Copies rank `root`'s `array` into every rank's `array`, in place; returns it."""
    _native.broadcast_(array, root)
    return array
