#!/usr/bin/env python3
"""TensorFlow's DLRM by `tf.distribute.ParameterServerStrategy`, on the task of
`mpiflow train --model dlrm --data synthetic-ctr:...`, for `benches/compare/dlrm.sh`.

    mpirun -np 5 mpiflow launch --ps 1 --chief -- PYTHON dlrm_tf.py --done-file F ...

TensorFlow 2's parameter-server training: a chief (the coordinator, which only dispatches),
ps tasks holding every variable, the tables sharded by rows over them
(`MinSizePartitioner`: 256 KiB and up, so the dense layers stay whole), and workers running the steps the coordinator schedules on
them (`ClusterCoordinator.schedule`), asynchronously. The model is mpiflow's DLRM: a
bottom MLP (ReLU hidden layers of `--bottom` widths, then `--dim` outputs and ReLU) over 13
dense features, one embedding per categorical feature (one id each: the bag is the row),
the dot product of every pair of [z, e_1, ...], a top MLP (`--top` widths) to one logit,
logistic loss. Dense layers by Adam at 0.003, tables by Adagrad at `--sparse-lr`, written
with TensorFlow's ops (Keras 3 has no ParameterServerStrategy): only the rows a batch
names are read and updated on their ps (`IndexedSlices` gradients, `scatter_*`). A
scheduled function runs `--steps-per-call` steps (Keras' `steps_per_execution`) to spare
the coordinator's round trips. `--batch` is the global batch: each step of a worker takes
`batch / workers` samples, so `workers` steps make one of mpiflow's. The data: Zipf(1.05)
ids folded into each table, standard-normal dense features, random labels, 32 batches
per worker made before the clock starts, cycled. One intra-op thread per task (and one
inter-op thread with `--local`).

`--local`: the same steps in one process without the strategy or a cluster, the baseline
beside mpiflow's and PyTorch's single-process rates.

Workers and ps tasks serve until the chief writes `--done-file` (TensorFlow's servers
`join()` forever). The chief prints `tf samples/s X steps N`: the samples of the steps
scheduled after the warm-up over their wall time.
"""
import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

p = argparse.ArgumentParser()
p.add_argument("--features", type=int, default=8)
p.add_argument("--rows", type=int, default=100000)
p.add_argument("--dim", type=int, default=16)
p.add_argument("--bottom", default="64")
p.add_argument("--top", default="64")
p.add_argument("--batch", type=int, default=1024)
p.add_argument("--steps", type=int, default=300, help="worker steps in all")
p.add_argument("--warmup", type=int, default=30)
p.add_argument("--steps-per-call", type=int, default=10)
p.add_argument("--sparse-lr", type=float, default=0.05)
p.add_argument("--done-file")
p.add_argument("--local", action="store_true",
               help="one process, no cluster: the same steps without the strategy (a baseline)")
args = p.parse_args()
DENSE = 13

tf.config.threading.set_intra_op_parallelism_threads(1)
if args.local:
    # One thread in all, as the other single-process baselines have. In a cluster
    # TensorFlow keeps its default inter-op threads, its faster setting there
    # (benches/results/2026-11-29-dlrm-tf-rows.md).
    tf.config.threading.set_inter_op_parallelism_threads(1)
    os.environ.pop("TF_CONFIG", None)
resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
if not args.local and args.done_file is None:
    sys.exit("--done-file is needed in a cluster")
if resolver.task_type in ("worker", "ps"):
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id, protocol="grpc", start=True)
    while not os.path.exists(args.done_file):
        time.sleep(0.2)
    sys.exit(0)

if args.local:
    workers, strategy = 1, tf.distribute.get_strategy()
else:
    num_ps = resolver.cluster_spec().num_tasks("ps")
    workers = resolver.cluster_spec().num_tasks("worker")
    strategy = tf.distribute.ParameterServerStrategy(
        resolver,
        variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=256 << 10, max_shards=num_ps))
share = args.batch // workers


def widths(s):
    return [int(w) for w in s.split(",") if w]


def glorot(shape, rng):
    bound = np.sqrt(6.0 / (shape[0] + shape[1]))
    return rng.uniform(-bound, bound, shape).astype(np.float32)


