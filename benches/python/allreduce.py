"""mpiflow's allreduce from Python against mpi4py's (`comm.Allreduce` of NumPy buffers,
the library's own MPI_Allreduce), side by side in one job: for each size, the two paths
alternate, `--reps` calls each per round, best round of `--rounds` per path (the VM's slow
phases only slow a round). Rank 0 prints one JSON line per size. Two pairs: out of place
(`allreduce(a, out=out)` against `Allreduce(a, out)`) and in place (`allreduce(b, out=b)`
against `Allreduce(MPI.IN_PLACE, b)`, `b` zeros so that repeated sums stay finite), each
form against its like. A third pair runs on arrays in symmetric memory
(`mpiflow.symmetric`), both libraries in place on the same arrays. `--forms` picks pairs.

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
p.add_argument("--forms", default="out,inplace,symmetric",
               help="comma-separated: out (out of place), inplace, symmetric")
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


# Per form: mpiflow's call and mpi4py's on the same buffers.
FORMS = {
    "out": (lambda b: mpiflow.allreduce(b["a"], out=b["out"]),
            lambda b: comm.Allreduce(b["a"], b["out"], op=MPI.SUM)),
    "inplace": (lambda b: mpiflow.allreduce(b["z"], out=b["z"]),
                lambda b: comm.Allreduce(MPI.IN_PLACE, b["z"], op=MPI.SUM)),
    "symmetric": (lambda b: mpiflow.allreduce(b["s"], out=b["s"]),
                  lambda b: comm.Allreduce(MPI.IN_PLACE, b["s"], op=MPI.SUM)),
}
forms = args.forms.split(",")
unknown = set(forms) - set(FORMS)
if unknown:
    raise SystemExit(f"allreduce.py: unknown forms {sorted(unknown)} (out, inplace, symmetric)")

for size in [1 << k for k in range(10, 25, 2)]:  # bytes: 1 KiB .. 16 MiB
    n = size // dtype.itemsize
    # In place, zeros, so that repeated sums stay finite.
    bufs = {"a": np.full(n, rank + 1, dtype), "out": np.empty(n, dtype),
            "z": np.zeros(n, dtype)}
    if "symmetric" in forms:
        bufs["s"] = mpiflow.symmetric(n, dtype)
    reps = max(2, min(args.reps, (1 << 24) // size * 4))
    paths = {}
    for form in forms:
        ours, theirs = FORMS[form]
        paths[(form, "mpiflow")] = lambda ours=ours: ours(bufs)
        paths[(form, "mpi4py")] = lambda theirs=theirs: theirs(bufs)
    best = {k: float("inf") for k in paths}
    for _ in range(args.rounds):
        for name, call in paths.items():
            best[name] = min(best[name], timed(call, reps))
    # Every form right: the sum of every rank's rank + 1.
    want = comm.Get_size() * (comm.Get_size() + 1) / 2
    ok = True
    for form in forms:
        if form != "out":
            bufs["z" if form == "inplace" else "s"][:] = rank + 1
        FORMS[form][0](bufs)
        got = bufs["out" if form == "out" else "z" if form == "inplace" else "s"]
        ok = ok and bool(np.all(got == want))
    if rank == 0:
        line = {"bytes": size, "ranks": comm.Get_size(), "dtype": args.dtype}
        for form in forms:
            ours, theirs = best[(form, "mpiflow")], best[(form, "mpi4py")]
            line[f"{form}_mpiflow_us"] = round(ours * 1e6, 2)
            line[f"{form}_mpi4py_us"] = round(theirs * 1e6, 2)
            line[f"{form}_mpi4py_over_mpiflow"] = round(theirs / ours, 2)
        line["right"] = ok
        print(json.dumps(line), flush=True)
