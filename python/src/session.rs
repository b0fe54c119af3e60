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

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use mpiflow::named::Named;
use mpiflow::tensor::Tensor;
use mpiflow::train::ps::placement::Strategy as Placement;
use mpiflow::{
    AllreduceConfig, Dataset, External, Local, Optimizer, OptimizerKind, PsConfig, Session,
    StepInfo, Strategy, TrainConfig, TrainError,
};
use mpiflow::{PsError, ServerError};
use numpy::{
    dtype, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use mpiflow::transport::Comm;

use super::{shared_server, Error, Shared, Stopped};

/// Where a NumPy array's float32 data are (kept alive by whoever sent it, for as long as
/// the session thread may use it: see each use).
#[derive(Debug, Clone, Copy)]
struct Span {
    ptr: usize,
    len: usize,
}

/// What the Python thread asks of its session thread.
enum Cmd {
    /// One step with these gradients (the program's arrays, borrowed until the reply).
    Step {
        grads: Vec<Span>,
        loss: f32,
        samples: usize,
    },
    /// The program's gradients were refused (why): the step fails with it on every rank.
    Refuse(String),
    /// A checkpoint of this step.
    Save,
    /// The session's end: its final checkpoint, the ps tasks told.
    Close,
}

/// What a session thread answers.
enum Reply {
    /// The session started (the parameters written).
    Ready {
        step: u64,
        shard: (usize, usize),
        chief: bool,
    },
    /// A step ran (the parameters written).
    Stepped {
        info: StepInfo,
        stop: bool,
    },
    Saved(Option<PathBuf>),
    Closed(Closed),
    /// A ps task served the one-sided session to its end.
    Served,
    /// The line of the error that ended the session; true if a stop signal ended it.
    Failed(String, bool),
}

/// A closed session's summary.
struct Closed {
    step: u64,
    first_step: u64,
    loss: f32,
    samples_per_sec: f64,
    checkpoint: Option<PathBuf>,
}

/// The channels to one session thread, and the thread.
struct Link {
    to: Mutex<Option<Sender<Cmd>>>,
    from: Mutex<Receiver<Reply>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Every session thread not yet joined: `finalize` ends them before MPI is finalised.
static OPEN: Mutex<Vec<Arc<Link>>> = Mutex::new(Vec::new());

impl Link {
    /// Sends `cmd` and waits for the reply (a gone thread: the session failed).
    fn ask(&self, cmd: Cmd) -> Reply {
        let sent = match &*self.to.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(to) => to.send(cmd).is_ok(),
            None => false,
        };
        let from = self.from.lock().unwrap_or_else(|p| p.into_inner());
        match sent.then(|| from.recv().ok()).flatten() {
            Some(reply) => reply,
            None => Reply::Failed("the session has ended".into(), false),
        }
    }

    /// Waits for the thread's next reply (the first: the session's start).
    fn receive(&self) -> Reply {
        let from = self.from.lock().unwrap_or_else(|p| p.into_inner());
        from.recv()
            .unwrap_or_else(|_| Reply::Failed("the session has ended".into(), false))
    }

    /// Ends the thread: its channel closed (a session not closed is abandoned: the ps
    /// tasks are told), then joined.
    fn end(&self) {
        self.to.lock().unwrap_or_else(|p| p.into_inner()).take();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// Ends every session thread (at finalize, before MPI is).
pub(super) fn end_all() {
    let open = std::mem::take(&mut *OPEN.lock().unwrap_or_else(|p| p.into_inner()));
    for link in open {
        link.end();
    }
}

/// How the workers train together.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Local,
    Allreduce,
    Ps,
    /// The ps over one-sided windows: every task opens the session (the windows are
    /// allocated by all together); a ps task serves in it until the workers end.
    PsRma,
}

/// What a session thread is started with.
struct Job {
    server: Arc<Shared>,
    model: External,
    mode: Mode,
    ps: PsConfig,
    /// The session's parameter arrays, written after the start and every step.
    out: Vec<Span>,
    stop_asked: Arc<AtomicBool>,
}

// SAFETY: the spans are the data of the Python session's own arrays, which outlive the
// thread's use of them (see `write_params`); the server is shared under
// MPI_THREAD_MULTIPLE (`Shared`).
unsafe impl Send for Job {}

/// The session thread: opens the session of `job.mode`, then serves commands until the
/// session is closed or the Python side lets go.
fn serve(job: Job, inbox: Receiver<Cmd>, outbox: Sender<Reply>) {
    let Job {
        server,
        model,
        mode,
        ps,
        out,
        stop_asked,
    } = job;
    let io = Io {
        model: &model,
        inbox,
        outbox,
        out,
        stop_asked,
    };
    let server = &server.0;
    match mode {
        Mode::Local => {
            let sess = Local::new(&model, &ps.train).and_then(|s| Session::new(s, &ps.train));
            let _ = io.drive(sess.map_err(|e| e.to_string()));
        }
        Mode::Allreduce => {
            let cfg = AllreduceConfig {
                train: ps.train.clone(),
                ..AllreduceConfig::default()
            };
            let _ = io.drive(
                server
                    .allreduce_session(&model, &cfg)
                    .map_err(|e| e.to_string()),
            );
        }
        Mode::Ps => {
            let _ = io.drive(server.session(&model, &ps).map_err(|e| e.to_string()));
        }
        Mode::PsRma => {
            let is_worker = server.worker().is_some();
            // The evaluator's held-out samples: none (an external model is evaluated by
            // the program).
            let none = Dataset {
                x: Vec::new(),
                y: Vec::new(),
                features: 0,
                classes: 1,
                shape: vec![0],
            };
            let served = server.one_sided(&model, &ps, &none, |sess| io.drive(Ok(sess)));
            match (served, is_worker) {
                (Ok(None), _) => io.reply(Reply::Served),
                // A worker's session told Python how it ended.
                (_, true) => {}
                (Err(e), false) => io.reply(Reply::Failed(e.to_string(), ps_stopped(&e))),
                (Ok(Some(())), false) => {}
            }
        }
    }
}

/// A session thread's ends: the model, the channels, the parameter arrays.
struct Io<'a> {
    model: &'a External,
    inbox: Receiver<Cmd>,
    outbox: Sender<Reply>,
    out: Vec<Span>,
    stop_asked: Arc<AtomicBool>,
}

impl Io<'_> {
    /// Serves the session's commands until it is closed (`Ok`) or the Python side lets
    /// go; then the error that ended it, if one did (or that it was left unclosed): the
    /// one-sided scope frees its windows together only after a clean end, as every
    /// other rank then does.
    fn drive<'m, S: Strategy<'m>>(
        &self,
        opened: Result<Session<'m, '_, S>, String>,
    ) -> Result<(), TrainError> {
        let mut sess = match opened {
            Ok(s) => {
                let asked = self.stop_asked.clone();
                s.with_hook(move |_: &StepInfo| asked.load(Ordering::SeqCst))
            }
            Err(e) => {
                self.reply(Reply::Failed(e.clone(), false));
                return Err(TrainError::Setup(e));
            }
        };
        self.write_params(&sess);
        self.reply(Reply::Ready {
            step: sess.global_step(),
            shard: sess.data_shard(),
            chief: sess.is_chief(),
        });
        let mut ended: Option<TrainError> = None;
        // A failure is answered, and kept as how the session ended.
        let mut fail = |e: TrainError| {
            let reply = failed(e.clone());
            ended.get_or_insert(e);
            reply
        };
        while let Ok(cmd) = self.inbox.recv() {
            let reply = match cmd {
                Cmd::Step {
                    grads,
                    loss,
                    samples,
                } => self
                    .step(&mut sess, &grads, loss, samples)
                    .unwrap_or_else(&mut fail),
                Cmd::Refuse(why) => fail(self.model.refuse(&mut sess, why)),
                Cmd::Save => match sess.save() {
                    Ok(path) => Reply::Saved(path),
                    Err(e) => fail(e),
                },
                Cmd::Close => {
                    let closed = sess.close();
                    let r = closed.as_ref().map(|_| ()).map_err(Clone::clone);
                    self.reply(match closed {
                        Ok(t) => Reply::Closed(Closed {
                            step: t.step,
                            first_step: t.first_step,
                            loss: t.loss,
                            samples_per_sec: t.samples_per_sec,
                            checkpoint: t.checkpoint,
                        }),
                        Err(e) => fail(e),
                    });
                    return r;
                }
            };
            self.reply(reply);
        }
        Err(ended
            .unwrap_or_else(|| TrainError::Usage("the session was left without close()".into())))
    }

    fn step<'m, S: Strategy<'m>>(
        &self,
        sess: &mut Session<'m, '_, S>,
        grads: &[Span],
        loss: f32,
        samples: usize,
    ) -> Result<Reply, TrainError> {
        // SAFETY: the spans are the data of float32 arrays the Python thread checked and
        // holds, waiting for this reply, for the whole step.
        let slices: Vec<&[f32]> = grads
            .iter()
            .map(|s| unsafe { std::slice::from_raw_parts(s.ptr as *const f32, s.len) })
            .collect();
        let info = self.model.run(sess, &slices, loss, samples)?;
        self.write_params(sess);
        Ok(Reply::Stepped {
            info,
            stop: sess.should_stop(),
        })
    }

    /// Copies the session's parameters into the Python session's arrays.
    fn write_params<'m, S: Strategy<'m>>(&self, sess: &Session<'m, '_, S>) {
        for (p, s) in sess.replica().params.iter().zip(&self.out) {
            let from = p
                .as_slice::<f32>()
                .expect("an external model's variables are f32");
            // SAFETY: the span is a C-contiguous float32 array of this variable's length,
            // owned by the Python session, which waits for this thread's reply while it
            // is written (the thread writes only while answering a command).
            let to = unsafe { std::slice::from_raw_parts_mut(s.ptr as *mut f32, s.len) };
            to.copy_from_slice(from);
        }
    }

    fn reply(&self, r: Reply) {
        // The Python side gone: nothing to tell.
        let _ = self.outbox.send(r);
    }
}

