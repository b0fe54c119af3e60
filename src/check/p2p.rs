//! Point-to-point checks of `mpiflow check`: tensors by rank and by task, mismatches
//! that name both sides, links that follow changes, a stream through an inbox, and
//! streams on channels and on links that take shared memory where they can.

use super::{tensor_of, Report};
use crate::cluster::peers::{self, Peer, Tasks};
use crate::cluster::{Layout, TaskId};
use crate::tensor::{DType, Tensor};
use crate::transport::channel::{Carrier, Channel};
use crate::transport::p2p::{Receives, Sends};
use crate::transport::{comm, p2p, Comm};

/// Runs the point-to-point checks on this rank (every rank of `c` calls it).
pub(super) fn run<C: Comm>(c: &C, layout: &Layout, rep: &mut Report) -> Result<(), String> {
    let (n, r) = (c.size(), c.rank());
    let e = |x: &dyn std::fmt::Display| x.to_string();
    // Point-to-point ring, by rank, on the highest tag left to callers under this job's
    // MPI_TAG_UB (the collectives below use the reserved ones above it).
    let top = c.tags().max_user();
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let out = tensor_of(DType::F32, r, 1001).named("ring");
    let mut inc = Tensor::zeros(DType::F32, &[1001])
        .map_err(|x| e(&x))?
        .named("ring");
    let send = p2p::immediate_send(c, &out, right, top).map_err(|x| e(&x))?;
    p2p::receive_into(c, &mut inc, left, top).map_err(|x| e(&x))?;
    send.wait().map_err(|x| e(&x))?;
    rep.expect(
        inc.bytes() == tensor_of(DType::F32, left, 1001).bytes(),
        || format!("p2p ring: data from rank {left} differs"),
    );

    // By task: each task sends to the task of the next rank.
    let tasks = Tasks::from_layout(layout);
    let me = &layout.ranks[r].task;
    let next: TaskId = layout.ranks[right].task.clone();
    let prev: TaskId = layout.ranks[left].task.clone();
    let out = Tensor::from_slice(&[2], &[r as i64, 42])
        .map_err(|x| e(&x))?
        .named(&format!("from {me}"));
    let mut inc = Tensor::zeros(DType::I64, &[2])
        .map_err(|x| e(&x))?
        .named(&format!("from {prev}"));
    let send = p2p::immediate_send(
        c,
        &out,
        tasks.rank(&Peer::Task(next)).map_err(|x| e(&x))?,
        6,
    )
    .map_err(|x| e(&x))?;
    peers::receive_from(c, &tasks, &mut inc, &Peer::Task(prev.clone()), 6).map_err(|x| e(&x))?;
    send.wait().map_err(|x| e(&x))?;
    rep.expect(
        inc.as_slice::<i64>().ok() == Some(&[left as i64, 42][..]),
        || format!("p2p by task: from {prev} got {inc:?}"),
    );

    // A mismatched receive fails, naming both tensors, and the channel stays usable.
    if n > 1 {
        let out = tensor_of(DType::F32, r, 8).named("grad/w");
        let mut wrong = Tensor::zeros(DType::F32, &[4])
            .map_err(|x| e(&x))?
            .named("grad/b");
        let send = p2p::immediate_send(c, &out, right, 7).map_err(|x| e(&x))?;
        let err = p2p::receive_into(c, &mut wrong, left, 7)
            .err()
            .map(|x| x.to_string())
            .unwrap_or_default();
        send.wait().map_err(|x| e(&x))?;
        let want = format!(
            "rank {r}: from rank {left}: received 'grad/w' f32[8] but expected 'grad/b' f32[4]"
        );
        rep.expect(err == want, || {
            format!("mismatch: got {err:?}, want {want:?}")
        });
        links_follow_changes(c, rep, (left, right))?;
        inbox_stream(c, rep, (left, right))?;
        ring_stream(c, rep, (left, right))?;
        link_stream(c, rep, (left, right))?;
    }
    Ok(())
}

/// Channels for tensors like `t` to the right (`out`) and from the left (`inc`) on `tag`.
/// Each open is a header exchange with one peer: even ranks open to the right first, odd
/// ranks from the left first, so that no cycle of ranks waits on each other.
fn open_around<C: Comm>(
    c: &C,
    t: &Tensor,
    (left, right): (usize, usize),
    tag: i32,
    carrier: Carrier,
) -> Result<(Channel, Channel), String> {
    let open = |peer| Channel::open_over(c, t, peer, tag, carrier).map_err(|x| x.to_string());
    Ok(if c.rank().is_multiple_of(2) {
        let out = open(right)?;
        (out, open(left)?)
    } else {
        let inc = open(left)?;
        (open(right)?, inc)
    })
}

