use super::super::local::LocalComm;
use super::*;
use crate::tensor::DType;

#[test]
fn tensors_arrive_intact_and_in_flight_together() {
    let out = LocalComm::run(2, |c| {
        if c.rank() == 0 {
            let a = Tensor::from_slice(&[3], &[1f32, 2., 3.])
                .unwrap()
                .named("a");
            let b = Tensor::from_slice(&[2, 2], &[5i64, 6, 7, 8])
                .unwrap()
                .named("b");
            let ra = immediate_send(&c, &a, 1, 1).unwrap();
            let rb = immediate_send(&c, &b, 1, 2).unwrap();
            rb.wait().unwrap();
            ra.wait().unwrap();
            (vec![], vec![])
        } else {
            let mut a = Tensor::zeros(DType::F32, &[3]).unwrap().named("a");
            let mut b = Tensor::zeros(DType::I64, &[2, 2]).unwrap().named("b");
            // Posted in the opposite order: tags keep them apart.
            let rb = immediate_receive_into(&c, &mut b, 0, 2).unwrap();
            let ra = immediate_receive_into(&c, &mut a, 0, 1).unwrap();
            ra.wait().unwrap();
            rb.wait().unwrap();
            (
                a.as_slice::<f32>().unwrap().to_vec(),
                b.as_slice::<i64>().unwrap().to_vec(),
            )
        }
    });
    assert_eq!(out[1], (vec![1., 2., 3.], vec![5, 6, 7, 8]));
}

#[test]
fn mismatches_name_both_sides() {
    let out = LocalComm::run(2, |c| {
        if c.rank() == 0 {
            let a = Tensor::from_slice(&[4], &[1f32; 4])
                .unwrap()
                .named("grad/w");
            send(&c, &a, 1, 0).unwrap();
            send(&c, &a, 1, 0).unwrap();
            String::new()
        } else {
            let mut wrong_shape = Tensor::zeros(DType::F32, &[3]).unwrap().named("grad/w");
            let e1 = receive_into(&c, &mut wrong_shape, 0, 0)
                .unwrap_err()
                .to_string();
            let mut wrong_name = Tensor::zeros(DType::F32, &[4]).unwrap().named("grad/b");
            let e2 = receive_into(&c, &mut wrong_name, 0, 0)
                .unwrap_err()
                .to_string();
            format!("{e1}\n{e2}")
        }
    });
    assert_eq!(
        out[1],
        "rank 1: from rank 0: received 'grad/w' f32[4] but expected 'grad/w' f32[3]\n\
         rank 1: from rank 0: received 'grad/w' f32[4] but expected 'grad/b' f32[4]"
    );
}

fn u8s(n: usize, v: u8, name: &str) -> Tensor {
    Tensor::from_slice(&[n], &vec![v; n]).unwrap().named(name)
}

#[test]
fn repeats_travel_without_header() {
    // On two nodes: MPI carries every message (a raw receive takes one).
    let out = LocalComm::run_on_nodes(&[0, 1], |c| {
        let t = u8s(5, 7, "x");
        if c.rank() == 0 {
            for _ in 0..3 {
                send(&c, &t, 1, 3).unwrap();
            }
            vec![]
        } else {
            let mut r = u8s(5, 0, "x");
            receive_into(&c, &mut r, 0, 3).unwrap();
            receive_into(&c, &mut r, 0, 3).unwrap();
            // The third message, taken raw: the payload alone.
            let mut raw = [0u8; 64];
            let got = super::super::comm::recv(&c, &mut raw, 0, 3).unwrap();
            let mut seen = r.bytes().to_vec();
            seen.extend_from_slice(&raw[..got.count]);
            seen
        }
    });
    assert_eq!(out[1], vec![7; 10]);
}

