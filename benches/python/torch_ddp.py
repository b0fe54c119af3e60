"""PyTorch training by mpiflow.torch.DistributedOptimizer against DistributedDataParallel
(gloo) and, where it is installed (benches/python/horovod.sh), Horovod's
DistributedOptimizer (over the same Open MPI), side by side in one job: the same model,
torch compute and batch (64 samples per rank, one intra-op thread per rank), the paths
alternating rounds of `--steps` steps, best round of `--rounds` per path; each library at
its defaults. Rank 0 prints one JSON line.

    mpirun -np 2 PYTHON benches/python/torch_ddp.py --model mlp   # 784-1024-1024-10
    mpirun -np 4 PYTHON benches/python/torch_ddp.py --model cnn   # conv32-pool-conv64-pool-fc128-fc10
    mpirun -np 2 PYTHON benches/python/torch_ddp.py --model mlp --paths horovod

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
p.add_argument("--paths", default="mpiflow,ddp,horovod",
               help="which to time, of mpiflow, ddp, horovod (where installed): Horovod's "
                    "background thread keeps cycling while the others run, so its column "
                    "is fairest from jobs of its own, alternating with the others'")
args = p.parse_args()
hvd = None
if "horovod" in args.paths.split(","):
    try:
        import horovod.torch as hvd
    except ImportError:
        pass

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
paths = {k: v for k, v in paths.items() if k in args.paths.split(",")}
if hvd is not None:
    hvd.init()  # on the MPI mpiflow.init() started
    theirs = net()
    paths["horovod"] = (theirs, hvd.DistributedOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.01),
        named_parameters=theirs.named_parameters()))
for m, o in paths.values():
    step(m, o)  # warm-up
best = {k: float("inf") for k in paths}
for _ in range(args.rounds):
    for name, (m, o) in paths.items():
        best[name] = min(best[name], timed(m, o))

def equal_everywhere(model):
    """Every rank's parameters of `model` the same (its replicas trained alike)."""
    flat = torch.cat([q.detach().flatten() for q in model.parameters()]).numpy()
    return bool((mpiflow.allgather(flat) == flat).all())


same = {k: equal_everywhere(m) for k, (m, _) in paths.items()}
if rank == 0:
    rate = {k: args.steps * args.batch * size / v for k, v in best.items()}
    line = {"model": args.model, "ranks": size, "batch_per_rank": args.batch,
            "steps": args.steps, "rounds": args.rounds}
    for k in paths:
        line[f"{k}_samples_per_s"] = round(rate[k], 1)
    for k in paths:
        if k != "mpiflow" and "mpiflow" in paths:
            line[f"mpiflow_over_{k}"] = round(rate["mpiflow"] / rate[k], 2)
    line["replicas_equal"] = same
    os.write(1, (json.dumps(line) + "\n").encode())
dist.destroy_process_group()
