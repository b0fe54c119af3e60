//! The collectives on NumPy arrays, in place: `allreduce_`, `allreduce_many_`,
//! `broadcast_`, `allgather_`, `barrier_`, each returning the [`Handle`] of the call
//! queued to the collectives' thread (`crate::executor`), or with `blocking` run at once
//! where nothing is queued; the Python layer's blocking forms wait at once.
//!
//! Each call first agrees with every rank on what it is (a description: the call, dtype,
//! shape, its argument and whether this rank refuses its array; checked by one small
//! allreduce of its hash), so ranks that call different things, or the same thing on
//! different arrays, get one exception each naming this rank's call and the first other
//! that differs, instead of a hang or wrong sums. The arrays are checked here, with the
//! GIL; what this rank refuses is raised by `wait()` after the agreement.

mod memo;

use std::fmt::Display;
use std::sync::Arc;

use mpiflow::tensor::DType;
use mpiflow::transport::ReduceOp;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

pub(crate) use super::described::dtype_name;
use super::described::Described;
use super::executor::{failure, Call, Job, Op, Port, Span};
use super::{with_state, Error};

/// An array checked for a collective: its dtype as mpiflow's, or why it cannot take
/// part (a `TypeError` or `ValueError` naming `call`), and a short word for that reason
/// that goes into the agreement.
fn checked(
    a: &Bound<'_, PyUntypedArray>,
    call: &Call,
    writes: bool,
) -> (PyResult<DType>, &'static str) {
    let Some(dt) = dtype_of(a) else {
        let e = PyTypeError::new_err(format!(
            "mpiflow: {call}: arrays of dtype {} are not supported (float32, float64, int32, int64 in the machine's byte order)",
            dtype_name(a)
        ));
        // In the description: a rank alone with such an array (another byte order of
        // float32) differs from the others.
        return (Err(e), " unsupported");
    };
    match layout_error(a, call, writes) {
        Some((e, why_not)) => (Err(e), why_not),
        None => (Ok(dt), ""),
    }
}

/// An array's dtype as mpiflow's, if it is one mpiflow takes: by kind, size and byte
/// order (native: '=', or '|' where order means nothing), not by comparing descriptors,
/// as this runs for every array of every call.
pub(crate) fn dtype_of(a: &Bound<'_, PyUntypedArray>) -> Option<DType> {
    let d = a.dtype();
    let native = matches!(d.byteorder(), b'=' | b'|')
        || (d.byteorder() == b'<') == cfg!(target_endian = "little");
    match (d.kind(), d.itemsize()) {
        (b'f', 4) if native => Some(DType::F32),
        (b'f', 8) if native => Some(DType::F64),
        (b'i', 4) if native => Some(DType::I32),
        (b'i', 8) if native => Some(DType::I64),
        _ => None,
    }
}

/// Why an array's memory cannot be used in place (a `ValueError` naming `call`, and its
/// short word): not C-contiguous, unaligned, or read-only where it is written.
pub(crate) fn layout_error(
    a: &Bound<'_, PyUntypedArray>,
    call: &dyn Display,
    writes: bool,
) -> Option<(PyErr, &'static str)> {
    let value = |what: &str| PyValueError::new_err(format!("mpiflow: {call}: {what}"));
    if !a.is_c_contiguous() {
        let e = value("the array must be C-contiguous (np.ascontiguousarray makes a copy that is)");
        return Some((e, " non-contiguous"));
    }
    if !a.is_aligned() {
        return Some((value("the array is not aligned to its dtype"), " unaligned"));
    }
    // SAFETY: the array object is a live NumPy array (PyUntypedArray); its flags are read.
    let flags = unsafe { (*a.as_array_ptr()).fields.flags };
    if writes && flags & numpy::npyffi::NPY_ARRAY_WRITEABLE == 0 {
        let e = value("the array is read-only (it is written in place)");
        return Some((e, " read-only"));
    }
    None
}

/// Where the bytes of an array [`checked`] found usable are.
pub(crate) fn span_of(a: &Bound<'_, PyUntypedArray>) -> Span {
    Span {
        // SAFETY: the array object is a live NumPy array; its data pointer is read.
        ptr: unsafe { (*a.as_array_ptr()).fields.data } as usize,
        len: a.len() * a.dtype().itemsize(),
    }
}

