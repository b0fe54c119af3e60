//! A worker's side of the ps protocol: one request to every ps, every reply awaited,
//! each with a deadline. The monitored session ([`super::session`]) and the
//! push/pull benchmark drive it.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::placement::Shard;
use super::protocol::{encode, finite, request_tag, Reply, Request, Setup, Then};
use super::roles::Roles;
use super::wire::notify;
use super::PsError;
use crate::observe::phases::{RankTimes, Times};
use crate::observe::stall::{self, Wait};
use crate::tensor::Tensor;
use crate::train::guard::NonFinite;
use crate::transport::comm::Comm;
use crate::transport::messages;

mod ahead;
mod round;
pub(super) use ahead::{places, Ahead};
pub(super) use round::Misfit;

/// A worker's connection to the ps tasks: the placement tells which slices of which
/// variable each ps holds.
pub struct Client<'a, C: Comm> {
    pub comm: &'a C,
    pub roles: &'a Roles,
    pub shards: Vec<Shard>,
    /// How long to wait for a ps.
    pub timeout: Duration,
    /// What a stall report calls the variables and the ps tasks.
    what: Arc<str>,
    peer: Arc<str>,
    buffers: Box<Buffers>,
    /// Rows asked for ahead, not landed yet (see [`ahead`]).
    ahead: std::cell::Cell<Option<Box<Ahead>>>,
}

/// A client's message buffers, reused from one round to the next: its requests' header
/// messages (one per ps), the replies' inbox, and per ps the rows a pull brings and the
/// gradient rows a push sends (of the embedding tables).
#[derive(Default)]
struct Buffers {
    headers: std::cell::Cell<Vec<Vec<u8>>>,
    inbox: std::cell::Cell<Vec<u8>>,
    rows: std::cell::Cell<Vec<Vec<f32>>>,
    grads: std::cell::Cell<Vec<Vec<f32>>>,
}

impl<'a, C: Comm> Client<'a, C> {
    /// A connection of rank `comm.rank()` to the ps tasks of `roles`, with `shards` placed.
    pub fn new(comm: &'a C, roles: &'a Roles, shards: Vec<Shard>, timeout: Duration) -> Self {
        let mut vars: Vec<&str> = shards.iter().map(|s| s.var.as_str()).collect();
        vars.dedup();
        let what = stall::tensors_label(vars);
        let peer = match roles.ps.as_slice() {
            [one] => roles.task_name(*one).into(),
            all => format!("{} ps tasks", all.len()).into(),
        };
        Client {
            comm,
            roles,
            shards,
            timeout,
            what,
            peer,
            buffers: Box::default(),
            ahead: std::cell::Cell::new(None),
        }
    }

    /// The per-ps buffers of pulled rows (empty ones the first time, or after an error
    /// gave them up).
    pub(super) fn take_rows(&self) -> Vec<Vec<f32>> {
        self.buffers.rows.take()
    }

    /// Gives the per-ps buffers of pulled rows back for the next pull.
    pub(super) fn give_rows(&self, rows: Vec<Vec<f32>>) {
        self.buffers.rows.set(rows);
    }

    /// The per-ps buffers of pushed gradient rows.
    pub(super) fn take_grads(&self) -> Vec<Vec<f32>> {
        self.buffers.grads.take()
    }

    /// Gives the per-ps buffers of pushed gradient rows back for the next push.
    pub(super) fn give_grads(&self, grads: Vec<Vec<f32>>) {
        self.buffers.grads.set(grads);
    }

