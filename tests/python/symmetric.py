"""Symmetric memory from Python, under mpirun (tests/python.rs runs it at 2, 3 and 4
ranks): `mpiflow.symmetric` arrays of every dtype, zeroed and page-aligned; their
allreduce (every op, odd sizes, in place, into another, a view) the same bits as the same
call on plain arrays and on every rank; a rank of plain memory among symmetric ones, and
ranks asking for different shapes, each one exception on every rank, after which the
collectives still work; nothing left in /dev/shm. Each rank prints one JSON line."""
import json
import os

import numpy as np

import mpiflow
from _data import data  # this directory is the script's: on its path

mpiflow.init()
rank, size = mpiflow.rank(), mpiflow.size()
checks, failures, errors = 0, [], {}


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


def same_everywhere(a):
    """The bytes of `a` are the same on every rank."""
    bits = np.ascontiguousarray(a).view(np.int32 if a.itemsize == 4 else np.int64)
    every = mpiflow.allgather(bits)
    return all(np.array_equal(every[0], b) for b in every)


for dtype in (np.float32, np.float64, np.int32, np.int64):
    for n in (7, 1000, 100003):
        s = mpiflow.symmetric((n,), dtype)
        check(s.dtype == dtype and s.shape == (n,), f"{dtype} {n}: type")
        check(not s.any(), f"{dtype} {n}: zeros")
        check(s.ctypes.data % 4096 == 0, f"{dtype} {n}: page-aligned")
        out = mpiflow.symmetric_like(s)
        for op in ("sum", "mean", "min", "max"):
            plain = mpiflow.allreduce(data(rank, n, dtype), op=op)
            s[:] = data(rank, n, dtype)
            mpiflow.allreduce(s, op=op, out=s)
            check(np.array_equal(s, plain), f"{op} {dtype} {n}: in place")
            check(same_everywhere(s), f"{op} {dtype} {n}: bits")
            s[:] = data(rank, n, dtype)
            mpiflow.allreduce(s, op=op, out=out)
            check(np.array_equal(out, plain), f"{op} {dtype} {n}: into")
            check(np.array_equal(s, data(rank, n, dtype)), f"{op} {dtype} {n}: input kept")

# A view at the same place on every rank; a 2-d array.
m = mpiflow.symmetric((6, 5), "float64")
m[:] = rank
mid = m[2:4]
mpiflow.allreduce(mid, op="sum", out=mid)
want = np.full((6, 5), float(rank))
want[2:4] = sum(range(size))
check(np.array_equal(m, want), "view")

# The last rank's array is plain memory: one exception on every rank, then it works.
x = mpiflow.symmetric(1024)
y = x if rank != size - 1 else np.zeros(1024, np.float32)
try:
    mpiflow.allreduce(y, out=y)
except mpiflow.Error as e:
    errors["plain"] = str(e)
x[:] = 1
mpiflow.allreduce(x, out=x)
check(np.all(x == size), "after the plain one")

# Ranks asking for different shapes: one exception on every rank.
try:
    mpiflow.symmetric((10 + (rank == 1),), "float32")
except mpiflow.Error as e:
    errors["shapes"] = str(e)
x[:] = 2
mpiflow.allreduce(x, out=x)
check(np.all(x == 2 * size), "after the shapes")

del s, out, m, mid, x, y
mpiflow.barrier()
left = [f for f in os.listdir("/dev/shm") if f.startswith(f"mpiflow-sym-{os.getpid()}-")]
# One write of the whole line (print writes its end apart, and ranks' lines would mix).
os.write(1, (json.dumps({"rank": rank, "size": size, "checks": checks, "failures": failures,
                         "errors": errors, "left": left}) + "\n").encode())
