"""A PyTorch CNN on Fashion-MNIST, trained on mpiflow: by its allreduce
(`mpiflow.torch.DistributedOptimizer`) or by its parameter servers
(`mpiflow.torch.PsOptimizer`).

    mpirun -np 2 PYTHON examples/python/torch_fashion.py --mode allreduce
    mpirun -np 3 PYTHON examples/python/torch_fashion.py --mode ps          # rank 0: the ps task
    mpirun -np 3 PYTHON examples/python/torch_fashion.py --mode ps --async

The model: conv3x3-32, pool, conv3x3-64, pool, fc128, fc10. Each worker takes its share
of every global batch (`--batch`, default 64 per worker); the chief prints `accuracy X`
on the 10,000 held-out images at the end. PYTHON: an environment with PyTorch and
mpiflow's package (benches/python/torch-venv.sh makes one).
"""
import argparse
import os

import numpy as np
import torch

import mpiflow
import mpiflow.torch as mt

p = argparse.ArgumentParser()
p.add_argument("--mode", default="allreduce", choices=["allreduce", "ps"])
p.add_argument("--async", dest="is_async", action="store_true")
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--batch", type=int, default=64, help="samples per worker and step")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--data", default="fashion-mnist")
args = p.parse_args()

mpiflow.init(ps=1 if args.mode == "ps" else 0)
torch.set_num_threads(1)
task = mpiflow.cluster()["task"]


def say(line):
    os.write(1, (line + "\n").encode())


def cnn(classes):
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 7 * 7, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, classes))


def images(x):
    """mpiflow's samples (n, 28, 28, 1), channels last, as PyTorch's (n, 1, 28, 28)."""
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


@torch.no_grad()
def accuracy(model, x, y):
    model.eval()
    right = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                for i in range(0, len(y), 1000))
    return right / len(y)


def main():
    if task["type"] == "ps":
        mpiflow.join()
        return
    (x, y), (x_test, y_test) = mpiflow.load_dataset(args.data)
    x, y = images(x), torch.from_numpy(y.astype(np.int64))
    x_test, y_test = images(x_test), torch.from_numpy(y_test.astype(np.int64))
    model = cnn(int(y.max()) + 1)
    if args.mode == "allreduce":
        workers, me = mpiflow.size(), mpiflow.rank()
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr,
                                                      momentum=0.9), model.named_parameters())
        mt.broadcast_parameters(model.state_dict(), root=0)
        chief, steps = me == 0, range(args.steps)
    else:
        opt = mt.PsOptimizer(model.named_parameters(), "ps", sync=not args.is_async,
                             optimizer="momentum", lr=args.lr, momentum=0.9,
                             steps=args.steps, log_every=200)
        workers, me = opt.session.data_shard
        chief, steps = opt.session.is_chief, iter(lambda: opt.should_stop(), True)
    for step in steps:
        if args.mode == "ps":
            step = opt.global_step
        # This step's global batch, the same on every worker; this worker's share.
        rows = np.random.default_rng([11, step]).choice(len(y), args.batch * workers,
                                                        replace=False)
        mine = torch.from_numpy(rows[me * args.batch:(me + 1) * args.batch])
        model.train()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        if args.mode == "ps":
            opt.step(loss.item(), samples=len(mine))
        else:
            opt.step()
    if args.mode == "ps":
        opt.close()
    if chief:
        say(f"accuracy {accuracy(model, x_test, y_test):.4f}")


main()
