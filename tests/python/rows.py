"""Embedding tables on the ps tasks from Python (tests/python.rs): 2 ps tasks and 2
workers; a table of 2^40 rows; the session's mode the first argument ("ps": the
variables on the ps tasks too; "hybrid": the variables by allreduce among the workers).
Each worker pulls the same rows (ids on both ps, one repeated), both push a sparse
gradient (SGD), and after a step both take together (every push applied) both pull the
rows as they must be, and hold the same variables; rows asked for ahead land as a pull
gives them; bad calls raise on their worker and the session goes on. With a checkpoint directory (the second argument) the session's
last checkpoint holds the rows; a third argument "resume" starts from it and reads the
rows back before any push. Each rank prints one JSON line."""
import hashlib
import json
import os
import sys

import numpy as np

import mpiflow

MODE = sys.argv[1] if len(sys.argv) > 1 else "ps"
CKPT = sys.argv[2] if len(sys.argv) > 2 else None
RESUME = len(sys.argv) > 3 and sys.argv[3] == "resume"
digest = lambda a: hashlib.sha256(a.tobytes()).hexdigest()
mpiflow.init(ps=2)
me = mpiflow.cluster()["task"]
out = {"rank": mpiflow.rank(), "task": f"{me['type']}:{me['index']}"}
if me["type"] == "ps":
    mpiflow.join()
else:
    ROWS, DIM, LR, SCALE = 1 << 40, 3, 0.5, 0.25
    sess = mpiflow.Session({"w": np.zeros(2, np.float32)}, MODE, steps=3, lr=0.01,
                           tables={"emb": (ROWS, DIM)}, sparse_optimizer="sgd", sparse_lr=LR,
                           checkpoint_dir=CKPT)
    ids = np.array([7, ROWS - 1, 10, 7, 123456789012], np.int64)
    if RESUME:
        out.update(first_step=sess.global_step, rows=digest(sess.pull_rows("emb", ids)),
                   w=[float(v) for v in sess.params["w"]])
        sess.close()
        os.write(1, (json.dumps(out) + "\n").encode())
        sys.exit(0)
    before = sess.pull_rows("emb", ids)
    sess.push_pull({"w": np.ones(2, np.float32)}, 0.0, 1)  # both workers pulled
    # Each worker's gradient: known to both, so each checks the sum of both.
    push = np.array([7, 10, 123456789012], np.uint64)
    grad = lambda w: (np.arange(9, dtype=np.float32).reshape(3, 3) + 10 * w)
    sess.push_rows("emb", push, grad(me["index"]), scale=SCALE)
    sess.push_pull({"w": np.ones(2, np.float32)}, 0.0, 1)  # both workers pushed
    after = sess.pull_rows("emb", ids)
    want = before.copy()
    both = grad(0) + grad(1)
    for i, r in enumerate(push):
        want[ids == np.int64(r)] -= LR * SCALE * both[i]
    # Rows asked for ahead (rows no push touches) land as a pull then gives them.
    fresh = np.array([11, 12, 13, ROWS - 2], np.uint64)
    sess.pull_rows_ahead({"emb": fresh})
    landed = sess.land_rows({"emb": fresh})["emb"]
    ahead = landed.shape == (4, 3) and bool((landed == sess.pull_rows("emb", fresh)).all())
    errors = {}
    other = lambda: (sess.pull_rows_ahead({"emb": fresh}), sess.land_rows({"emb": fresh[:2]}))
    for name, call in [("land", lambda: sess.land_rows({"emb": fresh})), ("other", other),
                       ("table", lambda: sess.pull_rows("nope", ids)),
                       ("shape", lambda: sess.push_rows("emb", push, np.zeros((2, 3)))),
                       ("row", lambda: sess.pull_rows("emb", [ROWS]))]:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - what was raised is the finding
            errors[name] = f"{type(e).__name__}: {e}"
    w = [float(v) for v in sess.params["w"]]
    closed = sess.close()
    out.update(shape=list(before.shape), step=closed["global_step"], repeated=bool((before[0] == before[3]).all()),
               before=digest(before), after=digest(after),
               worst=float(np.abs(after - want).max()), moved=float(np.abs(after - before).max()),
               errors=errors, w=w, ahead=ahead)
os.write(1, (json.dumps(out) + "\n").encode())
