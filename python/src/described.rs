//! A call's description for the ranks' agreement (`executor::agree`): the call's name, its
//! arguments' dtypes and shapes, whether this rank refuses an array and why, and its other
//! argument (`op=sum`). Its hash, what the ranks compare on every call, is made from
//! these fields without formatting any text, since it is made for every call; the text
//! that names both sides is made only where ranks differ.

use std::borrow::Cow;
use std::fmt::Write;

use mpiflow::hash::{fnv1a, fnv1a_from, FNV_OFFSET};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

/// One call's description.
#[derive(Debug, Clone, Default)]
pub(crate) struct Described {
    name: &'static str,
    /// The argument besides the arrays (`op=sum`, `root=0`), or empty.
    arg: String,
    /// A list's arrays (summarised in the text), or at most one.
    many: bool,
    arrays: Vec<Arg>,
    /// Every array's shape, back to back (each [`Arg::ndim`] long).
    dims: Vec<usize>,
}

/// One array of a call.
#[derive(Debug, Clone)]
struct Arg {
    dtype: Cow<'static, str>,
    ndim: usize,
    /// Why this rank refuses it (` non-contiguous`, ` not an array`), or empty.
    flaw: &'static str,
}

impl Described {
    /// The call `name` with `arg` and no arrays yet; `many`: a list, summarised.
    pub(crate) fn new(name: &'static str, arg: String, many: bool) -> Described {
        Described {
            name,
            arg,
            many,
            ..Described::default()
        }
    }

    /// Adds array `a`, which this rank refuses for `flaw` if that is not empty.
    pub(crate) fn array(mut self, a: &Bound<'_, PyUntypedArray>, flaw: &'static str) -> Self {
        self.push(a, flaw);
        self
    }

    /// Adds array `a` (as [`Described::array`]).
    pub(crate) fn push(&mut self, a: &Bound<'_, PyUntypedArray>, flaw: &'static str) {
        let shape = a.shape();
        self.dims.extend_from_slice(shape);
        self.arrays.push(Arg {
            dtype: dtype_name(a),
            ndim: shape.len(),
            flaw,
        });
    }

    /// Adds a list item that is no array.
    pub(crate) fn push_not_an_array(&mut self) {
        self.arrays.push(Arg {
            dtype: Cow::Borrowed(""),
            ndim: 0,
            flaw: " not an array",
        });
    }

    /// The hash the ranks compare: equal where the descriptions are.
    pub(crate) fn hash(&self) -> u64 {
        let h = mix(fnv1a(self.name.as_bytes()), self.many as u64);
        mix(self.arrays_hash(h), fnv1a(self.arg.as_bytes()))
    }

    /// The arrays' part of the hash, from `h`.
    fn arrays_hash(&self, h: u64) -> u64 {
        let h = self.arrays.iter().fold(h, |h, a| {
            let h = mix(h, fnv1a(a.dtype.as_bytes()));
            mix(mix(h, fnv1a(a.flaw.as_bytes())), a.ndim as u64)
        });
        self.dims.iter().fold(h, |h, d| mix(h, *d as u64))
    }

    /// The text that names the call: `allreduce(float32 [3, 4], op=sum)`, or for a list
    /// `allreduce_many(8 arrays, 1024 elements, list 5d3c..., op=sum)`.
    pub(crate) fn text(&self) -> String {
        let mut s = format!("{}(", self.name);
        if self.many {
            let elements: usize = self.shapes().map(|d| d.iter().product::<usize>()).sum();
            let list = self.arrays_hash(FNV_OFFSET);
            let n = self.arrays.len();
            let _ = write!(s, "{n} arrays, {elements} elements, list {list:016x}");
        } else {
            for (a, shape) in self.arrays.iter().zip(self.shapes()) {
                let _ = write!(s, "{} {shape:?}{}", a.dtype, a.flaw);
            }
        }
        if !self.arg.is_empty() {
            let sep = if self.arrays.is_empty() { "" } else { ", " };
            let _ = write!(s, "{sep}{}", self.arg);
        }
        s + ")"
    }

    /// Each array's shape.
    fn shapes(&self) -> impl Iterator<Item = &[usize]> {
        let mut at = 0;
        self.arrays.iter().map(move |a| {
            at += a.ndim;
            &self.dims[at - a.ndim..at]
        })
    }
}

/// `word` into hash `h` (FNV-1a continued over its bytes).
fn mix(h: u64, word: u64) -> u64 {
    fnv1a_from(h, &word.to_le_bytes())
}

/// NumPy's name of an array's dtype (`float32`), made here: NumPy's own `str(dtype)` runs
/// Python code, which costs more than a small collective (its cost measured in
/// benches/results/2026-11-28-python.md); the names of the dtypes mpiflow takes cost no
/// allocation.
pub(crate) fn dtype_name(a: &Bound<'_, PyUntypedArray>) -> Cow<'static, str> {
    let d = a.dtype();
    match (d.kind(), d.itemsize()) {
        (b'f', 4) => Cow::Borrowed("float32"),
        (b'f', 8) => Cow::Borrowed("float64"),
        (b'i', 4) => Cow::Borrowed("int32"),
        (b'i', 8) => Cow::Borrowed("int64"),
        (b'f', n) => Cow::Owned(format!("float{}", n * 8)),
        (b'i', n) => Cow::Owned(format!("int{}", n * 8)),
        (b'u', n) => Cow::Owned(format!("uint{}", n * 8)),
        (b'c', n) => Cow::Owned(format!("complex{}", n * 8)),
        (b'b', _) => Cow::Borrowed("bool"),
        _ => Cow::Owned(d.to_string()),
    }
}