/// Repeats, changes and mismatches on p2p links (headers travel only when the tensor
/// changes): every transfer's bytes, and the errors, are what a header on every message
/// would give. Tag 7 holds 'grad/w' f32[8] from the mismatch before.
fn links_follow_changes<C: Comm>(
    c: &C,
    rep: &mut Report,
    (left, right): (usize, usize),
) -> Result<(), String> {
    let r = c.rank();
    let e = |x: &dyn std::fmt::Display| x.to_string();
    // (what is sent, what is expected, the sender's tensor an error must name, if one is
    // due): repeats (payload alone), a receiver that expects another tensor, a change
    // whose whole message has the length of the previous payload (f32[8] = 32 bytes; u8[8]
    // with a 24-byte header), a sender switching back, and repeats again.
    let a = |k: usize| tensor_of(DType::F32, r + k, 8).named("grad/w");
    let b = |k: usize| tensor_of(DType::U8, r + k, 8);
    let plan: [(Tensor, Tensor, Option<&str>); 6] = [
        (a(1), a(1), None),
        (a(2), a(2), None),
        (
            a(3),
            Tensor::zeros(DType::F32, &[4])
                .map_err(|x| e(&x))?
                .named("grad/b"),
            Some("'grad/w' f32[8]"),
        ),
        (b(4), b(4), None),
        (b(5), a(5), Some("'' u8[8]")),
        (b(6), b(6), None),
    ];
    for (step, (out, mut want, error)) in plan.into_iter().enumerate() {
        // What rank `left` sent at this step, as `want` would hold it.
        let expect_bytes = tensor_of(want.dtype(), left + step + 1, want.numel())
            .bytes()
            .to_vec();
        let send = p2p::immediate_send(c, &out, right, 7).map_err(|x| e(&x))?;
        let got = p2p::receive_into(c, &mut want, left, 7);
        send.wait().map_err(|x| e(&x))?;
        match (got, error) {
            (Ok(()), None) => rep.expect(want.bytes() == expect_bytes, || {
                format!("p2p link step {step}: data from rank {left} differs")
            }),
            (Err(x), Some(sent)) => {
                let msg = x.to_string();
                rep.expect(
                    msg.contains(&format!("received {sent} but expected")),
                    || format!("p2p link step {step}: error {msg:?} does not name {sent}"),
                )
            }
            (got, _) => rep.expect(false, || format!("p2p link step {step}: {got:?}")),
        }
    }
    Ok(())
}

/// A stream of one tensor around the ring (to the right, from the left), received
/// through an inbox of 4 receives posted ahead: 20 messages in order, three stray messages
/// on the channel's tag, shorter, longer within the room behind the payload, and longer
/// than that (a truncated non-blocking receive, which MPICH raises on `MPI_COMM_WORLD`;
/// small enough to go eagerly, since every rank sends before it receives),
/// each an error naming the channel and the stream going on, one more message, and a
/// close that finds no message left untaken (every receive posted ahead withdrawn by
/// `MPI_Cancel`).
fn inbox_stream<C: Comm>(
    c: &C,
    rep: &mut Report,
    (left, right): (usize, usize),
) -> Result<(), String> {
    const TAG: i32 = 8;
    let r = c.rank();
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let of = |k: usize| tensor_of(DType::F32, k, 3).named("stream");
    let mut t = of(0);
    // On MPI: stray messages on a channel on rings go unseen (the channel owns its tag).
    let (out, inc) = open_around(c, &t, (left, right), TAG, Carrier::Mpi)?;
    let mut inbox = inc.inbox(c, &t, 4).map_err(|x| e(&x))?;
    for k in 0..20 {
        out.send(c, &of(r * 100 + k)).map_err(|x| e(&x))?;
    }
    comm::send(c, &[1; 5], right, TAG).map_err(|x| e(&x))?;
    comm::send(c, &[2; 40], right, TAG).map_err(|x| e(&x))?;
    comm::send(c, &[3; 1000], right, TAG).map_err(|x| e(&x))?;
    out.send(c, &of(r * 100 + 99)).map_err(|x| e(&x))?;
    for k in 0..20 {
        inbox.receive_into(&mut t).map_err(|x| e(&x))?;
        rep.expect(t.bytes() == of(left * 100 + k).bytes(), || {
            format!("inbox stream: message {k} from rank {left} differs")
        });
    }
    for got in ["5 bytes", "40 bytes", "more than 12 bytes"] {
        let err = inbox.receive_into(&mut t).err().map(|x| x.to_string());
        let want = format!(
            "rank {r}: from rank {left}: received {got} but expected 'stream' f32[3] (12 bytes) on the channel"
        );
        rep.expect(err.as_deref() == Some(&want[..]), || {
            format!("inbox stream: got {err:?}, want {want:?}")
        });
    }
    inbox.receive_into(&mut t).map_err(|x| e(&x))?;
    rep.expect(t.bytes() == of(left * 100 + 99).bytes(), || {
        format!("inbox stream: the message after the errors from rank {left} differs")
    });
    let closed = inbox.close().err().map(|x| x.to_string());
    rep.expect(closed.is_none(), || {
        format!("inbox stream: close: {closed:?}")
    });
    Ok(())
}

