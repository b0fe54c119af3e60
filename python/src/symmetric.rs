//! Symmetric memory from Python (`mpiflow.symmetric`): a region every rank of the node
//! maps ([`mpiflow::transport::symmetric`]), made together over the collectives' queue,
//! handed to NumPy as a byte array whose base owns the region. An allreduce of an array
//! over it reduces straight from and into every rank's region.

use std::sync::{Arc, Mutex};

use mpiflow::transport::symmetric::Symmetric;
use numpy::ndarray::ArrayView1;
use numpy::PyArray1;
use pyo3::prelude::*;

use super::collectives::with_call;
use super::described::Described;
use super::executor::{Job, Op};

/// Where the collectives' thread leaves the region it made (`None`: ranks that share no
/// memory, where plain memory serves).
pub(crate) type Made = Arc<Mutex<Option<Symmetric>>>;

/// One region of symmetric memory: the base of the NumPy arrays over it, unmapped on this
/// rank when the last of them goes.
#[pyclass(frozen, module = "mpiflow._native")]
struct SymmetricRegion {
    /// Held: the mapping lives as long as this object.
    _mem: Symmetric,
}

/// `nbytes` of symmetric memory as a NumPy byte array (zeros), or `None` where the ranks
/// share no memory. Collective: every rank calls it with the same `what` (the shape and
/// dtype the Python layer makes of it), else one exception on every rank.
#[pyfunction]
fn symmetric_(py: Python<'_>, nbytes: usize, what: String) -> PyResult<Option<Py<PyAny>>> {
    with_call("symmetric", |port, call| {
        let made: Made = Arc::default();
        let described = Described::new(call.name, what, false);
        let job = Job::new(described, call, Ok(Op::Symmetric(nbytes, made.clone())));
        port.submit(py, job, Vec::new, py.None(), true)?;
        let taken = made.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(mem) = taken else {
            return Ok(None);
        };
        let ptr = mem.as_ptr();
        let owner = Bound::new(py, SymmetricRegion { _mem: mem })?;
        // SAFETY: the region's `nbytes` bytes (its length) stay mapped while `owner`, the
        // array's base, lives; nothing reallocates them.
        let array = unsafe {
            let view = ArrayView1::from_shape_ptr(nbytes, ptr.cast_const());
            PyArray1::<u8>::borrow_from_array(&view, owner.into_any())
        };
        Ok(Some(array.into_any().unbind()))
    })
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SymmetricRegion>()?;
    m.add_function(wrap_pyfunction!(symmetric_, m)?)?;
    Ok(())
}
