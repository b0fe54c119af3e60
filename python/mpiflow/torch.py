"""PyTorch on mpiflow: gradients reduced by mpiflow's fused allreduce while the backward
pass runs, and a parameter server for PyTorch modules.

    import mpiflow, mpiflow.torch as mt
    mpiflow.init()
    model = Net()
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters())
    mt.broadcast_parameters(model.state_dict(), root=0)
    for x, y in batches:                  # this rank's share of each global batch
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # buckets are reduced as their gradients are ready
        opt.step()                        # waits for the last bucket, then steps

    opt = mt.PsOptimizer(model.named_parameters(), mode="ps", lr=0.1)  # ps tasks: mpiflow.join()
    ...
        loss.backward(); opt.step(loss.item(), samples=len(y))

Only CPU tensors (float32) take part, as NumPy views of their memory (no copies).
"""
try:
    import torch as _torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mpiflow.torch needs PyTorch (pip install torch; benches/python/torch-venv.sh "
        "installs it in a virtual environment outside the repository)"
    ) from e

from . import collectives as _coll
from .session import Session as _Session

__all__ = ["DistributedOptimizer", "PsOptimizer", "broadcast_parameters"]


def _view(tensor, what):
    """The NumPy view of a CPU, contiguous tensor's memory (written in place)."""
    if tensor.device.type != "cpu":
        raise TypeError(f"mpiflow.torch: {what} is on {tensor.device}; only CPU tensors take part")
    if not tensor.is_contiguous():
        raise ValueError(f"mpiflow.torch: {what} is not contiguous")
    return tensor.detach().numpy()


def broadcast_parameters(params, root=0):
    """Copies rank `root`'s values into every rank's, in place: a `state_dict()`, or
    `named_parameters()` (pairs of name and tensor), one broadcast per tensor in name
    order."""
    items = sorted(params.items() if hasattr(params, "items") else params, key=lambda kv: kv[0])
    for name, t in items:
        if t.numel() == 0:
            continue
        _coll.broadcast(_view(t, f"'{name}'"), root)


class DistributedOptimizer:
    """Wraps `optimizer`: each parameter's gradient joins a bucket as soon as the backward
    pass has accumulated it (a post-accumulate-grad hook), and each full bucket (about
    `bucket_bytes`) is reduced by mpiflow's fused allreduce on the collectives' thread
    while the backward pass goes on; `step()` waits for the last and steps the wrapped
    optimizer. The gradients are averaged over the ranks (`op="mean"`) or summed ("sum").
    Every rank must build the same model: the order the gradients become ready in, and so
    the buckets, are then the same on every rank (a difference raises `mpiflow.Error` on
    every rank, naming both sides)."""

    def __init__(self, optimizer, named_parameters, op="mean", bucket_bytes=1 << 20):
        self.optimizer = optimizer
        self.op = op
        self.bucket_bytes = int(bucket_bytes)
        self._names = {}
        self._bucket, self._bucket_size, self._handles = [], 0, []
        self._hooks = []
        for name, p in named_parameters:
            if not p.requires_grad:
                continue
            self._names[p] = name
            self._hooks.append(p.register_post_accumulate_grad_hook(self._ready))

    def _ready(self, p):
        g = _view(p.grad, f"the gradient of '{self._names[p]}'")
        self._bucket.append(g)
        self._bucket_size += g.nbytes
        if self._bucket_size >= self.bucket_bytes:
            self._flush()

    def _flush(self):
        if self._bucket:
            self._handles.append(_coll.allreduce_many_async(self._bucket, self.op, inplace=True))
        self._bucket, self._bucket_size = [], 0

    def synchronize(self):
        """Waits until every gradient of this backward pass is reduced."""
        self._flush()
        handles, self._handles = self._handles, []
        for h in handles:
            h.wait()

    def step(self, closure=None):
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


class PsOptimizer:
    """A parameter server for a PyTorch module: its parameters become the variables of an
    `mpiflow.Session` (`mode` "ps": the ps tasks hold them and apply `optimizer`, sync or
    async; "allreduce" or "local" likewise), the chief's values the job's start (or its
    newest checkpoint). The module's parameters are the session's arrays from then on (no
    copies): `step(loss, samples)` pushes the gradients and pulls the new values into
    them. Keywords go to `mpiflow.Session` (lr, steps, sync, replicas_to_aggregate,
    checkpoint_dir, checkpoint_every, ...)."""

    def __init__(self, named_parameters, mode="ps", **session):
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self._params = named
        self.session = _Session({n: _view(p, f"'{n}'") for n, p in named}, mode, **session)
        with _torch.no_grad():
            for n, p in named:
                p.data = _torch.from_numpy(self.session.params[n])

    def step(self, loss, samples):
        """One step with the module's gradients of the mean `loss` over `samples`."""
        grads = {}
        for n, p in self._params:
            grads[n] = _view(p.grad, f"the gradient of '{n}'") if p.grad is not None else None
        missing = [n for n, g in grads.items() if g is None]
        if missing:
            self.session.refuse(f"step: no gradient for {missing} (call backward() first)")
            raise ValueError(f"mpiflow.torch: step: no gradient for {missing}")
        self.session.push_pull(grads, float(loss), int(samples))

    def zero_grad(self, set_to_none=True):
        for _, p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def should_stop(self):
        return self.session.should_stop()

    @property
    def global_step(self):
        return self.session.global_step

    def close(self):
        return self.session.close()
