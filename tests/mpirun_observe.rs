//! Seeing a run under real `mpirun`: the metrics file in every mode (each rank's phase
//! times, the evaluation), the chief's progress as lines or a live line, the other ranks
//! quiet, and a metrics file that cannot be written as a one-line error.

mod common;

use common::{accuracy, mpiflow, mpiflow_alone, mpirun, tmpdir, Run};
use mpiflow::observe::metrics::{read, Record};

/// `mpirun -np NP mpiflow train FLAGS... MORE...`.
fn train(np: &str, flags: &str, more: &[&str]) -> Run {
    let mut args = vec!["-np", np, mpiflow(), "train"];
    args.extend(flags.split_whitespace());
    args.extend_from_slice(more);
    mpirun(&args)
}

/// The step records and the one evaluation of a metrics file.
fn records(path: &std::path::Path) -> (Vec<Record>, Record) {
    let all = read(path).unwrap_or_else(|e| panic!("{e}"));
    let (evals, steps): (Vec<Record>, Vec<Record>) = all
        .into_iter()
        .partition(|r| matches!(r, Record::Eval { .. }));
    assert_eq!(evals.len(), 1, "one evaluation: {evals:?}");
    (steps, evals.into_iter().next().unwrap())
}

/// Each step record's ranks, as (task, steps in the window, compute, comm, wait).
fn ranks(r: &Record) -> Vec<(String, u64, f64, f64, f64)> {
    let Record::Step { ranks, .. } = r else {
        panic!("not a step: {r:?}")
    };
    ranks
        .iter()
        .map(|t| {
            let x = &t.times;
            (t.task.clone(), x.steps, x.compute, x.comm, x.wait)
        })
        .collect()
}

