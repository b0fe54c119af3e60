"""mpiflow.init(comm=...) with an mpi4py communicator (tests/python.rs): the world split
into the even and the odd ranks, each half a job of its own: mpiflow's ranks, size and
cluster are the half's, its allreduce sums only the half, and a ps session trains within
each half at once. Something that is no communicator is a TypeError, MPI.COMM_NULL an mpiflow.Error,
after which init works. Each rank prints one
JSON line."""
import json
import os

import numpy as np
from mpi4py import MPI

import mpiflow

world = MPI.COMM_WORLD
half = world.Split(world.Get_rank() % 2, world.Get_rank())
refused = []
for bad, kind in (("world", TypeError), (MPI.COMM_NULL, mpiflow.Error)):
    try:
        mpiflow.init(comm=bad)
        refused.append(None)
    except kind as e:
        refused.append(str(e))
mpiflow.init(ps=1, comm=half)
summed = mpiflow.allreduce(np.full(3, world.Get_rank() + 1, np.float32))
cluster = mpiflow.cluster()
out = {"rank": world.Get_rank(), "half": world.Get_rank() % 2, "mpiflow_rank": mpiflow.rank(),
       "size": mpiflow.size(), "half_size": half.Get_size(), "sum": summed.tolist(),
       "task": f"{cluster['task']['type']}:{cluster['task']['index']}",
       "jobs": {k: len(v) for k, v in cluster["cluster"].items()}, "refused": refused}
# A ps session in each half at once: 20 synchronous steps towards a target.
target = np.arange(8, dtype=np.float32)
if cluster["task"]["type"] == "ps":
    mpiflow.join()
else:
    sess = mpiflow.Session({"w": np.zeros(8, np.float32)}, mode="ps", lr=0.25, steps=20)
    while not sess.should_stop():
        w = sess.params["w"]
        sess.push_pull({"w": w - target}, float(((w - target) ** 2).mean()), samples=1)
    out["step"] = sess.close()["global_step"]
    out["error"] = float(np.abs(sess.params["w"] - target).max())
os.write(1, (json.dumps(out) + "\n").encode())
