"""mpiflow from Python: the cluster, mpiflow's collectives on NumPy arrays, and training
sessions over its parameter servers and allreduce.

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
import types as _types

import numpy as _np

from . import _native
from ._native import Error, Stopped, barrier, catch_stop_signals, join, load_dataset, local_rank, rank, size

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
    "join",
    "catch_stop_signals",
    "load_dataset",
    "Session",
    "Stopped",
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


def _settings(**kw):
    return _types.SimpleNamespace(**kw)


class Session:
    """A worker's training session over named float32 arrays (the variables), whose loss
    and gradients the program computes: each step it hands them in with `push_pull`, and
    mpiflow updates the parameters in the session's mode and writes them back into
    `params`.

        sess = mpiflow.Session({"w": w0, "b": b0}, mode="ps", optimizer="sgd", lr=0.1,
                               steps=1000, checkpoint_dir="ckpt")
        while not sess.should_stop():
            loss, grads = my_model(sess.params, batch(sess.global_step))
            sess.push_pull(grads, loss, samples=len(batch))
        sess.close()

    Modes: "ps" (the ps tasks hold the variables and apply the updates, synchronously
    over every worker, or `replicas_to_aggregate` of them with the others as backups, or
    asynchronously with `sync=False`; the ps tasks call `mpiflow.join()`), "allreduce"
    (synchronous replicas: the gradients summed over the workers, each applying the
    update), "local" (one process). The chief's `variables` are the job's initial values,
    unless `checkpoint_dir` holds a checkpoint, which every mode restores; the chief
    checkpoints every `checkpoint_every` steps (and `checkpoint_secs`), and at close.
    Training stops at `steps`, at a non-finite loss or gradient (an error on every
    worker), at `request_stop()`, or at a stop signal with `stop_on_signal` (then
    `mpiflow.Stopped`, after a checkpoint). An error ends the session on every worker.
    """

    def __init__(self, variables, mode="ps", *, sync=True, replicas_to_aggregate=None,
                 optimizer="sgd", lr=0.01, momentum=0.9, steps=1000, seed=1,
                 log_every=100, checkpoint_dir=None, checkpoint_every=0,
                 checkpoint_secs=None, keep_checkpoints=5, stop_on_signal=False,
                 peer_timeout=60.0, name="python"):
        names = list(variables)
        settings = _settings(
            mode=mode, sync=sync, replicas_to_aggregate=replicas_to_aggregate,
            optimizer=optimizer, lr=float(lr), momentum=float(momentum), steps=int(steps),
            seed=int(seed), log_every=int(log_every),
            checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
            checkpoint_every=int(checkpoint_every), checkpoint_secs=checkpoint_secs,
            keep_checkpoints=int(keep_checkpoints), stop_on_signal=bool(stop_on_signal),
            peer_timeout=float(peer_timeout), name=str(name))
        self._s = _native.Session(names, [variables[n] for n in names], settings)
        self.params = dict(zip(self._s.names, self._s.arrays))

    def push_pull(self, grads, loss, samples):
        """One step: `grads` (a dict by variable name, or a list in the variables' order;
        float32 arrays of their variables' shapes) of the mean `loss` over this worker's
        `samples` samples. Returns `params`, updated in place."""
        if isinstance(grads, dict):
            missing = [n for n in self._s.names if n not in grads]
            extra = [n for n in grads if n not in self.params]
            if missing or extra:
                why = (f"push_pull: gradients missing for {missing}, given for unknown "
                       f"variables {extra}")
                self._s.refuse(why)  # every worker hears of it, as of a bad array
                raise ValueError(f"mpiflow: rank {rank()}: {why}")
            grads = [grads[n] for n in self._s.names]
        self._s.push_pull(list(grads), float(loss), int(samples))
        return self.params

    def should_stop(self):
        return self._s.should_stop()

    def request_stop(self):
        """Stop after the next step (every worker where they step together)."""
        self._s.request_stop()

    def save(self):
        """A checkpoint of this step now (every worker calls it); its path or None."""
        return self._s.save()

    def close(self):
        """Ends the session (the last checkpoint written, the ps tasks told): a dict of
        the global step, the first step, the last loss, samples per second and the
        newest checkpoint."""
        step, first, loss, rate, ckpt = self._s.close()
        return {"global_step": step, "first_step": first, "loss": loss,
                "samples_per_sec": rate, "checkpoint": ckpt}

    @property
    def global_step(self):
        return self._s.global_step

    @property
    def loss(self):
        """The last step's loss (over every worker's samples where they step together)."""
        return self._s.loss

    @property
    def is_chief(self):
        return self._s.is_chief

    @property
    def data_shard(self):
        """(shares, this worker's share) each global batch is cut into."""
        return self._s.data_shard

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        # Closed on a normal exit; after an exception the session is dropped, which ends
        # it as abandoned (the ps tasks tell the other workers).
        if kind is None and not self._s.ended:
            self.close()
