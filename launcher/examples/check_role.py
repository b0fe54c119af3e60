#!/usr/bin/env python3
"""A stand-in for a TensorFlow training script, for `mpiflow launch`.

It reads its role the way TensorFlow does (TFConfigClusterResolver's rules: TF_CONFIG JSON,
task type and index, the task must exist in the cluster, at most one chief, chief is
chief:0 or else worker:0), cross-checks the legacy flags and MPIFLOW_* variables when
present, and prints one JSON line. Exits 1 with a one-line reason if anything disagrees,
or with --exit-code N to test exit-status propagation.

Test options: --join (a ps blocks forever after its line, as `server.join()` does),
--sleep S (then sleep before exiting), --exit TYPE:INDEX=N (that task exits with N),
--ps-ready DIR (a ps task marks DIR once its line is out; the others wait, at most 60 s,
until every ps task has, so a job that stops its ps when the workers end still shows
every line), --count-usr1 S (SIGUSR1 is blocked before the line; after it, each SIGUSR1
is taken one at a time until S seconds after the first, at most 60 s for that one, and
the task prints {"usr1": COUNT, "type": ..., "index": ...}; with --ps-ready, before the
ps marks DIR).

Needs only the Python standard library (no TensorFlow).
"""
import json
import os
import signal
import sys
import time


def fail(msg):
    sys.stderr.write(f"check_role: {msg}\n")
    sys.exit(1)


def parse_legacy(argv):
    out = {}
    for a in argv:
        for name in ("ps_hosts", "worker_hosts", "job_name", "task_index"):
            if a.startswith(f"--{name}="):
                out[name] = a.split("=", 1)[1]
    return out


def wait_for_ps(directory, ttype, tindex, num_ps):
    """A ps task marks `directory`; every other task waits until all of them have."""
    if ttype == "ps":
        open(os.path.join(directory, f"ps.{tindex}"), "w").close()
        return
    deadline = time.monotonic() + 60
    while sum(f.startswith("ps.") for f in os.listdir(directory)) < num_ps:
        if time.monotonic() > deadline:
            fail(f"the ps tasks did not all mark {directory} within 60 s")
        time.sleep(0.05)


def count_usr1(ttype, tindex, window):
    """Counts SIGUSR1 (blocked, so none merge) until `window` s after the first."""
    n, until = 0, time.monotonic() + 60
    while time.monotonic() < until:
        if signal.sigtimedwait([signal.SIGUSR1], until - time.monotonic()) is None:
            break
        n += 1
        if n == 1:
            until = time.monotonic() + window
    os.write(1, (json.dumps({"usr1": n, "type": ttype, "index": tindex}) + "\n").encode())


def main():
    argv = sys.argv[1:]
    exit_code = 0
    if "--exit-code" in argv:
        exit_code = int(argv[argv.index("--exit-code") + 1])
    join = "--join" in argv
    exits = dict(a.split("=") for a in (argv[i + 1] for i, v in enumerate(argv) if v == "--exit"))
    sleep = float(argv[argv.index("--sleep") + 1]) if "--sleep" in argv else 0.0
    ready = argv[argv.index("--ps-ready") + 1] if "--ps-ready" in argv else None
    usr1 = float(argv[argv.index("--count-usr1") + 1]) if "--count-usr1" in argv else None
    if usr1 is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    raw = os.environ.get("TF_CONFIG")
    if raw is None:
        fail("TF_CONFIG is not set")
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        fail(f"TF_CONFIG is not JSON: {e}")
    cluster = cfg.get("cluster") or fail("no cluster")
    task = cfg.get("task") or fail("no task")
    ttype, tindex = task.get("type"), task.get("index")
    if not isinstance(tindex, int):
        fail(f"task index {tindex!r} is not an int")

    def tasks_of(job):
        v = cluster.get(job, [])
        return dict(enumerate(v)) if isinstance(v, list) else {int(k): a for k, a in v.items()}

    if ttype != "evaluator" and tindex not in tasks_of(ttype):
        fail(f"task {ttype}:{tindex} not in cluster")
    if len(tasks_of("chief")) > 1:
        fail("more than one chief")
    is_chief = (ttype == "chief") if "chief" in cluster else (ttype == "worker" and tindex == 0)
    address = tasks_of(ttype).get(tindex)

    env_job, env_idx = os.environ.get("MPIFLOW_JOB"), os.environ.get("MPIFLOW_TASK_INDEX")
    if env_job is not None and (env_job != ttype or int(env_idx) != tindex):
        fail(f"MPIFLOW_JOB/TASK_INDEX {env_job}:{env_idx} != TF_CONFIG {ttype}:{tindex}")
    if os.environ.get("MPIFLOW_ADDRESS") not in (None, address):
        fail(f"MPIFLOW_ADDRESS {os.environ['MPIFLOW_ADDRESS']} != {address}")

    legacy = parse_legacy(argv)
    if legacy:
        if legacy.get("job_name") != ttype or int(legacy.get("task_index", -1)) != tindex:
            fail(f"legacy flags {legacy} disagree with TF_CONFIG {ttype}:{tindex}")
        for job in ("ps", "worker"):
            want = ",".join(tasks_of(job)[i] for i in sorted(tasks_of(job)))
            if legacy.get(f"{job}_hosts", "") != want:
                fail(f"--{job}_hosts={legacy.get(f'{job}_hosts')} != cluster {want}")

    line = json.dumps({
        "rank": int(os.environ["MPIFLOW_RANK"]) if "MPIFLOW_RANK" in os.environ else None,
        "local_rank": int(os.environ["MPIFLOW_LOCAL_RANK"]) if "MPIFLOW_LOCAL_RANK" in os.environ else None,
        "type": ttype,
        "index": tindex,
        "is_chief": is_chief,
        "address": address,
        "legacy_flags": bool(legacy),
        "num_workers": len(tasks_of("worker")) + len(tasks_of("chief")),
        "num_ps": len(tasks_of("ps")),
    })
    # One write per line: mpirun splices lines written in pieces.
    os.write(1, (line + "\n").encode())
    if usr1 is not None:
        count_usr1(ttype, tindex, usr1)
    if ready is not None:
        wait_for_ps(ready, ttype, tindex, len(tasks_of("ps")))
    if join and ttype == "ps":
        while True:  # server.join()
            signal.pause()
    me = f"{ttype}:{tindex}"
    if me in exits:
        sys.exit(int(exits[me]))
    time.sleep(sleep)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