/// A stream of one tensor around the ring on channels that take shared memory where both
/// ranks share a node (and by MPI otherwise): 150 messages sent before any is received (a
/// ring holds 64, the rest go by MPI), then a window of 40 each way, all in order; both
/// sides of each channel on the same carrier, and on rings only within a node.
fn ring_stream<C: Comm>(
    c: &C,
    rep: &mut Report,
    (left, right): (usize, usize),
) -> Result<(), String> {
    const TAG: i32 = 9;
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let of = |k: usize| tensor_of(DType::I32, k, 2).named("ring stream");
    let mut t = of(0);
    let (out, inc) = open_around(c, &t, (left, right), TAG, Carrier::SharedMemory)?;
    // Each side of a channel reached the same verdict, and none spans two nodes (a node
    // may lack room for a ring: shared memory is then not required).
    let mine = c.node_name().unwrap_or_default();
    let swap = |ours: &[u8], to: usize, from: usize| -> Result<Vec<u8>, String> {
        let mut buf = [0u8; 256];
        let got = comm::sendrecv(c, ours, to, &mut buf, from, TAG).map_err(|x| e(&x))?;
        Ok(buf[..got.count].to_vec())
    };
    let on_rings = |ch: &Channel| u8::from(ch.carrier() == Carrier::SharedMemory);
    let of_left = swap(mine.as_bytes(), right, left)?;
    let of_right = swap(mine.as_bytes(), left, right)?;
    let left_out = swap(&[on_rings(&out)], right, left)?;
    let right_in = swap(&[on_rings(&inc)], left, right)?;
    for (ch, node, peer_says, side) in [
        (&out, &of_right, &right_in, "right"),
        (&inc, &of_left, &left_out, "left"),
    ] {
        let node = String::from_utf8_lossy(node);
        rep.expect(peer_says[..] == [on_rings(ch)], || {
            format!(
                "ring stream: the channel to the {side} is on {:?} here, not on the other side",
                ch.carrier()
            )
        });
        rep.expect(node == mine || ch.carrier() == Carrier::Mpi, || {
            format!("ring stream: the channel to the {side} ({node} from {mine}) is on rings")
        });
    }
    rep.rings = Some(on_rings(&out) + on_rings(&inc) == 2);
    let r = c.rank();
    for k in 0..150 {
        out.send(c, &of(r * 1000 + k)).map_err(|x| e(&x))?;
    }
    let mut got = Vec::new();
    for _ in 0..150 {
        inc.receive_into(c, &mut t).map_err(|x| e(&x))?;
        got.push(t.clone());
    }
    let sent: Vec<Tensor> = (150..190).map(|k| of(r * 1000 + k)).collect();
    let mut window: Vec<Tensor> = (0..40).map(|_| of(0)).collect();
    let mut sends = Sends::new(c);
    for s in &sent {
        out.immediate_send_in(&mut sends, s).map_err(|x| e(&x))?;
    }
    let mut receives = Receives::new(c);
    for w in window.iter_mut() {
        inc.immediate_receive_in(&mut receives, w)
            .map_err(|x| e(&x))?;
    }
    receives.wait_all().map_err(|x| e(&x))?;
    sends.wait_all().map_err(|x| e(&x))?;
    got.extend(window);
    expect_stream(rep, "ring stream", &got, left, of);
    Ok(())
}

/// `got` holds the 190 messages of `what` from rank `left`: `of(left * 1000 + k)` for each k.
fn expect_stream(
    rep: &mut Report,
    what: &str,
    got: &[Tensor],
    left: usize,
    of: impl Fn(usize) -> Tensor,
) {
    let wrong =
        (0..190).find(|k| got.get(*k).map(Tensor::bytes) != Some(of(left * 1000 + k).bytes()));
    rep.expect(wrong.is_none(), || {
        format!("{what}: message {wrong:?} from rank {left} differs")
    });
}

