//! `mpiflow scale`: links fitted to real `mpiflow bench latency` output, a real run's
//! metrics checked against the model, predictions by hosts, and its errors.

mod common;

use common::{mpiflow, mpiflow_alone, mpirun, tmpdir};

/// The predicted rows of a model's table: (hosts, allreduce ms, ps ms).
fn predictions(stdout: &str) -> Vec<(usize, f64, f64)> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.len() {
                8 => Some((f[0].parse().ok()?, f[2].parse().ok()?, f[4].parse().ok()?)),
                _ => None,
            }
        })
        .collect()
}

/// `mpirun -np 2 mpiflow ARGS` (split at spaces), which must succeed: its stdout.
fn two_ranks(args: &str) -> String {
    let mut cmd = vec!["-np", "2", mpiflow()];
    cmd.extend(args.split(' '));
    let run = mpirun(&cmd);
    assert_eq!(run.code, 0, "{args}: {run:?}");
    run.stdout
}

#[test]
fn a_measured_run_is_checked_and_hosts_are_predicted() {
    let dir = tmpdir("cli-scale");
    let lat = dir.join("latency.txt");
    let metrics = dir.join("ar.jsonl");
    let (lat_s, metrics_s) = (lat.to_str().unwrap(), metrics.to_str().unwrap());
    // Up to 1 MiB: from 2 MiB tensors sit on huge pages and one node's exchanges can take
    // less time than at 1 MiB, which no link fits (the fit's own error says so).
    std::fs::write(&lat, two_ranks("bench latency --path mpiflow -m 1:1048576")).unwrap();
    let bibw_path = dir.join("bibw.txt");
    std::fs::write(
        &bibw_path,
        two_ranks("bench bibw -W 1 --path mpiflow -m 1:1048576"),
    )
    .unwrap();
    let train = format!(
        "train --mode allreduce --steps 200 --log-every 50 --progress lines --metrics {metrics_s}"
    );
    two_ranks(&train);

    // One node: the same file for both links; the run on 1 host of 2 workers.
    let run = format!("mlp:1:{metrics_s}");
    let args = [
        "scale",
        "--shm",
        lat_s,
        "--net",
        lat_s,
        "--net-bibw",
        bibw_path.to_str().unwrap(),
        "--data",
        "digits",
        "--hosts",
        "2,16,1024",
        "--reps",
        "5",
        "--run",
        &run,
        "--tolerance",
        "100",
    ];
    let out = mpiflow_alone(&args, &[]);
    assert_eq!(out.code, 0, "{out:?}");
    let both = out
        .stdout
        .lines()
        .find(|l| l.starts_with("# both ways:"))
        .unwrap();
    assert!(
        both.ends_with("bibw.txt)") && both.contains("GB/s"),
        "{both}"
    );
    let rows = predictions(&out.stdout);
    assert_eq!(
        rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        [2, 16, 1024],
        "{}",
        out.stdout
    );
    // Weak scaling: an allreduce step never gets shorter with more hosts; a ps step may
    // (each of more ps tasks applies a smaller slice) until its messages dominate.
    for pair in rows.windows(2) {
        assert!(pair[1].1 >= pair[0].1, "{}", out.stdout);
    }
    assert!(rows[2].2 > rows[0].2, "{}", out.stdout);
    assert!(
        out.stdout.contains("# the shorter step: "),
        "{}",
        out.stdout
    );
    let checked: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.contains("ar.jsonl"))
        .collect();
    assert_eq!(checked.len(), 1, "{}", out.stdout);
    let f: Vec<&str> = checked[0].split_whitespace().collect();
    assert_eq!(
        (f[0], f[1], f[2], f[3], f[4]),
        ("mlp", "allreduce", "1", "2", "0")
    );
    let (predicted, measured): (f64, f64) = (f[7].parse().unwrap(), f[8].parse().unwrap());
    assert!(predicted > 0.0 && measured > 0.0, "{}", checked[0]);

    // No tolerance: the run is off its prediction, one line and a failure.
    let mut strict = args.to_vec();
    *strict.last_mut().unwrap() = "0";
    let out = mpiflow_alone(&strict, &[]);
    assert_eq!(out.code, 1, "{out:?}");
    assert_eq!(
        out.stderr.trim(),
        "mpiflow: error: 1 of 1 runs are off their prediction by more than 0%"
    );

    // The picture.
    let svg = dir.join("scale.svg");
    let mut drawn = args.to_vec();
    drawn.extend(["--svg", svg.to_str().unwrap()]);
    let out = mpiflow_alone(&drawn, &[]);
    assert_eq!(out.code, 0, "{out:?}");
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("mlp allreduce") && text.contains("mlp ps"));
}

