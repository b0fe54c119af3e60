//! The data plane under real `mpirun`: `mpiflow check` at 1 to 6 ranks (point-to-point,
//! every collective, op, dtype and algorithm including shared memory, identical bits
//! everywhere), the negotiation's
//! error path, and the benchmarks' OSU output format.

mod common;

use common::{mpiflow, mpirun};
use serde_json::json;

#[test]
fn every_collective_gives_identical_correct_bits_at_1_to_6_ranks() {
    for (np, flags) in [
        ("1", vec![]),
        ("2", vec!["--ps", "1"]),
        ("3", vec!["--ps", "1"]),
        ("4", vec!["--ps", "1", "--chief"]),
        ("5", vec!["--ps", "2"]),
        ("6", vec!["--ps", "2", "--chief", "--evaluator"]),
    ] {
        let mut args = vec!["-np", np, mpiflow(), "check"];
        args.extend(flags.iter().copied());
        let run = mpirun(&args);
        assert_eq!(run.code, 0, "np {np}: {run:?}");
        let lines = run.json_lines();
        let n: usize = np.parse().unwrap();
        assert_eq!(lines.len(), n, "one line per rank: {run:?}");
        for l in &lines {
            assert_eq!(l["failures"], json!([]), "np {np}: {l}");
            assert_eq!(
                l["digest"], lines[0]["digest"],
                "identical result bits on every rank (np {np})"
            );
            assert_eq!(l["checks"], lines[0]["checks"]);
            assert!(l["checks"].as_u64().unwrap() > 300);
            // One host: the shared-memory allreduce really ran (checked like the others).
            let shm = if n > 1 { json!(true) } else { json!(null) };
            assert_eq!(l["shm"], shm, "np {np}: {l}");
            // And the ring stream's channels took rings in shared memory.
            let rings = if n > 1 { json!(true) } else { json!(null) };
            assert_eq!(l["rings"], rings, "np {np}: {l}");
            // And the link stream's link (the header path) took a ring.
            assert_eq!(l["link_rings"], rings, "np {np}: {l}");
        }
        assert!(
            run.stderr
                .contains(&format!("checks passed on each of {n} ranks")),
            "{}",
            run.stderr
        );
    }
}

#[test]
fn a_rank_with_another_gradient_list_stops_all_ranks_with_the_first_mismatch() {
    let run = mpirun(&["-np", "4", mpiflow(), "check", "--mismatch-rank", "2"]);
    run.assert_one_line_error(
        "allreduce mismatch: rank 2 submitted 'grad/2' f32[76] where rank 0 submitted 'grad/1' f32[63] (position 1)",
    );
}

/// The rows of every OSU table in `out`: (size, first value) per table.
fn osu_tables(out: &str, header: &str) -> Vec<Vec<(usize, f64)>> {
    let mut tables = Vec::new();
    let mut lines = out.lines().peekable();
    while let Some(l) = lines.next() {
        if !l.starts_with("# OSU MPI ") {
            continue;
        }
        assert!(l.ends_with(" v7.4"), "{l}");
        assert!(lines.next().unwrap().starts_with("# Datatype: MPI_"));
        assert_eq!(lines.next().unwrap(), header);
        let mut rows = Vec::new();
        while let Some(r) = lines.peek().filter(|r| !r.starts_with('#')) {
            // %-10d%20.2f: the size left-aligned in 10 columns, the value right-aligned in 20.
            assert!(r.len() >= 30, "{r:?}");
            let size: usize = r[..10].trim().parse().unwrap();
            let value: f64 = r[10..30].trim().parse().unwrap();
            assert_eq!(
                r[10..30].trim().split('.').nth(1).map(str::len),
                Some(2),
                "{r:?}"
            );
            rows.push((size, value));
            lines.next();
        }
        tables.push(rows);
    }
    tables
}

