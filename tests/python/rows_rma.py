"""Embedding tables over one-sided windows from Python (tests/python.rs): 1 ps task and 2
workers, transport "rma", a table of 2^40 rows. Arguments: the checkpoint directory, the
scenario, the mode ("ps", or "hybrid": the variables by allreduce among the workers) and
the rows' synchrony ("sync": every worker's step summed and applied by the ps; "async":
each push added into the ps's window as it comes; plain SGD either way).

Scenario "train": each worker pulls rows of its own (none the other touches), pushes a
sparse gradient, which waits for the step (its push_pull), and pulls them after the step:
they moved by exactly its push. Bad calls raise on their worker and the session goes on
(close() with rows pushed and no step since raises too); the variables train to the last
step, and the last checkpoint holds the rows. "resume" starts from it and reads the rows
and variables back. "refused" asks for asynchronous tables with Adagrad, which every
task refuses with a ValueError. "overflow" (synchronous) allows one row per push and
worker 0 pushes two: the step fails on every worker with worker 0's line. Each rank
prints one JSON line."""
import hashlib
import json
import os
import sys

import numpy as np

import mpiflow

CKPT, SCENARIO, MODE, SYNC = sys.argv[1:5]
ROWS, DIM, LR, SCALE = 1 << 40, 3, 0.5, 0.25
digest = lambda a: hashlib.sha256(a.tobytes()).hexdigest()
mpiflow.init(ps=1)
me = mpiflow.cluster()["task"]
out = {"rank": mpiflow.rank(), "task": f"{me['type']}:{me['index']}"}
try:
    sess = mpiflow.Session({"w": np.zeros(2, np.float32)}, MODE, transport="rma",
                           sync=SYNC == "sync", optimizer="sgd", lr=0.01, steps=6,
                           tables={"emb": (ROWS, DIM)},
                           sparse_optimizer="adagrad" if SCENARIO == "refused" else "sgd",
                           sparse_lr=LR, checkpoint_dir=CKPT,
                           push_rows=1 if SCENARIO == "overflow" else 4096)
except ValueError as e:
    out["refused"] = str(e)
    os.write(1, (json.dumps(out) + "\n").encode())
    sys.exit(0)
except mpiflow.Error as e:
    # A ps task's session, ended by the workers' failure.
    out["ended"] = str(e)
    os.write(1, (json.dumps(out) + "\n").encode())
    sys.exit(0)
if not sess.is_worker:
    # A ps task's session served until the workers ended.
    os.write(1, (json.dumps(out) + "\n").encode())
    sys.exit(0)
# Rows of this worker's alone: one near each end of the table.
own = np.array([100 + me["index"], ROWS - 1 - me["index"]], np.uint64)
if SCENARIO == "resume":
    out.update(first_step=sess.global_step, rows=digest(sess.pull_rows("emb", own)),
               w=sess.params["w"].tolist())
    sess.close()
    os.write(1, (json.dumps(out) + "\n").encode())
    sys.exit(0)
ones = {"w": np.ones(2, np.float32)}
if SCENARIO == "overflow":
    n = 2 if me["index"] == 0 or "BOTH" in os.environ else 1
    sess.push_rows("emb", own[:n], np.ones((n, DIM), np.float32))
    try:
        sess.push_pull(ones, 0.0, 1)
        out["stepped"] = True
    except mpiflow.Error as e:
        out["error"] = str(e)
    os.write(1, (json.dumps(out) + "\n").encode())
    sys.exit(0)
before = sess.pull_rows("emb", own)
grad = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * me["index"] + 1
# Pushed in two calls, half the gradient each: one push with the step.
sess.push_rows("emb", own, grad / 2, scale=SCALE)
sess.push_rows("emb", own[::-1], grad[::-1] / 2, scale=SCALE)
unstepped = sess.pull_rows("emb", own)
errors = {}
try:
    sess.close()
except Exception as e:  # noqa: BLE001 - what was raised is the finding
    errors["close"] = f"{type(e).__name__}: {e}"
sess.push_pull(ones, 0.0, 1)
after = sess.pull_rows("emb", own)
for name, call in [("table", lambda: sess.pull_rows("nope", own)),
                   ("shape", lambda: sess.push_rows("emb", own, np.zeros((3, 3), np.float32))),
                   ("row", lambda: sess.pull_rows("emb", [ROWS]))]:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what was raised is the finding
        errors[name] = f"{type(e).__name__}: {e}"
while not sess.should_stop():
    sess.push_pull(ones, 0.0, 1)
closed = sess.close()
out.update(worst=float(np.abs(after - (before - LR * SCALE * grad)).max()),
           moved=float(np.abs(after - before).max()),
           unstepped=float(np.abs(unstepped - before).max()), after=digest(after),
           errors=errors, step=closed["global_step"], checkpoint=str(closed["checkpoint"]),
           w=sess.params["w"].tolist())
os.write(1, (json.dumps(out) + "\n").encode())
