use super::super::{receive_into, send};
use super::*;
use crate::tensor::DType;
use crate::transport::local::LocalComm;

fn u8s(n: usize, v: u8, name: &str) -> Tensor {
    Tensor::from_slice(&[n], &vec![v; n]).unwrap().named(name)
}

/// Four tensors a sender sends: a header with the first and the third (a change), the
/// payload alone with the second, and a header again with the fourth.
fn p_p_q_p() -> [Tensor; 4] {
    [
        u8s(4, 1, "p"),
        u8s(4, 2, "p"),
        u8s(6, 3, "q"),
        u8s(4, 4, "p"),
    ]
}

#[test]
fn a_window_of_sends_completes_in_one_wait_and_in_order() {
    // The receiver starts once all five are started: a receiver that took the first
    // would map the link's ring, and the later sends would go there, not in the window.
    let started = std::sync::Barrier::new(2);
    let out = LocalComm::run(2, |c| {
        if c.rank() == 0 {
            let ts: Vec<Tensor> = (0..5).map(|i| u8s(3, i as u8, "w")).collect();
            let mut sends = Sends::new(&c);
            for t in &ts {
                sends.immediate_send(t, 1, 4).unwrap();
            }
            assert_eq!(sends.len(), 5);
            started.wait();
            sends.wait_all().unwrap();
            Sends::new(&c).wait_all().unwrap();
            Vec::new()
        } else {
            started.wait();
            let mut t = u8s(3, 9, "w");
            (0..5)
                .map(|_| {
                    receive_into(&c, &mut t, 0, 4).unwrap();
                    t.bytes().to_vec()
                })
                .collect()
        }
    });
    let want: Vec<Vec<u8>> = (0..5).map(|i| vec![i; 3]).collect();
    assert_eq!(out[1], want);
}

#[test]
fn sending_each_of_a_window_lands_in_order_with_headers_where_the_tensor_changes() {
    // p, p, q, p: the receiver expects exactly that, so every header and payload-only
    // message is read as the sender meant it; a bad tag starts nothing.
    let out = LocalComm::run(2, |c| {
        let sent = p_p_q_p();
        if c.rank() == 0 {
            let mut sends = Sends::new(&c);
            let bad = sends.immediate_send_each(&sent, 1, -3).unwrap_err();
            assert!(bad.to_string().contains("tag"), "{bad}");
            assert!(sends.is_empty());
            sends.immediate_send_each(&sent, 1, 9).unwrap();
            assert_eq!(sends.len(), 4);
            sends.wait_all().unwrap();
            return Vec::new();
        }
        let mut got: Vec<Tensor> = [(4, "p"), (4, "p"), (6, "q"), (4, "p")]
            .iter()
            .map(|&(n, name)| u8s(n, 0, name))
            .collect();
        for t in got.iter_mut() {
            receive_into(&c, t, 0, 9).unwrap();
        }
        got.iter().map(|t| t.bytes().to_vec()).collect()
    });
    let want: Vec<Vec<u8>> = vec![vec![1; 4], vec![2; 4], vec![3; 6], vec![4; 4]];
    assert_eq!(out[1], want);
}

#[test]
fn a_window_of_receives_lands_in_order_and_checks_each() {
    // Rank 0 sends p, p, q, p (a header each time the tensor changes); rank 1 expects
    // p, p, p, p: the third is named as q, and the fourth still lands (the links
    // stay in step through the mismatch).
    let out = LocalComm::run(2, |c| {
        let sent = p_p_q_p();
        if c.rank() == 0 {
            sent.iter().for_each(|t| send(&c, t, 1, 9).unwrap());
            return (vec![], String::new());
        }
        let mut rs: Vec<Tensor> = (0..4).map(|_| u8s(4, 0, "p")).collect();
        let mut window = Receives::new(&c);
        for t in rs.iter_mut() {
            window.immediate_receive_into(t, 0, 9).unwrap();
        }
        let e = window.wait_all().unwrap_err().to_string();
        let got = [0, 1, 3].map(|i| rs[i].bytes().to_vec()).to_vec();
        (got, e)
    });
    assert_eq!(out[1].0, vec![vec![1; 4], vec![2; 4], vec![4; 4]]);
    assert_eq!(
        out[1].1,
        "rank 1: from rank 0: received 'q' u8[6] but expected 'p' u8[4]"
    );
}

#[test]
fn receiving_each_checks_every_tensor_against_its_own_runs_link() {
    // Rank 1's window: two tensors from rank 2 on tag 5, one from rank 0 on tag 3 (a
    // single receive between the runs), then p, p, q, p from rank 0 on tag 9 where it
    // expects p four times. The links already hold p, so the runs' receives land as
    // payloads: the mismatch is named with its own run's peer, and the rest land.
    let out = LocalComm::run(3, |c| {
        let p = || u8s(4, 7, "p");
        match c.rank() {
            0 => {
                send(&c, &p(), 1, 9).unwrap();
                send(&c, &p(), 1, 3).unwrap();
                p_p_q_p().iter().for_each(|t| send(&c, t, 1, 9).unwrap());
                (vec![], String::new())
            }
            2 => {
                (0..3).for_each(|i| send(&c, &u8s(4, 20 + i, "p"), 1, 5).unwrap());
                (vec![], String::new())
            }
            _ => {
                let mut t = p();
                receive_into(&c, &mut t, 0, 9).unwrap();
                receive_into(&c, &mut t, 2, 5).unwrap();
                let mut rs: Vec<Tensor> = (0..7).map(|_| p()).collect();
                let (from2, rest) = rs.split_at_mut(2);
                let (from0, on9) = rest.split_at_mut(1);
                let mut spare = [p()];
                let mut window = Receives::new(&c);
                let bad = window.immediate_receive_each(spare.iter_mut(), 0, -1);
                assert!(bad.unwrap_err().to_string().contains("tag"));
                window
                    .immediate_receive_each(from2.iter_mut(), 2, 5)
                    .unwrap();
                window.immediate_receive_into(&mut from0[0], 0, 3).unwrap();
                window.immediate_receive_each(on9.iter_mut(), 0, 9).unwrap();
                let e = window.wait_all().unwrap_err().to_string();
                let got = [0, 1, 2, 3, 4, 6].map(|i| rs[i].bytes()[0]).to_vec();
                (got, e)
            }
        }
    });
    assert_eq!(out[1].0, vec![21, 22, 7, 1, 2, 4]);
    assert_eq!(
        out[1].1,
        "rank 1: from rank 0: received 'q' u8[6] but expected 'p' u8[4]"
    );
}

#[test]
fn a_dropped_window_completes_and_the_link_stays_in_step() {
    let out = LocalComm::run(2, |c| {
        let t = Tensor::zeros(DType::F32, &[2]).unwrap().named("g");
        if c.rank() == 0 {
            for _ in 0..3 {
                send(&c, &t, 1, 2).unwrap();
            }
            return true;
        }
        let (mut a, mut b, mut d) = (t.clone(), t.clone(), t.clone());
        {
            let mut window = Receives::new(&c);
            window.immediate_receive_into(&mut a, 0, 2).unwrap();
            window.immediate_receive_into(&mut b, 0, 2).unwrap();
        }
        receive_into(&c, &mut d, 0, 2).is_ok()
    });
    assert_eq!(out, vec![true, true]);
}