    /// Marks a wait of `op` of global step `step` with the ps tasks (for stall reports).
    pub fn waiting(&self, op: &'static str, step: u64, bytes: usize) -> stall::Waiting<'static> {
        stall::wait(|| Wait {
            op,
            step,
            what: Some(self.what.clone()),
            peer: Some(self.peer.clone()),
            bytes: bytes as u64,
        })
    }

    /// This worker, as errors name it.
    pub fn me(&self) -> String {
        self.roles.task(self.comm.rank())
    }

    fn mine(&self, k: usize) -> impl Iterator<Item = &Shard> {
        self.shards.iter().filter(move |s| s.ps == k)
    }

    /// ps `k`'s shards as a push lists them (`var@offset`, length).
    fn vars_of(&self, k: usize) -> Vec<(String, usize)> {
        self.mine(k)
            .map(|s| (format!("{}@{}", s.var, s.offset), s.len))
            .collect()
    }

    /// The slices of per-variable tensors `src` that ps `k` holds, in its order (sent from
    /// where they are).
    fn gather<'t>(&self, k: usize, src: &'t [Tensor]) -> Vec<&'t [f32]> {
        self.mine(k)
            .map(|s| &src[s.var_index].as_slice::<f32>().expect("f32")[s.offset..s.offset + s.len])
            .collect()
    }

    /// Every shard's place in the per-variable tensors `dst`, writable, as one list per ps
    /// in its order (what its `Params` payload is received into, in place).
    fn places<'t>(&self, dst: &'t mut [Tensor]) -> Vec<Vec<&'t mut [f32]>> {
        let mut by_var: Vec<&Shard> = self.shards.iter().collect();
        by_var.sort_by_key(|s| (s.var_index, s.offset));
        let mut places: Vec<Vec<(usize, &mut [f32])>> =
            (0..self.roles.ps.len()).map(|_| Vec::new()).collect();
        let mut rest: Vec<Option<&mut [f32]>> = dst
            .iter_mut()
            .map(|t| Some(t.as_mut_slice::<f32>().expect("f32")))
            .collect();
        let mut taken = vec![0usize; rest.len()];
        for s in by_var {
            let tail = rest[s.var_index].take().expect("a variable of the model");
            let (_, from) = tail.split_at_mut(s.offset - taken[s.var_index]);
            let (place, after) = from.split_at_mut(s.len);
            (rest[s.var_index], taken[s.var_index]) = (Some(after), s.offset + s.len);
            let order = self.mine(s.ps).position(|m| m == s).expect("placed");
            places[s.ps].push((order, place));
        }
        places
            .into_iter()
            .map(|mut p| {
                p.sort_by_key(|(order, _)| *order);
                p.into_iter().map(|(_, place)| place).collect()
            })
            .collect()
    }

    /// The chief: hands every ps its setup and initial values `init` (per variable). On an
    /// error `init` is given up (MPI may still read it) and left empty.
    pub fn init(&self, setup: &Setup, init: &mut Vec<Tensor>) -> Result<(), PsError> {
        let r = self.round(
            |_| Request::Init {
                setup: setup.clone(),
            },
            |k| self.gather(k, init),
        );
        r.map(drop).inspect_err(|_| give_up(init))
    }

    /// The chief: hands every ps its setup and has it load its shard of checkpoint `path`.
    pub fn restore(&self, setup: &Setup, path: &Path) -> Result<(), PsError> {
        self.round(
            |_| Request::Restore {
                setup: setup.clone(),
                path: path.to_path_buf(),
            },
            |_| Vec::new(),
        )
        .map(drop)
    }

    /// The parameters once the global step is at least `step` (0: as soon as the
    /// variables exist), received into `params` in place; returns that global step (the
    /// smallest over the ps tasks), the loss of the update that made it and whether the
    /// job stops there. On an error `params` is given up (MPI may still write it) and
    /// left empty.
    /// `report`: the ps tasks add the phase times they gathered (the chief's pulls).
    pub fn pull(
        &self,
        step: u64,
        report: bool,
        params: &mut Vec<Tensor>,
    ) -> Result<Pulled, PsError> {
        let pulled = self.pull_into(step, report, params);
        pulled.inspect_err(|_| give_up(params))
    }

    fn pull_into(&self, step: u64, report: bool, params: &mut [Tensor]) -> Result<Pulled, PsError> {
        let request = |_| Request::Pull(Then { step, report });
        self.exchange(request, |_| Vec::new(), params)
            .map(|(p, _)| p)
    }

    /// A push of gradients `grads` (per variable) and the pull that follows it (the
    /// parameters once the global step is at least `then.step`, into `params` in place):
    /// as [`Client::push`], then [`Client::pull`], but in one request to each ps. Returns
    /// what the pull brought and when the push's sends completed. On an error `grads` and
    /// `params` are given up (MPI may still read or write them) and left empty.
    pub fn push_pull(
        &self,
        push: Gradients,
        grads: &mut Vec<Tensor>,
        then: Then,
        params: &mut Vec<Tensor>,
    ) -> Result<(Pulled, Instant), PsError> {
        let request = |k: usize| self.push_request(&push, k, Some(then));
        let r = self.exchange(request, |k| self.gather(k, grads), params);
        r.inspect_err(|_| {
            give_up(grads);
            give_up(params);
        })
    }

    /// A pull that brought parameters of other lengths than this worker's model holds:
    /// the chief set the ps tasks up for another model.
    fn other_model(&self, what: String) -> PsError {
        PsError::Setup(format!(
            "{}: its model is another than the chief's: {what}",
            self.me()
        ))
    }

    /// ps `k`'s push request of `push` (the phase times go to ps 0 only), with the pull
    /// `then` that follows it in the same request, if any.
    fn push_request(&self, push: &Gradients, k: usize, then: Option<Then>) -> Request {
        Request::Push {
            step: push.step,
            samples: push.samples,
            loss: finite(push.loss),
            vars: self.vars_of(k),
            stop: push.note.stop,
            times: push.note.times.filter(|_| k == 0),
            non_finite: push.note.non_finite.clone(),
            pull: then,
        }
    }

    /// One round whose replies are `Params`, each ps's received into its places in
    /// `params`; returns what the pull brought and when the request's sends completed.
    fn exchange<'p>(
        &self,
        request: impl Fn(usize) -> Request,
        payload: impl Fn(usize) -> Vec<&'p [f32]>,
        params: &mut [Tensor],
    ) -> Result<(Pulled, Instant), PsError> {
        let mut places = self.places(params);
        // Each ps's payload, its shards, comes with its reply or follows it in pieces: into
        // place.
        let take = |k: usize, reply: &Reply, inline_bytes: &[u8]| -> Result<(), PsError> {
            let task = || self.roles.task(self.roles.ps[k]);
            if !matches!(reply, Reply::Params { .. }) {
                return Err(PsError::Remote {
                    task: task(),
                    message: format!("answered a pull with {reply:?}"),
                });
            }
            let want: usize = places[k].iter().map(|p| p.len()).sum();
            match self.take_floats(k, &mut places[k], inline_bytes)? {
                None => Ok(()),
                Some(Misfit::Inline { sent }) => Err(self.other_model(format!(
                    "{} holds {sent} values of the variables it serves here, this model {want}",
                    task(),
                ))),
                Some(Misfit::Piece { want }) => Err(self.other_model(format!(
                    "{} sent a piece of the parameters it serves here of another length than this model's {want} bytes",
                    task()
                ))),
            }
        };
        let (replies, sent) = self.round_then(request, payload, take)?;
        let mut pulled = Pulled {
            step: u64::MAX,
            loss: f32::NAN,
            stop: None,
            held: Duration::ZERO,
            reports: Vec::new(),
        };
        for (k, reply) in replies.into_iter().enumerate() {
            if let Reply::Params {
                step,
                loss,
                stop,
                held_us,
                reports,
            } = reply
            {
                pulled.step = pulled.step.min(step);
                pulled.stop = pulled.stop.or(stop);
                pulled.held += Duration::from_micros(held_us);
                pulled.reports.extend(reports);
                if k == 0 {
                    pulled.loss = loss.unwrap_or(f32::NAN);
                }
            }
        }
        Ok((pulled, sent))
    }

    /// Pushes gradients `grads` (per variable) of `samples` samples computed at `step`,
    /// sent from where they are; `note`: a stop signal this worker noted, for the ps
    /// tasks to announce, and its phase times. On an error `grads` is given up (MPI may still read it) and
    /// left empty.
    pub fn push(
        &self,
        step: u64,
        samples: usize,
        loss: f32,
        grads: &mut Vec<Tensor>,
        note: PushNote,
    ) -> Result<(), PsError> {
        let push = Gradients {
            step,
            samples,
            loss,
            note,
        };
        let r = self.round(
            |k| self.push_request(&push, k, None),
            |k| self.gather(k, grads),
        );
        r.map(drop).inspect_err(|_| give_up(grads))
    }

    /// The chief: every ps writes its shard into staging directory `dir`; returns each
    /// file's name, bytes and checksum for the manifest.
    pub fn save(&self, dir: &Path) -> Result<Vec<(String, u64, u64)>, PsError> {
        let replies = self.round(
            |_| Request::Save {
                dir: dir.to_path_buf(),
            },
            |_| Vec::new(),
        )?;
        replies
            .into_iter()
            .map(|m| match m {
                Reply::Saved {
                    file,
                    bytes,
                    checksum,
                } => Ok((file, bytes, checksum)),
                other => Err(PsError::Remote {
                    task: self.me(),
                    message: format!("a ps answered save with {other:?}"),
                }),
            })
            .collect()
    }

    /// Tells every ps this worker stops with `message`; they tell the other workers.
    /// Rows asked for ahead are taken first (see [`Client::done`]).
    pub fn abort(&self, message: &str) {
        let _ = self.settle_ahead();
        abort(self.comm, self.roles, message);
    }

    /// [`abort_agreed`] from this worker, its rows asked for ahead taken first.
    pub fn abort_agreed(&self, message: &str) {
        let _ = self.settle_ahead();
        abort_agreed(self.comm, self.roles, message);
    }

    /// Tells every ps this worker is done (`stop`: stopped by that signal).
    pub fn done(&self, stop: Option<i32>) -> Result<(), PsError> {
        // Rows asked ahead are taken first: a ps ends once its replies are taken (where
        // they failed, so does the send below).
        let _ = self.settle_ahead();
        let m = encode(&Request::Done { stop });
        for r in &self.roles.ps {
            messages::send(self.comm, &m, *r, request_tag(self.comm))?;
        }
        Ok(())
    }
}