#[test]
fn benchmarks_print_osu_tables_for_every_path() {
    let run = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "latency",
        "-m",
        "1:1024",
        "-i",
        "200",
        "-x",
        "20",
        "--rounds",
        "1",
        "-c",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    // -c adds OSU's Validation column: every row passed.
    let t = osu_tables(
        &run.stdout,
        "# Size         Avg Latency(us)          Validation",
    );
    let rows: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(
        rows.iter().all(|r| r.ends_with("                Pass")),
        "{run:?}"
    );
    assert_eq!(
        t.len(),
        4,
        "mpi, mpiflow, channel and inbox tables: {}",
        run.stdout
    );
    for rows in &t {
        assert_eq!(
            rows.iter().map(|r| r.0).collect::<Vec<_>>(),
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
        );
        assert!(rows.iter().all(|r| r.1 > 0.0 && r.1.is_finite()));
    }
    assert!(run.stdout.contains("# ratio mpiflow/mpi"));
    assert!(run.stdout.contains("# ratio channel/mpi"));
    assert!(run.stdout.contains("# ratio inbox/mpi"));

    let run = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "bw",
        "-m",
        "1024:8192",
        "-i",
        "5",
        "-x",
        "1",
        "-W",
        "8",
        "-c",
        "--rounds",
        "1",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    // The inbox path's receiver withdraws its window of receives posted ahead after every
    // size: none had matched a message (else the run fails naming the untaken messages).
    assert_eq!(
        osu_tables(
            &run.stdout,
            "# Size        Bandwidth (MB/s)          Validation"
        )
        .len(),
        4,
        "{run:?}"
    );
    // OSU's -b multiple, every message of every window checked on every path.
    let run = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "bibw",
        "-m",
        "1024:65536",
        "-i",
        "4",
        "-x",
        "1",
        "-W",
        "8",
        "-b",
        "multiple",
        "-c",
        "--rounds",
        "1",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let header = "# Size        Bandwidth (MB/s)          Validation";
    assert_eq!(osu_tables(&run.stdout, header).len(), 4, "{run:?}");

    let run = mpirun(&[
        "-np",
        "3",
        mpiflow(),
        "bench",
        "allreduce",
        "-m",
        "4:4096",
        "-i",
        "10",
        "-x",
        "2",
        "-f",
        "-c",
        "--rounds",
        "2",
        "--algorithm",
        "auto,recursive-doubling",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    // -c: every iteration's sums checked on every rank (3, so recursive doubling folds
    // one in), OSU's Validation column after the -f ones.
    let header = "# Size         Avg Latency(us)     Min Latency(us)     Max Latency(us)  Iterations          Validation";
    let t = osu_tables(&run.stdout, header);
    // Plain MPI, then one mpiflow table per algorithm, each with its ratio to MPI.
    assert_eq!(t.len(), 3, "{}", run.stdout);
    let rows: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(
        rows.iter().all(|r| r.ends_with("                Pass")),
        "{run:?}"
    );
    for rows in &t {
        assert_eq!(
            rows.iter().map(|r| r.0).collect::<Vec<_>>(),
            [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
        );
    }
    for line in [
        "# mpiflow path: mpi\n",
        "# mpiflow path: mpiflow (algorithm auto)\n",
        "# mpiflow path: mpiflow (algorithm recursive-doubling)\n",
        "# ratio mpiflow (algorithm recursive-doubling)/mpi (median over rounds",
        // OSU's default elements: bytes.
        "# Datatype: MPI_CHAR.\n",
    ] {
        assert!(run.stdout.contains(line), "{line}: {}", run.stdout);
    }
    // OSU's -T: 32-bit integers, so no size below one element.
    let run = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "allreduce",
        "-T",
        "mpi_int",
        "-m",
        "1:16",
        "-i",
        "10",
        "-x",
        "2",
        "--rounds",
        "1",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let t = osu_tables(&run.stdout, "# Size         Avg Latency(us)");
    assert_eq!(t.len(), 2, "{}", run.stdout);
    assert!(t.iter().all(|rows| rows.iter().map(|r| r.0).eq([4, 8, 16])));
    assert!(
        run.stdout.contains("# Datatype: MPI_INT.\n"),
        "{}",
        run.stdout
    );
    // -c on bcast (every non-root buffer starts with a value the root never sends) and on
    // float sums through the shared-memory, ring and hierarchical algorithms, past a slot.
    for (args, tables) in [
        (&["bcast", "-m", "1:65536"][..], 2),
        (
            &[
                "allreduce",
                "-T",
                "mpi_float",
                "-m",
                "4:1048576",
                "--algorithm",
                "shm,ring,hierarchical",
            ],
            4,
        ),
    ] {
        let mut a = vec!["-np", "3", mpiflow(), "bench"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["-i", "3", "-x", "1", "--rounds", "1", "-c"]);
        let run = mpirun(&a);
        assert_eq!(run.code, 0, "{run:?}");
        let t = osu_tables(
            &run.stdout,
            "# Size         Avg Latency(us)          Validation",
        );
        assert_eq!(t.len(), tables, "{}", run.stdout);
        let rows: Vec<&str> = run.stdout.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(
            rows.iter().all(|r| r.ends_with("                Pass")),
            "{run:?}"
        );
    }

    let run = mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "allreduce-fused",
        "--count",
        "40",
        "-i",
        "5",
        "-x",
        "1",
        "--rounds",
        "1",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(
        osu_tables(&run.stdout, "# Size         Avg Latency(us)").len(),
        3
    );
    // 400 KiB per fused call crosses two 256 KiB slots: steps with both kinds of store
    // were timed.
    let stores = run
        .stdout
        .lines()
        .find(|l| {
            l.starts_with(
                "# shared-memory allreduce, cost of a step per byte (rank 0, last measured): \
                 cached stores ",
            )
        })
        .unwrap_or_else(|| panic!("no stores line: {}", run.stdout));
    // (Streaming stores exist on x86-64 only.)
    let both =
        stores.contains(" ns/B, streaming stores ") && stores.ends_with(" ns/B; 262144-byte slots");
    assert!(both || !cfg!(target_arch = "x86_64"), "{stores}");

    // Re-tuning the shared-memory allreduce: slot size (rounded up to pages) and a forced
    // store mode, many chunks per call.
    let tuned = "bench allreduce -m 4096:1048576 --algorithm shm --shm-slot-bytes 5000 \
                 --shm-stores streaming -i 3 -x 1 --rounds 1";
    let run = mpirun(
        &[
            &["-np", "2", mpiflow()][..],
            &tuned.split_whitespace().collect::<Vec<_>>(),
        ]
        .concat(),
    );
    let line = "# shared-memory allreduce: 8192-byte slots, stores forced streaming (--shm-stores)";
    assert!(
        run.code == 0 && run.stdout.contains(line),
        "{line}: {run:?}"
    );
}

/// To 1 MiB of rows per worker: each round's push carries the next pull, and both ps
/// tasks reply to both workers with pieces after their replies (with the workers taking
/// no reply before their sends completed, 2 of 3 such jobs deadlocked).
#[test]
fn rows_moves_embedding_rows_through_the_ps_beside_plain_messages() {
    let run = mpirun(&[
        "-np",
        "4",
        mpiflow(),
        "bench",
        "rows",
        "--ps",
        "2",
        "-m",
        "64:1048576",
        "-i",
        "5",
        "-x",
        "1",
        "--rounds",
        "1",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let t = osu_tables(&run.stdout, "# Size              Rows/s (M)");
    assert_eq!(t.len(), 2, "{}", run.stdout);
    for rows in &t {
        let sizes: Vec<usize> = rows.iter().map(|r| r.0).collect();
        let doubling: Vec<usize> = (6..=20).map(|k| 1 << k).collect();
        assert_eq!(sizes, doubling);
        assert!(rows.iter().all(|r| r.1 > 0.0), "{}", run.stdout);
    }
    assert!(
        run.stdout.contains("# ratio mpiflow/mpi "),
        "{}",
        run.stdout
    );
    mpirun(&["-np", "2", mpiflow(), "bench", "rows", "--ps", "2"]).assert_one_line_error(
        "all ranks: benchmark rows needs more than --ps 2 ranks, the job has 2",
    );
}

/// To 1 MiB: each of the 2 ps tasks replies to each of the 2 workers' fused push and pull
/// with pieces after its reply (a cycle if a worker took no reply before its sends to both
/// ps tasks completed).
#[test]
fn pushpull_runs_the_ps_protocol_beside_plain_messages() {
    let run = mpirun(&[
        "-np",
        "4",
        mpiflow(),
        "bench",
        "pushpull",
        "--ps",
        "2",
        "-m",
        "4096:1048576",
        "-i",
        "5",
        "-x",
        "1",
        "--rounds",
        "1",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let t = osu_tables(&run.stdout, "# Size        Bandwidth (MB/s)");
    // Plain messages, the ps protocol, plain messages with the ps's SGD update.
    assert_eq!(t.len(), 3, "{}", run.stdout);
    for path in ["mpi", "mpiflow", "mpi-sgd"] {
        assert!(
            run.stdout.contains(&format!("# mpiflow path: {path}\n")),
            "{}",
            run.stdout
        );
    }
    for ratio in ["mpiflow/mpi ", "mpi-sgd/mpi ", "mpiflow/mpi-sgd "] {
        assert!(
            run.stdout.contains(&format!("# ratio {ratio}")),
            "{}",
            run.stdout
        );
    }
    for rows in &t {
        assert_eq!(
            rows.iter().map(|r| r.0).collect::<Vec<_>>(),
            [4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576]
        );
        assert!(rows.iter().all(|r| r.1 > 0.0));
    }
    assert!(run
        .stdout
        .contains("Push-Pull Bandwidth Test (2 workers, 2 ps, transport p2p)"));
    mpirun(&["-np", "2", mpiflow(), "bench", "pushpull", "--ps", "2"]).assert_one_line_error(
        "all ranks: benchmark pushpull needs more than --ps 2 ranks, the job has 2",
    );
}

#[test]
fn bad_benchmark_requests_are_one_line_errors() {
    common::mpiflow_alone(&["bench", "pingpong"], &[]).assert_one_line_error(
        "invalid value 'pingpong' for '<NAME>' [possible values: latency, bw, bibw, allreduce, \
         bcast, allreduce-fused, pushpull, rows, put_latency, get_latency, acc_latency, get_bw]",
    );
    mpirun(&["-np", "1", mpiflow(), "bench", "latency"]).assert_one_line_error(
        "all ranks: benchmark latency needs at least 2 ranks, the job has 1",
    );
    common::mpiflow_alone(&["bench", "latency", "-m", "64:4"], &[])
        .assert_one_line_error("MIN 64 is larger than MAX 4");
    common::mpiflow_alone(&["bench", "bw", "-b", "several"], &[])
        .assert_one_line_error("invalid value 'several' for '--buffer-num <BUFFERS>'");
    // OSU refuses these too ("Invalid Number of Iterations", "Invalid Window Size"): at 0
    // the tables held NaN, or a window silently carried one message.
    common::mpiflow_alone(&["bench", "bw", "-i", "0"], &[])
        .assert_one_line_error("invalid value '0' for '--iterations <ITERATIONS>'");
    common::mpiflow_alone(&["bench", "bw", "-W", "0"], &[])
        .assert_one_line_error("invalid value '0' for '--window-size <WINDOW>'");
    mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "allreduce",
        "--path",
        "channel",
    ])
    .assert_one_line_error("all ranks: --path channel is for latency, bw and bibw, not allreduce");
    // One process (MPI's singleton) says it too, without mpirun's second after a failure.
    common::mpiflow_alone(&["bench", "bcast", "--path", "inbox"], &[])
        .assert_one_line_error("all ranks: --path inbox is for latency, bw and bibw, not bcast");
    mpirun(&["-np", "2", mpiflow(), "bench", "bw", "--path", "mpi-sgd"])
        .assert_one_line_error("all ranks: --path mpi-sgd is for pushpull, not bw");
    // A window of buffers beyond the node: the kernel's OOM killer ended the run unsaid.
    let huge = [
        "bench",
        "bw",
        "-b",
        "multiple",
        "-W",
        "100000",
        "-m",
        "1073741824:1073741824",
    ];
    let mut args = vec!["-np", "2", mpiflow()];
    args.extend(huge);
    mpirun(&args).assert_one_line_error(
        "all ranks: bench bw needs at least 214750.5 GB (OSU's single buffers 2.1 GB, 100000 send and \
         100000 receive buffers 214748.4 GB) but may use ",
    );
    mpirun(&["-np", "2", mpiflow(), "bench", "bw", "-T", "mpi_float"])
        .assert_one_line_error("all ranks: -T is for allreduce (the elements it sums), not bw");
    common::mpiflow_alone(&["bench", "allreduce", "-T", "mpi_double"], &[])
        .assert_one_line_error("invalid value 'mpi_double' for '--type <ELEMENT>'");
    // Options a benchmark does not use, refused as OSU's programs refuse them (they were
    // ignored: -c on a benchmark that checks nothing printed tables as if checked).
    for (args, error) in [
        (
            &["latency", "-W", "8"][..],
            "-W is for bw, bibw and get_bw, not latency",
        ),
        (
            &["allreduce-fused", "-c"],
            "-c is for latency, bw, bibw, allreduce and bcast, not allreduce-fused",
        ),
        (
            &["bcast", "--algorithm", "ring"],
            "--algorithm is for allreduce and allreduce-fused, not bcast",
        ),
        (
            &["allreduce", "--count", "5"],
            "--count is for allreduce-fused, not allreduce",
        ),
        (
            &["bw", "-f"],
            "-f is for allreduce, bcast and allreduce-fused, not bw",
        ),
    ] {
        let mut a = vec!["bench"];
        a.extend_from_slice(args);
        common::mpiflow_alone(&a, &[]).assert_one_line_error(&format!("all ranks: {error}"));
    }
    mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "allreduce-fused",
        "--algorithm",
        "ring,shm",
    ])
    .assert_one_line_error(
        "all ranks: --algorithm takes a list for allreduce only, not allreduce-fused",
    );
    mpirun(&[
        "-np",
        "2",
        mpiflow(),
        "bench",
        "latency",
        "--shm-stores",
        "cached",
    ])
    .assert_one_line_error(
        "all ranks: --shm-slot-bytes and --shm-stores are for allreduce and \
             allreduce-fused, not latency",
    );
    common::mpiflow_alone(&["bench", "allreduce", "--shm-slot-bytes", "0"], &[])
        .assert_one_line_error("\"0\" is not a positive number of bytes");
}

/// A node whose shared memory has little room (a container's small /dev/shm): a channel
/// that finds no room for its rings stays on MPI and its messages arrive whole. (A ring
/// sized but not allocated ended this very job with SIGBUS at its first stores.) Root
/// only: a private mount namespace with a 200 KiB /dev/shm, where 1 KiB channels fit and
/// 2-4 KiB ones do not.
#[test]
fn channels_stay_on_mpi_where_shared_memory_has_no_room() {
    if !common::as_root("a private /dev/shm (a mount namespace)") {
        return;
    }
    let inner = format!(
        "mount -t tmpfs -o size=200k tmpfs /dev/shm && exec mpirun --oversubscribe \
         --mca btl_vader_backing_directory /tmp -np 2 {} bench bw --path channel \
         -m 1024:4096 -c -i 200 -x 10 --rounds 1",
        mpiflow()
    );
    let _guard = common::lock();
    let run = common::run_bounded(120, &["unshare", "-m", "sh", "-c", &inner], &[]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.stdout.matches("Pass").count(), 3, "{run:?}");
}
