//! The training session from Python: `Session(names, values, mode, ...)`, one step per
//! `push_pull(grads, loss, samples)`, and `join()` for the ps tasks.
//!
//! The variables are an [`External`] model: the program computes each step's loss and
//! gradients (NumPy, PyTorch) and mpiflow's session does the rest in every mode, as it does
//! for its own models: the ps tasks (the chief's initial values or its newest checkpoint,
//! sync with backup workers or async), the allreduce, local training; checkpoints, the
//! stop at the last step, the guard against a non-finite loss, stop signals.
//!
//! A session borrows the server and the model for its whole life, and the one-sided modes
//! keep it inside a scope, so each session lives on a thread of its own that owns what it
//! borrows; the Python thread hands it one command at a time and waits (without the GIL)
//! for the reply. The gradients are read from the program's arrays in place during the
//! step, and the parameters copied into the session's own arrays after it.

mod settings;
mod thread;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};

use mpiflow::model::embedding::{SparseGrad, TableSpec};
use mpiflow::tensor::DType;
use mpiflow::tensor::Tensor;
use mpiflow::transport::Comm;
use mpiflow::{External, PsError, ServerError};
use numpy::{
    PyArray1, PyArray2, PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use self::settings::Settings;
pub(crate) use self::thread::end_all;
use self::thread::{serve, Cmd, Job, Link, Mode, Reply, Rows, OPEN};
use super::collectives::{dtype_name, dtype_of, layout_error, span_of};
use super::executor::Span;
use super::{shared_server, Error, Stopped};

/// A worker's training session over variables the program computes the gradients of.
#[pyclass(module = "mpiflow._native", name = "Session", unsendable)]
pub struct PySession {
    link: Arc<Link>,
    names: Vec<String>,
    params: Vec<Py<PyArrayDyn<f32>>>,
    /// How errors name this rank (`worker:0 (rank 1)`).
    me: String,
    step: u64,
    loss: f32,
    stop: bool,
    /// The session ended (closed, or failed): no more steps.
    ended: bool,
    shard: (usize, usize),
    chief: bool,
    /// False on a ps task of one-sided training, whose session served and ended.
    worker: bool,
    stop_asked: Arc<AtomicBool>,
    /// The embedding tables, by index.
    tables: Vec<TableSpec>,
    /// The tables and ids of the last `pull_rows_ahead`, until landed.
    asked: Option<Vec<(usize, Vec<u64>)>>,
    /// Over windows: pushed rows wait for the next step (`thread::Staged`), and whether
    /// some do.
    rows_wait: (bool, bool),
}

/// Variable `name`'s starting values: a float32 NumPy array (any layout, copied).
fn variable(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let a = value.cast::<PyArrayDyn<f32>>().map_err(|_| {
        let what = match value.cast::<PyUntypedArray>() {
            Ok(a) => format!("an array of dtype {}", dtype_name(a)),
            Err(_) => format!(
                "a {}",
                value
                    .get_type()
                    .name()
                    .map_or("?".into(), |n| n.to_string())
            ),
        };
        PyTypeError::new_err(format!(
            "mpiflow: Session: variable '{name}' is {what}, not a float32 NumPy array"
        ))
    })?;
    let ro = a.try_readonly()?;
    let view = ro.as_array();
    let data: Vec<f32> = view.iter().copied().collect();
    Tensor::from_slice(view.shape(), &data)
        .map(|t| t.named(name))
        .map_err(|e| PyValueError::new_err(format!("mpiflow: Session: variable '{name}': {e}")))
}

#[pymethods]
impl PySession {
    #[new]
    fn new(
        py: Python<'_>,
        names: Vec<String>,
        values: Vec<Bound<'_, PyAny>>,
        settings: Settings,
    ) -> PyResult<Self> {
        let (mode, ps, steps) = (settings.mode()?, settings.config()?, settings.steps);
        let tables = ps.tables.clone();
        if names.len() != values.len() {
            return Err(PyValueError::new_err("mpiflow: Session: a value per name"));
        }
        let vars = (names.iter().zip(&values))
            .map(|(n, v)| variable(n, v))
            .collect::<PyResult<Vec<Tensor>>>()?;
        let params = (vars.iter())
            .map(|t| PyArrayDyn::<f32>::zeros(py, t.shape(), false).unbind())
            .collect::<Vec<_>>();
        let out = (params.iter())
            .map(|a| span_of(a.bind(py).as_untyped()))
            .collect();
        let model = External::new(&settings.name, vars)
            .map_err(|e| PyValueError::new_err(format!("mpiflow: Session: {e}")))?;
        let server = shared_server()?;
        let me = format!("{} (rank {})", server.0.task(), server.0.comm().rank());
        if settings.stop_on_signal {
            mpiflow::catch_stop_signals()
                .map_err(|e| Error::new_err(format!("mpiflow: {me}: stop signals: {e}")))?;
        }
        let stop_asked = Arc::new(AtomicBool::new(false));
        let job = Job {
            server,
            model,
            mode,
            ps,
            out,
            stop_asked: stop_asked.clone(),
        };
        let (to, inbox) = channel();
        let (outbox, from) = channel();
        let thread = std::thread::Builder::new()
            .name("mpiflow-session".into())
            .spawn(move || serve(job, inbox, outbox))
            .map_err(|e| Error::new_err(format!("mpiflow: {me}: a session thread: {e}")))?;
        let link = Arc::new(Link {
            to: Mutex::new(Some(to)),
            from: Mutex::new(from),
            thread: Mutex::new(Some(thread)),
        });
        OPEN.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(link.clone());
        let mut sess = PySession {
            link,
            names,
            params,
            me,
            step: 0,
            loss: f32::NAN,
            stop: false,
            ended: false,
            shard: (1, 0),
            chief: false,
            worker: true,
            stop_asked,
            tables,
            asked: None,
            rows_wait: (matches!(mode, Mode::PsRma | Mode::HybridRma), false),
        };
        // The start waits for the other workers (the chief's initial values, or its
        // restore of the newest checkpoint).
        let link = sess.link.clone();
        let first = py.detach(move || link.receive());
        match first {
            Reply::Ready { step, shard, chief } => {
                (sess.step, sess.shard, sess.chief) = (step, shard, chief);
                sess.stop = step >= steps;
                Ok(sess)
            }
            // A ps task of one-sided training: its part is done.
            Reply::Served => {
                (sess.worker, sess.ended, sess.stop) = (false, true, true);
                Ok(sess)
            }
            other => Err(sess.ended_by(other)),
        }
    }

    /// One step: this rank's gradients (float32 arrays, one per variable in order, each
    /// of its variable's shape) of the mean loss `loss` over its `samples` samples, pushed
    /// (or reduced); the parameters after the update written into `params`. A bad
    /// gradient is a `TypeError` or `ValueError` here and ends the session on every rank.
    fn push_pull(
        &mut self,
        py: Python<'_>,
        grads: Vec<Bound<'_, PyAny>>,
        loss: f32,
        samples: usize,
    ) -> PyResult<()> {
        self.open("push_pull")?;
        let mut spans = Vec::with_capacity(grads.len());
        let mut refused = None;
        for (i, g) in grads.iter().enumerate() {
            match self.gradient(py, i, g) {
                Ok(span) => spans.push(span),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        if refused.is_none() && grads.len() != self.names.len() {
            refused = Some(PyValueError::new_err(format!(
                "mpiflow: {}: push_pull: {} gradients for {} variables ({})",
                self.me,
                grads.len(),
                self.names.len(),
                self.names.join(", ")
            )));
        }
        if let Some(e) = refused {
            // Every rank hears of it (the session ends there too, its line naming this
            // rank), this one raises it.
            let line = e.value(py).to_string();
            let why = line.strip_prefix(&format!("mpiflow: {}: ", self.me));
            self.refuse(py, why.unwrap_or(&line).to_string());
            return Err(e);
        }
        let link = self.link.clone();
        let reply = py.detach(move || {
            link.ask(Cmd::Step {
                grads: spans,
                loss,
                samples,
            })
        });
        match reply {
            Reply::Stepped { info, stop } => {
                (self.step, self.loss, self.stop) = (info.global_step, info.loss, stop);
                self.rows_wait.1 = false;
                Ok(())
            }
            other => Err(self.ended_by(other)),
        }
    }

    /// Ends the session on every worker with the program's line `why` (its own finding
    /// on a step's gradients, which it raises itself).
    fn refuse(&mut self, py: Python<'_>, why: String) {
        if self.ended {
            return;
        }
        self.ended = true;
        let link = self.link.clone();
        py.detach(move || link.ask(Cmd::Refuse(why)));
    }

    /// True once the session ended (closed, or by an error): no more calls.
    #[getter]
    fn ended(&self) -> bool {
        self.ended
    }

    /// Rows `ids` of embedding table `table` (from the ps tasks that hold them, made on
    /// first touch): a float32 array `(len(ids), width)`.
    fn pull_rows<'py>(
        &mut self,
        py: Python<'py>,
        table: usize,
        ids: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        self.open("pull_rows")?;
        let dim = self.dim(table)?;
        let ids = self.ids(table, "pull_rows", ids)?;
        let n = ids.len();
        let link = self.link.clone();
        match py.detach(move || link.ask(Cmd::Rows(Rows::Pull { table, ids }))) {
            Reply::Rows(rows) => PyArray1::from_vec(py, rows).reshape([n, dim]),
            other => Err(self.ended_by(other)),
        }
    }

    /// Pushes table `table`'s gradient `grads` (`(len(ids), width)` float32, a row per id
    /// of `ids`, distinct) scaled by `scale`: the ps tasks apply it to those rows at once
    /// (over one-sided windows, with the next step: `thread::Staged`).
    fn push_rows(
        &mut self,
        py: Python<'_>,
        table: usize,
        ids: PyReadonlyArray1<'_, u64>,
        grads: PyReadonlyArray2<'_, f32>,
        scale: f32,
    ) -> PyResult<()> {
        self.open("push_rows")?;
        let dim = self.dim(table)?;
        let ids = self.ids(table, "push_rows", ids)?;
        if grads.shape() != [ids.len(), dim] {
            return Err(PyValueError::new_err(format!(
                "mpiflow: {}: push_rows: gradients of shape {:?} for {} ids of width {dim}",
                self.me,
                grads.shape(),
                ids.len()
            )));
        }
        let values = grads.as_array().iter().copied().collect();
        let grad = SparseGrad { ids, values };
        let link = self.link.clone();
        match py.detach(move || link.ask(Cmd::Rows(Rows::Push { table, grad, scale }))) {
            Reply::Rows(_) => {
                self.rows_wait.1 = self.rows_wait.0;
                Ok(())
            }
            other => Err(self.ended_by(other)),
        }
    }

    /// Asks for the rows of `want` (each a table and its ids) now, to be taken by
    /// `land_rows` of the same tables and ids: over messages the ps tasks serve them
    /// while this worker computes (elsewhere they are pulled when landed). They hold the
    /// updates the ps tasks had applied when asked: ask ahead only for rows this worker's
    /// pending push does not touch.
    fn pull_rows_ahead(
        &mut self,
        py: Python<'_>,
        want: Vec<(usize, PyReadonlyArray1<'_, u64>)>,
    ) -> PyResult<()> {
        self.open("pull_rows_ahead")?;
        let want = self.wanted("pull_rows_ahead", want)?;
        self.asked = Some(want.clone());
        let link = self.link.clone();
        match py.detach(move || link.ask(Cmd::Rows(Rows::Ahead { want }))) {
            Reply::Tables(_) => Ok(()),
            other => Err(self.ended_by(other)),
        }
    }

    /// The rows `pull_rows_ahead` asked for (`want`: the same tables and ids): a float32
    /// array `(len(ids), width)` per table.
    fn land_rows<'py>(
        &mut self,
        py: Python<'py>,
        want: Vec<(usize, PyReadonlyArray1<'py, u64>)>,
    ) -> PyResult<Vec<Bound<'py, PyArray2<f32>>>> {
        self.open("land_rows")?;
        let want = self.wanted("land_rows", want)?;
        // A landing of other rows is refused here (the session goes on); the rows asked
        // for are dropped by the next call that asks for any.
        let why = match self.asked.take() {
            None => Some("no rows were asked for ahead"),
            Some(asked) if asked != want => {
                Some("other tables or ids than pull_rows_ahead asked for")
            }
            Some(_) => None,
        };
        if let Some(why) = why {
            return Err(PyValueError::new_err(format!(
                "mpiflow: {}: land_rows: {why}",
                self.me
            )));
        }
        let shapes: Vec<[usize; 2]> = (want.iter())
            .map(|(t, ids)| [ids.len(), self.tables[*t].dim])
            .collect();
        let link = self.link.clone();
        match py.detach(move || link.ask(Cmd::Rows(Rows::Land { want }))) {
            Reply::Tables(rows) => (rows.into_iter().zip(shapes))
                .map(|(r, shape)| PyArray1::from_vec(py, r).reshape(shape))
                .collect(),
            other => Err(self.ended_by(other)),
        }
    }

    /// Checkpoints this step now (every worker calls it); the checkpoint's path, or None
    /// without a checkpoint directory.
    fn save(&mut self, py: Python<'_>) -> PyResult<Option<PathBuf>> {
        self.open("save")?;
        let link = self.link.clone();
        match py.detach(move || link.ask(Cmd::Save)) {
            Reply::Saved(path) => Ok(path),
            other => Err(self.ended_by(other)),
        }
    }

    /// Ends the session: the last checkpoint written, the ps tasks told this worker is
    /// done. Returns (global step, first step, last loss, samples/s, checkpoint path).
    #[allow(clippy::type_complexity)]
    fn close(&mut self, py: Python<'_>) -> PyResult<(u64, u64, f32, f64, Option<PathBuf>)> {
        self.open("close")?;
        if self.rows_wait.1 {
            return Err(PyValueError::new_err(format!(
                "mpiflow: {}: close: rows pushed since the last push_pull are not applied (over one-sided windows a step's rows go with its push_pull): call push_pull first",
                self.me
            )));
        }
        self.ended = true;
        let link = self.link.clone();
        let reply = py.detach(move || {
            let r = link.ask(Cmd::Close);
            link.end();
            r
        });
        forget(&self.link);
        match reply {
            Reply::Closed(c) => Ok((
                c.step,
                c.first_step,
                c.loss,
                c.samples_per_sec,
                c.checkpoint,
            )),
            other => Err(self.ended_by(other)),
        }
    }

    /// Asks the session to stop after the next step (on every worker where they step
    /// together; this worker alone in asynchronous ps training).
    fn request_stop(&self) {
        self.stop_asked.store(true, Ordering::SeqCst);
    }

    /// True once training is over (the last step, a request to stop, an error).
    fn should_stop(&self) -> bool {
        self.stop || self.ended
    }

    /// The variables' names, in order.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// The parameters (this session's arrays, rewritten after every step), in order.
    #[getter]
    fn arrays(&self, py: Python<'_>) -> Vec<Py<PyArrayDyn<f32>>> {
        self.params.iter().map(|a| a.clone_ref(py)).collect()
    }

    #[getter]
    fn global_step(&self) -> u64 {
        self.step
    }

    /// The last step's loss (NaN before the first).
    #[getter]
    fn loss(&self) -> f32 {
        self.loss
    }

    #[getter]
    fn is_chief(&self) -> bool {
        self.chief
    }

    /// False on a ps task of one-sided training (its constructor served to the end).
    #[getter]
    fn is_worker(&self) -> bool {
        self.worker
    }

    /// The shares each global batch is cut into, and this worker's.
    #[getter]
    fn data_shard(&self) -> (usize, usize) {
        self.shard
    }
}

impl PySession {
    fn open(&self, what: &str) -> PyResult<()> {
        match self.ended {
            true => Err(Error::new_err(format!(
                "mpiflow: {}: {what}() after the session ended",
                self.me
            ))),
            false => Ok(()),
        }
    }

    /// The exception of a reply that is not the one asked for: the session's error.
    fn ended_by(&mut self, reply: Reply) -> PyErr {
        self.ended = true;
        let (line, stopped) = match reply {
            Reply::Failed(line, stopped) => (line, stopped),
            _ => ("the session thread answered out of turn".into(), false),
        };
        let line = match line.contains(&self.me) {
            true => format!("mpiflow: {line}"),
            false => format!("mpiflow: {}: {line}", self.me),
        };
        match stopped {
            true => Stopped::new_err(line),
            false => Error::new_err(line),
        }
    }

    /// Table `table`'s width, or an `IndexError`.
    fn dim(&self, table: usize) -> PyResult<usize> {
        self.tables.get(table).map(|t| t.dim).ok_or_else(|| {
            PyIndexError::new_err(format!(
                "mpiflow: {}: no embedding table {table} (the session has {})",
                self.me,
                self.tables.len()
            ))
        })
    }

    /// Each table of `want` with its ids, checked as [`Self::ids`] checks them.
    fn wanted(
        &self,
        call: &str,
        want: Vec<(usize, PyReadonlyArray1<'_, u64>)>,
    ) -> PyResult<Vec<(usize, Vec<u64>)>> {
        (want.into_iter())
            .map(|(t, ids)| {
                self.dim(t)?;
                Ok((t, self.ids(t, call, ids)?))
            })
            .collect()
    }

    /// `ids`, each checked to be a row of table `table` (a `ValueError` for `call`
    /// naming the table and the id otherwise: the session goes on).
    fn ids(&self, table: usize, call: &str, ids: PyReadonlyArray1<'_, u64>) -> PyResult<Vec<u64>> {
        let ids = ids.as_array().to_vec();
        match ids.iter().try_for_each(|id| self.tables[table].check(*id)) {
            Err(e) => Err(PyValueError::new_err(format!(
                "mpiflow: {}: {call}: {e}",
                self.me
            ))),
            Ok(()) => Ok(ids),
        }
    }

    /// Gradient `i`, checked against its variable (a float32 array of its shape) and as a
    /// collective's array is (C-contiguous, aligned): where its data are.
    fn gradient(&self, py: Python<'_>, i: usize, g: &Bound<'_, PyAny>) -> PyResult<Span> {
        let name = self.names.get(i).map_or("?", String::as_str);
        let call = format!("{}: push_pull: the gradient of '{name}'", self.me);
        let a = g.cast::<PyUntypedArray>().map_err(|_| {
            let kind = g.get_type().name().map_or("?".into(), |n| n.to_string());
            PyTypeError::new_err(format!("mpiflow: {call} is a {kind}, not a NumPy array"))
        })?;
        if dtype_of(a) != Some(DType::F32) {
            return Err(PyTypeError::new_err(format!(
                "mpiflow: {call} is {}, the variable is float32",
                dtype_name(a)
            )));
        }
        let want = self.params[i].bind(py).shape().to_vec();
        if a.shape() != want.as_slice() {
            return Err(PyValueError::new_err(format!(
                "mpiflow: {call} has shape {:?}, the variable {want:?}",
                a.shape()
            )));
        }
        match layout_error(a, &call, false) {
            Some((e, _)) => Err(e),
            None => Ok(span_of(a)),
        }
    }
}

impl Drop for PySession {
    /// A session dropped without close(): its thread ends it as abandoned (the ps tasks
    /// are told), joined at finalize.
    fn drop(&mut self) {
        if let Ok(mut to) = self.link.to.lock() {
            to.take();
        }
    }
}

/// The link leaves the open list (its thread joined).
fn forget(link: &Arc<Link>) {
    OPEN.lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|l| !Arc::ptr_eq(l, link));
}

/// A ps task's service: serves its variables until every worker is done (or one
/// is lost or fails, which raises).
#[pyfunction]
pub fn join(py: Python<'_>) -> PyResult<()> {
    let server = shared_server()?;
    py.detach(move || server.0.join()).map_err(|e| {
        let line = format!("mpiflow: {e}");
        match ps_stopped(&e) {
            true => Stopped::new_err(line),
            false => Error::new_err(line),
        }
    })
}

/// True if a ps task's service ended at a stop signal.
fn ps_stopped(e: &ServerError) -> bool {
    matches!(e, ServerError::Ps(PsError::Stopped(_)))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySession>()?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    Ok(())
}
