"""mpiflow.torch under mpirun (tests/python.rs, where PyTorch is installed):

    torch_optim.py allreduce   # every rank a worker
    torch_optim.py ps          # rank 0 a ps task (mpiflow.join()), the others workers

- broadcast_parameters: models built from different seeds end equal to rank 0's.
- DistributedOptimizer (allreduce) and PsOptimizer (ps, synchronous): each worker trains a
  small MLP on its share of one batch for 20 steps with SGD; the parameters equal the same
  model trained on the whole batch in one process within 1e-4 on every worker (the
  allreduce in several buckets, reduced while the backward pass runs).

Each rank prints one JSON line.
"""
import json
import os
import sys

import numpy as np
import torch

import mpiflow
import mpiflow.torch as mt

MODE = sys.argv[1]
mpiflow.init(ps=1 if MODE == "ps" else 0)
task = mpiflow.cluster()["task"]
out = {"rank": mpiflow.rank(), "task": f"{task['type']}:{task['index']}"}
torch.set_num_threads(1)
LR, STEPS, BATCH = 0.1, 20, 24


def net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.ReLU(),
        torch.nn.Linear(16, 3))


g = torch.Generator().manual_seed(5)
X = torch.randn(BATCH, 10, generator=g)
Y = torch.arange(BATCH) % 3


def local():
    """The whole batch in one process: what every worker must end with."""
    m = net(1)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(X), Y).backward()
        opt.step()
    return m


@torch.no_grad()
def worst(m, want):
    return max(float(((p - q).abs() / (1 + q.abs())).max())
               for p, q in zip(m.parameters(), want.parameters()))


if MODE == "allreduce":
    # Different starting values on every rank, made equal by the broadcast.
    m = net(1 if mpiflow.rank() == 0 else 100 + mpiflow.rank())
    mt.broadcast_parameters(m.state_dict(), root=0)
    start = torch.cat([p.detach().flatten() for p in m.parameters()]).numpy()
    gathered = mpiflow.allgather(start)
    out["broadcast_equal"] = bool((gathered == gathered[0]).all())
    n, i = mpiflow.size(), mpiflow.rank()
    rows = slice(i * BATCH // n, (i + 1) * BATCH // n)
    opt = mt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR), m.named_parameters(),
                                  bucket_bytes=1024)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(X[rows]), Y[rows]).backward()
        opt.step()
    out["worst"] = worst(m, local())
elif task["type"] == "ps":
    mpiflow.join()
else:
    m = net(1)
    opt = mt.PsOptimizer(m.named_parameters(), "ps", optimizer="sgd", lr=LR, steps=STEPS,
                         log_every=0)
    n, i = opt.session.data_shard
    rows = slice(i * BATCH // n, (i + 1) * BATCH // n)
    while not opt.should_stop():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(X[rows]), Y[rows])
        loss.backward()
        opt.step(loss.item(), samples=len(Y[rows]))
    out["step"] = opt.close()["global_step"]
    out["worst"] = worst(m, local())
os.write(1, (json.dumps(out) + "\n").encode())
