"""mpiflow's allreduce from Python against mpi4py's (`comm.Allreduce` of NumPy buffers,
the library's own MPI_Allreduce), side by side in one job: for each size, the two paths
alternate, `--reps` calls each per round, best round of `--rounds` per path (the VM's slow
phases only slow a round). Rank 0 prints one JSON line per size. Two pairs: out of place
(`allreduce(a, out=out)` against `Allreduce(a, out)`) and in place (`allreduce(b, out=b)`
against `Allreduce(MPI.IN_PLACE, b)`, `b` zeros so that repeated sums stay finite), each
form against its like.

    mpirun -np 4 target/venv/bin/python benches/python/allreduce.py
"""
import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import mpiflow

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=7)
p.add_argument("--reps", type=int, default=20)
p.add_argument("--dtype", default="float32")
args = p.parse_args()

mpiflow.init()
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
dtype = np.dtype(args.dtype)


def timed(call, reps):
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - t) / reps


for size in [1 << k for k in range(10, 25, 2)]:  # bytes: 1 KiB .. 16 MiB
    n = size // dtype.itemsize
    a = np.full(n, rank + 1, dtype)
    out = np.empty_like(a)
    b = np.zeros(n, dtype)
    reps = max(2, min(args.reps, (1 << 24) // size * 4))
    paths = {
        "mpiflow": lambda: mpiflow.allreduce(a, out=out),
        "mpi4py": lambda: comm.Allreduce(a, out, op=MPI.SUM),
        "mpiflow_inplace": lambda: mpiflow.allreduce(b, out=b),
        "mpi4py_inplace": lambda: comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM),
    }
    best = {k: float("inf") for k in paths}
    for _ in range(args.rounds):
        for name, call in paths.items():
            best[name] = min(best[name], timed(call, reps))
    # Both right: the sum of every rank's rank + 1.
    want = comm.Get_size() * (comm.Get_size() + 1) / 2
    mpiflow.allreduce(a, out=out)
    b[:] = rank + 1
    mpiflow.allreduce(b, out=b)
    ok = bool(np.all(out == want)) and bool(np.all(b == want))
    if rank == 0:
        print(json.dumps({
            "bytes": size, "ranks": comm.Get_size(), "dtype": args.dtype,
            "mpiflow_us": round(best["mpiflow"] * 1e6, 2),
            "mpi4py_us": round(best["mpi4py"] * 1e6, 2),
            "mpi4py_over_mpiflow": round(best["mpi4py"] / best["mpiflow"], 2),
            "inplace_mpiflow_us": round(best["mpiflow_inplace"] * 1e6, 2),
            "inplace_mpi4py_us": round(best["mpi4py_inplace"] * 1e6, 2),
            "inplace_mpi4py_over_mpiflow": round(
                best["mpi4py_inplace"] / best["mpiflow_inplace"], 2),
            "right": ok,
        }), flush=True)
