//! A session's own thread: it owns what the session borrows (the server, the model), and
//! serves the Python thread's commands (`Cmd`) one at a time with a `Reply` each.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use mpiflow::model::embedding::SparseGrad;
use mpiflow::train::hybrid::HybridConfig;
use mpiflow::train::tables::Tables;
use mpiflow::{
    AllreduceConfig, Dataset, External, Local, PsConfig, PsError, ServerError, Session, StepInfo,
    Strategy, TrainError,
};

use super::ps_stopped;
use crate::executor::Span;
use crate::Shared;

/// What the Python thread asks of its session thread.
pub(super) enum Cmd {
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
    /// Rows of an embedding table pulled or pushed (the ps over messages).
    Rows(Rows),
    /// The session's end: its final checkpoint, the ps tasks told.
    Close,
}

/// A request for an embedding table's rows.
pub(super) enum Rows {
    Pull {
        table: usize,
        ids: Vec<u64>,
    },
    Push {
        table: usize,
        grad: SparseGrad,
        scale: f32,
    },
    /// Rows of several tables asked for now, taken by [`Rows::Land`] of the same.
    Ahead {
        want: Vec<(usize, Vec<u64>)>,
    },
    Land {
        want: Vec<(usize, Vec<u64>)>,
    },
    /// A step begins: rows held for it (see [`Staged`]) are pushed now.
    Step,
}

/// Answers a [`Rows`] request in a session whose strategy has no tables.
fn no_rows<S>(_: &S, r: Rows) -> Result<Reply, TrainError> {
    match r {
        Rows::Step => Ok(Reply::Rows(Vec::new())),
        _ => Err(TrainError::Usage(
            "embedding tables need mode=\"ps\" or \"hybrid\"".into(),
        )),
    }
}

/// Rows pushed during a step, held until the step where the rows' home applies steps
/// (over windows: [`Tables::pushes_every_step`], every worker's push every step, which
/// the program's own calls of `push_rows` do not promise): at the step they go as its one
/// push (none held: an empty one), each table's rows once (an id pushed twice in a step
/// is summed), each call's gradient scaled by its own `scale`.
#[derive(Default)]
struct Staged(RefCell<Vec<Held>>);

/// One table's rows held for the step: the table, their gradient, each id's place in it.
type Held = (usize, SparseGrad, HashMap<u64, usize>);

impl Staged {
    fn add(&self, table: usize, grad: SparseGrad, scale: f32) {
        let mut held = self.0.borrow_mut();
        let i = match held.iter().position(|(t, _, _)| *t == table) {
            Some(i) => i,
            None => {
                held.push((table, SparseGrad::default(), HashMap::new()));
                held.len() - 1
            }
        };
        let (_, into, at) = &mut held[i];
        let dim = grad.values.len() / grad.ids.len().max(1);
        for (id, row) in grad.ids.iter().zip(grad.values.chunks_exact(dim.max(1))) {
            let scaled = row.iter().map(|v| v * scale);
            match at.get(id) {
                Some(&j) => (into.values[j * dim..(j + 1) * dim].iter_mut())
                    .zip(scaled)
                    .for_each(|(a, b)| *a += b),
                None => {
                    at.insert(*id, into.ids.len());
                    into.ids.push(*id);
                    into.values.extend(scaled);
                }
            }
        }
    }

    /// The step's push of the rows held (scaled already): none where nothing is held and
    /// the rows' home takes steps without (no tables).
    fn push<T: Tables>(&self, tables: &T) -> Result<(), TrainError> {
        let held = std::mem::take(&mut *self.0.borrow_mut());
        if held.is_empty() && !tables.pushes_every_step() {
            return Ok(());
        }
        let grads: Vec<(usize, &SparseGrad)> = held.iter().map(|(t, g, _)| (*t, g)).collect();
        tables.push_tables(&grads, 1.0)
    }
}

/// Answers a [`Rows`] request where pushes wait for the step ([`Staged`]).
fn step_rows<T: Tables>(staged: &Staged) -> impl Fn(&T, Rows) -> Result<Reply, TrainError> + '_ {
    move |tables, r| match r {
        Rows::Push { table, grad, scale } => {
            staged.add(table, grad, scale);
            Ok(Reply::Rows(Vec::new()))
        }
        Rows::Step => match staged.push(tables) {
            Ok(()) => Ok(Reply::Rows(Vec::new())),
            Err(e) => {
                // The others' step goes on without this worker's rows (an empty push),
                // and this worker's fails with why (the step's refusal).
                if tables.pushes_every_step() {
                    let _ = tables.push_tables(&[], 0.0);
                }
                Err(e)
            }
        },
        other => table_rows(tables, other),
    }
}

