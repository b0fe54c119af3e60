//! Element-wise reductions of byte buffers holding any [`DType`]: what every allreduce
//! algorithm (and the shared-memory one) applies to what arrives.

use super::comm::ReduceOp;
use crate::tensor::{DType, Element};

/// Reinterprets an aligned byte slice as elements.
fn typed<T: Element>(b: &[u8]) -> &[T] {
    // SAFETY: align_to only yields a middle part that is correctly aligned; we require
    // that part to cover the whole slice (all mpiflow buffers are 64-byte aligned and chunk
    // boundaries are element multiples).
    let (head, mid, tail) = unsafe { b.align_to::<T>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "unaligned reduction buffer"
    );
    mid
}

fn typed_mut<T: Element>(b: &mut [u8]) -> &mut [T] {
    // SAFETY: as in `typed`.
    let (head, mid, tail) = unsafe { b.align_to_mut::<T>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "unaligned reduction buffer"
    );
    mid
}

fn reduce_typed<T: Element>(op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    let (acc, inc) = (typed_mut::<T>(acc), typed::<T>(inc));
    match op {
        ReduceOp::Sum | ReduceOp::Average => {
            acc.iter_mut().zip(inc).for_each(|(a, b)| *a = a.add(*b))
        }
        ReduceOp::Min => acc.iter_mut().zip(inc).for_each(|(a, b)| {
            if *b < *a {
                *a = *b
            }
        }),
        ReduceOp::Max => acc.iter_mut().zip(inc).for_each(|(a, b)| {
            if *b > *a {
                *a = *b
            }
        }),
    }
}

fn reduce_into_typed<T: Element>(op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) {
    let (out, a, b) = (typed_mut::<T>(out), typed::<T>(a), typed::<T>(b));
    let pairs = out.iter_mut().zip(a.iter().zip(b));
    match op {
        ReduceOp::Sum | ReduceOp::Average => pairs.for_each(|(o, (a, b))| *o = a.add(*b)),
        ReduceOp::Min => pairs.for_each(|(o, (a, b))| *o = if *b < *a { *b } else { *a }),
        ReduceOp::Max => pairs.for_each(|(o, (a, b))| *o = if *b > *a { *b } else { *a }),
    }
}

/// `out = a (op) b`, element-wise: [`reduce_bytes`] of a copy of `a`, without the copy
/// (the same bits).
pub fn reduce_into_bytes(dtype: DType, op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) {
    match dtype {
        DType::F32 => reduce_into_typed::<f32>(op, out, a, b),
        DType::F64 => reduce_into_typed::<f64>(op, out, a, b),
        DType::I32 => reduce_into_typed::<i32>(op, out, a, b),
        DType::I64 => reduce_into_typed::<i64>(op, out, a, b),
        DType::U8 => reduce_into_typed::<u8>(op, out, a, b),
    }
}

/// `acc = acc (op) inc`, element-wise.
pub fn reduce_bytes(dtype: DType, op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    match dtype {
        DType::F32 => reduce_typed::<f32>(op, acc, inc),
        DType::F64 => reduce_typed::<f64>(op, acc, inc),
        DType::I32 => reduce_typed::<i32>(op, acc, inc),
        DType::I64 => reduce_typed::<i64>(op, acc, inc),
        DType::U8 => reduce_typed::<u8>(op, acc, inc),
    }
}

fn divide_typed<T: Element>(buf: &mut [u8], n: usize) {
    typed_mut::<T>(buf)
        .iter_mut()
        .for_each(|x| *x = x.div_count(n));
}

/// Divides every element by `n` (the second half of an average).
pub fn divide_bytes(dtype: DType, buf: &mut [u8], n: usize) {
    match dtype {
        DType::F32 => divide_typed::<f32>(buf, n),
        DType::F64 => divide_typed::<f64>(buf, n),
        DType::I32 => divide_typed::<i32>(buf, n),
        DType::I64 => divide_typed::<i64>(buf, n),
        DType::U8 => divide_typed::<u8>(buf, n),
    }
}
