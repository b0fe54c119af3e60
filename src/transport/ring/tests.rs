use super::*;

/// A ring for messages of `nbytes`, mapped twice: its sending and receiving sides.
fn pair_made(nbytes: usize, made: Made) -> (Outbound, Inbound) {
    let geo = Geometry::of(nbytes);
    let (map, name) = shm::create(geo).unwrap();
    let out = shm::open(&name, geo).unwrap();
    shm::unlink(&name);
    (Outbound::new(out, geo, made), Inbound::new(map, geo))
}

fn pair(nbytes: usize) -> (Outbound, Inbound) {
    pair_made(nbytes, Made::ForChannel)
}

#[test]
fn geometry_keeps_slots_within_the_ring_bytes() {
    assert_eq!(Geometry::of(4).stride, 64);
    assert_eq!(Geometry::of(48).stride, 64);
    assert_eq!(Geometry::of(49).stride, 128);
    assert_eq!(Geometry::of(8).slots, 64);
    assert_eq!(Geometry::of(4096).stride, 4160);
    assert_eq!(Geometry::of(4096).slots, 64);
    assert_eq!(Geometry::of(4096).len(), 3 * 64 + 64 * 4160);
    // A link's: a whole message of a 4 KiB tensor, in as many slots.
    assert_eq!(Geometry::of(LINK_BYTES).stride, 4288);
    assert_eq!(Geometry::of(LINK_BYTES).slots, 64);
}

#[test]
fn a_full_ring_sends_by_mpi_and_the_receiver_knows_which_went_where() {
    let (out, inb) = pair(8);
    let slots = out.geo.slots;
    let mut routes = Vec::new();
    for k in 0..slots + 3 {
        routes.push(out.put(&(k as u64).to_le_bytes()));
    }
    // The ring took the first `slots`; the three after went by MPI.
    assert!(routes[..slots].iter().all(|r| *r));
    assert!(routes[slots..].iter().all(|r| !*r));
    let mut buf = [0u8; 8];
    for k in 0..slots {
        assert_eq!(inb.poll(), Next::Ring);
        inb.take(&mut buf);
        assert_eq!(u64::from_le_bytes(buf), k as u64);
    }
    // A slot is free again, and the next message goes there; the three before it are
    // MPI's, in order.
    assert!(out.put(&99u64.to_le_bytes()));
    for _ in 0..3 {
        assert_eq!(inb.poll(), Next::Mpi);
        inb.skip();
    }
    assert_eq!(inb.poll(), Next::Ring);
    inb.take(&mut buf);
    assert_eq!(u64::from_le_bytes(buf), 99);
    assert_eq!(inb.poll(), Next::NotYet);
}

#[test]
fn a_peer_ring_of_another_geometry_is_refused() {
    let (_map, name) = shm::create(Geometry::of(16)).unwrap();
    let err = shm::open(&name, Geometry::of(64)).unwrap_err().to_string();
    shm::unlink(&name);
    assert!(err.contains("another"), "{err}");
    assert!(shm::open(&name, Geometry::of(16)).is_err(), "unlinked");
}

#[test]
fn messages_of_any_length_up_to_the_slot_and_longer_ones_by_mpi() {
    let (out, inb) = pair(100);
    let mut buf = [0u8; 100];
    for (k, len) in [0usize, 1, 57, 100, 101, 3].into_iter().enumerate() {
        let msg: Vec<u8> = (0..len).map(|i| (i + k) as u8).collect();
        let into_ring = out.put(&msg);
        assert_eq!(into_ring, len <= 100, "length {len}");
        if into_ring {
            assert_eq!(inb.poll(), Next::Ring);
            assert_eq!(inb.take(&mut buf), (len, false));
            assert_eq!(&buf[..len], &msg[..]);
        } else {
            assert_eq!(inb.poll(), Next::Mpi);
            inb.skip();
        }
    }
    // A message longer than the receiver's buffer: what fits, and the truncation.
    assert!(out.put(&[7u8; 80]));
    assert_eq!(inb.poll(), Next::Ring);
    assert_eq!(inb.take(&mut buf[..50]), (50, true));
}