/// Tells every ps of `roles` that this worker stops with `message` (they tell the other
/// workers): also before a [`Client`] exists (a setup error).
pub fn abort<C: Comm>(comm: &C, roles: &Roles, message: &str) {
    abort_as(comm, roles, message, false);
}

/// Tells every ps of `roles` that this worker stops with `message`, which every worker
/// of the job agreed on and stops with too (see [`Request::Abort`]): the ps tasks end
/// with it once all have said so, without a line of their own.
pub fn abort_agreed<C: Comm>(comm: &C, roles: &Roles, message: &str) {
    abort_as(comm, roles, message, true);
}

fn abort_as<C: Comm>(comm: &C, roles: &Roles, message: &str, agreed: bool) {
    let m = encode(&Request::Abort {
        message: message.to_string(),
        agreed,
    });
    notify(comm, &m, roles.ps.iter().copied(), request_tag(comm));
}

/// What a pull brought besides the parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Pulled {
    /// The global step of the parameters (the smallest over the ps tasks).
    pub step: u64,
    /// The loss of the update that made them (ps 0's; NaN if unknown).
    pub loss: f32,
    /// The job stops at this step, asked by this signal (any ps's word).
    pub stop: Option<i32>,
    /// How long the pull waited at the ps tasks for its step (summed over them).
    pub held: Duration,
    /// Phase times the ps tasks gathered, if asked for.
    pub reports: Vec<RankTimes>,
}

/// A push's header: the step its gradients were computed at, their samples and loss
/// (this worker's batch), and its note.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    pub step: u64,
    pub samples: usize,
    pub loss: f32,
    pub note: PushNote,
}

/// What a push tells the ps tasks besides the gradients.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PushNote {
    /// A stop signal this worker noted (the ps tasks announce the stop).
    pub stop: Option<i32>,
    /// This worker's phase times since it last reported (ps 0 passes them to the chief).
    pub times: Option<Times>,
    /// Synchronous training: what this worker found not finite in its step (the ps tasks
    /// then apply none of it, and every worker ends with their count).
    pub non_finite: Option<NonFinite>,
}

/// Tensors MPI may still read or write (a transfer that did not complete): their memory
/// stays allocated for the rest of the process, and the caller's list is left empty.
fn give_up(tensors: &mut Vec<Tensor>) {
    std::mem::forget(std::mem::take(tensors));
}