fn failed(e: TrainError) -> Reply {
    let stopped = matches!(
        e,
        TrainError::Stopped(_) | TrainError::Ps(PsError::Stopped(_))
    );
    Reply::Failed(e.to_string(), stopped)
}

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
}

/// The settings a session is made with (the Python layer's keywords).
#[derive(FromPyObject)]
pub struct Settings {
    mode: String,
    transport: String,
    sync: bool,
    replicas_to_aggregate: Option<usize>,
    optimizer: String,
    lr: f32,
    momentum: f32,
    steps: u64,
    seed: u64,
    log_every: u64,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_every: u64,
    checkpoint_secs: Option<f64>,
    keep_checkpoints: usize,
    stop_on_signal: bool,
    peer_timeout: f64,
    name: String,
}

impl Settings {
    fn mode(&self) -> PyResult<Mode> {
        if !matches!(self.transport.as_str(), "p2p" | "rma") {
            return Err(PyValueError::new_err(format!(
                "mpiflow: Session: transport {:?} is none of p2p, rma",
                self.transport
            )));
        }
        match self.mode.as_str() {
            "local" => Ok(Mode::Local),
            "allreduce" => Ok(Mode::Allreduce),
            "ps" if self.transport == "rma" => Ok(Mode::PsRma),
            "ps" => Ok(Mode::Ps),
            m => Err(PyValueError::new_err(format!(
                "mpiflow: Session: mode {m:?} is none of ps, allreduce, local"
            ))),
        }
    }

