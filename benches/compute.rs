//! `cargo bench --bench compute`: sgemm GFLOP/s through `mpiflow::kernels::gemm` beside
//! `cblas_sgemm` called directly (alternating, best of 5 rounds each), at one BLAS thread
//! and at the machine's cores; then single-process training samples/s on digits.
//!
//! `MPIFLOW_BENCH_QUICK=1` runs one small size only.

use std::time::Instant;

use mpiflow::kernels;
use mpiflow::train::data::Dataset;
use mpiflow::train::{train_local, TrainConfig};

fn fill(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0)
        .collect()
}

/// Best GFLOP/s of `reps` calls of `f` over `rounds` rounds.
fn gflops(n: usize, reps: usize, f: &mut dyn FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    2.0 * (n * n * n) as f64 * reps as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn main() {
    // OpenBLAS picks its kernels when it loads: choose them as the mpiflow binary does
    // (see kernels::openblas_coretype), by re-executing with OPENBLAS_CORETYPE set.
    if std::env::var_os("OPENBLAS_CORETYPE").is_none() {
        if let Some(core) = kernels::openblas_coretype() {
            use std::os::unix::process::CommandExt;
            let exe = std::env::current_exe().expect("own path");
            let err = std::process::Command::new(exe)
                .args(std::env::args_os().skip(1))
                .env("OPENBLAS_CORETYPE", core)
                .exec();
            eprintln!("could not re-execute with OPENBLAS_CORETYPE={core}: {err}");
        }
    }
    let quick = std::env::var_os("MPIFLOW_BENCH_QUICK").is_some();
    let sizes: &[usize] = if quick {
        &[128]
    } else {
        &[64, 128, 256, 512, 1024]
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("# sgemm, row-major, C = A B (GFLOP/s, best of 5 alternating rounds)");
    println!(
        "{:<8}{:>8}{:>16}{:>16}{:>10}",
        "# n", "threads", "cblas direct", "mpiflow gemm", "ratio"
    );
    for threads in [1, cores] {
        kernels::set_blas_threads(threads);
        for &n in sizes {
            let (a, b) = (fill(n * n), fill(n * n));
            let mut c = vec![0.0f32; n * n];
            let reps = (2_000_000_000 / (2 * n * n * n)).clamp(3, 2000);
            let (mut direct, mut ours) = (0.0f64, 0.0f64);
            for _ in 0..5 {
                direct = direct.max(gflops(n, reps, &mut || {
                    let ni = n as i32;
                    // SAFETY: a, b, c hold n*n floats each.
                    unsafe {
                        cblas::sgemm(
                            cblas::Layout::RowMajor,
                            cblas::Transpose::None,
                            cblas::Transpose::None,
                            ni,
                            ni,
                            ni,
                            1.0,
                            &a,
                            ni,
                            &b,
                            ni,
                            0.0,
                            &mut c,
                            ni,
                        )
                    }
                }));
                ours = ours.max(gflops(n, reps, &mut || {
                    kernels::gemm(false, false, n, n, n, 1.0, &a, &b, 0.0, &mut c)
                        .expect("shapes match");
                }));
            }
            println!(
                "{:<8}{:>8}{:>16.1}{:>16.1}{:>10.3}",
                n,
                threads,
                direct,
                ours,
                ours / direct
            );
        }
    }
    kernels::set_blas_threads(cores);
    let data = Dataset::load("digits", 0).expect("digits ship with the project");
    let (train, test) = data.split_holdout(1);
    println!("# single-process training on digits, layers 64-128-10, Adam, batch 64");
    println!("{:<8}{:>16}{:>12}", "# steps", "samples/s", "accuracy");
    let cfg = TrainConfig {
        log_every: 0,
        steps: if quick { 200 } else { 1500 },
        ..TrainConfig::default()
    };
    let mlp = mpiflow::model::mlp(64, &[128], 10).expect("a valid MLP");
    let r = train_local(&mlp, &cfg, &train, &test, |_| {}).expect("training runs");
    println!(
        "{:<8}{:>16.0}{:>12.4}",
        cfg.steps, r.samples_per_sec, r.accuracy
    );
}