rng = np.random.default_rng(1)
with strategy.scope():
    def mlp(sizes):
        return [(tf.Variable(glorot((a, b), rng)), tf.Variable(np.zeros(b, np.float32)))
                for a, b in zip(sizes[:-1], sizes[1:])]

    k = args.features + 1
    bottom = mlp([DENSE] + widths(args.bottom) + [args.dim])
    top = mlp([args.dim + k * (k - 1) // 2] + widths(args.top) + [1])
    dense_vars = [v for layer in bottom + top for v in layer]
    tables = [tf.Variable(rng.uniform(-0.05, 0.05, (args.rows, args.dim)).astype(np.float32))
              for _ in range(args.features)]
    adagrad = [tf.Variable(np.full((args.rows, args.dim), 0.1, np.float32)) for _ in tables]
    m = [tf.Variable(tf.zeros_like(v)) for v in dense_vars]
    v2 = [tf.Variable(tf.zeros_like(v)) for v in dense_vars]
    t = tf.Variable(0.0)
pairs = np.triu_indices(k, 1)
pair_index = tf.constant(pairs[0] * k + pairs[1], tf.int32)


def apply_mlp(layers, x, relu_last):
    for i, (w, b) in enumerate(layers):
        x = tf.matmul(x, w) + b
        if i + 1 < len(layers) or relu_last:
            x = tf.nn.relu(x)
    return x


def shards(var):
    return list(var.variables) if hasattr(var, "variables") else [var]


def step(dense, ids, labels):
    table_shards = [shards(tb) for tb in tables]
    with tf.GradientTape() as tape:
        z = apply_mlp(bottom, dense, True)
        e = [tf.nn.embedding_lookup(tb, ids[:, f]) for f, tb in enumerate(tables)]
        x = tf.stack([z] + e, axis=1)
        dots = tf.reshape(tf.matmul(x, x, transpose_b=True), [-1, k * k])
        logits = apply_mlp(top, tf.concat([z, tf.gather(dots, pair_index, axis=1)], 1), False)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=labels, logits=tf.squeeze(logits, 1)))
    flat = [s for ts in table_shards for s in ts]
    grads = tape.gradient(loss, dense_vars + flat)
    dense_g, sparse_g = grads[:len(dense_vars)], grads[len(dense_vars):]
    t.assign_add(1.0)
    lr = 0.003 * tf.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
    for var, g, mv, vv in zip(dense_vars, dense_g, m, v2):
        mv.assign(0.9 * mv + 0.1 * g)
        vv.assign(0.999 * vv + 0.001 * g * g)
        var.assign_sub(lr * mv / (tf.sqrt(vv) + 1e-7))
    at = 0
    for tb, acc in zip(tables, adagrad):
        for shard, acc_shard in zip(shards(tb), shards(acc)):
            g = sparse_g[at]
            at += 1
            if g is None:
                continue
            g = tf.convert_to_tensor(g) if not isinstance(g, tf.IndexedSlices) else g
            rows = tf.IndexedSlices(g.values * g.values, g.indices)
            acc_shard.scatter_add(rows)
            denom = tf.sqrt(tf.gather(acc_shard, g.indices))
            shard.scatter_sub(tf.IndexedSlices(args.sparse_lr * g.values / denom, g.indices))
    return loss


def dataset_fn():
    r = np.random.default_rng()
    n = 32
    ids = (r.zipf(1.05, size=(n * share, args.features)) - 1) % args.rows
    data = (r.standard_normal((n * share, DENSE)).astype(np.float32), ids.astype(np.int64),
            r.integers(0, 2, n * share).astype(np.float32))
    return tf.data.Dataset.from_tensor_slices(data).batch(share, drop_remainder=True).repeat()


@tf.function
def train(iterator):
    loss = tf.constant(0.0)
    for _ in tf.range(args.steps_per_call):
        dense, ids, labels = next(iterator)
        loss = step(dense, ids, labels)
    return loss


if args.local:
    it = iter(dataset_fn())
    calls = max(1, args.steps // args.steps_per_call)
    for _ in range(max(1, args.warmup // args.steps_per_call)):
        train(it)
    start = time.perf_counter()
    for _ in range(calls):
        last = train(it)
    secs = time.perf_counter() - start
    steps = calls * args.steps_per_call
    print(f"tf samples/s {share * steps / secs:.0f} steps {steps} loss {float(last):.4f}",
          flush=True)
    sys.exit(0)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
per_worker = coordinator.create_per_worker_dataset(dataset_fn)
it = iter(per_worker)
calls = max(1, args.steps // args.steps_per_call)
warm = max(1, args.warmup // args.steps_per_call)
for _ in range(warm):
    coordinator.schedule(train, args=(it,))
coordinator.join()
start = time.perf_counter()
for _ in range(calls):
    last = coordinator.schedule(train, args=(it,))
coordinator.join()
secs = time.perf_counter() - start
steps = calls * args.steps_per_call
print(f"tf samples/s {share * steps / secs:.0f} steps {steps} loss {last.fetch():.4f}", flush=True)
open(args.done_file, "w").close()
