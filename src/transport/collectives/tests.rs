//! The collectives against serial sums, on `LocalComm` ranks (in-process).

use super::super::local::LocalComm;
use super::*;

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 31 + i * 7) % 97) as f32 * 0.37 - 11.0)
        .collect()
}

#[test]
fn allreduce_algorithms_agree_with_a_serial_sum() {
    for n in 1..=6 {
        for len in [1usize, 2, 5, 7, 64, 1000, 4097] {
            for algo in [
                Algorithm::Ring,
                Algorithm::RecursiveDoubling,
                Algorithm::Shm,
                Algorithm::Auto,
            ] {
                let out = LocalComm::run(n, |c| {
                    let mut coll = Collectives::new(c);
                    coll.tuning.segment_bytes = 64; // many segments even for small tests
                    coll.tuning.shm_slot_bytes = 4096; // many chunks, slots reused
                    let mut t = Tensor::from_slice(&[len], &input(coll.rank(), len)).unwrap();
                    coll.allreduce_tensor(&mut t, ReduceOp::Sum, algo).unwrap();
                    t.as_slice::<f32>().unwrap().to_vec()
                });
                for o in &out {
                    assert_eq!(
                        o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        out[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "identical bits, n={n} len={len} {algo:?}"
                    );
                }
                for (i, got) in out[0].iter().enumerate() {
                    let want: f64 = (0..n).map(|r| input(r, len)[i] as f64).sum();
                    assert!(
                        (*got as f64 - want).abs() < 1e-3,
                        "n={n} len={len} {algo:?} i={i}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_op_and_dtype() {
    let out = LocalComm::run(3, |c| {
        let coll = Collectives::new(c);
        let r = coll.rank() as i64;
        let mut res = Vec::new();
        for op in ReduceOp::ALL {
            for algo in [
                Algorithm::Ring,
                Algorithm::RecursiveDoubling,
                Algorithm::Shm,
            ] {
                let mut a = Tensor::from_slice(&[3], &[r, 10 - r, r * r]).unwrap();
                coll.allreduce_tensor(&mut a, op, algo).unwrap();
                let mut b = Tensor::from_slice(&[2], &[r as f64 + 0.5, -(r as f64)]).unwrap();
                coll.allreduce_tensor(&mut b, op, algo).unwrap();
                let mut u = Tensor::from_slice(&[1], &[r as u8 * 100]).unwrap();
                coll.allreduce_tensor(&mut u, op, algo).unwrap();
                res.push((
                    op,
                    a.as_slice::<i64>().unwrap().to_vec(),
                    b.as_slice::<f64>().unwrap().to_vec(),
                    u.as_slice::<u8>().unwrap()[0],
                ));
            }
        }
        res
    });
    for (op, a, b, u) in &out[0] {
        let (wa, wb, wu): (Vec<i64>, Vec<f64>, u8) = match op {
            ReduceOp::Sum => (vec![3, 27, 5], vec![4.5, -3.0], 44), // 0+100+200 wraps to 44
            ReduceOp::Average => (vec![1, 9, 1], vec![1.5, -1.0], 14),
            ReduceOp::Min => (vec![0, 8, 0], vec![0.5, -2.0], 0),
            ReduceOp::Max => (vec![2, 10, 4], vec![2.5, 0.0], 200),
        };
        assert_eq!((a, b, *u), (&wa, &wb, wu), "{op:?}");
    }
    assert!(out.iter().all(|o| o == &out[0]));
}

#[test]
fn parts_reduce_as_one_message_across_chunks() {
    // 3 ranks, parts of odd lengths (one empty) crossing 4 KiB chunks and slot reuse;
    // then 64 KiB slots, where a rank's sub-slice of one chunk spans several parts.
    let lens = [1usize, 1500, 0, 3001, 7, 2048, 9000];
    let run = |algo: Algorithm, slot: usize, stores: Option<StoreMode>| {
        LocalComm::run(3, move |c| {
            // A fresh communicator per slot size: the segments are made once.
            let mut coll = Collectives::new(c);
            coll.tuning.shm_slot_bytes = slot;
            coll.force_shm_stores(stores).unwrap();
            let r = coll.rank();
            let mut ts: Vec<Tensor> = lens
                .iter()
                .enumerate()
                .map(|(k, &l)| Tensor::from_slice(&[l], &input(r + 10 * k, l)).unwrap())
                .collect();
            let mut parts: Vec<&mut [u8]> = ts.iter_mut().map(|t| t.bytes_mut()).collect();
            let ran = coll
                .allreduce_parts(&mut parts, DType::F32, ReduceOp::Average, algo)
                .unwrap();
            assert_eq!(ran, algo);
            ts.iter()
                .map(|t| t.as_slice::<f32>().unwrap().to_vec())
                .collect::<Vec<_>>()
        })
    };
    let runs = [
        run(Algorithm::Shm, 4096, Some(StoreMode::Cached)),
        run(Algorithm::Shm, 64 << 10, Some(StoreMode::Cached)),
        run(Algorithm::Shm, 4096, Some(StoreMode::Streaming)),
        run(Algorithm::Shm, 64 << 10, Some(StoreMode::Streaming)),
        run(Algorithm::Shm, 4096, None),
        run(Algorithm::Ring, 4096, None),
    ];
    for (k, &l) in lens.iter().enumerate() {
        for i in 0..l {
            let want: f64 = (0..3).map(|r| input(r + 10 * k, l)[i] as f64).sum::<f64>() / 3.0;
            for (j, out) in runs.iter().enumerate() {
                for rank in out {
                    let got = rank[k][i] as f64;
                    assert!((got - want).abs() < 1e-4, "run {j} part {k} elem {i}");
                }
            }
        }
    }
    // Shared memory: one rank reduces each element, so all ranks hold the same bits,
    // and the same whichever stores carried them (for one slot size: the slot size
    // decides which rank reduces an element, so the order of operands).
    for (i, out) in runs[..5].iter().enumerate() {
        let first = &runs[i % 2][0];
        assert!(out.iter().all(|o| o == first), "run {i}");
    }
}

/// `allreduce_into` leaves its input as it was and writes the bits `allreduce` writes in
/// place over a copy of it: every op, a float and an integer dtype, 1 to 4 ranks, one
/// chunk (the one-step protocol), several with slots reused, each algorithm.
#[test]
fn allreduce_into_equals_allreduce_of_a_copy_bit_for_bit() {
    for n in 1..=4 {
        for len in [3usize, 1000, 5000] {
            for algo in [Algorithm::Shm, Algorithm::Ring, Algorithm::Auto] {
                LocalComm::run(n, |c| {
                    let mut coll = Collectives::new(c);
                    coll.tuning.shm_slot_bytes = 4096;
                    let r = coll.rank();
                    let ints: Vec<i64> = (0..len as i64).map(|i| i * (r as i64 + 1) - 7).collect();
                    let inputs = [
                        Tensor::from_slice(&[len], &input(r, len)).unwrap(),
                        Tensor::from_slice(&[len], &ints).unwrap(),
                    ];
                    for op in ReduceOp::ALL {
                        for src in &inputs {
                            let (dt, kept) = (src.dtype(), src.clone());
                            let mut copy = src.clone();
                            let mut dst = Tensor::zeros(dt, &[len]).unwrap();
                            let into =
                                coll.allreduce_into(src.bytes(), dst.bytes_mut(), dt, op, algo);
                            let ran = into.unwrap();
                            assert!(algo == Algorithm::Auto || n == 1 || ran == algo, "{ran:?}");
                            coll.allreduce_tensor(&mut copy, op, algo).unwrap();
                            let what = format!("n={n} len={len} {algo:?} {op:?} {dt}");
                            assert_eq!(dst.bytes(), copy.bytes(), "{what}");
                            assert_eq!(src.bytes(), kept.bytes(), "{what}: the input is kept");
                        }
                    }
                });
            }
        }
    }
}

#[test]
fn shm_mismatch_is_the_same_error_everywhere_and_later_calls_work() {
    let out = LocalComm::run(3, |c| {
        let coll = Collectives::new(c);
        let r = coll.rank();
        let len = if r == 2 { 5 } else { 4 };
        let mut t = Tensor::from_slice(&[len], &vec![1f32; len]).unwrap();
        let e = coll
            .allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Shm)
            .unwrap_err()
            .to_string();
        let e = e.replacen(&format!("rank {r}: "), "rank R: ", 1);
        let mut ok = Tensor::from_slice(&[70000], &vec![r as f32; 70000]).unwrap();
        coll.allreduce_tensor(&mut ok, ReduceOp::Max, Algorithm::Shm)
            .unwrap();
        (e, ok.as_slice::<f32>().unwrap()[69999])
    });
    for o in &out {
        assert_eq!(
            o,
            &(
                "rank R: allreduce mismatch: rank 2 passed 20 bytes of f32 (sum) \
                 where rank 0 passed 16 bytes of f32 (sum)"
                    .to_string(),
                2.0
            )
        );
    }
}

#[test]
fn shm_names_a_rank_that_never_comes() {
    let limit = std::time::Duration::from_millis(300);
    let errs = LocalComm::run_with_timeout(2, limit, |c| {
        let coll = Collectives::new(c);
        // Both set the segments up; then rank 1 skips the allreduce.
        coll.shm().unwrap();
        let mut t = Tensor::from_slice(&[8], &[1f64; 8]).unwrap();
        if coll.rank() == 0 {
            coll.allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Shm)
                .unwrap_err()
                .to_string()
        } else {
            String::new()
        }
    });
    assert_eq!(
        errs[0],
        "rank 0: rank 1 did not reach the shared-memory allreduce within 0.3 s"
    );
}

#[test]
fn hierarchical_across_nodes_equals_a_serial_sum_with_identical_bits() {
    // Nodes of equal and unequal size, leaders not rank-ordered by node, one rank per
    // node; every op that divides or wraps.
    for nodes in [
        &[0, 0, 1, 1][..],
        &[0, 0, 0, 1],
        &[1, 0, 1, 0, 2],
        &[0, 1, 2],
    ] {
        for len in [1usize, 7, 4097, 70000] {
            let out = LocalComm::run_on_nodes(nodes, |c| {
                let mut coll = Collectives::new(c);
                coll.tuning.segment_bytes = 4096;
                coll.tuning.ring_min_bytes = 8192; // the leaders' ring for the largest
                let r = coll.rank();
                let mut t = Tensor::from_slice(&[len], &input(r, len)).unwrap();
                let ran = coll
                    .allreduce_tensor(&mut t, ReduceOp::Average, Algorithm::Hierarchical)
                    .unwrap();
                let mut w =
                    Tensor::from_slice(&[3], &[(r as u8).wrapping_mul(100), 1, r as u8]).unwrap();
                coll.allreduce_tensor(&mut w, ReduceOp::Sum, Algorithm::Hierarchical)
                    .unwrap();
                let mut m = Tensor::from_slice(&[2], &[r as i64, -(r as i64)]).unwrap();
                coll.allreduce_tensor(&mut m, ReduceOp::Max, Algorithm::Hierarchical)
                    .unwrap();
                (
                    ran,
                    t.as_slice::<f32>().unwrap().to_vec(),
                    w.as_slice::<u8>().unwrap().to_vec(),
                    m.as_slice::<i64>().unwrap().to_vec(),
                )
            });
            let n = nodes.len();
            for (ran, avg, wrapped, max) in &out {
                assert_eq!(*ran, Algorithm::Hierarchical, "{nodes:?}");
                assert_eq!(
                    avg.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    out[0].1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "identical bits on {nodes:?}, len {len}"
                );
                let sum: usize = (0..n).map(|r| r * 100).sum();
                let ids: usize = (0..n).sum();
                assert_eq!(wrapped, &[(sum % 256) as u8, n as u8, ids as u8]);
                assert_eq!(max, &[n as i64 - 1, 0]);
            }
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, len)).collect();
            for (i, got) in out[0].1.iter().enumerate() {
                let want = inputs.iter().map(|x| x[i] as f64).sum::<f64>() / n as f64;
                assert!(
                    (*got as f64 - want).abs() < 1e-4,
                    "{nodes:?} len {len} i {i}"
                );
            }
        }
    }
}

#[test]
fn auto_goes_hierarchical_across_nodes_from_its_threshold_and_never_on_one_node() {
    let picks = |nodes: &[usize]| {
        LocalComm::run_on_nodes(nodes, |c| {
            let coll = Collectives::new(c);
            let min = coll.tuning.hierarchical_min_bytes;
            (coll.choose(min - 4).unwrap(), coll.choose(min).unwrap())
        })
    };
    for p in picks(&[0, 0, 1, 1]) {
        assert_ne!(p.0, Algorithm::Hierarchical);
        assert_eq!(p.1, Algorithm::Hierarchical);
    }
    // One rank per node: nothing to gain from a second level.
    for p in picks(&[0, 1, 2]) {
        assert_eq!(p.1, Algorithm::RecursiveDoubling);
    }
    // One node: shared memory, and `hierarchical` asked for runs as that.
    for p in picks(&[0, 0, 0]) {
        assert_eq!(p.1, Algorithm::Shm);
    }
    let ran = LocalComm::run(3, |c| {
        let coll = Collectives::new(c);
        let mut t = Tensor::from_slice(&[300000], &vec![1f32; 300000]).unwrap();
        coll.allreduce_tensor(&mut t, ReduceOp::Sum, Algorithm::Hierarchical)
            .unwrap()
    });
    assert!(ran.iter().all(|a| *a == Algorithm::Shm), "{ran:?}");
}

#[test]
fn bcast_allgather_barrier() {
    for n in 1..=5 {
        let out = LocalComm::run(n, |c| {
            let coll = Collectives::new(c);
            let r = coll.rank();
            coll.barrier().unwrap();
            let mut b = if r == n - 1 {
                vec![7u8, 8, 9]
            } else {
                vec![0u8; 3]
            };
            coll.bcast(&mut b, n - 1).unwrap();
            let mut all = vec![0u8; 2 * n];
            coll.allgather(&[r as u8, 1], &mut all).unwrap();
            let var = coll.allgather_varlen(&vec![r as u8; r]).unwrap();
            (b, all, var)
        });
        for (b, all, var) in out {
            assert_eq!(b, [7, 8, 9]);
            assert_eq!(all, (0..n).flat_map(|r| [r as u8, 1]).collect::<Vec<_>>());
            assert_eq!(var, (0..n).map(|r| vec![r as u8; r]).collect::<Vec<_>>());
        }
    }
}