#[test]
fn bad_inputs_are_one_line_errors() {
    let dir = tmpdir("cli-scale-bad");
    let lat = dir.join("latency.txt");
    std::fs::write(
        &lat,
        "# Size Latency (us)\n1 5.0\n1048576 900.0\n4194304 3600.0\n",
    )
    .unwrap();
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "# nothing measured\n").unwrap();
    let one = dir.join("one.txt");
    std::fs::write(&one, "# Size Latency (us)\n8 5.0\n8 5.1\n").unwrap();
    let bad = dir.join("bad.txt");
    std::fs::write(&bad, "# Size Latency (us)\n1 5.0\n1024 abc\n4096 7.0\n").unwrap();
    let metrics = dir.join("none.jsonl");
    std::fs::write(&metrics, "").unwrap();
    let [lat, empty, one, bad, metrics] =
        [&lat, &empty, &one, &bad, &metrics].map(|p| p.to_str().unwrap());
    let base = ["scale", "--data", "digits", "--reps", "1", "--hosts", "2"];
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["--shm", empty, "--net", lat],
            format!(
                "--shm {empty}: no benchmark table (a `# Size` header and rows of size and value)"
            ),
        ),
        (
            vec!["--shm", lat, "--net", lat, "--net-bibw", empty],
            format!("--net-bibw {empty}: no benchmark table"),
        ),
        (
            vec!["--shm", lat, "--net", one],
            format!("--net {one}: a link needs measurements at 2 or more sizes, got 1"),
        ),
        (
            vec!["--shm", bad, "--net", lat],
            format!("--shm {bad}:3: \"1024 abc\": a row is a message size and a value"),
        ),
        (
            vec!["--shm", lat, "--net", "/nonexistent/net.txt"],
            "--net /nonexistent/net.txt: No such file or directory".into(),
        ),
        (
            vec!["--shm", lat, "--net", lat, "--run", "mlp:two:x.jsonl"],
            "--run mlp:two:x.jsonl: hosts two is not a positive count".into(),
        ),
        (
            vec!["--shm", lat, "--net", lat, "--run", "cnn:2:x.jsonl"],
            "--run cnn:2:x.jsonl: model cnn is not one of --model".into(),
        ),
        (
            vec!["--shm", lat, "--net", lat, "--run", "mlp:2"],
            "--run mlp:2: give it as MODEL:HOSTS:FILE".into(),
        ),
    ];
    for (extra, want) in cases {
        let mut args = base.to_vec();
        args.extend(extra);
        let out = mpiflow_alone(&args, &[]);
        assert_eq!(out.code, 1, "{args:?}: {out:?}");
        let line = out.stderr.trim();
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(
            line.starts_with("mpiflow: error: ") && line.contains(&want),
            "{line}\nwant: {want}"
        );
    }
    let out = mpiflow_alone(
        &["scale", "--shm", lat, "--net", lat, "--tolerance=-1"],
        &[],
    );
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("-1 is not a fraction of 0 or more"),
        "{out:?}"
    );
    let run = format!("mlp:2:{metrics}");
    let out = mpiflow_alone(
        &[
            "scale", "--shm", lat, "--net", lat, "--data", "digits", "--run", &run,
        ],
        &[],
    );
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr
            .contains("no logged step with every rank's times"),
        "{out:?}"
    );
}
