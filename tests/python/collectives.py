"""mpiflow's collectives from Python, under mpirun (tests/python.rs runs it at 2, 3 and
4 ranks): every op and dtype at odd sizes against the reduction each rank computes of the
arrays every rank holds, the same bits on every rank, the in-place and returning forms,
broadcast, allgather, barrier, non-blocking calls in flight together; then bad input, each one exception on every rank, after which the
collectives still work. Each rank prints one JSON line of what it checked."""
import json
import os
import sys

import numpy as np

import mpiflow
from _data import data  # this directory is the script's: on its path

mpiflow.init()
rank, size = mpiflow.rank(), mpiflow.size()
checks, failures = 0, []


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


def expected(n, dtype, op):
    stack = np.stack([data(r, n, dtype) for r in range(size)])
    if op == "sum":
        return stack.astype(np.float64).sum(axis=0)
    if op == "mean":
        return stack.astype(np.float64).sum(axis=0) / size
    return getattr(stack, op)(axis=0).astype(np.float64)


for dtype in (np.float32, np.float64, np.int32, np.int64):
    for op in ("sum", "mean", "min", "max"):
        for n in (1, 7, 1000, 100003):
            mine = data(rank, n, dtype)
            got = mpiflow.allreduce(mine, op=op)
            check(got.dtype == dtype and got.shape == mine.shape, f"{op} {dtype} {n}: type")
            check(np.array_equal(mine, data(rank, n, dtype)), f"{op} {dtype} {n}: input kept")
            want = expected(n, dtype, op)
            if np.issubdtype(dtype, np.floating):
                tol = 1e-5 if dtype == np.float32 else 1e-12
                ok = np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * 50)
            elif op == "mean":
                ok = np.array_equal(got, np.trunc(want).astype(dtype))
            else:
                ok = np.array_equal(got, want.astype(dtype))
            check(ok, f"{op} {dtype} {n}: values")
            # The same bits on every rank: the result's bytes' spread is zero.
            bits = got.view(np.int32 if got.itemsize == 4 else np.int64).astype(np.int64)
            spread = mpiflow.allreduce(bits, "max") - mpiflow.allreduce(bits, "min")
            check(not spread.any(), f"{op} {dtype} {n}: same bits")
            # Read where it is (the input left alone) or reduced in place: the same bits.
            inplace = mine.copy()
            mpiflow.allreduce(inplace, op=op, out=inplace)
            check(got.tobytes() == inplace.tobytes(), f"{op} {dtype} {n}: as in place")

# In place, with a 2-D shape.
a = np.full((3, 5), rank + 1, dtype=np.float32)
out = mpiflow.allreduce(a, out=a)
check(out is a and np.all(a == size * (size + 1) / 2), "in place")

# Fused: a list of several dtypes and shapes, as one allreduce of each would give.
specs = [((3,), np.float32), ((2, 5), np.float64), ((1000,), np.float32), ((7,), np.int64)]
arrays = [data(rank, int(np.prod(sh)), dt).reshape(sh) for sh, dt in specs]
singles = [mpiflow.allreduce(a) for a in arrays]
for op in ("sum", "max"):
    fused = mpiflow.allreduce_many(arrays, op=op)
    singles = [mpiflow.allreduce(a, op=op) for a in arrays]
    for f, one, a in zip(fused, singles, arrays):
        same = np.allclose(f, one, rtol=1e-6) if f.dtype.kind == "f" else np.array_equal(f, one)
        check(same and f.shape == a.shape and f.dtype == a.dtype, f"fused {op} {a.dtype} {a.shape}")
inplace = [a.copy() for a in arrays]
back = mpiflow.allreduce_many(inplace, inplace=True)
check(all(b is i for b, i in zip(back, inplace)), "fused in place: the same arrays")
check(all(np.allclose(i, one) for i, one in zip(inplace, mpiflow.allreduce_many(arrays))),
      "fused in place: values")

