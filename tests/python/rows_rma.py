"""Embedding tables over one-sided windows from Python (tests/python.rs): 1 ps task and 2
workers, mode "ps" with transport "rma" and sync=False; a table of 2^40 rows. Each worker
pulls rows of its own (none the other touches), pushes a sparse gradient (SGD, added into
the ps's window as it comes) and pulls them again: they moved by exactly its push. Bad
calls raise on their worker and the session goes on; the dense variables train
asynchronously to the last step, and the last checkpoint (in the first argument) holds
the rows. A second argument "resume" starts from it and reads the rows back; "sync"
asks for synchronous tables over windows, which every task refuses with a ValueError.
Each rank prints one JSON line."""
import hashlib
import json
import os
import sys

import numpy as np

import mpiflow

CKPT = sys.argv[1]
SCENARIO = sys.argv[2] if len(sys.argv) > 2 else "train"
ROWS, DIM, LR, SCALE = 1 << 40, 3, 0.5, 0.25
digest = lambda a: hashlib.sha256(a.tobytes()).hexdigest()
mpiflow.init(ps=1)
me = mpiflow.cluster()["task"]
out = {"rank": mpiflow.rank(), "task": f"{me['type']}:{me['index']}"}
try:
    sess = mpiflow.Session({"w": np.zeros(2, np.float32)}, "ps", transport="rma",
                           sync=SCENARIO == "sync", optimizer="sgd", lr=0.01, steps=6,
                           tables={"emb": (ROWS, DIM)}, sparse_optimizer="sgd",
                           sparse_lr=LR, checkpoint_dir=CKPT)
except ValueError as e:
    out["refused"] = str(e)
    os.write(1, (json.dumps(out) + "\n").encode())
    sys.exit(0)
if not sess.is_worker:
    # A ps task's session served until the workers ended.
    os.write(1, (json.dumps(out) + "\n").encode())
    sys.exit(0)
# Rows of this worker's alone: one near each end of the table.
own = np.array([100 + me["index"], ROWS - 1 - me["index"]], np.uint64)
if SCENARIO == "resume":
    out.update(first_step=sess.global_step, rows=digest(sess.pull_rows("emb", own)))
    sess.close()
    os.write(1, (json.dumps(out) + "\n").encode())
    sys.exit(0)
before = sess.pull_rows("emb", own)
grad = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * me["index"] + 1
sess.push_rows("emb", own, grad, scale=SCALE)
after = sess.pull_rows("emb", own)
errors = {}
for name, call in [("table", lambda: sess.pull_rows("nope", own)),
                   ("shape", lambda: sess.push_rows("emb", own, np.zeros((3, 3), np.float32))),
                   ("row", lambda: sess.pull_rows("emb", [ROWS]))]:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what was raised is the finding
        errors[name] = f"{type(e).__name__}: {e}"
while not sess.should_stop():
    sess.push_pull({"w": np.ones(2, np.float32)}, 0.0, 1)
closed = sess.close()
out.update(worst=float(np.abs(after - (before - LR * SCALE * grad)).max()),
           moved=float(np.abs(after - before).max()), after=digest(after),
           errors=errors, step=closed["global_step"], checkpoint=str(closed["checkpoint"]))
os.write(1, (json.dumps(out) + "\n").encode())
