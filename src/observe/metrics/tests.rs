use super::*;

#[test]
fn the_evaluators_file_is_beside_the_chiefs_in_its_format() {
    let at = |p: &str| evaluator_path(Path::new(p));
    assert_eq!(at("runs/run.csv"), Path::new("runs/run.evaluator.csv"));
    assert_eq!(at("run.jsonl"), Path::new("run.evaluator.jsonl"));
    assert_eq!(at("a.b.json"), Path::new("a.b.evaluator.json"));
    assert_eq!(Format::of(&at("x.csv")).unwrap(), Format::Csv);
}

fn records() -> Vec<Record> {
    let times = |rank: usize, task: &str, c: f64| RankTimes {
        rank,
        task: task.into(),
        times: Times {
            compute: c,
            comm: 0.25,
            wait: 0.125,
            other: 0.0625,
            steps: 250,
        },
    };
    vec![
        Record::Step {
            step: 250,
            wall_s: 0.5,
            loss: Some(0.75),
            steps_per_sec: 500.0,
            samples_per_sec: 32000.0,
            ranks: vec![times(0, "worker:0", 0.5), times(1, "worker:1", 0.375)],
        },
        Record::Step {
            step: 500,
            wall_s: 1.0,
            loss: None,
            steps_per_sec: 500.0,
            samples_per_sec: 32000.0,
            ranks: vec![],
        },
        Record::Eval {
            step: 500,
            wall_s: 1.25,
            accuracy: 0.875,
            correct: 350,
            total: 400,
        },
        Record::Ctr {
            step: 500,
            wall_s: 1.5,
            auc: 0.8125,
            logloss: 0.4375,
            total: 20000,
        },
        Record::Rows {
            step: 500,
            wall_s: 1.75,
            task: "ps:1 (rank 1)".into(),
            table: "emb0".into(),
            rows: 1200,
            bytes: 182400,
            pulls: 500,
            rows_pulled: 64000,
            pushes: 500,
            rows_pushed: 64000,
            hot: vec![(7, 480), (3, 300)],
        },
        Record::Stall {
            step: 612,
            wall_s: 63.5,
            waited_s: 61.25,
            op: "allreduce".into(),
            waiting: vec!["worker:0".into(), "worker:2".into()],
            missing: vec!["worker:1".into(), "rank 7".into()],
            cleared: false,
        },
        Record::Stall {
            step: 612,
            wall_s: 70.0,
            waited_s: 67.5,
            op: "allreduce".into(),
            waiting: vec![],
            missing: vec![],
            cleared: true,
        },
    ]
}

#[test]
fn both_formats_write_what_they_read_back_and_a_cut_last_line_is_dropped() {
    let dir = std::env::temp_dir().join(format!("mpiflow-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["m.csv", "m.jsonl"] {
        let path = dir.join(name);
        let mut m = MetricsFile::create(&path).unwrap();
        for r in records() {
            m.write(&r).unwrap();
        }
        assert_eq!(read(&path).unwrap(), records(), "{name}");
        // A run killed in the middle of a line: that line goes, the rest stays.
        let text = std::fs::read_to_string(&path).unwrap();
        let cut = &text[..text.len() - 5];
        let got = parse(&path, Format::of(&path).unwrap(), cut).unwrap();
        let all = records();
        assert_eq!(got, all[..all.len() - 1], "{name}");
    }
    // A file of the header before stall reports still reads.
    let old = format!(
        "{CSV_HEADER_V1}step,250,0.5,0.75,500,32000,,,,,,,,,,\neval,500,1.25,,,,0.875,350,400,,,,,,,\n"
    );
    let got = parse(&dir.join("old.csv"), Format::Csv, &old).unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[1], records()[2]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_names_and_lines_are_one_line_errors_naming_file_and_line() {
    let e = MetricsFile::create(Path::new("/tmp/m.txt")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "metrics file /tmp/m.txt: name it .csv or .jsonl (the extension picks the format)"
    );
    let p = Path::new("m.csv");
    let text = format!("{CSV_HEADER}step,x,1,,1,1,,,,,,,,,,,,,,,,,,,,,,,\n");
    let e = parse(p, Format::Csv, &text).unwrap_err().to_string();
    assert_eq!(
        e,
        "metrics file m.csv, line 2: step \"x\" is not a step number"
    );
    let text = format!("{CSV_HEADER}step,1,1,,1,1,,,,,,,,,,\n");
    let e = parse(p, Format::Csv, &text).unwrap_err().to_string();
    assert_eq!(e, "metrics file m.csv, line 2: 16 fields, not 29");
    let e = parse(p, Format::Csv, "a,b\n").unwrap_err().to_string();
    assert!(e.starts_with("metrics file m.csv, line 1: not mpiflow's CSV header"));
    let e = parse(Path::new("m.jsonl"), Format::JsonLines, "{}\n").unwrap_err();
    assert!(e.to_string().starts_with("metrics file m.jsonl, line 1: "));
    // Values no run writes: a time before the start (a plot's axis of 1e308 either
    // way never finished drawing), a rank's negative seconds, an accuracy above 1.
    let row = |wall: &str, compute: &str| {
        format!("step,10,{wall},1.5,1,1,,,,0,worker:0,{compute},0,0,0,10,,,,,,,,,,,,,\n")
    };
    // A second rank's row of the same step, merged into its record.
    let rank1 = "step,10,1,1.5,1,1,,,,1,worker:1,-2,0,0,0,10,,,,,,,,,,,,,\n";
    for (rows, line, why) in [
        (
            row("-5", "0"),
            2,
            "wall_s -5.0 is not a finite, non-negative number",
        ),
        (
            row("inf", "0"),
            2,
            "wall_s inf is not a finite, non-negative number",
        ),
        (
            row("1", "-3"),
            2,
            "compute_s -3.0 is not a finite, non-negative number",
        ),
        (
            row("1", "0") + rank1,
            3,
            "compute_s -2.0 is not a finite, non-negative number",
        ),
        (
            "eval,10,1,,,,2,1,1,,,,,,,,,,,,,,,,,,,,\n".to_string(),
            2,
            "accuracy 2.0 of 1 right in 1 is not an accuracy",
        ),
        (
            "ctr,10,1,,,,,,5,,,,,,,,,,,1.5,0.5,,,,,,,,\n".to_string(),
            2,
            "auc 1.5 is not an AUC",
        ),
    ] {
        let e = parse(p, Format::Csv, &format!("{CSV_HEADER}{rows}"));
        assert_eq!(
            e.unwrap_err().to_string(),
            format!("metrics file m.csv, line {line}: {why}")
        );
    }
    let json = r#"{"kind":"eval","step":1,"wall_s":-1.0,"accuracy":0.5,"correct":1,"total":2}"#;
    let e = parse(
        Path::new("m.jsonl"),
        Format::JsonLines,
        &format!("{json}\n"),
    );
    assert_eq!(
        e.unwrap_err().to_string(),
        "metrics file m.jsonl, line 1: wall_s -1.0 is not a finite, non-negative number"
    );
}

#[test]
fn quoted_csv_fields_split_as_written() {
    assert_eq!(csv_split("a,\"b,c\",\"d\"\"e\""), ["a", "b,c", "d\"e"]);
    assert_eq!(csv_field("a,b"), "\"a,b\"");
}
