"""`mpiflow.allreduce_many` from Python against the same call from Rust, side by side in
one job: a list of `--count` float32 arrays (in place) whose total is each size from 4 KiB
to 64 MiB; the Rust arm runs the very job the Python call makes (its agreement and its
fused reduction, `_native.allreduce_many_from_rust`) in a loop with no Python between
calls. The arms alternate rounds of `--reps` calls; best round of `--rounds` per arm.
Rank 0 prints one JSON line per size.

    mpirun -np 2 target/venv/bin/python benches/python/allreduce_many.py
"""
import argparse
import json
import os
import time

import numpy as np

import mpiflow
from mpiflow import _native

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=7)
p.add_argument("--count", type=int, default=8)
args = p.parse_args()

mpiflow.init()
rank = mpiflow.rank()


def from_python(arrays, reps):
    mpiflow.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        mpiflow.allreduce_many(arrays, inplace=True)
    return (time.perf_counter() - t) / reps


def from_rust(arrays, reps):
    mpiflow.barrier()
    return _native.allreduce_many_from_rust(arrays, "sum", reps)


for total in [1 << k for k in range(12, 27, 2)]:  # 4 KiB .. 64 MiB
    n = total // 4 // args.count
    arrays = [np.ones(n, np.float32) for _ in range(args.count)]
    reps = max(3, min(200, (1 << 26) // total))
    best = {"python": float("inf"), "rust": float("inf")}
    for r in range(args.rounds):
        arms = [("python", from_python), ("rust", from_rust)]
        for name, arm in arms if r % 2 == 0 else arms[::-1]:
            for a in arrays:
                a.fill(1.0)
            best[name] = min(best[name], arm(arrays, reps))
    for a in arrays:
        a.fill(1.0)
    mpiflow.allreduce_many(arrays, inplace=True)
    right = all(bool(np.all(a == mpiflow.size())) for a in arrays)
    if rank == 0:
        os.write(1, (json.dumps({
            "bytes": total, "arrays": args.count, "ranks": mpiflow.size(), "reps": reps,
            "python_us": round(best["python"] * 1e6, 2),
            "rust_us": round(best["rust"] * 1e6, 2),
            "rust_over_python": round(best["rust"] / best["python"], 3),
            "right": right,
        }) + "\n").encode())
