//! The collectives' own thread: every collective a Python program calls, blocking or not,
//! is queued to it in call order and run there (the agreement on the call, then the
//! operation), so that non-blocking calls keep the order every rank issued them in, and
//! a `Handle` is what a call returns: `wait()` gives its result or raises its error.
//! (Horovod's background loop, without the tensor-name negotiation: the order is the
//! program's, checked by the agreement.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use mpiflow::tensor::DType;
use mpiflow::transport::collectives::Collectives;
use mpiflow::transport::fusion::{self, FusionError};
use mpiflow::transport::mpi::MpiComm;
use mpiflow::transport::{Algorithm, ReduceOp, TransportError};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::described::Described;
use super::Error;

/// Where an array's bytes are. The array is kept alive by the call's [`Handle`] until the
/// call is done, and nothing else reaches it through Rust meanwhile.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub(crate) ptr: usize,
    pub(crate) len: usize,
}

impl Span {
    /// # Safety
    /// The span's array must be alive and not otherwise borrowed by Rust for `'a`.
    unsafe fn bytes<'a>(self) -> &'a mut [u8] {
        // SAFETY: as the caller promises; a span is made from an array's data and its
        // length in bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }

    /// The span's bytes, only read (an array that may be read-only).
    ///
    /// # Safety
    /// The span's array must be alive and not written by Rust for `'a`.
    unsafe fn read<'a>(self) -> &'a [u8] {
        // SAFETY: as the caller promises; a span is made from an array's data and its
        // length in bytes.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The span's float32 values.
    ///
    /// # Safety
    /// As [`Span::bytes`], and the span must be a float32 array's, aligned (checked by
    /// `collectives::layout_error`).
    pub(crate) unsafe fn floats<'a>(self) -> &'a mut [f32] {
        // SAFETY: as the caller promises: `len` bytes of aligned float32 values.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut f32, self.len / 4) }
    }
}

/// The exception a failed call raises.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Type,
    Value,
    Mpi,
}

/// A call's failure: its exception and line.
pub(crate) type Failure = (Kind, String);

/// An operation on the collectives' communicator.
#[derive(Clone)]
pub(crate) enum Op {
    /// The arrays of each dtype reduced as one message, in place (shared: a list's job is
    /// reused by its next call on the same arrays: `collectives::memo`).
    Allreduce(Arc<[(DType, Vec<Span>)]>, ReduceOp),
    /// The first span's reduction into the second (apart from it), as one message.
    AllreduceInto(Span, Span, DType, ReduceOp),
    Broadcast(Span, usize),
    /// This rank's bytes, and every rank's, in rank order.
    Allgather(Span, Span),
    Barrier,
    /// Symmetric memory of this many bytes, left where the caller takes it.
    Symmetric(usize, super::symmetric::Made),
}

/// This rank's name of a call, for its errors (`rank 2: allreduce`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    rank: usize,
    pub(crate) name: &'static str,
}

impl Call {
    pub(crate) fn new(rank: usize, name: &'static str) -> Call {
        Call { rank, name }
    }
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.name)
    }
}

/// One call: its description for the agreement and the description's hash (what the
/// ranks compare), its name for errors, what it does (or why this rank refuses it, said
/// after the agreement so that no rank waits for it). A clone shares the description.
#[derive(Clone)]
pub(crate) struct Job {
    what: Arc<Described>,
    hash: u64,
    pub(crate) call: Call,
    pub(crate) op: Result<Op, Failure>,
}

impl Job {
    pub(crate) fn new(what: Described, call: Call, op: Result<Op, Failure>) -> Job {
        Job {
            hash: what.hash(),
            what: Arc::new(what),
            call,
            op,
        }
    }
}

// SAFETY: the spans point into arrays the job's Handle keeps alive until the job is done;
// only the executor thread reaches them meanwhile.
unsafe impl Send for Job {}

/// A call's outcome, set once by the executor.
#[derive(Default)]
pub(crate) struct Done {
    outcome: Mutex<Option<Result<(), Failure>>>,
    cv: Condvar,
}

impl Done {
    fn set(&self, r: Result<(), Failure>) {
        *self.outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        self.cv.notify_all();
    }

