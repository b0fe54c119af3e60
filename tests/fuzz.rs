//! Property tests over every parser and decoder of outside input: host lists, hostfiles,
//! Slurm's variables, TF_CONFIG, the legacy flags, checkpoint files, data files (IDX and
//! the digits CSV), benchmark tables (OSU format), timelines (trace-event files), the
//! tensor wire header and the ps protocol. Any input: no panic (an error value is fine);
//! inputs a printer made: parsed back to the same value. Bounded: a fixed number of cases
//! each.
//! Cases proptest finds are kept under `tests/fuzz.proptest-regressions` and rerun first.

use std::collections::BTreeMap;
use std::path::Path;

use proptest::prelude::*;

use mpiflow::cluster::hostfile::Hostfile;
use mpiflow::cluster::hostlist::{expand_hosts, expand_tasks_per_node};
use mpiflow::cluster::slurm::SlurmStep;
use mpiflow::cluster::{flags, ClusterSpec, TaskId, TfConfig};
use mpiflow::train::checkpoint;
use mpiflow::train::data::Dataset;
use mpiflow::train::ps::protocol::{self, Reply, Request};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 400,
        max_shrink_iters: 2000,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::Direct(
                "tests/fuzz.proptest-regressions",
            ),
        )),
        ..ProptestConfig::default()
    }
}

/// A checkpoint file around `header` and `body`, with a matching checksum; `hlen` as the
/// header's length field (the true length if `None`).
fn framed(header: &str, body: &[u8], hlen: Option<u32>) -> Vec<u8> {
    let mut file = b"MFCKPT01".to_vec();
    file.extend_from_slice(&hlen.unwrap_or(header.len() as u32).to_le_bytes());
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(body);
    let sum = checkpoint::checksum(&file);
    file.extend_from_slice(&sum.to_le_bytes());
    file
}

/// An IDX file: its magic number, its counts (big-endian), then `body`.
fn idx_file(magic: u32, counts: &[u32], body: &[u8]) -> Vec<u8> {
    let mut file = magic.to_be_bytes().to_vec();
    for c in counts {
        file.extend_from_slice(&c.to_be_bytes());
    }
    file.extend_from_slice(body);
    file
}

/// A count in an IDX header: small, any, or one whose products wrap a `usize`.
fn idx_count() -> impl Strategy<Value = u32> {
    prop_oneof![
        0u32..5,
        any::<u32>(),
        Just(1 << 16),
        Just(1 << 24),
        Just(u32::MAX)
    ]
}

/// Strings made mostly of the characters the parsers care about.
fn syntaxy() -> impl Strategy<Value = String> {
    proptest::string::string_regex(r"[a-z0-9\[\]\-,()x:=.# \t\n{}\x22]{0,40}").unwrap()
}

/// A host name: a letter, then letters, digits and dashes.
fn host() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[a-z][a-z0-9-]{0,8}").unwrap()
}

