"""mpiflow's package and mpi4py in one program (tests/python.rs): whichever initialises MPI
first, the other uses it, and MPI is finalised once, at exit. `mpi4py-first` imports
mpi4py (which initialises MPI) before mpiflow.init(); `mpiflow-first` the other way round.
Each rank prints one JSON line."""
import json
import os
import sys

import numpy as np

order = sys.argv[1]
if order == "mpi4py-first":
    from mpi4py import MPI
    import mpiflow

    mpiflow.init()
else:
    import mpiflow

    mpiflow.init()
    from mpi4py import MPI

world = MPI.COMM_WORLD
ours = mpiflow.allreduce(np.full(4, mpiflow.rank() + 1, np.float64))
theirs = world.allreduce(world.Get_rank() + 1)
# One write: the ranks' lines reach mpirun's output whole.
os.write(1, (json.dumps({"rank": mpiflow.rank(), "mpi4py_rank": world.Get_rank(),
                  "size": mpiflow.size(), "mpi4py_size": world.Get_size(),
                  "ours": ours.tolist(), "theirs": theirs}) + "\n").encode())
