//! `cargo bench --bench compute`: sgemm GFLOP/s through `mpiflow::kernels::gemm` beside
//! `cblas_sgemm` called directly (alternating, best of 5 rounds each), at one BLAS thread
//! and at the machine's cores; the built-in CNN's convolution layers (forward and
//! backward, im2col and col2im included) beside the same three matrix products alone;
//! then single-process training samples/s on digits.
//!
//! `MPIFLOW_BENCH_QUICK=1` runs one small size only.

use std::time::Instant;

use mpiflow::kernels;
use mpiflow::kernels::conv::Window2d;
use mpiflow::model::layers::{Backward, Conv2d, Layer, Saved};
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
    conv_layers(quick);
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
    let r = train_local(&mlp, &cfg, &train, &test, &mut |_| {}).expect("training runs");
    println!(
        "{:<8}{:>16.0}{:>12.4}",
        cfg.steps, r.samples_per_sec, r.accuracy
    );
}

/// Seconds of the best of `rounds` rounds of `reps` calls of `f`.
fn best_secs(rounds: usize, reps: usize, f: &mut dyn FnMut()) -> f64 {
    f();
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() / reps as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// The CNN's two convolutions (and a wider one) at batch 64, one BLAS thread (a rank's
/// share): a layer's forward and backward through `Layer` (padding, im2col in blocks,
/// the thin products of `kernels::thin`, col2im), beside two references, rounds
/// alternating: OpenBLAS's sgemm on the same three products (`cols W`, `cols^T dY`, and
/// `dY W^T` where the input gradient is wanted: not for the CNN's first layer; the thin
/// path turned off), and OpenBLAS's rate on a square 512 product, the most this core
/// does. GFLOP/s count the products' FLOPs for all three.
fn conv_layers(quick: bool) {
    kernels::set_blas_threads(1);
    let n = if quick { 8 } else { 64 };
    println!(
        "# conv layer forward+backward vs sgemm, batch {n}, 1 thread (GFLOP/s, best of rounds)"
    );
    println!(
        "{:<28}{:>8}{:>14}{:>14}{:>10}{:>12}{:>12}",
        "# layer", "GFLOP", "sgemm same", "sgemm 512", "layer", "vs same", "vs 512"
    );
    let sq = 512;
    let (sa, sb) = (fill(sq * sq), fill(sq * sq));
    let mut sc = vec![0.0f32; sq * sq];
    for (input, layer, want_dx) in [
        ([28, 28, 1], conv(16), false),
        ([14, 14, 16], conv(32), true),
        ([14, 14, 16], conv(64), true),
    ] {
        let g = Window2d::new(input, [layer.kh, layer.kw], layer.stride, layer.pad)
            .expect("the layer fits");
        let (rows, k, oc) = (n * g.pixels(), g.k(), layer.filters);
        let x = fill(n * g.input_len());
        let (w, b) = (fill(k * oc), fill(oc));
        let dy = fill(rows * oc);
        let (mut gw, mut gb) = (vec![0.0f32; k * oc], vec![0.0f32; oc]);
        let (mut out, mut saved, mut dx) = (Vec::new(), Saved::Nothing, Vec::new());
        let (mut cols, mut y) = (fill(rows * k), vec![0.0f32; rows * oc]);
        let products = if want_dx { 3.0 } else { 2.0 };
        let flops = products * 2.0 * (rows * k * oc) as f64;
        let reps = (3e9 / flops).clamp(2.0, 200.0) as usize;
        let sq_reps = (flops / (2.0 * (sq * sq * sq) as f64)).ceil().max(1.0) as usize;
        let (mut alone, mut square, mut whole) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
        let shape = [input[0], input[1], input[2]];
        for _ in 0..if quick { 1 } else { 7 } {
            kernels::thin::set_enabled(false);
            alone = alone.min(best_secs(1, reps, &mut || {
                kernels::gemm(false, false, rows, oc, k, 1.0, &cols, &w, 0.0, &mut y).unwrap();
                kernels::gemm(true, false, k, oc, rows, 1.0, &cols, &dy, 0.0, &mut gw).unwrap();
                if want_dx {
                    kernels::gemm(false, true, rows, k, oc, 1.0, &dy, &w, 0.0, &mut cols).unwrap();
                }
            }));
            square = square.min(
                best_secs(1, reps * sq_reps, &mut || {
                    kernels::gemm(false, false, sq, sq, sq, 1.0, &sa, &sb, 0.0, &mut sc).unwrap();
                }) / (2.0 * (sq * sq * sq) as f64),
            );
            kernels::thin::set_enabled(true);
            whole = whole.min(best_secs(1, reps, &mut || {
                let p = [&w[..], &b[..]];
                layer
                    .forward_into(&p, &shape, &x, n, &mut out, &mut saved)
                    .unwrap();
                let back = Backward {
                    x: &x,
                    y: &out,
                    saved: &mut saved,
                    n,
                    dy: &dy,
                };
                layer
                    .backward_into(
                        &p,
                        &shape,
                        back,
                        &mut [&mut gw, &mut gb],
                        want_dx.then_some(&mut dx),
                    )
                    .unwrap();
            }));
        }
        let (same, peak, ours) = (flops / alone / 1e9, 1.0 / square / 1e9, flops / whole / 1e9);
        println!(
            "{:<28}{:>8.3}{:>14.1}{:>14.1}{:>10.1}{:>12.3}{:>12.3}",
            format!(
                "{} on {}x{}x{}{}",
                layer.describe(),
                shape[0],
                shape[1],
                shape[2],
                if want_dx { "" } else { ", no dx" }
            ),
            flops / 1e9,
            same,
            peak,
            ours,
            ours / same,
            ours / peak
        );
    }
}

fn conv(filters: usize) -> Conv2d {
    Conv2d {
        kh: 5,
        kw: 5,
        filters,
        stride: 1,
        pad: 2,
    }
}