    fn config(&self) -> PyResult<PsConfig> {
        let kind = OptimizerKind::from_name(&self.optimizer).ok_or_else(|| {
            PyValueError::new_err(format!(
                "mpiflow: Session: optimizer {:?} is none of sgd, momentum, adagrad, adam",
                self.optimizer
            ))
        })?;
        let mut optimizer = Optimizer::new(kind, self.lr);
        optimizer.momentum = self.momentum;
        let secs = |s: f64, what: &str| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                PyValueError::new_err(format!("mpiflow: Session: {what} {s} is no duration"))
            })
        };
        let train = TrainConfig {
            steps: self.steps,
            optimizer,
            seed: self.seed,
            log_every: self.log_every,
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            checkpoint_every_secs: match self.checkpoint_secs {
                Some(s) => Some(secs(s, "checkpoint_secs")?),
                None => None,
            },
            keep_checkpoints: self.keep_checkpoints,
            stop_on_signal: self.stop_on_signal,
            ..TrainConfig::default()
        };
        Ok(PsConfig {
            train,
            sync: self.sync,
            replicas_to_aggregate: self.replicas_to_aggregate,
            strategy: Placement::Greedy,
            peer_timeout: secs(self.peer_timeout, "peer_timeout")?,
            ..PsConfig::default()
        })
    }
}

/// Variable `name`'s starting values: a float32 NumPy array (any layout, copied).
fn variable(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let a = value.cast::<PyArrayDyn<f32>>().map_err(|_| {
        let what = match value.cast::<PyUntypedArray>() {
            Ok(a) => format!("an array of dtype {}", a.dtype()),
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
            .map(|a| {
                let a = a.bind(py);
                Span {
                    ptr: a.data() as usize,
                    len: a.len(),
                }
            })
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

    /// Gradient `i`, checked against its variable: a float32, C-contiguous array of its
    /// shape.
    fn gradient(&self, py: Python<'_>, i: usize, g: &Bound<'_, PyAny>) -> PyResult<Span> {
        let name = self.names.get(i).map_or("?", String::as_str);
        let call = format!("{}: push_pull: the gradient of '{name}'", self.me);
        let a = g.cast::<PyUntypedArray>().map_err(|_| {
            let kind = g.get_type().name().map_or("?".into(), |n| n.to_string());
            PyTypeError::new_err(format!("mpiflow: {call} is a {kind}, not a NumPy array"))
        })?;
        if !a.dtype().is_equiv_to(&dtype::<f32>(py)) {
            return Err(PyTypeError::new_err(format!(
                "mpiflow: {call} is {}, the variable is float32",
                a.dtype()
            )));
        }
        let want = self.params[i].bind(py).shape().to_vec();
        if a.shape() != want.as_slice() {
            return Err(PyValueError::new_err(format!(
                "mpiflow: {call} has shape {:?}, the variable {want:?}",
                a.shape()
            )));
        }
        if !a.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "mpiflow: {call} is not C-contiguous (np.ascontiguousarray makes a copy that is)"
            )));
        }
        Ok(Span {
            // SAFETY: the array object is live (borrowed for this call); its data pointer
            // is read.
            ptr: unsafe { (*a.as_array_ptr()).fields.data } as usize,
            len: a.len(),
        })
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