    fn wait(&self) -> Result<(), Failure> {
        let mut g = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone();
            }
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn is_set(&self) -> bool {
        self.outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

/// The collectives, their queue and what is in it.
struct Inner {
    coll: Mutex<Owned>,
    /// Jobs queued and not yet done.
    pending: AtomicUsize,
    /// Held while a call is queued or run at once, so that calls keep their order.
    order: Mutex<()>,
}

/// The collectives' thread and its queue.
pub(crate) struct Executor {
    port: Port,
    thread: Option<JoinHandle<()>>,
}

/// Where calls go: the collectives and their thread's queue. Taken from the state, so
/// that no lock is held while a call runs without the GIL (a Python thread waiting for
/// the state's lock with the GIL would wait for ever for a call that needs the GIL back).
#[derive(Clone)]
pub(crate) struct Port {
    inner: Arc<Inner>,
    to: Option<Sender<(Job, Arc<Done>)>>,
    pub(crate) rank: usize,
    pub(crate) size: usize,
}

impl Executor {
    /// Starts the thread; the collectives are shared with blocking calls, which run on
    /// the caller's thread when nothing is queued (a thread's wake-up costs more than a
    /// small allreduce).
    pub(crate) fn start(coll: Collectives<MpiComm>) -> std::io::Result<Executor> {
        let (rank, size) = (coll.rank(), coll.size());
        let inner = Arc::new(Inner {
            coll: Mutex::new(Owned(coll)),
            pending: AtomicUsize::new(0),
            order: Mutex::new(()),
        });
        let (to, inbox) = channel::<(Job, Arc<Done>)>();
        let shared = inner.clone();
        let thread = std::thread::Builder::new()
            .name("mpiflow-collectives".into())
            .spawn(move || {
                while let Ok((job, done)) = inbox.recv() {
                    let r = run(&lock(&shared.coll).0, job);
                    shared.pending.fetch_sub(1, Ordering::SeqCst);
                    done.set(r);
                }
            })?;
        let port = Port {
            inner,
            to: Some(to),
            rank,
            size,
        };
        Ok(Executor {
            port,
            thread: Some(thread),
        })
    }

    /// Where calls go (see [`Port`]).
    pub(crate) fn port(&self) -> Port {
        self.port.clone()
    }
}

impl Port {
    /// Queues `job` (or, `blocking` with nothing queued, runs it now without the GIL);
    /// `keep` (the call's arrays, taken only if the job is queued: a call run at once has
    /// its caller's) stays with the handle until the job is done, `result` is what its
    /// `wait()` returns. The handle; with `blocking`, what its `wait()` returns (no handle
    /// is made).
    pub(crate) fn submit(
        &self,
        py: Python<'_>,
        job: Job,
        keep: impl FnOnce() -> Vec<Py<PyAny>>,
        result: Py<PyAny>,
        blocking: bool,
    ) -> PyResult<Py<PyAny>> {
        let inner = &self.inner;
        let queued = py.detach(|| {
            let _order = lock(&inner.order);
            if blocking && inner.pending.load(Ordering::SeqCst) == 0 {
                return Err(run(&lock(&inner.coll).0, job));
            }
            let done = Arc::new(Done::default());
            inner.pending.fetch_add(1, Ordering::SeqCst);
            let sent = self
                .to
                .as_ref()
                .map(|to| to.send((job, done.clone())).is_ok());
            if sent != Some(true) {
                inner.pending.fetch_sub(1, Ordering::SeqCst);
                done.set(Err((
                    Kind::Mpi,
                    "mpiflow: the collectives have ended".into(),
                )));
            }
            Ok(done)
        });
        match queued {
            // Run at once: done, and no handle needed.
            Err(ran) => ran.map(|()| result).map_err(raised),
            Ok(done) => {
                let mut handle = Handle {
                    done,
                    keep: keep(),
                    result: Some(result),
                };
                match blocking {
                    true => handle.wait(py),
                    false => Ok(Py::new(py, handle)?.into_any()),
                }
            }
        }
    }

    /// Benchmarks: `job`'s call run `reps` times from Rust, without the GIL, when nothing
    /// is queued; the seconds per call. Each call describes its list anew and agrees on
    /// it, as a Rust program's fused allreduce does (`fusion::Fusion::allreduce`).
    pub(crate) fn time_from_rust(
        &self,
        py: Python<'_>,
        job: Job,
        reps: usize,
    ) -> Result<f64, Failure> {
        let inner = self.inner.clone();
        py.detach(move || {
            let _order = lock(&inner.order);
            if inner.pending.load(Ordering::SeqCst) != 0 {
                return Err((Kind::Mpi, "mpiflow: calls are queued".into()));
            }
            let coll = lock(&inner.coll);
            let op = job.op?;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                let what = Described::clone(&job.what);
                run(&coll.0, Job::new(what, job.call, Ok(op.clone())))?;
            }
            Ok(t.elapsed().as_secs_f64() / reps.max(1) as f64)
        })
    }
}

impl Drop for Executor {
    /// The queue closed, the thread joined (its calls done) before MPI is finalised.
    fn drop(&mut self) {
        self.port.to.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The collectives, shared by the executor's thread and blocking calls.
struct Owned(Collectives<MpiComm>);

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE; the communicator is used under
// `Inner::coll`'s lock, by one thread at a time.
unsafe impl Send for Owned {}

/// Runs one job: the agreement, then this rank's refusal or the operation.
fn run(coll: &Collectives<MpiComm>, job: Job) -> Result<(), Failure> {
    agree(coll, job.hash, &job.what)?;
    let mpi = |e: TransportError| (Kind::Mpi, format!("mpiflow: {}: {e}", job.call));
    // SAFETY (each `bytes` and `read`): the job's handle keeps its arrays alive until
    // `done` is set, after this returns (a call run at once: its caller, until this
    // returns); each span is reached by this call alone (the same array twice in one list
    // was refused when the job was made, a remembered job is reused only for arrays where
    // its spans are: `collectives::memo`, and an input read is apart from its output:
    // `collectives::apart_input`).
    match job.op? {
        Op::Allreduce(groups, reduce) => {
            for (dt, spans) in groups.iter() {
                let mut parts: Vec<&mut [u8]> =
                    spans.iter().map(|s| unsafe { s.bytes() }).collect();
                coll.allreduce_parts(&mut parts, *dt, reduce, Algorithm::Auto)
                    .map_err(mpi)?;
            }
            Ok(())
        }
        Op::AllreduceInto(src, dst, dt, reduce) => {
            let src = unsafe { src.read() };
            (coll.allreduce_into(src, unsafe { dst.bytes() }, dt, reduce, Algorithm::Auto))
                .map(drop)
                .map_err(mpi)
        }
        Op::Broadcast(span, root) => coll.bcast(unsafe { span.bytes() }, root).map_err(mpi),
        Op::Allgather(mine, all) => {
            let mine = unsafe { mine.read() };
            coll.allgather(mine, unsafe { all.bytes() }).map_err(mpi)
        }
        Op::Barrier => coll.barrier().map_err(mpi),
        Op::Symmetric(bytes, made) => {
            let region = coll.symmetric(bytes).map_err(mpi)?;
            *made.lock().unwrap_or_else(|p| p.into_inner()) = region;
            Ok(())
        }
    }
}

/// Agrees with every rank on `what` (this rank's call, whose hash is `hash`): mpiflow's
/// negotiation of fused lists ([`fusion::negotiate`]: one small allreduce of the hash,
/// the descriptions gathered only on a mismatch). An error naming the first rank whose call
/// differs from this rank's: rank 0 where this rank's differs from rank 0's, else the
/// first that differs from rank 0's.
fn agree(coll: &Collectives<MpiComm>, hash: u64, what: &Described) -> Result<(), Failure> {
    match fusion::negotiate(coll, hash, || vec![what.text()]) {
        Ok(()) => Ok(()),
        Err(FusionError::Mismatch {
            rank, theirs, ours, ..
        }) => {
            let mine = what.text();
            let (r, other) = if ours != mine {
                (0, ours)
            } else {
                (rank, theirs)
            };
            let line = format!(
                "mpiflow: rank {} called {mine}, but rank {r} called {other}",
                coll.rank()
            );
            Err((Kind::Mpi, line))
        }
        Err(e) => Err((Kind::Mpi, format!("mpiflow: {e}"))),
    }
}

/// A call in flight: `wait()` returns its result (the array written, or the list) or
/// raises its error. Dropped before it is done, it waits first (its arrays are in use).
#[pyclass(module = "mpiflow._native", name = "Handle")]
pub struct Handle {
    done: Arc<Done>,
    keep: Vec<Py<PyAny>>,
    result: Option<Py<PyAny>>,
}

#[pymethods]
impl Handle {
    /// Waits for the call (without the GIL); its result, or its exception.
    fn wait(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let done = self.done.clone();
        // A call run at once is done already: no need to let the GIL go.
        let outcome = match done.is_set() {
            true => done.wait(),
            false => py.detach(move || done.wait()),
        };
        self.keep.clear();
        outcome.map_err(raised)?;
        Ok(match &self.result {
            Some(r) => r.clone_ref(py),
            None => py.None(),
        })
    }

    /// True once the call is done (`wait()` then returns at once).
    fn done(&self) -> bool {
        self.done.is_set()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if !self.keep.is_empty() {
            // The executor needs no GIL: waiting with it held cannot deadlock.
            let _ = self.done.wait();
        }
    }
}

/// The exception a [`Failure`] raises.
fn raised((kind, line): Failure) -> PyErr {
    match kind {
        Kind::Type => PyTypeError::new_err(line),
        Kind::Value => PyValueError::new_err(line),
        Kind::Mpi => Error::new_err(line),
    }
}

/// A Python exception as a [`Failure`], to be raised by `wait()`.
pub(crate) fn failure(py: Python<'_>, e: &PyErr) -> Failure {
    let kind = if e.is_instance_of::<PyTypeError>(py) {
        Kind::Type
    } else if e.is_instance_of::<PyValueError>(py) {
        Kind::Value
    } else {
        Kind::Mpi
    };
    (kind, e.value(py).to_string())
}
