#!/usr/bin/env python3
"""The seeds' TensorFlow 1 `trainer.py` pattern (ps/worker, between-graph replication), runnable
on TensorFlow 2 through `tf.compat.v1`, for `mpiflow launch --legacy-flags`:

    mpirun -np 3 mpiflow launch --ps 1 --legacy-flags -- python3 tf1_trainer.py --steps 200

Flags as in the seeds (`--ps_hosts --worker_hosts --job_name --task_index`, appended by
`--legacy-flags`). A ps task creates its server and calls `server.join()`, which never
returns; each worker trains a linear model on synthetic data under a
`MonitoredTrainingSession` with a `StopAtStepHook`, variables placed on the ps tasks by
`replica_device_setter`, then prints `worker N done at global step S`. Under mpiflow the
job ends when the workers are done (see `mpiflow launch --ps-lifetime`). Unlike the seeds'
sketch, each worker's session filters its devices to the ps tasks and itself: without
that, a worker that starts after another has finished waits for the finished one's server
forever (seen here under mpirun, with and without mpiflow, in 2 of 3 runs).
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


def main(flags):
    cluster = tf.train.ClusterSpec(
        {"ps": flags.ps_hosts.split(","), "worker": flags.worker_hosts.split(",")}
    )
    server = tf1.train.Server(cluster, job_name=flags.job_name, task_index=flags.task_index)
    if flags.job_name == "ps":
        print(f"ps {flags.task_index} serving", flush=True)
        server.join()
        return
    rng = np.random.default_rng(flags.task_index)
    true_w = np.arange(1, 11, dtype=np.float32).reshape(10, 1)
    with tf1.device(
        tf1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{flags.task_index}", cluster=cluster
        )
    ):
        x = tf1.placeholder(tf.float32, [None, 10])
        y = tf1.placeholder(tf.float32, [None, 1])
        w = tf1.get_variable("w", [10, 1], initializer=tf1.zeros_initializer())
        loss = tf1.reduce_mean(tf1.square(tf1.matmul(x, w) - y))
        global_step = tf1.train.get_or_create_global_step()
        train_op = tf1.train.AdagradOptimizer(0.5).minimize(loss, global_step=global_step)
    hooks = [tf1.train.StopAtStepHook(last_step=flags.steps)]
    step, last = 0, float("nan")
    with tf1.train.MonitoredTrainingSession(
        master=server.target,
        is_chief=flags.task_index == 0,
        checkpoint_dir=flags.checkpoint_dir if flags.task_index == 0 else None,
        hooks=hooks,
        # Only the ps tasks and this worker: a session that waits for every task's server
        # never starts once another worker has finished and gone.
        config=tf1.ConfigProto(
            device_filters=["/job:ps", f"/job:worker/task:{flags.task_index}"]
        ),
    ) as sess:
        while not sess.should_stop():
            xs = rng.standard_normal((32, 10)).astype(np.float32)
            _, last, step = sess.run([train_op, loss, global_step], {x: xs, y: xs @ true_w})
    print(f"worker {flags.task_index} done at global step {step}, loss {last:.4f}", flush=True)


if __name__ == "__main__":
    tf1.disable_eager_execution()
    p = argparse.ArgumentParser()
    p.add_argument("--ps_hosts", default="")
    p.add_argument("--worker_hosts", default="")
    p.add_argument("--job_name", default="")
    p.add_argument("--task_index", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--checkpoint_dir",
        default=os.path.join(tempfile.gettempdir(), f"tf1-trainer-{os.getuid()}"),
    )
    main(p.parse_known_args(sys.argv[1:])[0])
