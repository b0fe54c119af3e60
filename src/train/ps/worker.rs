//! A worker's side of the ps protocol: one request to every ps, every reply awaited,
//! each with a deadline. The monitored session ([`super::session`]) and the
//! push/pull benchmark drive it.

use std::borrow::Cow;
use std::cell::{RefCell, RefMut};
use std::path::Path;
use std::time::Duration;

use super::placement::Shard;
use super::protocol::{decode_view, encode, finite, reply_tag, request_tag, Reply, Request, Setup};
use super::roles::Roles;
use super::wire::{error_of, notify, receive_within_into, send_owned_within, Sent};
use super::PsError;
use crate::tensor::Tensor;
use crate::transport::comm::{Comm, TransportError};

/// A worker's connection to the ps tasks: the placement tells which slices of which
/// variable each ps holds.
pub struct Client<'a, C: Comm> {
    pub comm: &'a C,
    pub roles: &'a Roles,
    pub shards: Vec<Shard>,
    /// How long to wait for a ps.
    pub timeout: Duration,
    /// Where each ps's replies land, reused from one round to the next (a pull's
    /// parameters are read from there, in place).
    inbox: RefCell<Vec<Vec<u8>>>,
}

impl<'a, C: Comm> Client<'a, C> {
    /// A connection of rank `comm.rank()` to the ps tasks of `roles`, with `shards` placed.
    pub fn new(comm: &'a C, roles: &'a Roles, shards: Vec<Shard>, timeout: Duration) -> Self {
        Client {
            comm,
            roles,
            shards,
            timeout,
            inbox: RefCell::new(vec![Vec::new(); roles.ps.len()]),
        }
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

    /// The slices of per-variable tensors `src` that ps `k` holds, in its order (sent as
    /// they are, without gathering them first).
    fn gather<'t>(&self, k: usize, src: &'t [Tensor]) -> Vec<&'t [f32]> {
        self.mine(k)
            .map(|s| &src[s.var_index].as_slice::<f32>().expect("f32")[s.offset..s.offset + s.len])
            .collect()
    }

    /// Writes ps `k`'s values `flat` into the per-variable tensors `dst`.
    fn scatter(&self, k: usize, flat: &[f32], dst: &mut [Tensor]) {
        let mut off = 0;
        for s in self.mine(k) {
            dst[s.var_index].as_mut_slice::<f32>().expect("f32")[s.offset..s.offset + s.len]
                .copy_from_slice(&flat[off..off + s.len]);
            off += s.len;
        }
    }

    fn lost(&self, rank: usize) -> PsError {
        PsError::Lost {
            task: self.me(),
            lost: self.roles.task(rank),
            secs: (self.timeout * 2).as_secs(),
        }
    }

    /// Sends one request to every ps (header and payload per ps) and waits for every
    /// reply; a ps's error reply stops with its message. Returns the replies (messages,
    /// one per ps, valid replies).
    fn round<'p>(
        &self,
        request: impl Fn(usize) -> Request,
        payload: impl Fn(usize) -> Vec<&'p [f32]>,
    ) -> Result<RefMut<'_, Vec<Vec<u8>>>, PsError> {
        // Twice the ps's own deadline: a ps that lost another task says so first.
        let deadline = self.timeout * 2;
        let remote = |message| PsError::Remote {
            task: self.me(),
            message,
        };
        let mut inbox = self.inbox.borrow_mut();
        let mut early = vec![false; self.roles.ps.len()];
        for (k, r) in self.roles.ps.iter().enumerate() {
            let m = encode(&request(k), &payload(k));
            let tag = request_tag(self.comm);
            match send_owned_within(self.comm, m, *r, tag, deadline, Some(*r))? {
                Sent::Done(Some(reply)) => (inbox[k], early[k]) = (reply, true),
                Sent::Done(None) => {}
                Sent::TimedOut => return Err(self.lost(*r)),
                Sent::Interrupted(message) => return Err(remote(message)),
            }
        }
        for (k, r) in self.roles.ps.iter().enumerate() {
            if !early[k] {
                let tag = reply_tag(self.comm);
                match receive_within_into(self.comm, *r, tag, deadline, &mut inbox[k]) {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(TransportError::Timeout { .. }) => return Err(self.lost(*r)),
                    Err(e) => return Err(e.into()),
                }
            }
            // The ps already names itself and the lost task.
            if let Some(message) = error_of(&inbox[k]) {
                return Err(remote(message));
            }
        }
        Ok(inbox)
    }

    /// The header of a reply [`Client::round`] returned, and its payload read in place.
    fn reply(m: &[u8]) -> (Reply, Cow<'_, [f32]>) {
        decode_view::<Reply>(m).expect("checked by error_of")
    }

    /// The chief: hands every ps its setup and initial values `init` (per variable).
    pub fn init(&self, setup: &Setup, init: &[Tensor]) -> Result<(), PsError> {
        self.round(
            |_| Request::Init {
                setup: setup.clone(),
            },
            |k| self.gather(k, init),
        )
        .map(drop)
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
    /// variables exist), into `params`; returns that global step (the smallest over the
    /// ps tasks) and the loss of the update that made it (NaN if unknown).
    pub fn pull(&self, step: u64, params: &mut [Tensor]) -> Result<(u64, f32), PsError> {
        let replies = self.round(|_| Request::Pull { step }, |_| Vec::new())?;
        let (mut global, mut loss) = (u64::MAX, f32::NAN);
        for (k, (reply, flat)) in replies.iter().map(|m| Self::reply(m)).enumerate() {
            let Reply::Params { step, loss: l } = reply else {
                return Err(PsError::Remote {
                    task: self.roles.task(self.roles.ps[k]),
                    message: format!("answered a pull with {reply:?}"),
                });
            };
            global = global.min(step);
            if k == 0 {
                loss = l.unwrap_or(f32::NAN);
            }
            self.scatter(k, &flat, params);
        }
        Ok((global, loss))
    }

    /// Pushes gradients `grads` (per variable) of `samples` samples computed at `step`.
    pub fn push(
        &self,
        step: u64,
        samples: usize,
        loss: f32,
        grads: &[Tensor],
    ) -> Result<(), PsError> {
        self.round(
            |k| Request::Push {
                step,
                samples,
                loss: finite(loss),
                vars: self.vars_of(k),
            },
            |k| self.gather(k, grads),
        )
        .map(drop)
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
            .iter()
            .map(|m| match Self::reply(m).0 {
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
    pub fn abort(&self, message: &str) {
        let m = encode(
            &Request::Abort {
                message: message.to_string(),
            },
            &[],
        );
        notify(
            self.comm,
            &m,
            self.roles.ps.iter().copied(),
            request_tag(self.comm),
        );
    }

    /// Tells every ps this worker is done.
    pub fn done(&self) -> Result<(), PsError> {
        let m = encode(&Request::Done, &[]);
        for r in &self.roles.ps {
            crate::transport::comm::send(self.comm, &m, *r, request_tag(self.comm))?;
        }
        Ok(())
    }
}