/// A stream on a p2p link around the ring of ranks (the header path), which takes a ring in
/// shared memory where both ranks share a node: one message (the receiver maps the ring
/// at its first receive), 149 sent before any is received (the ring holds 64, the rest go
/// by MPI), a window of 40, all in order; then a large tensor each way on the same link,
/// its receive started before its send (under `ob1` a rendezvous: a receive left queued
/// on the ring would leave both ranks waiting); then 20 tensors of 16 KiB (four slots of a
/// ring each), started before their receives, in order (the first by MPI, the link
/// detached by the large receive; the rest through the ring once the receiver let its
/// sender back). On a ring only within a node.
fn link_stream<C: Comm>(
    c: &C,
    rep: &mut Report,
    (left, right): (usize, usize),
) -> Result<(), String> {
    const TAG: i32 = 10;
    const BIG: usize = 64 * 1024;
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let of = |k: usize| tensor_of(DType::I32, k, 2).named("link stream");
    let r = c.rank();
    let mut t = of(0);
    let mut got = Vec::new();
    let first = of(r * 1000);
    let send = p2p::immediate_send(c, &first, right, TAG).map_err(|x| e(&x))?;
    p2p::receive_into(c, &mut t, left, TAG).map_err(|x| e(&x))?;
    send.wait().map_err(|x| e(&x))?;
    got.push(t.clone());
    for k in 1..150 {
        p2p::send(c, &of(r * 1000 + k), right, TAG).map_err(|x| e(&x))?;
    }
    for _ in 1..150 {
        p2p::receive_into(c, &mut t, left, TAG).map_err(|x| e(&x))?;
        got.push(t.clone());
    }
    let sent: Vec<Tensor> = (150..190).map(|k| of(r * 1000 + k)).collect();
    let mut window: Vec<Tensor> = (0..40).map(|_| of(0)).collect();
    let mut receives = Receives::new(c);
    receives
        .immediate_receive_each(window.iter_mut(), left, TAG)
        .map_err(|x| e(&x))?;
    let mut sends = Sends::new(c);
    sends
        .immediate_send_each(sent.iter(), right, TAG)
        .map_err(|x| e(&x))?;
    receives.wait_all().map_err(|x| e(&x))?;
    sends.wait_all().map_err(|x| e(&x))?;
    got.extend(window);
    expect_stream(rep, "link stream", &got, left, of);
    let on_ring = p2p::receives_by_ring(c, left, TAG);
    let big_out = tensor_of(DType::F32, r, BIG).named("link stream big");
    let mut big_in = Tensor::zeros(DType::F32, &[BIG])
        .map_err(|x| e(&x))?
        .named("link stream big");
    let recv = p2p::immediate_receive_into(c, &mut big_in, left, TAG).map_err(|x| e(&x))?;
    p2p::send(c, &big_out, right, TAG).map_err(|x| e(&x))?;
    recv.wait().map_err(|x| e(&x))?;
    rep.expect(
        big_in.bytes() == tensor_of(DType::F32, left, BIG).bytes(),
        || format!("link stream: the large tensor from rank {left} differs"),
    );
    let mid = |k: usize| tensor_of(DType::F32, k, 4096).named("link stream mid");
    let mids: Vec<Tensor> = (0..20).map(|k| mid(r * 1000 + k)).collect();
    let mut sends = Sends::new(c);
    sends
        .immediate_send_each(mids.iter(), right, TAG)
        .map_err(|x| e(&x))?;
    let (mut m, mut wrong) = (mid(0), None);
    for k in 0..20 {
        p2p::receive_into(c, &mut m, left, TAG).map_err(|x| e(&x))?;
        if wrong.is_none() && m.bytes() != mid(left * 1000 + k).bytes() {
            wrong = Some(k);
        }
    }
    sends.wait_all().map_err(|x| e(&x))?;
    rep.expect(wrong.is_none(), || {
        format!("link stream: 16 KiB message {wrong:?} from rank {left} differs")
    });
    // A ring only within a node (the node names, swapped on a tag of their own).
    let mine = c.node_name().unwrap_or_default();
    let mut theirs = [0u8; 256];
    let n = comm::sendrecv(c, mine.as_bytes(), right, &mut theirs, left, TAG + 1)
        .map_err(|x| e(&x))?
        .count;
    let node = String::from_utf8_lossy(&theirs[..n]);
    rep.expect(!on_ring || node == mine, || {
        format!("link stream: the link from rank {left} ({node} from {mine}) is on a ring")
    });
    rep.link_rings = Some(on_ring);
    Ok(())
}
