//! Tests of [`super`]: layout, wire format, views.

use super::*;

#[test]
fn storage_moves_between_like_tensors_only() {
    let mut a = Tensor::from_slice(&[3], &[1f32, 2., 3.])
        .unwrap()
        .named("a");
    let mut b = Tensor::from_slice(&[3], &[7f32, 8., 9.])
        .unwrap()
        .named("a");
    let (pa, pb) = (a.bytes().as_ptr(), b.bytes().as_ptr());
    assert!(a.swap_storage(&mut b));
    assert_eq!(a.as_slice::<f32>().unwrap(), &[7., 8., 9.]);
    assert_eq!(b.as_slice::<f32>().unwrap(), &[1., 2., 3.]);
    // Not a byte copied: the buffers changed hands.
    assert_eq!((a.bytes().as_ptr(), b.bytes().as_ptr()), (pb, pa));
    // The header went along: each still goes on the wire as itself.
    assert_eq!(&a.wire()[..a.wire_header().len()], a.wire_header());
    let mut other = Tensor::from_slice(&[3], &[0f32; 3]).unwrap().named("b");
    let mut longer = Tensor::from_slice(&[4], &[0f32; 4]).unwrap().named("a");
    assert!(!a.swap_storage(&mut other) && !a.swap_storage(&mut longer));
    assert_eq!(a.as_slice::<f32>().unwrap(), &[7., 8., 9.]);
}

#[test]
fn slices_views_and_dtype_checks() {
    let mut t = Tensor::from_slice(&[2, 3], &[1f32, 2., 3., 4., 5., 6.])
        .unwrap()
        .named("w");
    assert_eq!(t.numel(), 6);
    assert_eq!(t.nbytes(), 24);
    assert_eq!(t.view::<f32>().unwrap()[[1, 2]], 6.0);
    t.view_mut::<f32>().unwrap()[[0, 0]] = 9.0;
    assert_eq!(t.as_slice::<f32>().unwrap()[0], 9.0);
    assert_eq!(
        t.as_slice::<f64>().unwrap_err().to_string(),
        "tensor \"w\" is f32, not f64"
    );
    assert_eq!(t.as_slice::<f32>().unwrap().as_ptr() as usize % 64, 0);
    assert!(Tensor::from_slice(&[2], &[1i32]).is_err());
    assert!(Tensor::zeros(DType::U8, &[1; 9]).is_err());
    t.reshape(&[3, 2]).unwrap();
    assert!(t.reshape(&[4]).is_err());
}

/// Simulates a transfer: the sender's wire bytes land in the receiver's region.
fn transfer(from: &Tensor, to: &mut Tensor) -> Result<(), TensorError> {
    let wire = from.wire().to_vec();
    let region = to.receive_region();
    let (n, room) = (wire.len().min(region.len()), region.len());
    region[..n].copy_from_slice(&wire[..n]);
    to.check_received(n, wire.len() > room)
}

#[test]
fn wire_round_trip_and_mismatches() {
    let a = Tensor::from_slice(&[3], &[1f32, 2., 3.])
        .unwrap()
        .named("grad/w");
    let mut b = Tensor::zeros(DType::F32, &[3]).unwrap().named("grad/w");
    transfer(&a, &mut b).unwrap();
    assert_eq!(b.as_slice::<f32>().unwrap(), &[1., 2., 3.]);
    // The receiver keeps its own header after a receive.
    assert_eq!(b.wire()[..8], a.wire()[..8]);

    for (mut to, want) in [
        (
            Tensor::zeros(DType::F32, &[3]).unwrap().named("grad/b"),
            "received 'grad/w' f32[3] but expected 'grad/b' f32[3]",
        ),
        (
            Tensor::zeros(DType::I32, &[3]).unwrap().named("grad/w"),
            "received 'grad/w' f32[3] but expected 'grad/w' i32[3]",
        ),
        (
            Tensor::zeros(DType::F32, &[1, 3]).unwrap().named("grad/w"),
            "received 'grad/w' f32[3] but expected 'grad/w' f32[1,3]",
        ),
        (
            Tensor::zeros(DType::F32, &[2]).unwrap().named("grad/w"),
            "received 'grad/w' f32[3] but expected 'grad/w' f32[2]",
        ),
    ] {
        assert_eq!(transfer(&a, &mut to).unwrap_err().to_string(), want);
    }
    // Far larger than expected: truncated, still named, never read past the region.
    let big = Tensor::zeros(DType::F32, &[1000]).unwrap().named("grad/w");
    let mut small = Tensor::zeros(DType::F32, &[3]).unwrap().named("grad/w");
    assert_eq!(
        transfer(&big, &mut small).unwrap_err().to_string(),
        "received 'grad/w' f32[1000] but expected 'grad/w' f32[3]"
    );
    // Garbage.
    let mut t = Tensor::zeros(DType::U8, &[64]).unwrap();
    t.receive_region()[..8].copy_from_slice(b"garbage!");
    assert!(matches!(
        t.check_received(64, false),
        Err(TensorError::NotATensor { .. })
    ));
}

#[test]
fn large_payloads_are_huge_page_aligned_and_travel_intact() {
    let n = 600_000; // 2.4 MB
    let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let a = Tensor::from_slice(&[n], &data).unwrap().named("big");
    assert_eq!(
        a.as_slice::<f32>().unwrap().as_ptr() as usize % buffer::HUGE,
        0
    );
    let mut b = Tensor::zeros(DType::F32, &[n]).unwrap().named("big");
    transfer(&a, &mut b).unwrap();
    assert_eq!(b.as_slice::<f32>().unwrap(), &data[..]);
    let mut c = Tensor::zeros(DType::F32, &[n - 1]).unwrap().named("big");
    assert!(transfer(&a, &mut c).is_err());
}

#[test]
fn payloads_from_a_page_are_page_aligned_and_travel_intact() {
    for n in [1024, 1500, 500_000] {
        let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let a = Tensor::from_slice(&[n], &data).unwrap().named("mid");
        assert_eq!(a.as_slice::<f32>().unwrap().as_ptr() as usize % 4096, 0);
        let mut b = Tensor::zeros(DType::F32, &[n]).unwrap().named("mid");
        transfer(&a, &mut b).unwrap();
        assert_eq!(b.as_slice::<f32>().unwrap(), &data[..]);
    }
    // Below a page: a cache line, the header just before.
    let small = Tensor::zeros(DType::F32, &[1023]).unwrap();
    assert_eq!(small.as_slice::<f32>().unwrap().as_ptr() as usize % 64, 0);
}

#[test]
fn long_names_and_scalars() {
    let long = "x".repeat(200);
    let a = Tensor::from_slice(&[], &[5i64]).unwrap().named(&long);
    let mut b = Tensor::zeros(DType::I64, &[]).unwrap().named(&long);
    transfer(&a, &mut b).unwrap();
    assert_eq!(b.as_slice::<i64>().unwrap(), &[5]);
    let mut c = Tensor::zeros(DType::I64, &[])
        .unwrap()
        .named(&"x".repeat(199));
    assert!(transfer(&a, &mut c).is_err());
    // Eight dimensions and a 48-byte name still fit the header room.
    let d = Tensor::zeros(DType::U8, &[1; 8])
        .unwrap()
        .named(&"n".repeat(48));
    assert_eq!(d.wire().len(), 128 + 1);
}