/// Answers a [`Rows`] request from the tables' home (the ps tasks).
fn table_rows<T: Tables>(tables: &T, r: Rows) -> Result<Reply, TrainError> {
    match r {
        Rows::Pull { table, ids } => {
            let mut out = Vec::new();
            tables.pull_rows(table, &ids, &mut out)?;
            Ok(Reply::Rows(out))
        }
        Rows::Push { table, grad, scale } => {
            tables.push_rows(table, &grad, scale)?;
            Ok(Reply::Rows(Vec::new()))
        }
        Rows::Ahead { want } => {
            let want: Vec<(usize, &[u64])> = want.iter().map(|(t, i)| (*t, &i[..])).collect();
            tables.pull_ahead(&want)?;
            Ok(Reply::Tables(Vec::new()))
        }
        Rows::Land { want } => {
            let want: Vec<(usize, &[u64])> = want.iter().map(|(t, i)| (*t, &i[..])).collect();
            let mut out = vec![Vec::new(); want.len()];
            tables.land_tables(&want, &mut out)?;
            Ok(Reply::Tables(out))
        }
        // Pushes went at once.
        Rows::Step => Ok(Reply::Rows(Vec::new())),
    }
}

/// What a session thread answers.
pub(super) enum Reply {
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
    /// The rows pulled (or none: a push done).
    Rows(Vec<f32>),
    /// Rows of several tables, each table's in the order asked.
    Tables(Vec<Vec<f32>>),
    Closed(Closed),
    /// A ps task served the one-sided session to its end.
    Served,
    /// The line of the error that ended the session; true if a stop signal ended it.
    Failed(String, bool),
}

/// A closed session's summary.
pub(super) struct Closed {
    pub(super) step: u64,
    pub(super) first_step: u64,
    pub(super) loss: f32,
    pub(super) samples_per_sec: f64,
    pub(super) checkpoint: Option<PathBuf>,
}

/// The channels to one session thread, and the thread.
pub(super) struct Link {
    pub(super) to: Mutex<Option<Sender<Cmd>>>,
    pub(super) from: Mutex<Receiver<Reply>>,
    pub(super) thread: Mutex<Option<JoinHandle<()>>>,
}

/// Every session thread not yet joined: `finalize` ends them before MPI is finalised.
pub(super) static OPEN: Mutex<Vec<Arc<Link>>> = Mutex::new(Vec::new());