/// A cluster of ps and worker tasks on `host:port` addresses, and one of its tasks.
fn cluster() -> impl Strategy<Value = TfConfig> {
    (
        proptest::collection::vec((host(), 1024u16..65535), 0..3),
        proptest::collection::vec((host(), 1024u16..65535), 1..5),
        any::<bool>(),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(ps, workers, pick_ps, at)| {
            let addrs = |v: &[(String, u16)]| -> Vec<String> {
                v.iter()
                    .enumerate()
                    .map(|(i, (h, p))| format!("{h}:{}", p.wrapping_add(i as u16).max(1024)))
                    .collect()
            };
            let mut spec = ClusterSpec::new();
            if !ps.is_empty() {
                spec.add_dense_job("ps", &addrs(&ps)).unwrap();
            }
            spec.add_dense_job("worker", &addrs(&workers)).unwrap();
            let task = if pick_ps && !ps.is_empty() {
                TaskId::new("ps", at.index(ps.len()))
            } else {
                TaskId::new("worker", at.index(workers.len()))
            };
            TfConfig::new(spec, task)
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn host_lists_never_panic(s in syntaxy()) {
        let _ = expand_hosts(&s);
        let _ = expand_tasks_per_node(&s);
    }

    #[test]
    fn host_lists_expand_ranges(prefix in "[a-z]{1,5}", a in 0usize..50, n in 1usize..20, width in 1usize..4) {
        let b = a + n - 1;
        let list = format!("{prefix}[{a:0width$}-{b:0width$}],{prefix}x");
        let hosts = expand_hosts(&list).unwrap();
        prop_assert_eq!(hosts.len(), n + 1);
        prop_assert_eq!(&hosts[0], &format!("{prefix}{a:0width$}"));
        prop_assert_eq!(&hosts[n - 1], &format!("{prefix}{b:0width$}"));
    }

    #[test]
    fn tasks_per_node_expand(parts in proptest::collection::vec((1usize..9, 1usize..5), 1..6)) {
        let list: Vec<String> = parts.iter().map(|(c, r)| if *r == 1 { c.to_string() } else { format!("{c}(x{r})") }).collect();
        let want: Vec<usize> = parts.iter().flat_map(|(c, r)| std::iter::repeat_n(*c, *r)).collect();
        prop_assert_eq!(expand_tasks_per_node(&list.join(",")).unwrap(), want);
    }

    #[test]
    fn hostfiles_never_panic(text in syntaxy(), slots in 0usize..4) {
        let _ = Hostfile::parse("fuzzed", &text, slots);
    }

    #[test]
    fn slurm_variables_never_panic(vals in proptest::collection::vec(syntaxy(), 6)) {
        let names = ["SLURM_PROCID", "SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_LOCALID"];
        let env: BTreeMap<String, String> = names.iter().map(|n| n.to_string()).zip(vals).collect();
        let _ = SlurmStep::from_env(&env);
    }

    #[test]
    fn tf_config_never_panics(s in syntaxy()) {
        let _ = TfConfig::parse(&s);
    }

    #[test]
    fn tf_config_round_trips(c in cluster()) {
        let back = TfConfig::parse(&c.to_json()).unwrap();
        prop_assert_eq!(back.to_json(), c.to_json());
        prop_assert_eq!(back.task, c.task);
    }

    #[test]
    fn legacy_flags_never_panic(args in proptest::collection::vec(prop_oneof![
        syntaxy(),
        Just("--ps_hosts".to_string()),
        Just("--worker_hosts".to_string()),
        Just("--job_name".to_string()),
        Just("--task_index".to_string()),
        syntaxy().prop_map(|v| format!("--task_index={v}")),
        syntaxy().prop_map(|v| format!("--worker_hosts={v}")),
    ], 0..8)) {
        let _ = flags::parse(&args);
    }

    #[test]
    fn legacy_flags_round_trip(c in cluster()) {
        let back = flags::parse(&flags::emit(&c).unwrap()).unwrap();
        prop_assert_eq!(back.to_json(), c.to_json());
    }

    #[test]
    fn checkpoint_files_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = checkpoint::parse(Path::new("fuzzed"), &bytes, None);
    }

    /// Well-framed files (magic, header length, a checksum that matches) around any
    /// header and body: the checks past the checksum must hold on their own.
    #[test]
    fn framed_checkpoint_files_never_panic(
        header in syntaxy(),
        body in proptest::collection::vec(any::<u8>(), 0..64),
        hlen in any::<Option<u32>>(),
    ) {
        let _ = checkpoint::parse(Path::new("fuzzed"), &framed(&header, &body, hlen), None);
    }

    /// An array is read with exactly the length its header declares, or refused: a
    /// length past the body (or one whose byte count overflows) is never wrapped around.
    #[test]
    fn checkpoint_arrays_have_their_declared_length(
        step in any::<u64>(),
        len in prop_oneof![0u64..20, any::<u64>(), (1u64 << 62)..(1u64 << 62) + 4],
        body in proptest::collection::vec(any::<u8>(), 0..80),
    ) {
        let header = format!(r#"{{"step":{step},"arrays":[["w",{len}]]}}"#);
        if let Ok(a) = checkpoint::parse(Path::new("fuzzed"), &framed(&header, &body, None), None) {
            prop_assert_eq!(a.arrays[0].1.len() as u64, len);
            prop_assert_eq!(body.len() as u64, 4 * len);
        }
    }

    /// Any manifest: an error or a checkpoint, and never a file outside its directory.
    #[test]
    fn checkpoint_manifests_never_panic_nor_leave_the_directory(
        manifest in prop_oneof![
            syntaxy(),
            ("[a-z./]{0,12}", any::<u64>(), "[0-9a-f]{0,17}").prop_map(|(f, b, c)| {
                format!(r#"{{"step":3,"files":[{{"file":"{f}","bytes":{b},"checksum":"{c}"}}]}}"#)
            }),
        ],
    ) {
        let dir = std::env::temp_dir().join(format!("mpiflow-fuzz-manifest-{}", std::process::id()));
        let ckpt = dir.join("ckpt-3");
        std::fs::create_dir_all(&ckpt).unwrap();
        std::fs::write(dir.join("outside"), framed("{}", &[], None)).unwrap();
        std::fs::write(ckpt.join("manifest.json"), &manifest).unwrap();
        if let Ok(found) = checkpoint::verify(&ckpt) {
            for (name, ..) in &found.files {
                prop_assert!(ckpt.join(name).parent() == Some(ckpt.as_path()), "{name}");
            }
        }
        let escape = r#"{"step":3,"files":[{"file":"../outside","bytes":0,"checksum":"0"}]}"#;
        std::fs::write(ckpt.join("manifest.json"), escape).unwrap();
        let e = checkpoint::verify(&ckpt).unwrap_err().to_string();
        prop_assert!(e.contains("is not a file name"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn checkpoint_arrays_round_trip(arrays in proptest::collection::vec(("[a-z/]{1,8}", proptest::collection::vec(-1e6f32..1e6, 0..20)), 0..4), step in any::<u64>()) {
        let a = checkpoint::Arrays { step, meta: serde_json::Value::Null, arrays };
        let back = checkpoint::parse(Path::new("fuzzed"), &checkpoint::encode(&a), None).unwrap();
        prop_assert_eq!(back.step, a.step);
        prop_assert_eq!(back.arrays, a.arrays);
    }

    #[test]
    fn tensor_headers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
        let _ = mpiflow::tensor::describe_header(&bytes);
        let _ = mpiflow::tensor::header_payload_len(&bytes);
    }

    #[test]
    fn metrics_files_never_panic(text in "[a-z0-9_,.:\"{}\n-]{0,300}") {
        use mpiflow::observe::metrics::{parse, Format};
        let header = "kind,step,wall_s,loss,steps_per_sec,samples_per_sec,accuracy,correct,total,rank,task,compute_s,comm_s,wait_s,other_s,rank_steps\n";
        for format in [Format::Csv, Format::JsonLines] {
            let _ = parse(std::path::Path::new("m"), format, &text);
            let _ = parse(std::path::Path::new("m"), format, &format!("{header}{text}"));
        }
    }

    #[test]
    fn benchmark_tables_never_panic(text in "(# Size  Latency \\(us\\)\n|# mpiflow path: [a-z]{1,4}\n|# OSU [A-Za-z ]{0,9}\n|[0-9]{1,7}|[ .eE+-]|nan|inf|abc|\n){0,60}") {
        use mpiflow::observe::osu_tables::{read, ReadError};
        match read("t.txt", &text) {
            Ok(tables) => prop_assert!(tables.iter().all(|t| !t.rows.is_empty()
                && t.rows.iter().all(|(m, v)| m.is_finite() && *m >= 0.0 && v.is_finite() && *v >= 0.0))),
            Err(ReadError::Row { line, .. }) => prop_assert!(line >= 1 && line <= text.lines().count()),
            Err(ReadError::NoTable(f)) => prop_assert_eq!(f, "t.txt"),
        }
    }

    #[test]
    fn benchmark_tables_read_back(rows in proptest::collection::vec((0u32..1 << 22, 0.0f64..1e6), 1..20)) {
        let mut text = String::from("# OSU MPI Latency Test v7.4\n# Size          Latency (us)\n");
        for (m, v) in &rows {
            text.push_str(&format!("{m:<10}{v:>20.2}\n"));
        }
        let tables = mpiflow::observe::osu_tables::read("t.txt", &text).unwrap();
        prop_assert_eq!(tables.len(), 1);
        prop_assert_eq!(tables[0].rows.len(), rows.len());
        for ((m, v), (gm, gv)) in rows.iter().zip(&tables[0].rows) {
            prop_assert_eq!(f64::from(*m), *gm);
            prop_assert!((v - gv).abs() <= 0.005 + 1e-9);
        }
    }

    #[test]
    fn trace_files_never_panic_nor_break_the_picture(
        events in proptest::collection::vec((
            prop_oneof![Just("X"), Just("M"), Just("B")],
            0u64..3,
            prop_oneof![-1e9f64..1e9, Just(0.0), Just(1e300), Just(-1e300), Just(1.7e308), Just(-1.7e308)],
            prop_oneof![-10.0f64..1e6, Just(0.0), Just(1e308), Just(-1.0)],
            proptest::option::of(0u64..20),
        ), 0..12),
    ) {
        use mpiflow::observe::timeline::parse;
        let events: Vec<String> = events
            .iter()
            .map(|(ph, pid, ts, dur, step)| {
                let step = step.map_or("null".to_string(), |s| s.to_string());
                format!(r#"{{"name":"n","ph":"{ph}","pid":{pid},"ts":{ts:?},"dur":{dur:?},"args":{{"step":{step},"name":"t"}}}}"#)
            })
            .collect();
        let text = format!(r#"{{"traceEvents":[{}]}}"#, events.join(","));
        if let Ok(tracks) = parse(Path::new("t.json"), &text) {
            for s in tracks.iter().flat_map(|t| &t.spans) {
                prop_assert!(s.dur_us >= 0.0 && (s.start_us + s.dur_us).abs() <= 1e300);
            }
            let svg = std::env::temp_dir().join(format!("mpiflow-fuzz-{}.svg", std::process::id()));
            let _ = mpiflow::observe::plot::timeline_svg(&tracks, None, &svg);
            let _ = std::fs::remove_file(&svg);
        }
    }

    #[test]
    fn ps_messages_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
        let _ = protocol::decode::<Request>(&bytes);
        let _ = protocol::decode::<Reply>(&bytes);
        if let Some(r) = protocol::decode::<Request>(&bytes) {
            let _ = r.payload(0);
        }
    }

    #[test]
    fn ps_messages_round_trip(lens in proptest::collection::vec(0usize..1 << 20, 0..6), step in any::<u64>(), samples in 0usize..1024, name in "[a-z/]{1,8}", stop in proptest::option::of(1i32..64), compute in proptest::option::of(0.0f64..1e9)) {
        let vars: Vec<(String, usize)> = lens.iter().map(|l| (name.clone(), *l)).collect();
        let times = compute.map(|c| mpiflow::observe::phases::Times { compute: c, comm: c / 3.0, wait: 0.0, other: 1e-9, steps: step });
        let pull = stop.map(|s| protocol::Then { step: s as u64, report: step % 2 == 0 });
        // Some pushes say what their worker found not finite (a gradient named by `name`).
        let non_finite = stop.map(|_| mpiflow::train::guard::NonFinite::Gradient { step, tensor: name.clone(), value: "inf".into(), whose: String::new() });
        let req = Request::Push { step, samples, loss: Some(0.5), vars, stop, times, non_finite: non_finite.clone(), pull };
        let back = protocol::decode::<Request>(&protocol::encode(&req)).unwrap();
        prop_assert_eq!(&back, &req);
        // The payload the header declares: its parts, in pieces that cover each once.
        prop_assert_eq!(back.payload(0), lens.clone());
        let mut covered = vec![0usize; lens.len()];
        for p in protocol::pieces(lens.iter().copied()) {
            prop_assert!(p.range.len() <= protocol::PIECE_FLOATS && !p.range.is_empty());
            prop_assert_eq!(p.range.start, covered[p.part]);
            covered[p.part] = p.range.end;
        }
        prop_assert_eq!(covered, lens);
        let reply = Reply::Stale { step };
        let back = protocol::decode::<Reply>(&protocol::encode(&reply)).unwrap();
        prop_assert_eq!(back, reply);
        if let Some(why) = non_finite {
            let verdict = Reply::NotApplied { why: why.seen(format!(" on {samples} of 1024 workers")) };
            let back = protocol::decode::<Reply>(&protocol::encode(&verdict)).unwrap();
            prop_assert_eq!(back, verdict);
        }
    }

    /// Any IDX pair: an error, or a data set whose sizes agree with each other.
    #[test]
    fn idx_files_never_panic(
        img_magic in prop_oneof![Just(0x803u32), any::<u32>()],
        counts in proptest::collection::vec(idx_count(), 0..4),
        body in proptest::collection::vec(any::<u8>(), 0..64),
        lab_magic in prop_oneof![Just(0x801u32), any::<u32>()],
        lab_count in idx_count(),
        labels in proptest::collection::vec(any::<u8>(), 0..8),
    ) {
        let img = idx_file(img_magic, &counts, &body);
        let lab = idx_file(lab_magic, &[lab_count], &labels);
        if let Ok(d) = Dataset::idx_from((Path::new("i"), &img), (Path::new("l"), &lab)) {
            prop_assert!(!d.is_empty() && d.features > 0);
            prop_assert_eq!(d.x.len(), d.len() * d.features);
            prop_assert!(d.y.iter().all(|&l| usize::from(l) < d.classes));
        }
    }

    /// Well-formed IDX pairs load with the images, pixels and labels written.
    #[test]
    fn idx_files_load(n in 1usize..6, rows in 1usize..4, cols in 1usize..4, seed in any::<u8>()) {
        let pixels: Vec<u8> = (0..n * rows * cols).map(|i| (i as u8).wrapping_mul(seed)).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i as u8 + seed) % 10).collect();
        let img = idx_file(0x803, &[n as u32, rows as u32, cols as u32], &pixels);
        let lab = idx_file(0x801, &[n as u32], &labels);
        let d = Dataset::idx_from((Path::new("i"), &img), (Path::new("l"), &lab)).unwrap();
        prop_assert_eq!((d.len(), d.features, &d.shape), (n, rows * cols, &vec![rows, cols, 1]));
        prop_assert_eq!(&d.y, &labels);
        let back: Vec<u8> = d.x.iter().map(|v| (v * 255.0).round() as u8).collect();
        prop_assert_eq!(back, pixels);
    }

    /// Any text as the digits CSV: an error naming a line, or 64 pixels and a label each.
    #[test]
    fn digits_files_never_panic(text in "([0-9]{1,3}|[.,\n -]|1e9|nan|inf){0,200}") {
        if let Ok(d) = Dataset::digits_from(Path::new("d"), text.as_bytes()) {
            prop_assert!(!d.is_empty());
            prop_assert_eq!(d.x.len(), d.len() * 64);
            prop_assert!(d.x.iter().all(|p| (0.0..=1.0).contains(p)));
            prop_assert!(d.y.iter().all(|&l| l < 10));
        }
    }

    /// Rows a writer made load as written.
    #[test]
    fn digits_files_load(rows in proptest::collection::vec((proptest::collection::vec(0u8..17, 64), 0u8..10), 1..5)) {
        let text: String = rows
            .iter()
            .map(|(px, l)| format!("{},{l}\n", px.iter().map(u8::to_string).collect::<Vec<_>>().join(",")))
            .collect();
        let d = Dataset::digits_from(Path::new("d"), text.as_bytes()).unwrap();
        prop_assert_eq!(d.y, rows.iter().map(|r| r.1).collect::<Vec<_>>());
        let want: Vec<f32> = rows.iter().flat_map(|r| r.0.iter().map(|p| f32::from(*p) / 16.0)).collect();
        prop_assert_eq!(d.x, want);
    }
}