/// `op`'s reduction, or a `ValueError` naming `call`.
fn reduce_op(op: &str, call: &Call) -> PyResult<ReduceOp> {
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

/// A call of `name` on this rank, made and queued by `make` to the collectives (the
/// state's lock is not held meanwhile: see [`Port`]).
pub(crate) fn with_call<R>(
    name: &'static str,
    make: impl FnOnce(&Port, Call) -> PyResult<R>,
) -> PyResult<R> {
    let port = with_state(|s| Ok(s.exec.port()))?;
    let call = Call::new(port.rank, name);
    make(&port, call)
}

/// Reduces `array` over every rank, in place, by `op` ("sum", "mean", "min", "max"):
/// every rank ends with the same bits. With `source`, `array` is the output: the reduction
/// of `source` (read where it is, left as it is, where it is an array of `array`'s dtype
/// and shape, C-contiguous and apart from it; otherwise copied into `array` first, as
/// `numpy.copyto` does). Returns the call's handle (`wait()`: the array), or with
/// `blocking` the array.
#[pyfunction]
#[pyo3(signature = (array, op = "sum", blocking = false, source = None))]
fn allreduce_(
    py: Python<'_>,
    array: &Bound<'_, PyUntypedArray>,
    op: &str,
    blocking: bool,
    source: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    with_call("allreduce", |s, call| {
        let (dt, why_not) = checked(array, &call, true);
        // The input: read where it is, or copied into `array` first (a failed copy is this
        // rank's refusal, said after the agreement).
        let input = match (&dt, source) {
            (Ok(dt), Some(src)) => match apart_input(src, array, *dt) {
                Some(span) => Ok(Some(span)),
                None => copied(py, src, array).map(|()| None).map_err(|e| {
                    let why = e.value(py).to_string();
                    PyValueError::new_err(format!(
                        "mpiflow: {call}: the input does not copy into out: {why}"
                    ))
                }),
            },
            _ => Ok(None),
        };
        let why_not = if input.is_err() { " uncopied" } else { why_not };
        let what = Described::new(call.name, format!("op={op}"), false).array(array, why_not);
        let run = dt.and_then(|dt| {
            let reduce = reduce_op(op, &call)?;
            Ok(match input? {
                Some(src) => Op::AllreduceInto(src, span_of(array), dt, reduce),
                None => Op::Allreduce(Arc::from([(dt, vec![span_of(array)])]), reduce),
            })
        });
        let a: Py<PyAny> = array.clone().into_any().unbind();
        let job = Job::new(what, call, run.map_err(|e| failure(py, &e)));
        let kept = a.clone_ref(py);
        let src = source.map(|s| s.clone().unbind());
        let keep = move || [Some(kept), src].into_iter().flatten().collect();
        s.submit(py, job, keep, a, blocking)
    })
}

/// Where `src`'s bytes are, if the reduction can read them where they are into `out`
/// (of `dt`): an array of its dtype and shape, C-contiguous, aligned, not overlapping it.
fn apart_input(src: &Bound<'_, PyAny>, out: &Bound<'_, PyUntypedArray>, dt: DType) -> Option<Span> {
    let a = src.cast::<PyUntypedArray>().ok()?;
    if dtype_of(a) != Some(dt)
        || a.shape() != out.shape()
        || !a.is_c_contiguous()
        || !a.is_aligned()
    {
        return None;
    }
    let (s, o) = (span_of(a), span_of(out));
    let apart = s.ptr + s.len <= o.ptr || o.ptr + o.len <= s.ptr;
    apart.then_some(s)
}

/// `numpy.copyto(out, src)`.
fn copied(py: Python<'_>, src: &Bound<'_, PyAny>, out: &Bound<'_, PyUntypedArray>) -> PyResult<()> {
    py.import("numpy")?.getattr("copyto")?.call1((out, src))?;
    Ok(())
}

/// Copies `root`'s `array` into every rank's, in place (checked as `allreduce_` does).
#[pyfunction]
#[pyo3(signature = (array, root = 0, blocking = false))]
fn broadcast_(
    py: Python<'_>,
    array: &Bound<'_, PyUntypedArray>,
    root: usize,
    blocking: bool,
) -> PyResult<Py<PyAny>> {
    with_call("broadcast", |s, call| {
        let (dt, why_not) = checked(array, &call, true);
        let what = Described::new(call.name, format!("root={root}"), false).array(array, why_not);
        let size = s.size;
        let run = dt.and_then(|_| match root < size {
            true => Ok(Op::Broadcast(span_of(array), root)),
            false => Err(PyValueError::new_err(format!(
                "mpiflow: {call}: root {root} is no rank of {size}"
            ))),
        });
        let a: Py<PyAny> = array.clone().into_any().unbind();
        let job = Job::new(what, call, run.map_err(|e| failure(py, &e)));
        let kept = a.clone_ref(py);
        s.submit(py, job, move || vec![kept], a, blocking)
    })
}

/// Every rank's `array` into `out` (`[size, *array.shape]`, the same dtype), in rank
/// order. `array` is only read.
#[pyfunction]
#[pyo3(signature = (array, out, blocking = false))]
fn allgather_(
    py: Python<'_>,
    array: &Bound<'_, PyUntypedArray>,
    out: &Bound<'_, PyUntypedArray>,
    blocking: bool,
) -> PyResult<Py<PyAny>> {
    with_call("allgather", |s, call| {
        let (dt, why_not) = checked(array, &call, false);
        let (out_dt, _) = checked(out, &call, true);
        let what = Described::new(call.name, String::new(), false).array(array, why_not);
        let run = dt.and_then(|dt| {
            let mut want = vec![s.size];
            want.extend(array.shape());
            if out_dt? != dt || out.shape() != want.as_slice() {
                return Err(PyValueError::new_err(format!(
                    "mpiflow: {call}: out is {} {:?}, not {} {want:?}",
                    out.dtype(),
                    out.shape(),
                    array.dtype()
                )));
            }
            Ok(Op::Allgather(span_of(array), span_of(out)))
        });
        let (a, o): (Py<PyAny>, Py<PyAny>) = (
            array.clone().into_any().unbind(),
            out.clone().into_any().unbind(),
        );
        let job = Job::new(what, call, run.map_err(|e| failure(py, &e)));
        let kept = o.clone_ref(py);
        s.submit(py, job, move || vec![a, kept], o, blocking)
    })
}

/// Reduces every array of `items` over every rank, in place, by `op`, as one message per
/// dtype (the arrays of a dtype back to back: mpiflow's fusion of a model's gradients):
/// the same results as one `allreduce_` each, in fewer, larger collectives. The ranks
/// agree on the whole list (count, dtypes, shapes) first. `wait()` returns `items` itself
/// (with `blocking`, it is returned); its arrays are kept until the call is done, even if
/// the list changes meanwhile.
#[pyfunction]
#[pyo3(signature = (items, op = "sum", blocking = false))]
fn allreduce_many_(
    py: Python<'_>,
    items: &Bound<'_, PyList>,
    op: &str,
    blocking: bool,
) -> PyResult<Py<PyAny>> {
    let list = items.clone().into_any().unbind();
    let items: Vec<Bound<'_, PyAny>> = items.iter().collect();
    with_call("allreduce_many", |s, call| {
        let job = memo::job(&items, op, || many_job(py, call, &items, op));
        let keep = || items.iter().map(|i| i.clone().unbind()).collect();
        s.submit(py, job, keep, list, blocking)
    })
}

/// The reduction of every array of `arrays` over every rank by `op`, fused: one message
/// per dtype (the arrays of a dtype back to back), as mpiflow reduces a model's
/// gradients. In place if `inplace` (each array C-contiguous and writeable), else into new
/// arrays; returns the list (not `blocking`: the call's handle, whose `wait()` returns
/// it). A call on the arrays of an earlier call, unchanged, reuses that call's checks.
/// (The package's `mpiflow.allreduce_many` and `allreduce_many_async`: made here rather
/// than in Python, whose own function call would add to every small list's call.)
#[pyfunction]
#[pyo3(signature = (arrays, op = "sum", inplace = false, blocking = true))]
fn allreduce_many(
    py: Python<'_>,
    arrays: &Bound<'_, PyAny>,
    op: &str,
    inplace: bool,
    blocking: bool,
) -> PyResult<Py<PyAny>> {
    let items = match arrays.cast::<PyList>() {
        // A blocking call in place uses a list as it is: the call is over before the
        // caller can change it (a call in flight gets a list of its own).
        Ok(list) if inplace && blocking => list.clone(),
        _ => outs(py, arrays, inplace)?,
    };
    allreduce_many_(py, &items, op, blocking)
}

/// The list a call on `arrays` reduces: its arrays (`inplace`), or C-ordered copies. What
/// cannot be listed or copied stays as it is, to be refused after the ranks agreed (an
/// error here, on one rank alone, would leave the others waiting in the agreement): a
/// non-iterable `arrays` is a list of itself.
fn outs<'py>(
    py: Python<'py>,
    arrays: &Bound<'py, PyAny>,
    inplace: bool,
) -> PyResult<Bound<'py, PyList>> {
    let items: Vec<Bound<'py, PyAny>> = match arrays.try_iter() {
        Ok(items) => items.collect::<PyResult<_>>()?,
        Err(_) => return PyList::new(py, [arrays]),
    };
    if inplace {
        return PyList::new(py, items);
    }
    let array = py.import("numpy")?.getattr("array")?;
    let options = PyDict::new(py);
    options.set_item("copy", true)?;
    options.set_item("order", "C")?;
    let copy = |a: Bound<'py, PyAny>| array.call((&a,), Some(&options)).unwrap_or(a);
    PyList::new(py, items.into_iter().map(copy))
}