#[test]
fn a_link_message_takes_two_slots_in_turn_across_the_end_and_whole() {
    let (out, inb) = pair_made(100, Made::ForLink);
    inb.attach();
    let (slots, mut one) = (out.geo.slots, [0u8; 100]);
    // Up to the last slot, each message taken as it comes: the next one wraps.
    for k in 0..slots - 1 {
        assert!(out.put(&[k as u8; 10]));
        assert_eq!(inb.poll(), Next::Ring);
        assert_eq!(inb.take(&mut one), (10, false));
    }
    let msg: Vec<u8> = (0..150).map(|i| i as u8).collect();
    assert!(out.put(&msg));
    assert_eq!(inb.poll(), Next::Ring);
    let mut two = [0u8; 200];
    assert_eq!(inb.take(&mut two), (150, false));
    assert_eq!(&two[..150], &msg[..]);
    // Into a shorter buffer: what fits, the truncation, and both slots consumed.
    assert!(out.put(&msg));
    assert_eq!(inb.poll(), Next::Ring);
    assert_eq!(inb.take(&mut two[..120]), (120, true));
    assert_eq!(&two[..120], &msg[..120]);
    assert!(out.put(&[9; 3]));
    assert_eq!(inb.poll(), Next::Ring);
    assert_eq!(inb.take(&mut one), (3, false));
    // Longer than a link's message may be: by MPI, numbered.
    assert!(!out.put(&vec![0u8; LINK_CHUNKS * 100 + 1]));
    assert_eq!(inb.poll(), Next::Mpi);
    inb.skip();
    // One slot free: a message of two goes by MPI, a message of one into the slot.
    for _ in 0..slots - 1 {
        assert!(out.put(&[1; 8]));
    }
    assert!(!out.put(&msg));
    assert!(out.put(&[2; 8]));
    for _ in 0..slots - 1 {
        assert_eq!(inb.poll(), Next::Ring);
        inb.take(&mut one);
    }
    assert_eq!(inb.poll(), Next::Mpi);
    inb.skip();
    assert_eq!(inb.poll(), Next::Ring);
    assert_eq!(inb.take(&mut one), (8, false));
    assert_eq!(one[..8], [2; 8]);
    // A channel's message takes one slot: longer ones go by MPI.
    let (out, inb) = pair(100);
    assert!(!out.put(&msg));
    assert_eq!(inb.poll(), Next::Mpi);
}

#[test]
fn a_ring_its_sender_made_carries_nothing_until_the_receiver_attaches() {
    let (out, inb) = pair_made(8, Made::ForLink);
    // Before the receiver maps it: by MPI, numbered, so the receiver knows.
    assert!(!out.put(&1u64.to_le_bytes()));
    assert_eq!(inb.poll(), Next::Mpi);
    inb.skip();
    inb.attach();
    assert!(out.put(&2u64.to_le_bytes()));
    let mut buf = [0u8; 8];
    assert_eq!(inb.poll(), Next::Ring);
    assert_eq!(inb.take(&mut buf), (8, false));
    assert_eq!(u64::from_le_bytes(buf), 2);
}

#[test]
fn a_detached_link_ring_carries_nothing_until_reattached_and_order_holds() {
    let (out, inb) = pair_made(8, Made::ForLink);
    inb.attach();
    let mut buf = [0u8; 8];
    // Message 0 announced and in the ring: a detach now cannot post for it.
    assert!(out.put(&[0; 8]));
    assert!(!inb.detach());
    // Detached: message 1 goes by MPI, numbered.
    assert!(!out.put(&[1; 8]));
    inb.reattach();
    assert!(out.put(&[2; 8]));
    assert_eq!(inb.poll(), Next::Ring);
    assert_eq!(inb.take(&mut buf), (8, false));
    assert_eq!(buf, [0; 8]);
    assert_eq!(inb.poll(), Next::Mpi);
    inb.skip();
    assert_eq!(inb.poll(), Next::Ring);
    inb.take(&mut buf);
    assert_eq!(buf, [2; 8]);
    // Nothing announced past what this side expects: the detach holds, and holds
    // without asking again until this side lets the sender back.
    assert!(inb.detach());
    assert!(!out.put(&[3; 8]));
    assert_eq!(inb.poll(), Next::Mpi);
    inb.skip();
    assert!(inb.detach());
    assert!(!out.put(&[4; 8]));
    inb.skip();
    inb.back();
    assert!(out.put(&[5; 8]));
    assert_eq!(inb.poll(), Next::Ring);
    inb.take(&mut buf);
    assert_eq!(buf, [5; 8]);
    inb.back();
    assert!(out.put(&[6; 8]));
}
