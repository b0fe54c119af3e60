//! The collectives on NumPy arrays, in place: `allreduce_`, `allreduce_many_`,
//! `broadcast_`, `barrier`.
//!
//! Each call first agrees with every rank on what it is (a description: the call, dtype,
//! shape, its argument and whether this rank refuses its array; checked by one small
//! allreduce of its hash), so ranks that call different things, or the same thing on
//! different arrays, get one exception each naming this rank's call and the first other
//! that differs, instead of a hang or wrong sums.

use mpiflow::tensor::DType;
use mpiflow::transport::fusion::{self, FusionError};
use mpiflow::transport::{Algorithm, ReduceOp};
use numpy::{dtype, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::{with_state, Error, State};

/// An array checked for a collective: its dtype as mpiflow's, or why it cannot take
/// part (a `TypeError` or `ValueError` naming `call`), and a short word for that reason
/// that goes into the agreement.
fn checked(
    py: Python<'_>,
    a: &Bound<'_, PyUntypedArray>,
    call: &str,
) -> (PyResult<DType>, &'static str) {
    let d = a.dtype();
    let table = [
        (dtype::<f32>(py), DType::F32),
        (dtype::<f64>(py), DType::F64),
        (dtype::<i32>(py), DType::I32),
        (dtype::<i64>(py), DType::I64),
    ];
    let Some(dt) = table.iter().find(|(np, _)| d.is_equiv_to(np)).map(|t| t.1) else {
        let e = PyTypeError::new_err(format!(
            "mpiflow: {call}: arrays of dtype {d} are not supported (float32, float64, int32, int64)"
        ));
        return (Err(e), "");
    };
    let value = |what: &str| PyValueError::new_err(format!("mpiflow: {call}: {what}"));
    if !a.is_c_contiguous() {
        let e = value("the array must be C-contiguous (np.ascontiguousarray makes a copy that is)");
        return (Err(e), " non-contiguous");
    }
    if !a.is_aligned() {
        return (
            Err(value("the array is not aligned to its dtype")),
            " unaligned",
        );
    }
    // SAFETY: the array object is a live NumPy array (PyUntypedArray); its flags are read.
    let flags = unsafe { (*a.as_array_ptr()).fields.flags };
    if flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0 {
        let e = value("the array is read-only (it is written in place)");
        return (Err(e), " read-only");
    }
    (Ok(dt), "")
}

/// The bytes of an array [`checked`] found usable, to be written in place.
///
/// # Safety
/// The array must outlive `'a`, and while the slice lives nothing else may reach the
/// array's memory through Rust: the caller writes it in one collective and lets go.
/// (Python code of other threads can, as while any NumPy operation that releases the GIL
/// runs: the program's to avoid.)
unsafe fn bytes_of<'a>(a: &Bound<'_, PyUntypedArray>) -> &'a mut [u8] {
    let len = a.len() * a.dtype().itemsize();
    // SAFETY: a C-contiguous array's data are `len` bytes from its data pointer, owned by
    // the array, which the caller keeps alive (and borrowed from Python) for the call.
    unsafe { std::slice::from_raw_parts_mut((*a.as_array_ptr()).fields.data.cast::<u8>(), len) }
}

/// This rank's call, for the agreement: `name(dtype [shape]<why not>, arg)`.
fn described(name: &str, a: &Bound<'_, PyUntypedArray>, why_not: &str, arg: &str) -> String {
    format!("{name}({} {:?}{why_not}, {arg})", a.dtype(), a.shape())
}

/// Agrees with every rank on `what` (this rank's call): mpiflow's negotiation of fused
/// lists ([`fusion::negotiate`]: one small allreduce of the description's hash, the
/// descriptions gathered only on a mismatch). An `Error` naming the first rank whose call
/// differs from this rank's: rank 0 where this rank's differs from rank 0's, else the
/// first that differs from rank 0's.
fn agree(s: &State, what: &str) -> PyResult<()> {
    let entries = || vec![what.to_string()];
    match fusion::negotiate(&s.coll, fusion::list_hash(&entries()), entries) {
        Ok(()) => Ok(()),
        Err(FusionError::Mismatch {
            rank, theirs, ours, ..
        }) => {
            let (r, other) = if ours != what {
                (0, ours)
            } else {
                (rank, theirs)
            };
            Err(Error::new_err(format!(
                "mpiflow: rank {} called {what}, but rank {r} called {other}",
                s.coll.rank()
            )))
        }
        Err(e) => Err(Error::new_err(format!("mpiflow: {e}"))),
    }
}

