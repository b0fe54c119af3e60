//! The jobs of the lists `allreduce_many_` was called on lately, found again by their
//! arrays' memory and layout: a call on a list whose arrays are where they were, with the
//! same dtypes, shapes and flags (a training loop's gradients, step after step), reuses its
//! job (the description, its hash, the spans) instead of checking and describing every
//! array again. The ranks still agree on every call, by the job's hash; what is saved is
//! this rank's own work, which for a small list costs more than its reduction. (Horovod's
//! response cache saves its negotiation the same way.) No array is kept alive by the memo:
//! what a job depends on is compared, not the objects' identity, so a list of new array
//! objects over the same memory (PyTorch's `.numpy()` views) is found too.

use std::os::raw::{c_char, c_int};
use std::sync::Mutex;

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::executor::Job;

/// How many lists are remembered (a model's gradient buckets), newest first.
const KEPT: usize = 16;

/// One list's job and what it was made from.
struct Entry {
    op: String,
    keys: Vec<Key>,
    /// Every array's shape, back to back (each [`Key::ndim`] long).
    dims: Vec<usize>,
    job: Job,
}

/// What a job depends on of one array besides its shape: where its bytes are, its dtype
/// (the descriptor's address, and its type number and byte order, which tell the dtypes
/// mpiflow takes apart, since an address can be reused) and its flags (contiguity,
/// alignment, writeable). Read from the objects' fields: this runs for every array of
/// every call.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    data: usize,
    descr: usize,
    type_num: c_int,
    byteorder: c_char,
    flags: c_int,
    ndim: c_int,
}

static MEMO: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// The job of `allreduce_many_(items, op)`: the remembered one, or the one `make` makes
/// (remembered when this rank takes the list, whose arrays then all have dtypes mpiflow
/// takes: a refusal is made anew each time).
pub(super) fn job(items: &[Bound<'_, PyAny>], op: &str, make: impl FnOnce() -> Job) -> Job {
    let mut memo = MEMO.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = memo.iter().position(|e| e.matches(items, op)) {
        let entry = memo.remove(i);
        let job = entry.job.clone();
        memo.insert(0, entry);
        return job;
    }
    let job = make();
    if job.op.is_ok() {
        if let Some(entry) = Entry::of(items, op, &job) {
            memo.insert(0, entry);
            memo.truncate(KEPT);
        }
    }
    job
}

impl Entry {
    /// The entry of `job`, made for `items` (arrays all, or none).
    fn of(items: &[Bound<'_, PyAny>], op: &str, job: &Job) -> Option<Entry> {
        let mut dims = Vec::new();
        let keys = (items.iter())
            .map(|item| {
                let a = item.cast::<PyUntypedArray>().ok()?;
                dims.extend_from_slice(a.shape());
                Some(key(a))
            })
            .collect::<Option<Vec<Key>>>()?;
        Some(Entry {
            op: op.to_string(),
            keys,
            dims,
            job: job.clone(),
        })
    }

    /// Whether `items` are this entry's arrays, unchanged, and `op` its op.
    fn matches(&self, items: &[Bound<'_, PyAny>], op: &str) -> bool {
        if self.keys.len() != items.len() || self.op != op {
            return false;
        }
        let mut dims = self.dims.as_slice();
        items.iter().zip(&self.keys).all(|(item, k)| {
            let Ok(a) = item.cast::<PyUntypedArray>() else {
                return false;
            };
            if key(a) != *k {
                return false;
            }
            // Equal ndim: the shape is the next `ndim` of the dims.
            let (shape, rest) = dims.split_at(k.ndim as usize);
            dims = rest;
            shape == a.shape()
        })
    }
}

/// Array `a`'s key.
fn key(a: &Bound<'_, PyUntypedArray>) -> Key {
    // SAFETY: the array object is a live NumPy array (PyUntypedArray), which holds its
    // descriptor; their fields are read.
    let (raw, descr) = unsafe {
        let raw = &(*a.as_array_ptr()).fields;
        (raw, &(*raw.descr).fields)
    };
    Key {
        data: raw.data as usize,
        descr: raw.descr as usize,
        type_num: descr.type_num,
        byteorder: descr.byteorder,
        flags: raw.flags,
        ndim: raw.nd,
    }
}
