use super::*;
use crate::tensor::Tensor;
use crate::transport::local::LocalComm;
use crate::transport::Algorithm;

/// Rank `r`'s input of `len` elements: floats whose sums depend on the order of addition,
/// and integers.
fn inputs(r: usize, len: usize) -> [Tensor; 2] {
    let floats: Vec<f32> = (0..len)
        .map(|i| ((r * 31 + i * 7) % 97) as f32 * 0.37 - 11.0 + 1e-3 * i as f32)
        .collect();
    let ints: Vec<i64> = (0..len as i64).map(|i| i * (r as i64 + 1) - 7).collect();
    [
        Tensor::from_slice(&[len], &floats).unwrap(),
        Tensor::from_slice(&[len], &ints).unwrap(),
    ]
}

/// An allreduce of symmetric memory, in place and from one region into another, writes on
/// every rank the bits the slot algorithm writes over a copy (every op, a float and an
/// integer dtype, 1 to 4 ranks, a piece and several, at an offset inside the region), and
/// leaves its input as it was; a call of plain memory between them still works.
#[test]
fn symmetric_allreduces_write_the_slot_algorithms_bits_in_place_and_into() {
    for n in 1..=4 {
        for len in [3usize, 1000, 20_011] {
            LocalComm::run(n, |c| {
                let coll = Collectives::new(c);
                let r = coll.rank();
                let room = 8 * len + 64;
                let (mut a, mut b) = (coll.symmetric(room).unwrap(), coll.symmetric(room).unwrap());
                if n == 1 {
                    // One rank: no shared memory to make (plain memory serves).
                    assert!(a.is_none() && b.is_none());
                    return;
                }
                let (a, b) = (a.as_mut().unwrap(), b.as_mut().unwrap());
                assert_eq!((a.len(), a.as_ptr() as usize % 4096), (room, 0));
                for op in ReduceOp::ALL {
                    for src in inputs(r, len) {
                        let (dt, bytes) = (src.dtype(), src.nbytes());
                        let what = format!("n={n} len={len} {op:?} {dt}");
                        let mut want = src.clone();
                        coll.allreduce_tensor(&mut want, op, Algorithm::Shm)
                            .unwrap();
                        // In place, 64 bytes into the region.
                        a.bytes_mut()[64..64 + bytes].copy_from_slice(src.bytes());
                        let ran = coll.allreduce(
                            &mut a.bytes_mut()[64..64 + bytes],
                            dt,
                            op,
                            Algorithm::Auto,
                        );
                        assert_eq!(ran.unwrap(), Algorithm::Shm, "{what}");
                        assert_eq!(&a.bytes()[64..64 + bytes], want.bytes(), "{what}: in place");
                        // From `a` into `b`, the input kept.
                        a.bytes_mut()[..bytes].copy_from_slice(src.bytes());
                        let (input, output) = (&a.bytes()[..bytes], &mut b.bytes_mut()[..bytes]);
                        coll.allreduce_into(input, output, dt, op, Algorithm::Shm)
                            .unwrap();
                        assert_eq!(&b.bytes()[..bytes], want.bytes(), "{what}: into");
                        assert_eq!(&a.bytes()[..bytes], src.bytes(), "{what}: input kept");
                    }
                }
            });
        }
    }
}

/// A rank whose buffer is not symmetric memory (or lies at another offset) where the
/// others' is: the same error on every rank, naming both, and the next calls work.
#[test]
fn a_rank_of_plain_memory_among_symmetric_ones_is_the_same_error_everywhere() {
    let out = LocalComm::run(3, |c| {
        let coll = Collectives::new(c);
        let r = coll.rank();
        let mut sym = coll.symmetric(4096).unwrap().unwrap();
        let mut plain = vec![0u8; 400];
        let mut errors = vec![];
        for odd in [1usize, 2] {
            let buf: &mut [u8] = match r {
                // Rank 1: plain memory; rank 2: another offset.
                1 if odd == 1 => &mut plain,
                2 if odd == 2 => &mut sym.bytes_mut()[400..800],
                _ => &mut sym.bytes_mut()[..400],
            };
            let e = coll.allreduce(buf, DType::F32, ReduceOp::Sum, Algorithm::Shm);
            errors.push(
                e.unwrap_err()
                    .to_string()
                    .replacen(&format!("rank {r}: "), "rank R: ", 1),
            );
        }
        // Still in step: a symmetric call and a plain one.
        sym.bytes_mut()[..4].copy_from_slice(&1f32.to_le_bytes());
        coll.allreduce(
            &mut sym.bytes_mut()[..4],
            DType::F32,
            ReduceOp::Sum,
            Algorithm::Shm,
        )
        .unwrap();
        let mut t = Tensor::from_slice(&[70_000], &vec![r as f32; 70_000]).unwrap();
        coll.allreduce_tensor(&mut t, ReduceOp::Max, Algorithm::Shm)
            .unwrap();
        let sum = f32::from_le_bytes(sym.bytes()[..4].try_into().unwrap());
        (errors, sum, t.as_slice::<f32>().unwrap()[69_999])
    });
    let want = vec![
        "rank R: allreduce mismatch: rank 1 passed 400 bytes of f32 (sum) where rank 0 passed \
         400 bytes of f32 (sum) in symmetric memory (region 0 at byte 0)"
            .to_string(),
        "rank R: allreduce mismatch: rank 2 passed 400 bytes of f32 (sum) in symmetric memory \
         (region 0 at byte 400) where rank 0 passed 400 bytes of f32 (sum) in symmetric memory \
         (region 0 at byte 0)"
            .to_string(),
    ];
    for o in out {
        assert_eq!(o, (want.clone(), 3.0, 2.0));
    }
}

/// Ranks asking for symmetric memory of different lengths: the same error on every rank,
/// and nothing left in /dev/shm.
#[test]
fn symmetric_memory_of_different_lengths_is_the_same_error_everywhere() {
    let out = LocalComm::run(2, |c| {
        let coll = Collectives::new(c);
        let r = coll.rank();
        let e = coll.symmetric(4096 + r).unwrap_err().to_string();
        e.replacen(&format!("rank {r}: "), "rank R: ", 1)
    });
    for o in &out {
        assert_eq!(
            o,
            "rank R: allreduce mismatch: rank 1 passed symmetric memory of 4097 bytes where \
             rank 0 passed symmetric memory of 4096 bytes"
        );
    }
    // Other tests of this process make regions too: theirs go within moments.
    let pid = format!("mpiflow-sym-{}-", std::process::id());
    let left = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(&pid))
            .collect()
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !left().is_empty() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(left().is_empty(), "{:?}", left());
}
