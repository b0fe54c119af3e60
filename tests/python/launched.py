"""A program on mpiflow's Python package, as `mpiflow launch` starts it (tests/mpirun_launch.rs):
every task initialises the package (its cluster from the TF_CONFIG launch exported),
allreduces over the whole job and prints one JSON line; a ps task then waits for ever, as
TensorFlow's server.join() does, and the job still ends when the workers are done."""
import json
import os
import threading

import numpy as np

import mpiflow

mpiflow.init()
c = mpiflow.cluster()
total = mpiflow.allreduce(np.ones(5, np.float64) * (mpiflow.rank() + 1))
# One write: the ranks' lines reach mpirun's output whole.
os.write(1, (json.dumps({"rank": mpiflow.rank(), "size": mpiflow.size(), "task": c["task"],
                  "ps": c["cluster"].get("ps", []), "sum": total.tolist()}) + "\n").encode())
if c["task"]["type"] == "ps":
    threading.Event().wait()