#[test]
fn metrics_files_hold_every_ranks_phase_times_in_every_mode() {
    let dir = tmpdir("observe-metrics");
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();

    // Local: one rank, all compute; the final accuracy is the evaluation record.
    let local = path("local.csv");
    let run = mpiflow_alone(
        &[
            "train",
            "--mode",
            "local",
            "--steps",
            "300",
            "--log-every",
            "100",
            "--metrics",
            &local,
        ],
        &[],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let (steps, eval) = records(local.as_ref());
    assert_eq!(
        steps.iter().map(Record::step).collect::<Vec<_>>(),
        [100, 200, 300]
    );
    for s in &steps {
        let r = ranks(s);
        assert_eq!((r[0].0.as_str(), r[0].1), ("local", 100), "{s:?}");
        assert!(r[0].2 > 0.0 && r[0].3 == 0.0, "{s:?}");
    }
    let Record::Eval { accuracy: a, .. } = eval else {
        unreachable!()
    };
    assert_eq!(format!("{a:.4}"), format!("{:.4}", accuracy(&run.stdout)));
    // Plain lines (not a terminal) carry the ETA; the wall clock only grows.
    assert!(run.stdout.contains("step    300 loss") && run.stdout.contains(" eta 0:00"));
    assert!(steps.windows(2).all(|w| w[0].wall_s() <= w[1].wall_s()));

    // Allreduce, 3 replicas, JSON lines: every replica's window holds the logged steps;
    // the reduction's time is split into communication (the least any replica spent: the
    // same on all) and waiting (each one's excess: none for the last to arrive).
    let ar = path("ar.jsonl");
    let run = train(
        "3",
        "--mode allreduce --steps 300 --log-every 100 --metrics",
        &[&ar],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let (steps, eval) = records(ar.as_ref());
    assert_eq!(steps.len(), 3, "{steps:?}");
    for s in &steps {
        let r = ranks(s);
        let tasks: Vec<&str> = r.iter().map(|x| x.0.as_str()).collect();
        assert_eq!(tasks, ["worker:0", "worker:1", "worker:2"], "{s:?}");
        assert!(r.iter().all(|x| x.1 == 100 && x.2 > 0.0), "{s:?}");
        assert!(
            r.iter().all(|x| x.3 == r[0].3),
            "one communication time: {s:?}"
        );
        assert!(r.iter().any(|x| x.4 == 0.0), "someone arrived last: {s:?}");
    }
    let Record::Eval {
        accuracy: a, step, ..
    } = eval
    else {
        unreachable!()
    };
    assert_eq!(step, 300);
    assert!(
        (a - accuracy(&run.stdout)).abs() < 1e-4,
        "{a} {}",
        run.stdout
    );
    // Only the chief speaks: one line per logged step.
    let lines = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .count();
    assert_eq!(lines, 3, "{}", run.stdout);

    // ps, synchronous, 1 ps and 3 workers: the ps's times and every worker's, each window
    // exactly the logged steps; the ps made one update per step. The same by the one-sided
    // ps (counters in ps 0's window).
    let modes: [(&str, &[&str]); 3] = [
        ("sync", &[]),
        ("async", &["--async"]),
        ("rma", &["--transport", "rma"]),
    ];
    for (mode, extra) in modes {
        let ps = path(&format!("ps-{mode}.csv"));
        let flags = "--mode ps --ps 1 --steps 300 --log-every 100 --metrics";
        let mut more = vec![ps.as_str()];
        more.extend(extra);
        let run = train("4", flags, &more);
        assert_eq!(run.code, 0, "{run:?}");
        let (steps, _) = records(ps.as_ref());
        assert_eq!(steps.len(), 3, "{mode}: {steps:?}");
        let mut heard = std::collections::BTreeSet::new();
        for s in &steps {
            let r = ranks(s);
            heard.extend(r.iter().map(|x| x.0.clone()));
            if mode != "async" {
                let windows: Vec<(&str, u64)> = r.iter().map(|x| (x.0.as_str(), x.1)).collect();
                assert_eq!(
                    windows,
                    [
                        ("ps:0", 100),
                        ("worker:0", 100),
                        ("worker:1", 100),
                        ("worker:2", 100)
                    ],
                    "{s:?}"
                );
                assert!(r.iter().all(|x| x.2 > 0.0), "everyone computed: {s:?}");
            }
        }
        let heard: Vec<&str> = heard.iter().map(String::as_str).collect();
        assert_eq!(
            heard,
            ["ps:0", "worker:0", "worker:1", "worker:2"],
            "{mode}"
        );
    }
}

#[test]
fn progress_redraws_one_live_line_and_other_lines_go_above_it() {
    let dir = tmpdir("observe-live");
    let ckpt = dir.join("ckpt");
    let run = train(
        "2",
        "--mode allreduce --steps 300 --log-every 100 --progress live --checkpoint-every 200",
        &["--checkpoint-dir", ckpt.to_str().unwrap()],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let erase = "\r\x1b[2K";
    for step in [100, 200, 300] {
        let pct = format!("{:.0}", 100.0 * step as f64 / 300.0);
        let live = format!("{erase}step {step}/300 {pct}% loss ");
        assert!(run.stdout.contains(&live), "{live:?} in {:?}", run.stdout);
    }
    // The checkpoint note erases the live line, prints, and draws it again.
    let note = format!("{erase}# checkpoint {}/ckpt-200 written\n", ckpt.display());
    let at = run
        .stdout
        .find(&note)
        .unwrap_or_else(|| panic!("{:?}", run.stdout));
    assert!(run.stdout[at + note.len()..].starts_with("step 200/300 "));
    // The run's end starts a line of its own.
    let last = run.stdout.lines().last().unwrap();
    assert!(last.starts_with("accuracy "), "{:?}", run.stdout);
    assert!(!run.stdout.contains(" eta ?"), "{:?}", run.stdout);
}

#[test]
fn a_metrics_file_that_cannot_be_created_is_one_line_on_every_rank() {
    for (file, why) in [
        (
            "/nonexistent-dir/m.csv",
            "cannot create it: No such file or directory",
        ),
        ("/tmp/m.txt", "name it .csv or .jsonl"),
    ] {
        let run = train("2", "--mode allreduce --steps 10 --metrics", &[file]);
        run.assert_one_line_error(&format!(
            "mpiflow: error: rank 0: metrics file {file}: {why}"
        ));
        assert!(!run.stdout.contains("step "), "{run:?}");
    }
}

/// The spans of one rank in a trace: (name, start, duration, args).
fn spans_of(trace: &serde_json::Value, rank: u64) -> Vec<(String, f64, f64, serde_json::Value)> {
    trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == rank)
        .map(|e| {
            let name = e["name"].as_str().unwrap().to_string();
            let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
            (name, ts, dur, e["args"].clone())
        })
        .collect()
}

#[test]
fn timelines_hold_every_ranks_spans_on_one_clock() {
    let dir = tmpdir("observe-timeline");
    let read = |p: &std::path::Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    // Allreduce, 3 replicas: per rank and step the gradients, the allreduce (its bytes,
    // its peers) and the update; a track per rank named by its task; the replicas leave
    // each allreduce together on the aligned clocks.
    let ar = dir.join("ar.json");
    let ckpt = dir.join("ckpt");
    let run = train(
        "3",
        "--mode allreduce --steps 200 --checkpoint-every 100 --timeline",
        &[
            ar.to_str().unwrap(),
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
        ],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let trace = read(&ar);
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "worker:0 (rank 0)",
            "worker:1 (rank 1)",
            "worker:2 (rank 2)"
        ]
    );
    let mut ends: Vec<Vec<f64>> = vec![Vec::new(); 200];
    for rank in 0..3 {
        let spans = spans_of(&trace, rank);
        for name in ["gradients", "allreduce", "update"] {
            let n = spans.iter().filter(|s| s.0 == name).count();
            assert_eq!(n, 200, "rank {rank} {name}");
        }
        for (_, ts, dur, args) in spans.iter().filter(|s| s.0 == "allreduce") {
            // The gradients and the step's word (9 f32).
            assert_eq!(args["bytes"], 38440 + 36, "{args}");
            assert_eq!(args["peer"], "3 replicas");
            ends[args["step"].as_u64().unwrap() as usize].push(ts + dur);
        }
        let ckpts = spans.iter().filter(|s| s.0 == "checkpoint").count();
        assert_eq!(
            ckpts,
            if rank == 0 { 2 } else { 0 },
            "the chief checkpoints"
        );
    }
    let mut spread: Vec<f64> = ends
        .iter()
        .map(|e| {
            e.iter().cloned().fold(f64::MIN, f64::max) - e.iter().cloned().fold(f64::MAX, f64::min)
        })
        .collect();
    spread.sort_by(f64::total_cmp);
    assert!(
        spread[100] < 1000.0,
        "median spread of allreduce ends {} us",
        spread[100]
    );

    // ps, 1 ps and 2 workers: the workers' pushes and pulls with their bytes and their
    // ps; the ps's requests, updates and idle time.
    let ps = dir.join("ps.json");
    let run = train(
        "3",
        "--mode ps --ps 1 --steps 100 --timeline",
        &[ps.to_str().unwrap()],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let trace = read(&ps);
    for worker in [1, 2] {
        let spans = spans_of(&trace, worker);
        for name in ["gradients", "push", "pull"] {
            let n = spans.iter().filter(|s| s.0 == name).count();
            assert_eq!(n, 100, "rank {worker} {name}");
        }
        let push = spans.iter().find(|s| s.0 == "push").unwrap();
        assert_eq!(
            (push.3["bytes"].as_u64(), push.3["peer"].as_str()),
            (Some(38440), Some("ps:0"))
        );
    }
    let spans = spans_of(&trace, 0);
    assert_eq!(spans.iter().filter(|s| s.0 == "update").count(), 100);
    // One request per worker and step: each push carries the pull after it.
    let requests = spans.iter().filter(|s| s.0 == "request").count();
    assert!(
        (200..210).contains(&requests),
        "2 workers x 100 push-and-pulls (and the first pulls): {requests}"
    );

    // The picture of a timeline: a row per rank, a bar per span of the steps asked for.
    let svg = dir.join("ps.svg");
    let (svg, ps) = (svg.to_str().unwrap(), ps.to_str().unwrap());
    let run = mpiflow_alone(&["plot", "-o", svg, ps, "--steps", "50:52"], &[]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("3 ranks' spans of steps 50 to 52"),
        "{run:?}"
    );
    let (texts, _) = svg_contents(svg);
    for label in [
        "ps:0 (rank 0)",
        "worker:1 (rank 2)",
        "push",
        "pull",
        "request",
    ] {
        assert!(texts.iter().any(|t| t == label), "{label} in {texts:?}");
    }
    let rects = std::fs::read_to_string(svg)
        .unwrap()
        .matches("<rect")
        .count();
    assert!(
        rects >= 2 * 3 * 3,
        "2 workers x 3 steps x (gradients, push, pull): {rects}"
    );
    let run = mpiflow_alone(&["plot", "-o", svg, ps, "--steps", "500:510"], &[]);
    run.assert_one_line_error("no spans of steps 500..=510");
    // A timeline's rows are its tasks: a label would be ignored.
    let run = mpiflow_alone(&["plot", "-o", svg, ps, "--label", "mine"], &[]);
    run.assert_one_line_error(
        "--label names the curves of metrics files and benchmark outputs, not a timeline's rows",
    );
    // The picture's place is checked before the work; the picture there stays whole.
    let before = std::fs::read(svg).unwrap();
    let run = mpiflow_alone(&["plot", "-o", "/proc/none/t.svg", ps], &[]);
    run.assert_one_line_error(
        "/proc/none/t.svg: cannot write the picture there: cannot create /proc/none: ",
    );
    let run = mpiflow_alone(&["plot", "-o", svg, "/nonexistent.csv"], &[]);
    run.assert_one_line_error("/nonexistent.csv");
    assert_eq!(std::fs::read(svg).unwrap(), before);

    // A file that cannot be written: one line before training.
    let run = train(
        "2",
        "--mode allreduce --steps 10 --timeline",
        &["/nonexistent-dir/t.json"],
    );
    run.assert_one_line_error(
        "mpiflow: error: rank 0: timeline /nonexistent-dir/t.json: cannot write it: No such file",
    );
}

#[test]
fn plots_draw_runs_and_benchmarks_as_svg() {
    let dir = tmpdir("observe-plot");
    let file = |name: &str| dir.join(name).to_str().unwrap().to_string();
    // Two runs to overlay: ps against allreduce.
    let (ps, ar) = (file("ps.csv"), file("ar.jsonl"));
    let run = train(
        "3",
        "--mode ps --ps 1 --steps 200 --log-every 50 --metrics",
        &[&ps],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let run = train(
        "2",
        "--mode allreduce --steps 200 --log-every 50 --metrics",
        &[&ar],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let svg = file("runs.svg");
    let run = mpiflow_alone(
        &["plot", "-o", &svg, &ps, &ar, "--label", "ps, 3 ranks"],
        &[],
    );
    assert_eq!(run.code, 0, "{run:?}");
    let (texts, lines) = svg_contents(&svg);
    for label in [
        "ps, 3 ranks",
        "ar",
        "loss against global step",
        "loss against seconds",
    ] {
        assert!(texts.iter().any(|t| t == label), "{label} in {texts:?}");
    }
    // Each run's 4 logged steps, in both loss panels.
    assert_eq!(lines.iter().filter(|n| **n == 4).count(), 4, "{lines:?}");

    // A benchmark's output, a curve per path.
    let bench = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "latency",
        "-m",
        "1:4096",
        "--rounds",
        "1",
    ]);
    assert_eq!(bench.code, 0, "{bench:?}");
    let out = file("latency.txt");
    std::fs::write(&out, &bench.stdout).unwrap();
    let svg = file("latency.svg");
    let run = mpiflow_alone(&["plot", "-o", &svg, &out], &[]);
    assert_eq!(run.code, 0, "{run:?}");
    let (texts, lines) = svg_contents(&svg);
    for label in ["latency: mpi", "latency: mpiflow"] {
        assert!(texts.iter().any(|t| t == label), "{label} in {texts:?}");
    }
    assert!(
        lines.iter().filter(|n| **n == 13).count() >= 2,
        "1 B to 4 KiB: {lines:?}"
    );

    // More labels than files: the extra ones would be ignored.
    let run = mpiflow_alone(
        &["plot", "-o", &svg, &out, "--label", "a", "--label", "b"],
        &[],
    );
    run.assert_one_line_error("2 --label for 1 file(s): one per file, in order");

    // Mixed kinds, and a file that is neither: one line each.
    let run = mpiflow_alone(&["plot", "-o", &svg, &ps, &out], &[]);
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run
        .stderr
        .contains("metrics files (.csv, .jsonl) or benchmark outputs, not both"));
    let run = mpiflow_alone(&["plot", "-o", &svg, "Cargo.toml"], &[]);
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.stderr.lines().count(), 1, "{run:?}");
    assert!(
        run.stderr.contains("Cargo.toml: no benchmark table"),
        "{run:?}"
    );
}

