#!/usr/bin/env python3
"""PyTorch DDP (gloo backend) on the same task as `mpiflow train --mode allreduce`.

`--model mlp`: MLP 784-1024-1024-10 with ReLU. `--model cnn`: mpiflow's built-in CNN on
28x28x1 images (conv 5x5x16 pad 2, ReLU, max-pool 2, conv 5x5x32 pad 2, ReLU, max-pool 2,
dense 128, ReLU, dense 10). Adam lr 0.003, softmax cross-entropy, `--batch` samples per
rank per step, one intra-op thread per rank, each rank pinned to its own core when there
are enough cores (as mpiflow pins its ranks). Random data of the same shape. Prints one
line: `ddp ranks N samples/s X` (after warm-up steps, timed on rank 0 between barriers).
"""
import argparse
import os
import socket
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    ncpu = os.cpu_count() or 1
    if args.ranks <= ncpu:
        os.sched_setaffinity(0, {rank % ncpu})
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(1)
    if args.model == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
        shape = (args.batch, 1, 28, 28)
    else:
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        shape = (args.batch, 784)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.003)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    x = torch.rand(*shape, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step():
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - t
    if rank == 0:
        sps = args.ranks * args.batch * args.steps / elapsed
        os.write(1, f"ddp ranks {args.ranks} samples/s {sps:.0f}\n".encode())
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    args = p.parse_args()
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args, free_port()), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    sys.exit(main())
