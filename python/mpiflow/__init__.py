"""mpiflow from Python: the cluster, mpiflow's collectives on NumPy arrays, and training
sessions over its parameter servers and allreduce.

    import numpy as np, mpiflow
    mpiflow.init()                      # under mpirun or srun (or with TF_CONFIG)
    g = np.ones(1000, np.float32)
    mpiflow.allreduce(g, op="mean", out=g)

The collectives (`mpiflow.collectives`) take NumPy arrays; `Session`
(`mpiflow.session`) trains variables whose gradients the program computes, over the ps
tasks or the allreduce.
"""
import atexit as _atexit
import json as _json

from . import _native
from ._native import Error, Handle, Stopped, catch_stop_signals, join, load_dataset
from ._native import local_rank, rank, size
from .collectives import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    allreduce_many,
    allreduce_many_async,
    barrier,
    broadcast,
    broadcast_async,
    symmetric,
    symmetric_like,
)
from .session import Session

__all__ = [
    "Error",
    "init",
    "rank",
    "size",
    "local_rank",
    "cluster",
    "allreduce",
    "allreduce_async",
    "allreduce_many",
    "allreduce_many_async",
    "broadcast",
    "broadcast_async",
    "allgather",
    "allgather_async",
    "barrier",
    "symmetric",
    "symmetric_like",
    "Handle",
    "join",
    "catch_stop_signals",
    "load_dataset",
    "Session",
    "Stopped",
]


def init(args=None, ps=0, chief=False, evaluator=False, comm=None):
    """Initialises MPI and resolves this process's task, as `mpiflow spec` does: from the
    seeds' flags in `args` (--ps_hosts ... --job_name ... --task_index), else TF_CONFIG,
    else the MPI job's ranks mapped onto `ps` ps tasks (and a chief or an evaluator if
    asked). `comm`: an mpi4py intracommunicator whose ranks are the job instead of every
    rank's (mpiflow works on a duplicate of it; mpi4py finalises MPI). Calling it again
    does nothing."""
    handle = None
    if comm is not None:
        py2f = getattr(comm, "py2f", None)
        if py2f is None:
            raise TypeError("mpiflow.init: comm must be an mpi4py communicator "
                            f"(MPI.Comm), not {type(comm).__name__}")
        handle = py2f()
    _native.init(list(args or []), ps, chief, evaluator, handle)


# MPI is finalised once, at exit (MPI_Finalize waits for every rank).
_atexit.register(_native.finalize)


def cluster():
    """This task's view of the cluster, as TF_CONFIG gives it: a dict with "cluster" (job
    name to a list of "host:port"), "task" ({"type": ..., "index": ...}) and
    "is_chief"."""
    return _json.loads(_native.cluster_json())
