//! mpiflow's data sets for Python programs: `load_dataset(spec, seed)`, the training and
//! held-out samples as NumPy arrays (what `--data SPEC` loads for the command line).

use mpiflow::Dataset;
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// One part of a data set: the samples (float32, `[n, *shape]`) and labels (uint8).
type Part<'py> = (Bound<'py, PyArrayDyn<f32>>, Bound<'py, PyArray1<u8>>);

fn part<'py>(py: Python<'py>, d: Dataset) -> PyResult<Part<'py>> {
    let mut shape = vec![d.y.len()];
    shape.extend(&d.shape);
    let x = PyArray1::from_vec(py, d.x).reshape(shape)?;
    Ok((x, PyArray1::from_vec(py, d.y)))
}

/// The training and held-out samples of `spec` (`digits`, `fashion-mnist`,
/// `synthetic:N`, as the command line's `--data`), split as mpiflow splits them (by
/// `seed` where the set has no split of its own): `((x, y), (x_test, y_test))`.
#[pyfunction]
#[pyo3(signature = (spec = "digits", seed = 1))]
fn load_dataset<'py>(py: Python<'py>, spec: &str, seed: u64) -> PyResult<(Part<'py>, Part<'py>)> {
    let (train, test) = py
        .detach(|| Dataset::load_split(spec, seed))
        .map_err(|e| PyValueError::new_err(format!("mpiflow: load_dataset: {e}")))?;
    Ok((part(py, train)?, part(py, test)?))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(load_dataset, m)?)
}