/// The state, for a closure that runs without the GIL.
struct Detached<'a>(&'a State);

// SAFETY: `Python::detach` runs its closure on the calling thread (only the GIL is let
// go), which holds the state's mutex for the whole call.
unsafe impl Send for Detached<'_> {}

/// The whole state, dropped without the GIL (MPI finalised).
pub(super) struct Owned(pub(super) State);

// SAFETY: as for `Detached`: `Python::detach` runs the drop on the calling thread.
unsafe impl Send for Owned {}

/// Runs `f` on the state without the GIL.
fn detached<R: Send>(py: Python<'_>, s: &State, f: impl FnOnce(&State) -> R + Send) -> R {
    let d = Detached(s);
    py.detach(move || {
        let d = d;
        f(d.0)
    })
}

/// The call `name(array, arg)` agreed by every rank and its array checked: the call's
/// name for errors (`rank R: name`) and the array's dtype.
fn agreed(
    py: Python<'_>,
    s: &State,
    array: &Bound<'_, PyUntypedArray>,
    name: &str,
    arg: &str,
) -> PyResult<(String, DType)> {
    let call = format!("rank {}: {name}", s.coll.rank());
    let (dt, why_not) = checked(py, array, &call);
    agree(s, &described(name, array, why_not, arg))?;
    Ok((call, dt?))
}

/// `op`'s reduction, or a `ValueError` naming `call`.
fn reduce_op(op: &str, call: &str) -> PyResult<ReduceOp> {
    match op {
        "sum" => Ok(ReduceOp::Sum),
        "mean" => Ok(ReduceOp::Average),
        "min" => Ok(ReduceOp::Min),
        "max" => Ok(ReduceOp::Max),
        _ => Err(PyValueError::new_err(format!(
            "mpiflow: {call}: op {op:?} is none of sum, mean, min, max"
        ))),
    }
}

/// Reduces `array` over every rank, in place, by `op` ("sum", "mean", "min", "max"):
/// every rank ends with the same bits. The ranks agree on the call before any checks
/// this rank's array alone fails, so no rank waits for one that gave up.
#[pyfunction]
#[pyo3(signature = (array, op = "sum"))]
fn allreduce_(py: Python<'_>, array: &Bound<'_, PyUntypedArray>, op: &str) -> PyResult<()> {
    with_state(|s| {
        let (call, dt) = agreed(py, s, array, "allreduce", &format!("op={op}"))?;
        let reduce = reduce_op(op, &call)?;
        // SAFETY: the array is borrowed for this call; the slice serves this allreduce only.
        let bytes = unsafe { bytes_of(array) };
        detached(py, s, |s| {
            s.coll.allreduce(bytes, dt, reduce, Algorithm::Auto)
        })
        .map_err(|e| Error::new_err(format!("mpiflow: {call}: {e}")))?;
        Ok(())
    })
}

/// Copies `root`'s `array` into every rank's, in place (checked as `allreduce_` does).
#[pyfunction]
#[pyo3(signature = (array, root = 0))]
fn broadcast_(py: Python<'_>, array: &Bound<'_, PyUntypedArray>, root: usize) -> PyResult<()> {
    with_state(|s| {
        let (call, _) = agreed(py, s, array, "broadcast", &format!("root={root}"))?;
        let size = s.coll.size();
        if root >= size {
            return Err(PyValueError::new_err(format!(
                "mpiflow: {call}: root {root} is no rank of {size}"
            )));
        }
        // SAFETY: the array is borrowed for this call; the slice serves this broadcast only.
        let bytes = unsafe { bytes_of(array) };
        detached(py, s, |s| s.coll.bcast(bytes, root))
            .map_err(|e| Error::new_err(format!("mpiflow: {call}: {e}")))
    })
}