/// Benchmarks: `allreduce_many_(items, op)`'s call (its agreement and fused reduction)
/// run `reps` times from Rust, with no Python between calls: the seconds per call, to
/// set beside the same call from Python.
#[pyfunction]
#[pyo3(signature = (items, op = "sum", reps = 10))]
fn allreduce_many_from_rust(
    py: Python<'_>,
    items: Vec<Bound<'_, PyAny>>,
    op: &str,
    reps: usize,
) -> PyResult<f64> {
    with_call("allreduce_many", |s, call| {
        let job = many_job(py, call, &items, op);
        s.time_from_rust(py, job, reps)
            .map_err(|(_, line)| Error::new_err(line))
    })
}

/// The job of `allreduce_many_(items, op)`: the list's description for the agreement and
/// the fused reduction (or this rank's refusal of the list).
fn many_job(py: Python<'_>, call: Call, items: &[Bound<'_, PyAny>], op: &str) -> Job {
    // An item that is no NumPy array is refused after the agreement, as a bad array.
    let arrays: Vec<Option<&Bound<'_, PyUntypedArray>>> = items
        .iter()
        .map(|a| a.cast::<PyUntypedArray>().ok())
        .collect();
    let mut what = Described::new(call.name, format!("op={op}"), true);
    let checks: Vec<_> = (arrays.iter().enumerate())
        .map(|(i, a)| match a {
            Some(a) => {
                let (dt, why_not) = checked(a, &call, true);
                what.push(a, why_not);
                dt
            }
            None => {
                what.push_not_an_array();
                Err(not_an_array(&call, i, &items[i]))
            }
        })
        .collect();
    let op = fused(&call, &arrays, checks, op).map_err(|e| failure(py, &e));
    Job::new(what, call, op)
}

