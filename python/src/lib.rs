//! `mpiflow._native`: mpiflow's cluster and collectives for Python programs (the extension
//! module under the pure-Python package in `python/mpiflow`).
//!
//! One process-wide state, made by `init()`: the server (MPI initialised with threads, or
//! the library mpi4py initialised, which then finalises it; the cluster resolved as
//! `mpiflow spec` resolves it) and mpiflow's collectives over a
//! communicator of their own. Every call takes NumPy arrays in place (C-contiguous
//! float32, float64, int32 or int64, writeable), releases the GIL while it communicates,
//! and first agrees with every other rank on what is being called (the operation, dtype,
//! shape and op): a call that differs between ranks is one exception on every rank naming
//! both sides, never a hang. Errors are `mpiflow.Error` (bad arrays: `TypeError`,
//! `ValueError`), each one line naming the rank.

mod collectives;
mod data;
mod described;
mod executor;
mod session;
mod symmetric;

use std::sync::{Arc, Mutex, MutexGuard};

use mpiflow::cluster::{MappingOptions, Source};
use mpiflow::transport::collectives::Collectives;
use mpiflow::transport::{Comm, Context, InitError};
use mpiflow::Server;
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

create_exception!(
    _native,
    Error,
    PyRuntimeError,
    "An mpiflow call failed (on this rank, or agreed by every rank)."
);

create_exception!(
    _native,
    Stopped,
    Error,
    "Training stopped at a step boundary, asked by a signal (SIGTERM, SIGINT, SIGUSR1), \
     after a checkpoint: a rerun resumes from it."
);

/// The server, shared by the Python thread and the session threads.
pub(crate) struct Shared(pub(crate) Server);

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (checked in `init`); the server's
// communicators are used by one session thread at a time (its own duplicates: the ps
// protocol, the workers' split), apart from the collectives' communicator of `State`.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// What `init()` made (fields drop in order: the collectives' thread, its queue run out,
/// and its communicator before the server, which finalises MPI).
struct State {
    exec: executor::Executor,
    server: Arc<Shared>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// The state's lock, made or not.
fn locked() -> PyResult<MutexGuard<'static, Option<State>>> {
    STATE
        .lock()
        .map_err(|_| Error::new_err("mpiflow: an earlier call panicked"))
}

/// The state, locked; an error before `init()`.
fn state() -> PyResult<MutexGuard<'static, Option<State>>> {
    let guard = locked()?;
    if guard.is_none() {
        return Err(Error::new_err(
            "mpiflow: call mpiflow.init() first (under mpirun or srun)",
        ));
    }
    Ok(guard)
}

/// The server, for a session or a ps task's service (which run without the lock).
fn shared_server() -> PyResult<Arc<Shared>> {
    with_state(|s| Ok(s.server.clone()))
}

/// Runs `f` with the state (locked).
fn with_state<R>(f: impl FnOnce(&State) -> PyResult<R>) -> PyResult<R> {
    let guard = state()?;
    f(guard.as_ref().expect("checked by state()"))
}

/// Initialises MPI (with threads) and resolves this process's cluster: from the seeds'
/// flags in `args` if any, else `TF_CONFIG`, else the ranks of the MPI job mapped onto
/// `ps` ps tasks (and a chief or evaluator if asked). `comm`: the Fortran handle of a
/// communicator the program made (mpi4py's `comm.py2f()`), whose ranks are then the job
/// (MPI initialised by mpi4py; the cluster is never Slurm's whole step then, which may
/// hold other ranks). A second call does nothing.
#[pyfunction]
#[pyo3(signature = (args = Vec::new(), ps = 0, chief = false, evaluator = false, comm = None))]
fn init(
    args: Vec<String>,
    ps: usize,
    chief: bool,
    evaluator: bool,
    comm: Option<i32>,
) -> PyResult<()> {
    let mut guard = locked()?;
    if guard.is_some() {
        return Ok(());
    }
    let fail = |e: &dyn std::fmt::Display| Error::new_err(format!("mpiflow: {e}"));
    // MPI initialised already (mpi4py imported first): its library is used, and left to
    // it to finalise.
    if comm.is_none() && !Context::mpi_started() {
        one_sided_env();
    }
    let (ctx, multiple) = match comm {
        Some(fortran) => Context::adopt_communicator(fortran),
        None => match Context::init_threaded() {
            Err(InitError::AlreadyInitialised) => Context::adopt(),
            started => started,
        },
    }
    .map_err(|e| fail(&e))?;
    if !multiple {
        return Err(fail(
            &"the MPI library does not provide MPI_THREAD_MULTIPLE, which Python threads need",
        ));
    }
    let mapping = MappingOptions {
        ps,
        chief,
        evaluator,
        ..MappingOptions::default()
    };
    let mut req = Server::request(&args, mapping);
    let env = std::env::vars().collect();
    if comm.is_some() && req.pick_source(&env) == Source::Slurm {
        req.source = Source::Mpi;
    }
    let server = Server::start_in(ctx, &req, &env).map_err(|e| fail(&e))?;
    let comm = server.comm();
    let own = comm.split(0, comm.rank()).map_err(|e| fail(&e))?;
    let exec = executor::Executor::start(Collectives::new(own)).map_err(|e| fail(&e))?;
    *guard = Some(State {
        exec,
        server: Arc::new(Shared(server)),
    });
    Ok(())
}

