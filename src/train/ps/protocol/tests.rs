use super::*;

#[test]
fn headers_round_trip_with_a_non_finite_loss() {
    let r = Request::Push {
        step: 7,
        samples: 21,
        loss: finite(f32::NAN),
        vars: vec![("layer0/w@0".into(), 3)],
        stop: None,
        times: None,
        non_finite: None,
        pull: None,
    };
    assert_eq!(decode::<Request>(&encode(&r)), Some(r.clone()));
    // No stop, no times, nothing not finite: the fields are left out, and a header
    // without them reads as none.
    let text = String::from_utf8_lossy(&encode(&r)).to_string();
    assert!(
        ["stop", "times", "pull", "non_finite"]
            .iter()
            .all(|f| !text.contains(f)),
        "{text}"
    );
    // What a worker found, and the ps tasks' verdict, travel whole.
    let grad = crate::tensor::Tensor::from_slice(&[2], &[1f32, f32::INFINITY])
        .unwrap()
        .named("layer0/w");
    let found = crate::train::guard::check_gradients(7, &[grad]).unwrap_err();
    let mut bad = r.clone();
    if let Request::Push { non_finite, .. } = &mut bad {
        *non_finite = Some(found.clone());
    }
    assert_eq!(decode::<Request>(&encode(&bad)), Some(bad));
    let verdict = Reply::NotApplied {
        why: found.seen(" on 2 of 3 workers".into()),
    };
    assert_eq!(decode::<Reply>(&encode(&verdict)), Some(verdict.clone()));
    let Reply::NotApplied { why } = verdict else {
        unreachable!()
    };
    assert!(
        why.to_string()
            .starts_with("gradient 'layer0/w' holds inf at step 7 on 2 of 3 workers: "),
        "{why}"
    );
    let timed = Request::Push {
        step: 7,
        samples: 21,
        loss: None,
        vars: vec![],
        stop: None,
        non_finite: None,
        times: Some(Times {
            compute: 0.5,
            steps: 3,
            ..Times::default()
        }),
        pull: Some(Then {
            step: 8,
            report: true,
        }),
    };
    assert_eq!(decode::<Request>(&encode(&timed)), Some(timed));
    let params = Reply::Params {
        step: 4,
        loss: None,
        stop: None,
        held_us: 0,
        reports: vec![],
    };
    // A step's headers are a few bytes (4 of length, the header padded to 4).
    let m = encode(&params);
    assert!(m.len() <= 12, "{} bytes: {m:?}", m.len());
    assert_eq!(decode::<Reply>(&m), Some(params));
    let pull = Request::Pull(Then {
        step: 1,
        report: false,
    });
    let m = encode(&pull);
    assert!(m.len() <= 8, "{} bytes: {m:?}", m.len());
    assert_eq!(decode::<Request>(&m), Some(pull));
    // Bytes that are no header are refused, a length beyond the message too.
    assert_eq!(decode::<Request>(&[4, 0, 0, 0, 255, 255, 255, 255]), None);
    assert_eq!(decode::<Request>(&[64, 0, 0, 0, 1]), None);
    let done = Request::Done { stop: Some(10) };
    assert_eq!(decode::<Request>(&encode(&done)), Some(done));
    assert_eq!(r.payload(0), [3]);
    // An inline payload rides after the header, whatever the header's length mod 4.
    for pad in 0..4 {
        let long = Reply::Error {
            message: "x".repeat(pad),
        };
        let m = encode_with(&long, &[&[1.0, 2.0], &[3.0]]);
        let (back, bytes) = decode_with::<Reply>(&m).unwrap();
        assert_eq!(back, long);
        let (mut a, mut b) = ([0f32; 2], [0f32; 1]);
        assert!(read_inline(bytes, [&mut a[..], &mut b[..]]));
        assert_eq!((a, b), ([1.0, 2.0], [3.0]));
        assert!(!read_inline(bytes, [&mut a[..]]));
        // Fewer floats than places: refused, nothing written.
        let mut c = [9f32; 1];
        assert!(!read_inline(bytes, [&mut a[..], &mut b[..], &mut c[..]]));
        assert_eq!(c, [9.0]);
    }
    assert!(inline([INLINE_FLOATS]) && !inline([INLINE_FLOATS, 1]));
    // A checksum above 2^53 survives (an integer, not a float).
    let s = Reply::Saved {
        file: "shard-ps0.bin".into(),
        bytes: 9,
        checksum: u64::MAX - 1,
    };
    assert_eq!(decode::<Reply>(&encode(&s)), Some(s.clone()));
    // A reply is not a request; a truncated message is nothing.
    assert!(decode::<Request>(&encode(&s)).is_none());
    let m = encode(&r);
    assert!(decode::<Request>(&m[..m.len() - 1]).is_none());
}

