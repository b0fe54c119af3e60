"""A worker's training session over variables whose gradients the program computes."""
import types as _types

import numpy as _np

from . import _native
from ._native import rank


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
    asynchronously with `sync=False`; the ps tasks call `mpiflow.join()`; with
    `transport="rma"` over one-sided MPI windows, where every task, the ps tasks too,
    makes the session with the same variables and settings, and a ps task's constructor
    serves until the workers end: `is_worker` is then False), "allreduce"
    (synchronous replicas: the gradients summed over the workers, each applying the
    update), "local" (one process). The chief's `variables` are the job's initial values,
    unless `checkpoint_dir` holds a checkpoint, which every mode restores; the chief
    checkpoints every `checkpoint_every` steps (and `checkpoint_secs`), and at close.
    Training stops at `steps`, at a non-finite loss or gradient (an error on every
    worker), at `request_stop()`, or at a stop signal with `stop_on_signal` (then
    `mpiflow.Stopped`, after a checkpoint). An error ends the session on every worker.

    `tables` (modes "ps" and "hybrid"): embedding tables the ps tasks hold, `{name:
    (rows, width)}`, of any number of rows (a row exists once touched, made from `seed`);
    `pull_rows` and `push_rows` reach them, updated by `sparse_optimizer` ("sgd",
    "adagrad", "lazy_adam") at `sparse_lr` as each push arrives. Mode "hybrid" (Persia's
    design): the tables on the ps tasks (which call `mpiflow.join()`), the variables
    replicated on the workers and summed by allreduce among them every step, as in
    "allreduce"; its checkpoints hold the variables and the rows that exist. With
    `transport="rma"` the tables are in the ps tasks' one-sided windows and a step's
    `push_rows` go with its `push_pull`: summed over the workers and applied once per step,
    or with `sync=False` added into the rows as each comes (sparse "sgd" only); each ps
    holds at most `window_rows` rows of a table, and a worker pushes at most `push_rows`
    rows of a table to one ps in a step (synchronous: its staging area there).
    """

    def __init__(self, variables, mode="ps", *, transport="p2p", sync=True,
                 replicas_to_aggregate=None,
                 optimizer="sgd", lr=0.01, momentum=0.9, steps=1000, seed=1,
                 log_every=100, checkpoint_dir=None, checkpoint_every=0,
                 checkpoint_secs=None, keep_checkpoints=5, stop_on_signal=False,
                 peer_timeout=60.0, name="python", tables=None, sparse_optimizer="adagrad",
                 sparse_lr=0.05, window_rows=1 << 21, push_rows=4096):
        names = list(variables)
        tables = dict(tables or {})
        self._tables = {n: i for i, n in enumerate(tables)}
        settings = _settings(
            mode=mode, transport=transport, sync=sync, replicas_to_aggregate=replicas_to_aggregate,
            optimizer=optimizer, lr=float(lr), momentum=float(momentum), steps=int(steps),
            seed=int(seed), log_every=int(log_every),
            checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
            checkpoint_every=int(checkpoint_every), checkpoint_secs=checkpoint_secs,
            keep_checkpoints=int(keep_checkpoints), stop_on_signal=bool(stop_on_signal),
            peer_timeout=float(peer_timeout), name=str(name),
            tables=[(str(n), int(r), int(d)) for n, (r, d) in tables.items()],
            sparse_optimizer=str(sparse_optimizer), sparse_lr=float(sparse_lr),
            window_rows=int(window_rows), push_rows=int(push_rows))
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
                self.refuse(why)
                raise ValueError(f"mpiflow: rank {rank()}: {why}")
            grads = [grads[n] for n in self._s.names]
        self._s.push_pull(list(grads), float(loss), int(samples))
        return self.params

    def pull_rows(self, table, ids):
        """Rows `ids` (integers) of embedding table `table` (a name of `tables`), from the
        ps tasks that hold them (a row is made on its first touch): a float32 array of
        shape `(len(ids), width)`."""
        return self._s.pull_rows(self._table(table), _np.ascontiguousarray(ids, _np.uint64))

    def push_rows(self, table, ids, grads, scale=1.0):
        """Table `table`'s gradient `grads` (a row per id of `ids`, the ids distinct)
        times `scale`: the ps tasks apply it to those rows at once with the session's
        `sparse_optimizer` (over one-sided windows, with the next `push_pull`, the step's
        pushes as one)."""
        self._s.push_rows(self._table(table), _np.ascontiguousarray(ids, _np.uint64),
                          _np.ascontiguousarray(grads, _np.float32), float(scale))

    def pull_rows_ahead(self, rows):
        """Asks for the rows of `rows` ({table: ids}) now, to be taken by
        `land_rows(rows)` with the same tables and ids: over messages the ps tasks serve
        them while this worker computes. They hold the updates the ps tasks had applied
        when asked: ask ahead only for rows this worker's pending push does not touch
        (the next batch's ids that the current batch lacks; the others after the push)."""
        self._s.pull_rows_ahead(self._wanted(rows))

    def land_rows(self, rows):
        """The rows `pull_rows_ahead(rows)` asked for: {table: float32 array of shape
        `(len(ids), width)`}."""
        return dict(zip(rows, self._s.land_rows(self._wanted(rows))))

    def _wanted(self, rows):
        return [(self._table(t), _np.ascontiguousarray(ids, _np.uint64))
                for t, ids in rows.items()]

    def _table(self, name):
        if name not in self._tables:
            raise KeyError(f"mpiflow: rank {rank()}: no embedding table {name!r} "
                           f"(the session has {list(self._tables)})")
        return self._tables[name]

    def refuse(self, why):
        """Ends the session on every worker at this step for this worker's finding `why`
        (a corrupt batch, a missing gradient): the others raise an `mpiflow.Error` naming
        this task, as for a bad array; the caller raises its own error."""
        self._s.refuse(str(why))

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
        if not self._s.is_worker:
            return None  # a ps task of one-sided training: its part ended with it
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
    def is_worker(self):
        """False on a ps task of one-sided training (its session served and ended)."""
        return self._s.is_worker

    @property
    def data_shard(self):
        """(shares, this worker's share) each global batch is cut into."""
        return self._s.data_shard

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        # Closed on a normal exit; after an exception the session is dropped, which ends
        # it as abandoned (the ps tasks tell the other workers).
        if kind is None and self._s.is_worker and not self._s.ended:
            self.close()