/// Sets what Open MPI reads in `MPI_Init` for one-sided windows, as the command line does
/// (`mpiflow::transport::stack`): on a machine without an RDMA device its one-sided
/// components `sm,pt2pt` (its default, `osc rdma`, crashes in `MPI_Compare_and_swap` over
/// shared memory, which embedding rows over windows use), unless the environment chose.
/// Called before MPI starts, by the thread that starts it.
fn one_sided_env() {
    for (var, value) in one_sided_vars() {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, value);
        }
    }
}

/// What [`one_sided_env`] sets on this machine (nothing with MPICH, with an RDMA device,
/// or where the environment chose).
fn one_sided_vars() -> Vec<(&'static str, String)> {
    use mpiflow::transport::stack::{settings, Facts, RdmaStack};
    let env = std::env::vars().collect();
    settings(RdmaStack::Auto, &Facts::detect(), &env).map_or(Vec::new(), |s| s.vars)
}

/// A variable [`one_sided_env`] would set that the environment lacks (MPI started by
/// another package before `init()`), with its value.
pub(crate) fn one_sided_env_missing() -> Option<(&'static str, String)> {
    one_sided_vars()
        .into_iter()
        .find(|(var, _)| std::env::var_os(var).is_none())
}

/// Finalises MPI (the package calls it at exit); nothing before `init()` or after a first
/// call.
#[pyfunction]
fn finalize(py: Python<'_>) -> PyResult<()> {
    // Sessions still open end first (as abandoned: the ps tasks are told); their threads
    // hold the server.
    py.detach(session::end_all);
    let taken = locked()?.take();
    if let Some(state) = taken {
        // The collectives' queue runs out, then MPI_Finalize waits for every rank: not
        // with the GIL held.
        py.detach(move || drop(state));
    }
    Ok(())
}

/// From now on SIGTERM, SIGINT and SIGUSR1 are noted instead of ending the process: a
/// session with `stop_on_signal` stops every worker at a step with a checkpoint, and a ps
/// task's `join()` announces the stop to the workers (then raises `Stopped`).
#[pyfunction]
fn catch_stop_signals() -> PyResult<()> {
    mpiflow::catch_stop_signals()
        .map_err(|e| Error::new_err(format!("mpiflow: catching the stop signals: {e}")))
}

/// This process's rank in the job.
#[pyfunction]
fn rank() -> PyResult<usize> {
    with_state(|s| Ok(s.server.0.comm().rank()))
}

/// The number of processes in the job.
#[pyfunction]
fn size() -> PyResult<usize> {
    with_state(|s| Ok(s.server.0.comm().size()))
}

/// This process's rank among those of its host.
#[pyfunction]
fn local_rank() -> PyResult<usize> {
    with_state(|s| {
        let me = &s.server.0.layout().ranks[s.server.0.comm().rank()];
        Ok(me.local_rank.unwrap_or(0))
    })
}

/// The cluster as TF_CONFIG says it (JSON), with `is_chief`: the Python layer's dict.
#[pyfunction]
fn cluster_json() -> PyResult<String> {
    with_state(|s| {
        let layout = s.server.0.layout();
        let me = &layout.ranks[s.server.0.comm().rank()];
        let mut v: serde_json::Value = serde_json::from_str(&layout.tf_config(me).to_json())
            .map_err(|e| Error::new_err(format!("mpiflow: {e}")))?;
        v["is_chief"] = serde_json::Value::Bool(s.server.0.is_chief());
        Ok(v.to_string())
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("Error", m.py().get_type::<Error>())?;
    m.add("Stopped", m.py().get_type::<Stopped>())?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(finalize, m)?)?;
    m.add_function(wrap_pyfunction!(rank, m)?)?;
    m.add_function(wrap_pyfunction!(catch_stop_signals, m)?)?;
    m.add_function(wrap_pyfunction!(size, m)?)?;
    m.add_function(wrap_pyfunction!(local_rank, m)?)?;
    m.add_function(wrap_pyfunction!(cluster_json, m)?)?;
    collectives::register(m)?;
    session::register(m)?;
    data::register(m)?;
    symmetric::register(m)?;
    Ok(())
}
