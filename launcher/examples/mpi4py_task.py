"""A Python program that itself uses MPI (mpi4py), for `mpiflow launch` (tests, README).

It initialises MPI as its rank, sums the ranks over MPI.COMM_WORLD and prints one line:
    rank R size N sum S task JOB:INDEX tf_config yes|no
the task as TF_CONFIG gives it, or, with --legacy-flags, as the seeds' flags do
(--job_name, --task_index). With --ps-joins a ps task then waits for ever without
finalising MPI, as TensorFlow's server.join() does; with --exit N worker 1 exits N.
"""
import argparse
import json
import os
import sys
import threading

from mpi4py import MPI


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ps-joins", action="store_true")
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--job_name")
    p.add_argument("--task_index", type=int)
    p.add_argument("--ps_hosts")
    p.add_argument("--worker_hosts")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    total = comm.allreduce(rank + 1, op=MPI.SUM)
    tf_config = os.environ.get("TF_CONFIG")
    if args.job_name is not None:
        job, index = args.job_name, args.task_index
    elif tf_config:
        task = json.loads(tf_config)["task"]
        job, index = task["type"], task["index"]
    else:
        job, index = "none", "none"
    yes = "yes" if tf_config else "no"
    line = f"rank {rank} size {size} sum {total} task {job}:{index} tf_config {yes}\n"
    # One write: the ranks' lines reach mpirun's output whole, never interleaved.
    os.write(1, line.encode())
    if args.ps_joins and job == "ps":
        threading.Event().wait()
    if job == "worker" and index == 1 and args.exit:
        sys.exit(args.exit)


main()