/// The texts of an SVG, and its polylines' point counts (it must parse as XML).
fn svg_contents(path: &str) -> (Vec<String>, Vec<usize>) {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    let texts = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .collect();
    let lines = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .map(|n| {
            n.attribute("points")
                .unwrap_or("")
                .split_whitespace()
                .count()
        })
        .collect();
    (texts, lines)
}

/// The task of world rank `rank`, from the chief's `# ranks: 0=ps:0 1=worker:0 ...` line.
fn task_of(text: &str, rank: usize) -> String {
    let line = text
        .lines()
        .find(|l| l.starts_with("# ranks: "))
        .unwrap_or_else(|| panic!("no ranks line in {text}"));
    let want = format!("{rank}=");
    line["# ranks: ".len()..]
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(want.as_str()))
        .unwrap_or_else(|| panic!("rank {rank} not in {line}"))
        .to_string()
}

/// A rank stopped (SIGSTOP) for 4 s in the middle of training: the chief names it as not
/// arrived, with the step and the operation the others wait in, again while it lasts, then
/// says the stall cleared; the metrics file holds the reports; training goes on until
/// SIGUSR1 stops it (exit 75). Every wait counts, the periodic ones too.
#[test]
fn a_stopped_rank_is_named_in_a_stall_report_until_it_continues() {
    let dir = tmpdir("observe-stall");
    for (np, mode) in [
        // Replicas compare parameters every step: a stop often lands in that allgather.
        ("3", "--mode allreduce --check-every 1"),
        ("4", "--mode ps --ps 1"),
        ("4", "--mode allreduce --stages 2"),
    ] {
        let metrics = dir.join(format!("{}.jsonl", mode.replace([' ', '-'], "")));
        let trace = metrics.with_extension("json");
        let mut args = vec!["-np", np, mpiflow(), "train"];
        args.extend(mode.split_whitespace());
        let m = metrics.to_str().unwrap();
        args.extend([
            "--steps",
            "100000000",
            "--log-every",
            "1000",
            "--stall-warning",
            "1",
            "--metrics",
            m,
            "--timeline",
            trace.to_str().unwrap(),
        ]);
        let start = std::time::Instant::now();
        // Training is under way (a step logged), for a second at least.
        let ready = |_: &str| {
            start.elapsed() > std::time::Duration::from_secs(1)
                && std::fs::read_to_string(&metrics).is_ok_and(|t| t.contains(r#""kind":"step""#))
        };
        let last = np.parse::<usize>().unwrap() - 1;
        let (text, code) = common::with_rank_when(&args, Some(last), ready, |pid, mpirun| {
            common::signal(pid, "-STOP");
            std::thread::sleep(std::time::Duration::from_secs(4));
            common::signal(pid, "-CONT");
            // The chief asks every 0.5 s while a stall lasts: its clearing is out by then.
            std::thread::sleep(std::time::Duration::from_secs(2));
            common::signal(mpirun, "-USR1");
        });
        assert_eq!(code, Some(75), "{mode}: {text}");
        let victim = task_of(&text, last);
        let stalls: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("# warning: stall at step "))
            .collect();
        let reports: Vec<&&str> = stalls.iter().filter(|l| !l.contains("cleared")).collect();
        assert!(reports.len() >= 2, "{mode}: {text}");
        for r in &reports {
            assert!(
                r.ends_with(&format!("; not arrived: {victim} (no answer)")),
                "{mode}: {r}"
            );
        }
        // The workers wait in the allreduce, or in their push and pull (one request); the
        // ps gathers the pushes or replies.
        // With stages: the stopped stage's neighbour waits in its receive, the others in
        // the step's allreduce. Replicas may also wait in the allgather of their
        // parameter checksums (every 100 steps) or of the log's phase times.
        let ops: &[&str] = if mode.contains("stages") {
            &["allreduce", "pipeline receive", "allgather"]
        } else if mode.contains("ps") {
            &["push and pull", "gather of pushes", "reply"]
        } else {
            &["allreduce", "allgather"]
        };
        let waits = |line: &str| ops.iter().any(|op| line.contains(&format!(" in {op}")));
        assert!(reports.iter().all(|r| waits(r)), "{mode}: {reports:?}");
        let cleared: Vec<&&str> = stalls.iter().filter(|l| l.contains("cleared")).collect();
        assert_eq!(cleared.len(), 1, "{mode}: {text}");
        // Only the chief reports; the stopped rank is not blamed by anyone else.
        assert_eq!(text.matches("does not answer").count(), 0, "{mode}: {text}");
        let records = read(&metrics).unwrap();
        let stall_records: Vec<&Record> = records
            .iter()
            .filter(|r| matches!(r, Record::Stall { .. }))
            .collect();
        assert_eq!(stall_records.len(), stalls.len(), "{mode}: {records:?}");
        let Record::Stall { missing, op: o, .. } = stall_records[0] else {
            unreachable!()
        };
        assert_eq!(missing, std::slice::from_ref(&victim), "{mode}");
        assert!(ops.contains(&o.as_str()), "{mode}: {o}");
        let Some(Record::Stall {
            cleared: true,
            waited_s,
            ..
        }) = stall_records.last()
        else {
            panic!("{mode}: the last stall record is not the clearing: {records:?}")
        };
        assert!((3.0..8.0).contains(waited_s), "{mode}: {waited_s}");
        // The timeline, gathered although a signal stopped the job, holds the stall on
        // the chief's track.
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        let stalls: Vec<&serde_json::Value> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "stall")
            .collect();
        assert_eq!(stalls.len(), 1, "{mode}: {stalls:?}");
        let peer = format!("not arrived: {victim}");
        assert_eq!(
            stalls[0]["args"]["peer"].as_str(),
            Some(peer.as_str()),
            "{mode}"
        );
        assert!(
            stalls[0]["dur"].as_f64().unwrap() >= 3e6,
            "{mode}: {}",
            stalls[0]
        );
    }
}