#[test]
fn payloads_travel_as_pieces_covering_each_part_in_order() {
    let lens = [0, 3, PIECE_FLOATS, 2 * PIECE_FLOATS + 1];
    let all: Vec<Piece> = pieces(lens).collect();
    let want = |part, a: usize, b: usize| Piece { part, range: a..b };
    let p = PIECE_FLOATS;
    assert_eq!(
        all,
        [
            want(1, 0, 3),
            want(2, 0, p),
            want(3, 0, p),
            want(3, p, 2 * p),
            want(3, 2 * p, 2 * p + 1)
        ]
    );
    let setup = Setup {
        shards: vec![],
        optimizer: crate::train::optim::Optimizer::new(
            crate::train::optim::OptimizerKind::Sgd,
            0.1,
        ),
        sync: None,
        stage: None,
        tables: Vec::new(),
        sparse: None,
        seed: 0,
    };
    assert!(Request::Init { setup }.payload(0).is_empty());
    let rows = Request::PushRows {
        parts: vec![RowsPart {
            table: 0,
            ids: vec![3, 9],
        }],
        scale: 1.0,
        values: 8,
        pull: Vec::new(),
    };
    assert_eq!(rows.payload(0), vec![8]);
    assert!(Request::Done { stop: None }.payload(0).is_empty());
}

/// A header written as words, floats appended after it, is the message
/// `encode_with` makes of the same header and floats.
#[test]
fn a_header_in_words_with_floats_after_it_is_the_same_message() {
    let reply = Reply::Rows { values: 3 };
    let floats = [1.5f32, f32::from_bits(0x7fc0_0001), -0.0];
    let mut words = vec![9.0; 40];
    let head = encode_words(&mut words, &reply);
    words.extend_from_slice(&floats);
    assert_eq!(f32_bytes(&words), &encode_with(&reply, &[&floats])[..]);
    assert_eq!(words.len(), head + 3);
}

/// Row ids travel as bytes, 8 an id, every bit kept; a string of bytes that is not a
/// whole number of ids is no request.
#[test]
fn row_ids_round_trip_as_bytes_and_a_broken_id_is_refused() {
    let ids = vec![0, 1, 255, 1 << 40, u64::MAX - 1, u64::MAX];
    let r = Request::PullRows {
        parts: vec![
            RowsPart {
                table: 2,
                ids: ids.clone(),
            },
            RowsPart {
                table: 0,
                ids: Vec::new(),
            },
        ],
    };
    let m = encode_with(&r, &[&[1.5, -2.0]]);
    let (back, floats) = decode_with::<Request>(&m).expect("a request");
    assert_eq!(back, r);
    assert_eq!(floats.len(), 8);
    // The ids' bytes are the message's: 8 per id, little-endian.
    let raw: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    assert!(m.windows(raw.len()).any(|w| w == raw));
    // One byte fewer in the first part's length: 47 bytes are no ids.
    let at = m.windows(raw.len()).position(|w| w == raw).unwrap();
    let mut broken = m.clone();
    assert_eq!(broken[at - 1], 48, "the length before the ids");
    broken[at - 1] = 47;
    assert!(decode_with::<Request>(&broken).is_none());
}
