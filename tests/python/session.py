"""A training session from Python, under mpirun (tests/python.rs): a small MLP in NumPy
whose gradients each worker computes on its share of every global batch and hands to
mpiflow, over the ps tasks (mode ps: `mpiflow.init(ps=1)`) or the allreduce.

    session.py MODE SCENARIO DIR      # MODE: ps, rma (the ps over one-sided windows), allreduce

- equal: the parameters after 25 steps equal local training of the whole batch (NumPy
  SGD on one process) within 1e-4, on every worker.
- restore10, restore20: a job trains 10 steps checkpointed into DIR; a second job to step
  20 restores step 10 and ends equal to 20 steps straight.
- async, backup: asynchronous (`sync=False`), and synchronous with
  `replicas_to_aggregate=1` (the other worker a backup): 60 steps reached, the loss
  falling.
- bad: worker 1 hands a float64 gradient at step 3 (allreduce: no gradient for one
  variable): a TypeError (ValueError) there, an mpiflow.Error on every other task, each
  within seconds.

Each rank prints one JSON line of what it found.
"""
import json
import os
import sys
import time

import numpy as np

import mpiflow

MODE, SCENARIO, DIR = sys.argv[1], sys.argv[2], sys.argv[3]
mpiflow.init(ps=0 if MODE == "allreduce" else 1)
me = mpiflow.cluster()["task"]
out = {"rank": mpiflow.rank(), "task": f"{me['type']}:{me['index']}"}

FEATURES, HIDDEN, CLASSES, BATCH, LR = 12, 16, 4, 32, 0.2
rng = np.random.default_rng(7)
X = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
Y = (np.arange(BATCH) % CLASSES).astype(np.int64)
X[np.arange(BATCH), Y] += 2.0  # learnable


def initial():
    r = np.random.default_rng(3)
    return {
        "w1": (r.standard_normal((FEATURES, HIDDEN)) * 0.3).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (r.standard_normal((HIDDEN, CLASSES)) * 0.3).astype(np.float32),
        "b2": np.zeros(CLASSES, np.float32),
    }


def loss_and_grads(p, x, y):
    """Mean softmax cross-entropy of the MLP on (x, y) and its gradients (float32)."""
    h = np.maximum(x @ p["w1"] + p["b1"], 0)
    z = h @ p["w2"] + p["b2"]
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    s = e / e.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(s[np.arange(n), y]).mean())
    d = s.copy()
    d[np.arange(n), y] -= 1
    d /= n
    dh = (d @ p["w2"].T) * (h > 0)
    g = {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ d, "b2": d.sum(0)}
    return loss, {k: v.astype(np.float32) for k, v in g.items()}


def local(steps):
    """Plain SGD on the whole batch in one process: what every mode must equal."""
    p = initial()
    for _ in range(steps):
        _, g = loss_and_grads(p, X, Y)
        p = {k: (p[k] - np.float32(LR) * g[k]).astype(np.float32) for k in p}
    return p


def session(steps, **kw):
    """This task's session to `steps`: a worker's, or None on a ps task once it has
    served (p2p: `join()`; rma: the session on every task, the ps's serving in it)."""
    mode, transport = ("ps", "rma") if MODE == "rma" else (MODE, "p2p")
    if me["type"] == "ps" and transport == "p2p":
        mpiflow.join()
        return None
    sess = mpiflow.Session(initial(), mode, transport=transport, optimizer="sgd", lr=LR,
                           steps=steps, log_every=0, **kw)
    return sess if sess.is_worker else None


def train(steps, **kw):
    """A session to `steps` on this worker's share of the batch: its parameters, losses,
    summary (None on a ps task)."""
    sess = session(steps, peer_timeout=10, **kw)
    if sess is None:
        return None
    k, i = sess.data_shard
    rows = slice(i * BATCH // k, (i + 1) * BATCH // k)
    losses = []
    while not sess.should_stop():
        loss, g = loss_and_grads(sess.params, X[rows], Y[rows])
        sess.push_pull(g, loss, samples=len(Y[rows]))
        losses.append(loss)  # the program's own loss of the parameters it stepped from
    closed = sess.close()
    return {k: v.copy() for k, v in sess.params.items()}, losses, closed


def worst(p, q):
    return max(float(np.max(np.abs(p[k] - q[k]) / (1 + np.abs(q[k])))) for k in q)


if SCENARIO == "equal":
    trained = train(25)
    if trained:
        p, losses, closed = trained
        out.update(worst=worst(p, local(25)), step=closed["global_step"],
                   first_loss=losses[0], last_loss=losses[-1])
elif SCENARIO.startswith("restore"):
    steps = int(SCENARIO[len("restore"):])
    trained = train(steps, checkpoint_dir=os.path.join(DIR, "ckpt"))
    if trained:
        p, _, closed = trained
        out.update(resumed_at=closed["first_step"], step=closed["global_step"],
                   worst=worst(p, local(steps)),
                   checkpoint=os.path.basename(closed["checkpoint"] or ""))
elif SCENARIO in ("async", "backup"):
    kw = {"sync": False} if SCENARIO == "async" else {"replicas_to_aggregate": 1}
    trained = train(60, **kw)
    if trained:
        p, losses, closed = trained
        out.update(step=closed["global_step"], first_loss=losses[0],
                   last_loss=float(np.mean(losses[-5:])))
elif SCENARIO == "bad":
    t = time.monotonic()
    try:
        sess = session(100, peer_timeout=30)
        if sess is not None:
            k, i = sess.data_shard
            rows = slice(i * BATCH // k, (i + 1) * BATCH // k)
            while not sess.should_stop():
                loss, g = loss_and_grads(sess.params, X[rows], Y[rows])
                if sess.global_step == 3 and me["index"] == 1 and me["type"] == "worker":
                    if MODE == "allreduce":
                        del g["w2"]  # refused by the session (Session.refuse)
                    else:
                        g["w2"] = g["w2"].astype(np.float64)
                sess.push_pull(g, loss, samples=len(Y[rows]))
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - what was raised is the finding
        out.update(raised=type(e).__name__, line=str(e))
    out["secs"] = time.monotonic() - t
os.write(1, (json.dumps(out) + "\n").encode())
