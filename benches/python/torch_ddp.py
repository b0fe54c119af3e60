"""PyTorch training by mpiflow.torch.DistributedOptimizer against DistributedDataParallel
(gloo), side by side in one job: the same model, torch compute and batch (64 samples per
rank, one intra-op thread per rank), the two paths alternating rounds of `--steps` steps,
best round of `--rounds` per path. Rank 0 prints one JSON line.

    mpirun -np 2 PYTHON benches/python/torch_ddp.py --model mlp   # 784-1024-1024-10
    mpirun -np 4 PYTHON benches/python/torch_ddp.py --model cnn   # conv32-pool-conv64-pool-fc128-fc10

PYTHON: the environment benches/python/torch-venv.sh makes.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import mpiflow
import mpiflow.torch as mt

p = argparse.ArgumentParser()
p.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
p.add_argument("--steps", type=int, default=30)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--port", type=int, default=29517)
args = p.parse_args()

mpiflow.init()
rank, size = mpiflow.rank(), mpiflow.size()
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                        world_size=size)


def net():
    torch.manual_seed(1)
    if args.model == "mlp":
        return torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(784, 1024), torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 7 * 7, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10))


g = torch.Generator().manual_seed(rank)
x = torch.randn(args.batch, 1, 28, 28, generator=g)
y = torch.randint(0, 10, (args.batch,), generator=g)

ddp = torch.nn.parallel.DistributedDataParallel(net())
ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
ours = net()
our_opt = mt.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01),
                                  ours.named_parameters())


def step(model, opt):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def timed(model, opt):
    mpiflow.barrier()
    t = time.perf_counter()
    for _ in range(args.steps):
        step(model, opt)
    mpiflow.barrier()
    return time.perf_counter() - t


paths = {"mpiflow": (ours, our_opt), "ddp": (ddp, ddp_opt)}
for m, o in paths.values():
    step(m, o)  # warm-up
best = {k: float("inf") for k in paths}
for _ in range(args.rounds):
    for name, (m, o) in paths.items():
        best[name] = min(best[name], timed(m, o))
# Both trained alike: every rank's parameters the same.
flat = torch.cat([q.detach().flatten() for q in ours.parameters()]).numpy()
same = bool((mpiflow.allgather(flat) == flat).all())
if rank == 0:
    rate = {k: args.steps * args.batch * size / v for k, v in best.items()}
    os.write(1, (json.dumps({
        "model": args.model, "ranks": size, "batch_per_rank": args.batch,
        "steps": args.steps, "rounds": args.rounds,
        "mpiflow_samples_per_s": round(rate["mpiflow"], 1),
        "ddp_samples_per_s": round(rate["ddp"], 1),
        "mpiflow_over_ddp": round(rate["mpiflow"] / rate["ddp"], 2),
        "replicas_equal": same,
    }) + "\n").encode())
dist.destroy_process_group()