/// The fused reduction of `arrays` (checked), grouped by dtype; an error for a bad array
/// or an array in the list twice.
fn fused(
    call: &Call,
    arrays: &[Option<&Bound<'_, PyUntypedArray>>],
    checks: Vec<PyResult<DType>>,
    op: &str,
) -> PyResult<Op> {
    let mut groups: Vec<(DType, Vec<Span>)> = Vec::new();
    for (a, dt) in arrays.iter().zip(checks) {
        let (dt, a) = (dt?, a.expect("an array where checked said so"));
        match groups.iter_mut().find(|(d, _)| *d == dt) {
            Some((_, parts)) => parts.push(span_of(a)),
            None => groups.push((dt, vec![span_of(a)])),
        }
    }
    let reduce = reduce_op(op, call)?;
    let mut starts: Vec<usize> = groups
        .iter()
        .flat_map(|(_, p)| p.iter().map(|s| s.ptr))
        .collect();
    starts.sort_unstable();
    if starts.windows(2).any(|w| w[0] == w[1]) {
        return Err(PyValueError::new_err(format!(
            "mpiflow: {call}: an array is in the list twice (or two share memory)"
        )));
    }
    Ok(Op::Allreduce(groups.into(), reduce))
}

/// The `TypeError` of list item `i`, which is no NumPy array.
fn not_an_array(call: &Call, i: usize, item: &Bound<'_, PyAny>) -> PyErr {
    let kind = item.get_type().name().map_or("?".into(), |n| n.to_string());
    PyTypeError::new_err(format!(
        "mpiflow: {call}: item {i} of the list is a {kind}, not a NumPy array"
    ))
}

/// Waits until every rank called `barrier()` (its handle's `wait()`).
#[pyfunction]
#[pyo3(signature = (blocking = false))]
fn barrier_(py: Python<'_>, blocking: bool) -> PyResult<Py<PyAny>> {
    with_call("barrier", |s, call| {
        let job = Job::new(
            Described::new(call.name, String::new(), false),
            call,
            Ok(Op::Barrier),
        );
        s.submit(py, job, Vec::new, py.None(), blocking)
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<super::executor::Handle>()?;
    m.add_function(wrap_pyfunction!(allreduce_, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_many_, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_many, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast_, m)?)?;
    m.add_function(wrap_pyfunction!(allgather_, m)?)?;
    m.add_function(wrap_pyfunction!(barrier_, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_many_from_rust, m)?)?;
    Ok(())
}