#[test]
fn links_stay_in_step_through_changes_and_mismatches() {
    // a: u8[32]; b: u8[8] unnamed, whose whole message (24-byte header) is 32 bytes
    // long, the length of a's payload alone: the sender pads it.
    let out = LocalComm::run(2, |c| {
        let a = u8s(32, 1, "");
        let b = u8s(8, 2, "");
        if c.rank() == 0 {
            for t in [&a, &a, &b, &b, &a, &a, &b] {
                send(&c, t, 1, 0).unwrap();
            }
            vec![]
        } else {
            let mut ra = u8s(32, 0, "");
            let mut rb = u8s(8, 0, "");
            let mut log = vec![];
            let mut note = |r: Result<(), P2pError>, t: &Tensor| {
                log.push(match r {
                    Ok(()) => format!("ok {:?}", &t.bytes()[..2]),
                    Err(e) => e.to_string(),
                })
            };
            let r = receive_into(&c, &mut ra, 0, 0);
            note(r, &ra);
            let r = receive_into(&c, &mut ra, 0, 0);
            note(r, &ra);
            // Sender switched to b (padded), receiver still expects a.
            ra.bytes_mut().fill(0);
            let r = receive_into(&c, &mut ra, 0, 0);
            note(r, &ra);
            // The link now holds b on both sides.
            let r = receive_into(&c, &mut rb, 0, 0);
            note(r, &rb);
            // Sender switched back to a, receiver expects b: a whole message lands in
            // the payload's place.
            let r = receive_into(&c, &mut rb, 0, 0);
            note(r, &rb);
            // Sender repeats a (payload alone) while the receiver still expects b;
            // then b again, in step.
            let r = receive_into(&c, &mut rb, 0, 0);
            note(r, &rb);
            let r = receive_into(&c, &mut rb, 0, 0);
            note(r, &rb);
            log
        }
    });
    assert_eq!(
        out[1],
        [
            "ok [1, 1]",
            "ok [1, 1]",
            "rank 1: from rank 0: received '' u8[8] but expected '' u8[32]",
            "ok [2, 2]",
            "rank 1: from rank 0: received '' u8[32] but expected '' u8[8]",
            "rank 1: from rank 0: received '' u8[32] but expected '' u8[8]",
            "ok [2, 2]",
        ]
    );
}

#[test]
fn many_in_flight_on_one_link() {
    let out = LocalComm::run(2, |c| {
        let ts: Vec<Tensor> = [(4, 1, "p"), (4, 2, "p"), (6, 3, "q"), (4, 4, "p")]
            .iter()
            .map(|&(n, v, name)| u8s(n, v, name))
            .collect();
        if c.rank() == 0 {
            let reqs: Vec<_> = ts
                .iter()
                .map(|t| immediate_send(&c, t, 1, 9).unwrap())
                .collect();
            reqs.into_iter().for_each(|r| r.wait().unwrap());
            vec![]
        } else {
            let mut rs: Vec<Tensor> = ts
                .iter()
                .map(|t| Tensor::zeros(DType::U8, t.shape()).unwrap().named(t.name()))
                .collect();
            let reqs: Vec<_> = rs
                .iter_mut()
                .map(|t| immediate_receive_into(&c, t, 0, 9).unwrap())
                .collect();
            reqs.into_iter().for_each(|r| r.wait().unwrap());
            rs.iter().map(|t| t.bytes().to_vec()).collect()
        }
    });
    assert_eq!(out[1], vec![vec![1; 4], vec![2; 4], vec![3; 6], vec![4; 4]]);
}

#[test]
fn any_source_is_refused() {
    let c = LocalComm::create(2, std::time::Duration::from_millis(10));
    let mut x = Tensor::zeros(DType::U8, &[1]).unwrap();
    assert_eq!(
        receive_into(&c[0], &mut x, ANY_SOURCE, 1).unwrap_err(),
        P2pError::AnySource(0)
    );
}

#[test]
fn tags_above_the_bound_are_refused() {
    let c = LocalComm::create(1, std::time::Duration::from_millis(10));
    let x = Tensor::zeros(DType::U8, &[1]).unwrap();
    // The in-process transport runs under the standard's minimum bound, 32767, with
    // mpiflow's own tags at its top.
    let max = c[0].tags().max_user();
    assert_eq!(max, 32767 - 14);
    assert_eq!(
        send(&c[0], &x, 0, max + 1).unwrap_err().to_string(),
        "rank 0: tag 32754 is out of range 0..=32753 (MPI_TAG_UB 32767; the 14 tags above are mpiflow's own)"
    );
    send(&c[0], &x, 0, max).unwrap();
}
