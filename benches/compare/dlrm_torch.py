#!/usr/bin/env python3
"""PyTorch's DLRM by DistributedDataParallel (gloo) with `EmbeddingBag(sparse=True)`, on
the task of `mpiflow train --model dlrm --data synthetic-ctr:...`, for
`benches/compare/dlrm.sh`.

    mpirun -np 4 PYTHON dlrm_torch.py --features 8 --rows 100000 --dim 16 --batch 1024

The model is mpiflow's DLRM: a bottom MLP (ReLU hidden layers of `--bottom` widths, then
`--dim` outputs and ReLU) over 13 dense features, one `EmbeddingBag(rows, dim, mode="sum",
sparse=True)` per categorical feature, the dot product of every pair of [z, e_1, ...],
a top MLP (`--top` widths) to one logit, logistic loss. Dense layers by Adam at 0.003,
tables by Adagrad at `--sparse-lr` (the optimizers that take sparse gradients); every
rank holds every table, DDP allreduces the dense gradients and the tables' sparse ones.
`--batch` is the global batch (each rank its share). The data: Zipf(1.05) ids folded into
each table, standard-normal dense features, random labels, made before the clock starts
(mpiflow makes its samples as it trains, inside its time). One intra-op thread per rank.

Rank 0 prints `torch samples/s X steps N`: the global batch times the steps from the
`--warmup`-th on, over their wall time.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--features", type=int, default=8)
p.add_argument("--rows", type=int, default=100000)
p.add_argument("--dim", type=int, default=16)
p.add_argument("--bottom", default="64")
p.add_argument("--top", default="64")
p.add_argument("--batch", type=int, default=1024)
p.add_argument("--steps", type=int, default=300)
p.add_argument("--warmup", type=int, default=30)
p.add_argument("--sparse-lr", type=float, default=0.05)
p.add_argument("--port", type=int, default=29531)
args = p.parse_args()

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                        world_size=size)
DENSE = 13


def mlp(widths, relu_last):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths) or relu_last:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class Dlrm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        widths = lambda s: [int(w) for w in s.split(",") if w]
        self.bottom = mlp([DENSE] + widths(args.bottom) + [args.dim], True)
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
            for _ in range(args.features))
        k = args.features + 1
        self.pairs = torch.triu_indices(k, k, offset=1)
        self.top = mlp([args.dim + k * (k - 1) // 2] + widths(args.top) + [1], False)

    def forward(self, dense, ids):
        z = self.bottom(dense)
        e = [t(ids[:, f:f + 1]) for f, t in enumerate(self.tables)]
        t = torch.stack([z] + e, dim=1)
        dots = torch.bmm(t, t.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([z, dots], dim=1)).squeeze(1)


torch.manual_seed(1)
model = torch.nn.parallel.DistributedDataParallel(Dlrm())
dense_params = [p for n, p in model.named_parameters() if ".tables." not in n]
sparse_params = [p for n, p in model.named_parameters() if ".tables." in n]
dense_opt = torch.optim.Adam(dense_params, lr=0.003)
sparse_opt = torch.optim.Adagrad(sparse_params, lr=args.sparse_lr)
loss_fn = torch.nn.BCEWithLogitsLoss()

share = args.batch // size
rng = np.random.default_rng(rank + 1)
batches = []
for _ in range(32):
    ids = (rng.zipf(1.05, size=(share, args.features)) - 1) % args.rows
    batches.append((torch.tensor(rng.standard_normal((share, DENSE)), dtype=torch.float32),
                    torch.tensor(ids, dtype=torch.int64),
                    torch.tensor(rng.integers(0, 2, share), dtype=torch.float32)))

start = None
for step in range(args.steps):
    if step == args.warmup:
        dist.barrier()
        start = time.perf_counter()
    dense, ids, labels = batches[step % len(batches)]
    dense_opt.zero_grad()
    sparse_opt.zero_grad()
    loss = loss_fn(model(dense, ids), labels)
    loss.backward()
    dense_opt.step()
    sparse_opt.step()
dist.barrier()
secs = time.perf_counter() - start
if rank == 0:
    steps = args.steps - args.warmup
    print(f"torch samples/s {share * size * steps / secs:.0f} steps {steps}", flush=True)
dist.destroy_process_group()
