//! `cargo bench`: runs mpiflow's OSU-style benchmarks under a real `mpirun`.
//!
//! With no arguments: latency, bw, bibw, bcast, allreduce-fused and the one-sided
//! put/get/acc latency and get_bw at 2 ranks, allreduce at 2 and 4 ranks, pushpull (p2p
//! and rma) at 4 ranks, each with both paths (plain MPI and mpiflow) alternating in one job.
//! `cargo bench -- NAME [OSU options]` runs one benchmark (e.g. `cargo bench -- latency -m
//! 1:4096`); `MPIFLOW_BENCH_NP` sets the rank count. Under an MPI launcher already (e.g.
//! `mpirun -np 4 target/release/deps/osu-*`), the benchmark runs in place instead.
//!
//! Output is OSU 7.4's format; see `shared/docs/osu-format.md` and the README.

use std::process::Command;

fn run(np: &str, args: &[String]) -> bool {
    println!("## mpirun -np {np} mpiflow bench {}", args.join(" "));
    let status = Command::new("mpirun")
        .args([
            "--oversubscribe",
            "-np",
            np,
            env!("CARGO_BIN_EXE_mpiflow"),
            "bench",
        ])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .status();
    match status {
        Ok(s) if s.success() => true,
        Ok(s) => {
            eprintln!("benchmark failed: {s}");
            false
        }
        Err(e) => {
            eprintln!("cannot start mpirun: {e} (run scripts/setup.sh)");
            false
        }
    }
}

fn main() {
    // cargo passes `--bench`; everything else is ours.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let np = std::env::var("MPIFLOW_BENCH_NP").unwrap_or_else(|_| "2".into());
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
    {
        let status = Command::new(env!("CARGO_BIN_EXE_mpiflow"))
            .arg("bench")
            .args(&args)
            .status();
        std::process::exit(status.map_or(1, |s| s.code().unwrap_or(1)));
    }
    let plan: Vec<(String, Vec<String>)> = if args.is_empty() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        vec![
            ("2".into(), s(&["latency"])),
            ("2".into(), s(&["bw"])),
            ("2".into(), s(&["bibw"])),
            ("2".into(), s(&["allreduce", "-m", "4:16777216"])),
            ("4".into(), s(&["allreduce", "-m", "4:16777216"])),
            ("2".into(), s(&["bcast"])),
            ("2".into(), s(&["allreduce-fused"])),
            ("2".into(), s(&["put_latency"])),
            ("2".into(), s(&["get_latency"])),
            ("2".into(), s(&["acc_latency"])),
            ("2".into(), s(&["get_bw"])),
            ("4".into(), s(&["pushpull", "--transport", "p2p"])),
            ("4".into(), s(&["pushpull", "--transport", "rma"])),
        ]
    } else {
        vec![(np, args)]
    };
    // Every benchmark runs, even after a failure.
    let failed = plan.iter().filter(|(np, a)| !run(np, a)).count();
    std::process::exit(i32::from(failed > 0));
}