/// Reduces every array of `arrays` over every rank, in place, by `op`, as one message per
/// dtype (the arrays of a dtype back to back: mpiflow's fusion of a model's gradients):
/// the same results as one `allreduce_` each, in fewer, larger collectives. The ranks
/// agree on the whole list (count, dtypes, shapes) first.
#[pyfunction]
#[pyo3(signature = (items, op = "sum"))]
fn allreduce_many_(py: Python<'_>, items: Vec<Bound<'_, PyAny>>, op: &str) -> PyResult<()> {
    with_state(|s| {
        let call = format!("rank {}: allreduce_many", s.coll.rank());
        // An item that is no NumPy array is refused after the agreement, as a bad array.
        let arrays: Vec<Option<&Bound<'_, PyUntypedArray>>> = items
            .iter()
            .map(|a| a.cast::<PyUntypedArray>().ok())
            .collect();
        let checks: Vec<_> = (arrays.iter().enumerate())
            .map(|(i, a)| match a {
                Some(a) => checked(py, a, &call),
                None => (Err(not_an_array(&call, i, &items[i])), " not an array"),
            })
            .collect();
        // The list in full for the hash, a summary to show.
        let full: String = (arrays.iter().zip(&checks))
            .map(|(a, (_, why_not))| match a {
                Some(a) => described("", a, why_not, ""),
                None => why_not.to_string(),
            })
            .collect();
        let elements: usize = arrays.iter().flatten().map(|a| a.len()).sum();
        let what = format!(
            "allreduce_many({} arrays, {elements} elements, list {:016x}, op={op})",
            arrays.len(),
            fusion::list_hash(&[full])
        );
        agree(s, &what)?;
        let reduce = reduce_op(op, &call)?;
        let mut groups: Vec<(DType, Vec<&mut [u8]>)> = Vec::new();
        for (a, (dt, _)) in arrays.iter().zip(checks) {
            let (dt, a) = (dt?, a.expect("an array where checked said so"));
            // SAFETY: the arrays are borrowed for this call; each slice serves this
            // collective only (the same array twice in the list is refused below).
            let bytes = unsafe { bytes_of(a) };
            match groups.iter_mut().find(|(d, _)| *d == dt) {
                Some((_, parts)) => parts.push(bytes),
                None => groups.push((dt, vec![bytes])),
            }
        }
        let mut starts: Vec<usize> = groups
            .iter()
            .flat_map(|(_, p)| p.iter().map(|b| b.as_ptr() as usize))
            .collect();
        starts.sort_unstable();
        if starts.windows(2).any(|w| w[0] == w[1]) {
            return Err(PyValueError::new_err(format!(
                "mpiflow: {call}: an array is in the list twice (or two share memory)"
            )));
        }
        detached(py, s, move |s| {
            for (dt, mut parts) in groups {
                s.coll
                    .allreduce_parts(&mut parts, dt, reduce, Algorithm::Auto)?;
            }
            Ok(())
        })
        .map_err(|e: mpiflow::transport::TransportError| {
            Error::new_err(format!("mpiflow: {call}: {e}"))
        })
    })
}

/// The `TypeError` of list item `i`, which is no NumPy array.
fn not_an_array(call: &str, i: usize, item: &Bound<'_, PyAny>) -> PyErr {
    let kind = item.get_type().name().map_or("?".into(), |n| n.to_string());
    PyTypeError::new_err(format!(
        "mpiflow: {call}: item {i} of the list is a {kind}, not a NumPy array"
    ))
}

/// Waits until every rank called `barrier()`.
#[pyfunction]
fn barrier(py: Python<'_>) -> PyResult<()> {
    with_state(|s| {
        agree(s, "barrier()")?;
        detached(py, s, |s| s.coll.barrier())
            .map_err(|e| Error::new_err(format!("mpiflow: barrier: {e}")))
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(allreduce_, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_many_, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast_, m)?)?;
    m.add_function(wrap_pyfunction!(barrier, m)?)?;
    Ok(())
}