impl Link {
    /// Sends `cmd` and waits for the reply (a gone thread: the session failed).
    pub(super) fn ask(&self, cmd: Cmd) -> Reply {
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
    pub(super) fn receive(&self) -> Reply {
        let from = self.from.lock().unwrap_or_else(|p| p.into_inner());
        from.recv()
            .unwrap_or_else(|_| Reply::Failed("the session has ended".into(), false))
    }

    /// Ends the thread: its channel closed (a session not closed is abandoned: the ps
    /// tasks are told), then joined.
    pub(super) fn end(&self) {
        self.to.lock().unwrap_or_else(|p| p.into_inner()).take();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// Ends every session thread (at finalize, before MPI is).
pub(crate) fn end_all() {
    let open = std::mem::take(&mut *OPEN.lock().unwrap_or_else(|p| p.into_inner()));
    for link in open {
        link.end();
    }
}

/// How the workers train together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Mode {
    Local,
    Allreduce,
    Ps,
    /// The ps over one-sided windows: every task opens the session (the windows are
    /// allocated by all together); a ps task serves in it until the workers end.
    PsRma,
    /// Embedding tables on the ps tasks, the variables by allreduce among the workers.
    Hybrid,
    /// Hybrid with the rows over one-sided windows: every task opens the session, as in
    /// [`Mode::PsRma`].
    HybridRma,
}

/// What a session thread is started with.
pub(super) struct Job {
    pub(super) server: Arc<Shared>,
    pub(super) model: External,
    pub(super) mode: Mode,
    pub(super) ps: PsConfig,
    /// The session's parameter arrays, written after the start and every step.
    pub(super) out: Vec<Span>,
    pub(super) stop_asked: Arc<AtomicBool>,
}

// SAFETY: the spans are the data of the Python session's own arrays, which outlive the
// thread's use of them (see `write_params`); the server is shared under
// MPI_THREAD_MULTIPLE (`Shared`).
unsafe impl Send for Job {}

/// The session thread: opens the session of `job.mode`, then serves commands until the
/// session is closed or the Python side lets go.
pub(super) fn serve(job: Job, inbox: Receiver<Cmd>, outbox: Sender<Reply>) {
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
            let _ = io.drive(sess.map_err(|e| e.to_string()), no_rows);
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
                no_rows,
            );
        }
        Mode::Ps => {
            let opened = server.session(&model, &ps).map_err(|e| e.to_string());
            let _ = io.drive(opened, table_rows);
        }
        Mode::Hybrid => {
            let opened = server.hybrid_session(&model, &hybrid(&ps));
            let _ = io.drive(opened.map_err(|e| e.to_string()), table_rows);
        }
        Mode::HybridRma => {
            let cfg = HybridConfig {
                asynchronous: !ps.sync,
                ..hybrid(&ps)
            };
            let is_worker = server.worker().is_some();
            let staged = Staged::default();
            let served = server
                .hybrid_one_sided(&model, &cfg, |sess| io.drive(Ok(sess), step_rows(&staged)));
            io.served(served, is_worker);
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
            let staged = Staged::default();
            let served = server.one_sided(&model, &ps, &none, |sess| {
                io.drive(Ok(sess), step_rows(&staged))
            });
            io.served(served, is_worker);
        }
    }
}

/// The hybrid settings of session settings `ps` (its tables, their optimizer, the
/// variables' training).
fn hybrid(ps: &PsConfig) -> HybridConfig {
    HybridConfig {
        allreduce: AllreduceConfig {
            train: ps.train.clone(),
            ..AllreduceConfig::default()
        },
        tables: ps.tables.clone(),
        sparse: ps.sparse,
        peer_timeout: ps.peer_timeout,
        window_rows: ps.window_rows,
        push_rows: ps.push_rows,
        ..HybridConfig::default()
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
        rows: impl Fn(&S, Rows) -> Result<Reply, TrainError>,
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
                } => match rows(sess.strategy(), Rows::Step) {
                    Ok(_) => {
                        (self.step(&mut sess, &grads, loss, samples)).unwrap_or_else(&mut fail)
                    }
                    // The step's rows not pushed: the step fails on every worker with why.
                    Err(e) => fail(self.model.refuse(&mut sess, e.to_string())),
                },
                Cmd::Refuse(why) => fail(self.model.refuse(&mut sess, why)),
                Cmd::Save => match sess.save() {
                    Ok(path) => Reply::Saved(path),
                    Err(e) => fail(e),
                },
                Cmd::Rows(r) => rows(sess.strategy(), r).unwrap_or_else(&mut fail),
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
        // SAFETY: the spans are the data of float32 arrays the Python thread checked
        // (aligned, C-contiguous) and holds, waiting for this reply, for the whole step;
        // they are only read.
        let slices: Vec<&[f32]> = grads.iter().map(|s| &*unsafe { s.floats() }).collect();
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
            unsafe { s.floats() }.copy_from_slice(from);
        }
    }

    /// A one-sided session's end on this task: a ps task (or any other that is no
    /// worker) says it served, or how serving failed; a worker's session told Python how
    /// it ended.
    fn served(&self, served: Result<Option<()>, ServerError>, is_worker: bool) {
        match (served, is_worker) {
            (Ok(None), _) => self.reply(Reply::Served),
            (_, true) => {}
            (Err(e), false) => self.reply(Reply::Failed(e.to_string(), ps_stopped(&e))),
            (Ok(Some(())), false) => {}
        }
    }

    fn reply(&self, r: Reply) {
        // The Python side gone: nothing to tell.
        let _ = self.outbox.send(r);
    }
}

pub(super) fn failed(e: TrainError) -> Reply {
    let stopped = matches!(
        e,
        TrainError::Stopped(_) | TrainError::Ps(PsError::Stopped(_))
    );
    Reply::Failed(e.to_string(), stopped)
}