# A list called on again is found by its arrays' memory and layout (its checks reused):
# new views of the same memory are found too; a change the call depends on is seen.
again = [np.full(6, rank + 1, np.float32), np.full((2, 2), rank + 1, np.int64)]
for k in range(3):
    for a in again:
        a.fill(rank + 1)
    mpiflow.allreduce_many([a.view() for a in again] if k == 2 else again, inplace=True)
    check(all(np.all(a == size * (size + 1) // 2) for a in again), f"fused again {k}")
again[0].shape = (2, 3)  # in place: the same memory, another shape
again[0].fill(1.0)
mpiflow.allreduce_many(again, inplace=True)
check(again[0].shape == (2, 3) and np.all(again[0] == size), "fused again, reshaped")
again[1].dtype = np.float64  # the same bytes read as float64
again[1].fill(0.5)
mpiflow.allreduce_many(again, inplace=True)
check(np.all(again[1] == 0.5 * size), "fused again, another dtype")

# Broadcast from the last rank.
b = np.full(11, rank, dtype=np.int64)
mpiflow.broadcast(b, root=size - 1)
check(np.all(b == size - 1), "broadcast")
mpiflow.barrier()

# Allgather: every rank's array in rank order, from a read-only input too.
g = mpiflow.allgather(np.arange(5, dtype=np.float64) + 10 * rank)
check(g.shape == (size, 5) and all(np.array_equal(g[r], np.arange(5) + 10 * r) for r in range(size)),
      "allgather")
ro = np.full((2, 3), rank, np.int32)
ro.flags.writeable = False
check(np.array_equal(mpiflow.allgather(ro)[:, 0, 0], np.arange(size)), "allgather, read-only 2-D")

# Non-blocking: several calls in flight at once complete in call order with the same
# results as the blocking calls; wait() twice returns the same array.
xs = [data(rank, n, np.float32) for n in (5, 100003, 17)]
handles = [mpiflow.allreduce_async(x, op="sum") for x in xs]
handles.append(mpiflow.allgather_async(np.full(3, rank, np.int64)))
handles.append(mpiflow.allreduce_many_async([x.copy() for x in xs], op="max"))
bb = np.full(4, rank, np.float64)
handles.append(mpiflow.broadcast_async(bb, root=0))
results = [h.wait() for h in handles]
for x, r in zip(xs, results):
    check(np.allclose(r, expected(len(x), np.float32, "sum"), rtol=1e-5, atol=1e-3), f"async {len(x)}")
check(np.array_equal(results[3][:, 0], np.arange(size)), "async allgather")
check(all(np.allclose(m, expected(len(x), np.float32, "max")) for m, x in zip(results[4], xs)),
      "async fused")
check(results[5] is bb and np.all(bb == 0) and handles[5].done(), "async broadcast")
check(handles[0].wait() is results[0], "wait twice")


def raises(kind, text, call):
    """`call` raises `kind` with `text` and this rank in its message; the message."""
    try:
        call()
    except kind as e:
        check(text in str(e) and f"rank {rank}" in str(e), f"{text}: {e}")
        return str(e)
    check(False, f"no {kind.__name__} for {text}")
    return None


# Into `out`: from a read-only input (read where it is), from a strided one and from
# another dtype (copied into out first, as numpy.copyto does); an out of another shape on
# one rank is one exception on every rank.
ro = np.full(1000, rank + 1, np.float32)
ro.flags.writeable = False
o = np.empty(1000, np.float32)
check(mpiflow.allreduce(ro, out=o) is o and np.all(o == size * (size + 1) / 2), "into out, read-only input")
strided = np.arange(2000, dtype=np.float32)[::2] + rank
check(np.array_equal(mpiflow.allreduce(strided, out=o), np.arange(0, 2000, 2) * size + size * (size - 1) / 2),
      "into out, strided input")
check(np.all(mpiflow.allreduce(np.full(1000, 0.5), out=o) == 0.5 * size), "into out, float64 input")
wrong = np.empty(999 if rank == size - 1 else 1000, np.float32)
said = raises(mpiflow.Error, "but rank", lambda: mpiflow.allreduce(np.ones(1000, np.float32), out=wrong))
check(said is not None, "into out of another shape")


def read_only():
    a = np.ones(4, np.float32)
    a.flags.writeable = False
    return a


def reshaped_on(r):
    """A list called on once; then, on rank `r` only, its first array reshaped in place."""
    xs = [np.ones(4, np.float32), np.ones(3, np.float64)]
    mpiflow.allreduce_many(xs, inplace=True)
    if rank == r:
        xs[0].shape = (2, 2)
    return xs


frozen_list = [np.ones(4, np.float32), np.ones(3, np.float64)]


def frozen():
    """`frozen_list` called on once (its values then `size`); then its first array made
    read-only."""
    mpiflow.allreduce_many(frozen_list, inplace=True)
    frozen_list[0].flags.writeable = False
    return frozen_list


mine_only = np.ones(4, np.float16 if rank == size - 1 else np.float32)
errors = {
    "dtype": raises(TypeError, "float16", lambda: mpiflow.allreduce(np.ones(4, np.float16))),
    "strides": raises(
        ValueError, "C-contiguous", lambda: mpiflow.broadcast(np.ones((4, 4), np.float32)[:, 1])
    ),
    "read-only": raises(ValueError, "read-only", lambda: mpiflow.broadcast(read_only())),
    "op": raises(ValueError, "none of", lambda: mpiflow.allreduce(np.ones(4, np.float32), op="prod")),
    "root": raises(ValueError, "no rank", lambda: mpiflow.broadcast(np.ones(2), root=size)),
    # One rank's array alone is bad: every rank hears of it, none waits.
    "one dtype": raises(mpiflow.Error, "but rank", lambda: mpiflow.allreduce(mine_only, out=mine_only)),
    "shape": raises(
        mpiflow.Error, "but rank", lambda: mpiflow.allreduce(np.ones(4 + (rank == 1), np.float32))
    ),
    # float32 in the other byte order on one rank: named "float32 [4] unsupported".
    "byte order": raises(
        mpiflow.Error, "unsupported", lambda: mpiflow.allreduce(np.ones(4, ">f4" if rank == 1 else "<f4"))
    ),
    "fused list": raises(
        mpiflow.Error, "but rank", lambda: mpiflow.allreduce_many([np.ones(3)] * (1 + (rank == 0)))
    ),
    # A list remembered from its last call, changed on one rank (its shape, its
    # flags) since: every rank hears of it; the read-only array is not written.
    "fused again, one reshaped": raises(
        mpiflow.Error, "but rank", lambda: mpiflow.allreduce_many(reshaped_on(0), inplace=True)
    ),
    "fused again, read-only": raises(
        ValueError, "read-only", lambda: mpiflow.allreduce_many(frozen(), inplace=True)
    ),
    "fused twice": raises(
        ValueError, "twice", lambda: (lambda x: mpiflow.allreduce_many([x, x], inplace=True))(np.ones(3))
    ),
    "fused not a list": raises(
        TypeError, "not a NumPy array", lambda: mpiflow.allreduce_many(3.5)
    ),
    "fused item": raises(
        TypeError, "not a NumPy array", lambda: mpiflow.allreduce_many([np.ones(2), [1.0]], inplace=True)
    ),
    # A bad array in a non-blocking call raises at wait(), after every rank agreed.
    "async dtype": raises(
        mpiflow.Error, "but rank",
        lambda: mpiflow.allreduce_async(mine_only, out=mine_only).wait(),
    ),
    "allgather shapes": raises(
        mpiflow.Error, "but rank", lambda: mpiflow.allgather(np.ones(2 + (rank == 0), np.float32))
    ),
    "order": raises(
        mpiflow.Error, "but rank",
        lambda: mpiflow.barrier() if rank == 0 else mpiflow.allreduce(np.ones(2, np.float64)),
    ),
}
check(np.all(frozen_list[0] == size) and np.all(frozen_list[1] == size), "read-only list not written")
# Still usable after every error.
check(np.all(mpiflow.allreduce(np.ones(3, np.float64)) == size), "usable after errors")
# One write of a line under 2 KiB, so that the ranks' lines reach mpirun's output whole
# (mpirun forwards longer output in pieces, which other ranks' lines can split). Every
# error's text was checked above; the ones the test reads across ranks go in the line.
shown = {k: errors[k] for k in ("one dtype", "order", "async dtype", "allgather shapes")}
os.write(1, (json.dumps({"rank": rank, "size": size, "checks": checks, "failures": failures,
                  "errors": shown, "task": mpiflow.cluster()["task"]}) + "\n").encode())
sys.exit(1 if failures else 0)
