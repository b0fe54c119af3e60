#!/usr/bin/env python3
"""TensorFlow's own parameter-server training (the seeds' TF1 pattern: between-graph
replication, `replica_device_setter`, gRPC between the tasks) on the task of
`mpiflow train --mode ps --data synthetic:784`, for `benches/compare/tf.sh`.

Run under `mpiflow launch --ps N --legacy-flags` (which gives each process its
`--ps_hosts --worker_hosts --job_name --task_index`, and stops the ps tasks, which
`server.join()` forever, when the workers are done):

    mpirun -np 4 mpiflow launch --ps 1 --legacy-flags -- \\
        python3 tf_ps_train.py --hidden 1024,1024 --batch 64 --steps 300 --sync

The model: dense layers of `--hidden` widths with ReLU on 784 inputs, 10 classes, softmax
cross-entropy, Adam at 0.003 (mpiflow's defaults), variables placed on the ps tasks
round-robin (`replica_device_setter`'s default). `--batch` samples per worker per step, of
random data (fixed per worker, as `synthetic:784` is fixed). Sync: `SyncReplicasOptimizer`
aggregating every worker's gradient (one update per step, as mpiflow's sync mode); async:
each worker's update applied as it comes. One intra-op thread per task.

The workers start together (each marks a counter on the ps once its session is up, and
waits for all). Each prints one line, `tf worker I samples/s X steps N`: its own samples
over its own wall time from its `--warmup`-th step to the step that sees the global step
reach nine tenths of `--steps` (the job's rate is their sum).
"""
import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


def model_fn(x, hidden):
    """Dense layers (Glorot-uniform weights, zero biases), ReLU between them."""
    h, fan_in = x, 784
    widths = hidden + [10]
    for i, width in enumerate(widths):
        w = tf1.get_variable(f"layer{i}/w", [fan_in, width],
                             initializer=tf1.glorot_uniform_initializer())
        b = tf1.get_variable(f"layer{i}/b", [width], initializer=tf1.zeros_initializer())
        h = tf1.matmul(h, w) + b
        if i + 1 < len(widths):
            h = tf.nn.relu(h)
        fan_in = width
    return h


def main(flags):
    hidden = [int(w) for w in flags.hidden.split(",") if w]
    workers = flags.worker_hosts.split(",")
    cluster = tf.train.ClusterSpec({"ps": flags.ps_hosts.split(","), "worker": workers})
    config = tf1.ConfigProto(
        intra_op_parallelism_threads=1,
        inter_op_parallelism_threads=2,
        # Only the ps tasks and this worker: a worker must not wait for a finished one.
        device_filters=["/job:ps", f"/job:{flags.job_name}/task:{flags.task_index}"],
    )
    server = tf1.train.Server(
        cluster, job_name=flags.job_name, task_index=flags.task_index, config=config
    )
    if flags.job_name == "ps":
        server.join()
        return
    chief = flags.task_index == 0
    with tf1.device(
        tf1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{flags.task_index}", cluster=cluster
        )
    ):
        x = tf1.placeholder(tf.float32, [None, 784])
        y = tf1.placeholder(tf.int64, [None])
        logits = model_fn(x, hidden)
        loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        global_step = tf1.train.get_or_create_global_step()
        opt = tf1.train.AdamOptimizer(0.003)
        hooks = []
        if flags.sync:
            opt = tf1.train.SyncReplicasOptimizer(
                opt, replicas_to_aggregate=len(workers), total_num_replicas=len(workers)
            )
            hooks.append(opt.make_session_run_hook(chief))
        train_op = opt.minimize(loss, global_step=global_step)
        # Every worker adds one once its session is up; training starts when all have.
        arrived = tf1.get_variable("arrived", [], tf.int32, tf1.zeros_initializer(),
                                   trainable=False)
        arrive = tf1.assign_add(arrived, 1)
    hooks.append(tf1.train.StopAtStepHook(last_step=flags.steps))
    rng = np.random.default_rng(flags.task_index)
    feed = {
        x: rng.random((flags.batch, 784), dtype=np.float32),
        y: rng.integers(0, 10, flags.batch),
    }
    # The timed window ends at this global step, before the last ones (a worker whose
    # peers have stopped may wait on them).
    until = flags.steps - max(flags.steps // 10, 2)
    if chief:
        creator = tf1.train.ChiefSessionCreator(master=server.target, config=config)
    else:
        creator = WorkerSessionCreator(server.target, config)
    local, timed, start, end = 0, 0, None, None
    # A short grace period: the chief's token queue runner of SyncReplicasOptimizer waits
    # for gradients that stopped workers never send (TensorFlow's default is 120 s).
    with tf1.train.MonitoredSession(
        session_creator=creator, hooks=hooks, stop_grace_period_secs=1
    ) as sess:
        sess.run(arrive)
        while sess.run(arrived) < len(workers):
            time.sleep(0.01)
        while not sess.should_stop():
            _, step = sess.run([train_op, global_step], feed_dict=feed)
            local += 1
            if local == flags.warmup:
                start = time.perf_counter()
            elif start is not None and end is None:
                timed += 1
                if step >= until:
                    end = time.perf_counter()
    if end is None:
        sys.exit(f"tf_ps_train: worker {flags.task_index} ran {local} steps and did not "
                 f"see global step {until} after its {flags.warmup} warm-up steps")
    rate = timed * flags.batch / (end - start)
    # One write per line: mpirun splices lines written in pieces.
    os.write(1, f"tf worker {flags.task_index} samples/s {rate:.1f} steps {local}\n".encode())


class WorkerSessionCreator(tf1.train.SessionCreator):
    """TensorFlow's WorkerSessionCreator, polling for the chief's initialisation every
    0.1 s rather than every 30 s."""

    def __init__(self, master, config):
        self._scaffold = tf1.train.Scaffold()
        self._master, self._config = master, config

    def create_session(self):
        self._scaffold.finalize()
        return tf1.train.SessionManager(
            local_init_op=self._scaffold.local_init_op,
            ready_op=self._scaffold.ready_op,
            ready_for_local_init_op=self._scaffold.ready_for_local_init_op,
            graph=tf1.get_default_graph(),
            recovery_wait_secs=0.1,
        ).wait_for_session(self._master, config=self._config, max_wait_secs=600)


if __name__ == "__main__":
    tf1.disable_eager_execution()
    p = argparse.ArgumentParser()
    p.add_argument("--ps_hosts", required=True)
    p.add_argument("--worker_hosts", required=True)
    p.add_argument("--job_name", required=True)
    p.add_argument("--task_index", type=int, required=True)
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=300, help="last global step")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per worker")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sync", action="store_true")
    mode.add_argument("--async", dest="sync", action="store_false")
    main(p.parse_args())
