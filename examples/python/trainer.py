"""The seeds' trainer.py, in Python on mpiflow: the same program on every task, its model
(an MLP) in NumPy, its variables on the ps tasks.

    mpirun -np 4 python examples/python/trainer.py                 # roles from MPI: 1 ps, 3 workers
    mpirun -np 1 python trainer.py --ps_hosts=localhost:2222 --worker_hosts=localhost:2223 \\
           --job_name=ps --task_index=0 : -np 1 python trainer.py ... --job_name=worker --task_index=0
    TF_CONFIG='{"cluster": ..., "task": ...}' python trainer.py    # per process, under an MPI launcher

Options: --steps N (default 1000), --async, --checkpoint_dir DIR, --data SPEC (digits,
fashion-mnist), --lr X. The chief prints `accuracy X` on the held-out samples at the end.
SIGTERM, SIGINT or SIGUSR1 on any task stops every worker at a step, the chief
checkpoints, and the tasks exit 75 (a rerun resumes from the checkpoint).
"""
import argparse
import os
import sys

import numpy as np

import mpiflow

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--async", dest="is_async", action="store_true")
parser.add_argument("--checkpoint_dir", default=None)
parser.add_argument("--data", default="digits")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--batch", type=int, default=64)
FLAGS, unparsed = parser.parse_known_args()

# The seeds' flags (--ps_hosts, --worker_hosts, --job_name, --task_index) if given, else
# TF_CONFIG, else the MPI job's ranks with one ps task.
mpiflow.init(args=unparsed, ps=1)
# Every task: the ps tasks announce a signal to the workers, which stop at one step.
mpiflow.catch_stop_signals()
task = mpiflow.cluster()["task"]


def say(line):
    os.write(1, (line + "\n").encode())


def initial(features, classes, hidden=64):
    """He-initialised weights, zero biases (the same on every task: the chief's count)."""
    r = np.random.default_rng(1)
    return {
        "w1": (r.standard_normal((features, hidden)) * np.sqrt(2 / features)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (r.standard_normal((hidden, classes)) * np.sqrt(2 / hidden)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }


def logits(p, x):
    h = np.maximum(x @ p["w1"] + p["b1"], 0)
    return h, h @ p["w2"] + p["b2"]


def loss_and_grads(p, x, y):
    """Mean softmax cross-entropy and its gradients, float32."""
    h, z = logits(p, x)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    s = e / e.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(s[np.arange(n), y] + 1e-12).mean())
    d = s
    d[np.arange(n), y] -= 1
    d /= n
    dh = (d @ p["w2"].T) * (h > 0)
    g = {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ d, "b2": d.sum(0)}
    return loss, {k: v.astype(np.float32, copy=False) for k, v in g.items()}


def main():
    if task["type"] == "ps":
        try:
            mpiflow.join()
        except mpiflow.Stopped:
            return 75  # the workers say where they stopped
        return 0
    (x, y), (x_test, y_test) = mpiflow.load_dataset(FLAGS.data)
    x, x_test = x.reshape(len(x), -1), x_test.reshape(len(x_test), -1)
    classes = int(max(y.max(), y_test.max())) + 1
    sess = mpiflow.Session(
        initial(x.shape[1], classes), "ps", sync=not FLAGS.is_async, optimizer="adagrad",
        lr=FLAGS.lr, steps=FLAGS.steps, checkpoint_dir=FLAGS.checkpoint_dir,
        checkpoint_every=200, log_every=200, stop_on_signal=True, name="trainer-mlp")
    workers, me = sess.data_shard
    try:
        while not sess.should_stop():
            # The global batch of this step (the same on every worker), and this
            # worker's share of it.
            rows = np.random.default_rng([7, sess.global_step]).choice(
                len(y), FLAGS.batch, replace=False)
            mine = rows[me * len(rows) // workers:(me + 1) * len(rows) // workers]
            loss, grads = loss_and_grads(sess.params, x[mine], y[mine])
            sess.push_pull(grads, loss, samples=len(mine))
    except mpiflow.Stopped as e:
        say(f"trainer: {e}")
        return 75
    sess.close()
    if sess.is_chief:
        _, z = logits(sess.params, x_test)
        say(f"accuracy {float((z.argmax(1) == y_test).mean()):.4f}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except mpiflow.Stopped as e:
        say(f"trainer: {e}")
        sys.exit(75)
    except mpiflow.Error as e:
        print(e, file=sys.stderr)
        sys.exit(1)
