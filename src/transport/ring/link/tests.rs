use super::super::MAX_BYTES;
use super::*;
use crate::tensor::{DType, Tensor};
use crate::transport::local::LocalComm;
use crate::transport::p2p;

fn u8s(n: usize, v: u8, name: &str) -> Tensor {
    Tensor::from_slice(&[n], &vec![v; n]).unwrap().named(name)
}

#[test]
fn an_offer_names_its_link_and_ring() {
    let o = Offer {
        tag: 7,
        ring: Some(Offered {
            name: "/mpiflow-ring-1-2".into(),
            nbytes: 256,
        }),
    };
    let back: Offer = serde_json::from_slice(&serde_json::to_vec(&o).unwrap()).unwrap();
    assert_eq!(back.tag, 7);
    assert_eq!(back.ring.unwrap().nbytes, 256);
}

/// Rank 0 sends a tensor of `first` bytes, and once rank 1 has received it (mapping
/// the ring) `n - 1` more of `rest` bytes (value k, every tenth renamed) before rank 1
/// receives any (it waits until rank 0 says all are sent, not for a time, so a slow
/// machine cannot let it take one early); rank 1's values and how many slots came
/// through the ring.
fn stream(nodes: &[usize], n: usize, first: usize, rest: usize) -> (Vec<u8>, u64) {
    let sent = std::sync::atomic::AtomicBool::new(false);
    let out = LocalComm::run_on_nodes(nodes, |c| {
        let name = |k: usize| if k % 10 == 9 { "odd" } else { "even" };
        let size = |k: usize| if k == 0 { first } else { rest };
        let mut ack = u8s(1, 0, "ack");
        if c.rank() == 0 {
            for k in 0..n {
                p2p::send(&c, &u8s(size(k), k as u8, name(k)), 1, 3).unwrap();
                if k == 0 {
                    p2p::receive_into(&c, &mut ack, 1, 8).unwrap();
                }
            }
            sent.store(true, std::sync::atomic::Ordering::Release);
            // Its rings' names last as long as the communicator.
            p2p::receive_into(&c, &mut ack, 1, 8).unwrap();
            (vec![], 0)
        } else {
            let mut got = vec![];
            for k in 0..n {
                let mut t = u8s(size(k), 0, name(k));
                p2p::receive_into(&c, &mut t, 0, 3).unwrap();
                got.push(t.bytes()[0]);
                if k == 0 {
                    p2p::send(&c, &ack, 0, 8).unwrap();
                    // Bounded, so a sender that cannot finish fails the count, not a hang.
                    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
                    while !sent.load(std::sync::atomic::Ordering::Acquire)
                        && std::time::Instant::now() < until
                    {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
            }
            p2p::send(&c, &ack, 0, 8).unwrap();
            (got, c.links().rings.taken_from_ring(0, 3))
        }
    });
    out[1].clone()
}

#[test]
fn a_link_on_one_node_takes_a_ring_and_keeps_order_past_a_full_one() {
    // 200 messages: the first before the receiver mapped the ring, then 199 before it
    // takes one (64 into the ring, the rest by MPI); headers where the name changes.
    let want: Vec<u8> = (0..200).map(|k| k as u8).collect();
    let slots = Geometry::of(LINK_BYTES).slots as u64;
    assert_eq!(stream(&[0, 0], 200, 16, 16), (want.clone(), slots));
    assert_eq!(stream(&[0, 1], 200, 16, 16), (want, 0));
}

#[test]
fn tensors_of_max_bytes_take_the_ring_whole_or_payload_alone() {
    // Payloads of MAX_BYTES, and whole messages of such tensors (every tenth renamed),
    // fit a slot; so does a receive's room for a longer message. All but the first
    // (sent before the receiver mapped the ring) come through it, whether the link
    // started with a small tensor or with one of MAX_BYTES.
    let want: Vec<u8> = (0..40).map(|k| k as u8).collect();
    assert_eq!(stream(&[0, 0], 40, 16, MAX_BYTES), (want.clone(), 39));
    assert_eq!(stream(&[0, 0], 40, MAX_BYTES, MAX_BYTES), (want, 39));
}

#[test]
fn tensors_of_several_slots_take_them_and_longer_ones_go_by_mpi() {
    // 8 KiB tensors (whole messages too) take two slots each: all but the first come
    // through the ring, in turn with the small first one, whichever started the link;
    // 32 KiB tensors take eight.
    let want: Vec<u8> = (0..20).map(|k| k as u8).collect();
    let two = 2 * MAX_BYTES;
    assert_eq!(stream(&[0, 0], 20, 16, two), (want.clone(), 2 * 19));
    assert_eq!(stream(&[0, 0], 20, two, two), (want.clone(), 2 * 19));
    let eight = 8 * MAX_BYTES;
    let want8: Vec<u8> = (0..8).map(|k| k as u8).collect();
    assert_eq!(stream(&[0, 0], 8, 16, eight), (want8, 8 * 7));
    // 39 of them before the receiver takes any: 32 fill the ring, the rest by MPI,
    // in order.
    let want40: Vec<u8> = (0..40).map(|k| k as u8).collect();
    assert_eq!(stream(&[0, 0], 40, 16, two), (want40, 64));
    // One byte more than the slots carry: by MPI, in order.
    let over = LINK_CHUNKS * LINK_BYTES + 1;
    assert_eq!(stream(&[0, 0], 20, 16, over), (want, 0));
}

#[test]
fn receives_keep_mpi_order_whether_queued_or_blocking() {
    let out = LocalComm::run(2, |c| {
        if c.rank() == 0 {
            for v in 1..=4 {
                p2p::send(&c, &u8s(8, v, "x"), 1, 2).unwrap();
            }
            vec![]
        } else {
            let (mut a, mut b, mut d, mut e) = (
                u8s(8, 0, "x"),
                u8s(8, 0, "x"),
                u8s(8, 0, "x"),
                u8s(8, 0, "x"),
            );
            let ra = p2p::immediate_receive_into(&c, &mut a, 0, 2).unwrap();
            let rb = p2p::immediate_receive_into(&c, &mut b, 0, 2).unwrap();
            // A blocking receive after two started ones takes the third message.
            p2p::receive_into(&c, &mut d, 0, 2).unwrap();
            rb.wait().unwrap();
            let mut w = p2p::Receives::new(&c);
            w.immediate_receive_into(&mut e, 0, 2).unwrap();
            w.wait_all().unwrap();
            ra.wait().unwrap();
            [&a, &b, &d, &e].iter().map(|t| t.bytes()[0]).collect()
        }
    });
    assert_eq!(out[1], vec![1, 2, 3, 4]);
}

#[test]
fn offers_read_for_other_links_wait_for_theirs() {
    let out = LocalComm::run(2, |c| {
        if c.rank() == 0 {
            for tag in [1, 2, 3] {
                p2p::send(&c, &u8s(4, tag as u8, "t"), 1, tag).unwrap();
            }
            // Its rings' names last as long as the communicator: until rank 1 is done.
            p2p::receive_into(&c, &mut u8s(1, 0, "done"), 1, 9).unwrap();
            vec![]
        } else {
            let mut got = vec![];
            for tag in [3, 1, 2] {
                let mut t = u8s(4, 0, "t");
                p2p::receive_into(&c, &mut t, 0, tag).unwrap();
                got.push((t.bytes()[0], c.links().rings.receives_by_ring(0, tag)));
            }
            p2p::send(&c, &u8s(1, 0, "done"), 0, 9).unwrap();
            got
        }
    });
    assert_eq!(out[1], vec![(3, true), (1, true), (2, true)]);
}

#[test]
fn large_tensors_cross_both_ways_by_mpi_and_small_ones_return_to_the_ring() {
    // Each rank starts a receive of a large tensor, then sends one (the pattern that
    // must not wait on the peer under MPI's rendezvous), after small ones took a ring;
    // then a blocking large receive, then small ones again.
    let out = LocalComm::run(2, |c| {
        let peer = 1 - c.rank();
        let small = u8s(8, c.rank() as u8, "s");
        let mut s_in = u8s(8, 9, "s");
        let swap_small = |s_in: &mut Tensor| {
            p2p::send(&c, &small, peer, 6).unwrap();
            p2p::receive_into(&c, s_in, peer, 6).unwrap();
        };
        // The third message each way comes after the peer's first receive (which
        // mapped the ring): through the ring.
        for _ in 0..3 {
            swap_small(&mut s_in);
        }
        let before = c.links().rings.taken_from_ring(peer, 6);
        let big = u8s(64 * 1024, 10 + c.rank() as u8, "big");
        let mut big_in = Tensor::zeros(DType::U8, &[64 * 1024]).unwrap().named("big");
        let r = p2p::immediate_receive_into(&c, &mut big_in, peer, 6).unwrap();
        p2p::send(&c, &big, peer, 6).unwrap();
        r.wait().unwrap();
        let immediate = big_in.bytes().iter().all(|&b| b == 10 + peer as u8);
        big_in.bytes_mut().fill(0);
        p2p::send(&c, &big, peer, 6).unwrap();
        p2p::receive_into(&c, &mut big_in, peer, 6).unwrap();
        let blocking = big_in.bytes().iter().all(|&b| b == 10 + peer as u8);
        for _ in 0..3 {
            swap_small(&mut s_in);
        }
        (
            s_in.bytes()[0],
            before > 0,
            immediate && blocking,
            c.links().rings.taken_from_ring(peer, 6) > before,
        )
    });
    assert_eq!(out, vec![(1, true, true, true), (0, true, true, true)]);
}

#[test]
fn a_small_message_where_a_large_one_was_expected_is_an_error_not_a_wait() {
    let out = LocalComm::run(2, |c| {
        if c.rank() == 0 {
            for _ in 0..2 {
                p2p::send(&c, &u8s(8, 1, "x"), 1, 4).unwrap();
            }
            String::new()
        } else {
            let mut x = u8s(8, 0, "x");
            p2p::receive_into(&c, &mut x, 0, 4).unwrap();
            let mut big = Tensor::zeros(DType::U8, &[8192]).unwrap().named("x");
            let r = p2p::immediate_receive_into(&c, &mut big, 0, 4).unwrap();
            r.wait().unwrap_err().to_string()
        }
    });
    assert_eq!(
        out[1],
        "rank 1: from rank 0: received 'x' u8[8] but expected 'x' u8[8192]"
    );
}

#[test]
fn a_first_receive_from_a_silent_peer_ends_as_an_mpi_receive_would_in_process() {
    let out = LocalComm::run_with_timeout(2, std::time::Duration::from_millis(300), |c| {
        if c.rank() == 0 {
            return String::new();
        }
        let mut t = u8s(4, 0, "t");
        p2p::receive_into(&c, &mut t, 0, 5).unwrap_err().to_string()
    });
    assert_eq!(out[1], "rank 1: no message from rank 0 (tag 5) within 0 s");
}
