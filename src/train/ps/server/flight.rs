//! A ps's replies of rows left in flight: every send of a reply is started at once, and
//! those that do not complete there and then (pieces larger than MPI sends eagerly, which
//! complete only once the worker receives them) are tended from the serving loop while the
//! ps serves everyone else.
//!
//! A worker may ask for rows and compute before it takes them (a pull ahead, see
//! `Client::pull_ahead`): a ps that waited on that worker's receive would hold up every
//! other worker's requests for as long. MPI keeps the replies to one worker in order, so
//! the next reply may start while one is in flight. A reply's message stays in its
//! [`Flight`] until every send of it completed; one not taken within the timeout loses
//! its worker.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::super::protocol::{f32_bytes, payload_tag};
use crate::transport::comm::{Comm, TransportError};
use crate::transport::messages;

/// Replies in flight, and the messages of those that completed, for the next replies.
pub(super) struct Flights<R> {
    list: Vec<Flight<R>>,
    spare: Vec<Vec<f32>>,
}

/// A reply to worker rank `to` whose sends (`reqs`) read `message` still.
struct Flight<R> {
    to: usize,
    message: Vec<f32>,
    reqs: Vec<R>,
    since: Instant,
}

/// Messages kept for the next replies once theirs completed.
const SPARE: usize = 4;

impl<R> Default for Flights<R> {
    fn default() -> Self {
        Flights {
            list: Vec::new(),
            spare: Vec::new(),
        }
    }
}

impl<R> Flights<R> {
    /// An empty message for a reply (one of a completed reply's, its allocation reused).
    pub(super) fn message(&mut self) -> Vec<f32> {
        let mut m = self.spare.pop().unwrap_or_default();
        m.clear();
        m
    }

    /// Takes back a message no send was started from.
    pub(super) fn unused(&mut self, message: Vec<f32>) {
        self.keep(message);
    }

    fn keep(&mut self, message: Vec<f32>) {
        if self.spare.len() < SPARE {
            self.spare.push(message);
        }
    }

    /// True while any reply is in flight.
    pub(super) fn busy(&self) -> bool {
        !self.list.is_empty()
    }

    /// Starts sending `message` to worker rank `to`, as the messages `parts` (each a range
    /// of its floats and a tag: a reply's header through the link's ring where it can,
    /// pieces by MPI); what does not complete at once stays in flight with the message.
    /// After an error the message is given up (sends of it may be in flight).
    pub(super) fn start<C: Comm<Request = R>>(
        &mut self,
        c: &C,
        to: usize,
        message: Vec<f32>,
        parts: &[(Range<usize>, i32)],
    ) -> Result<(), TransportError> {
        let pieces = payload_tag(c);
        let mut reqs = Vec::new();
        for (range, tag) in parts {
            let bytes = f32_bytes(&message[range.clone()]);
            let started = match *tag != pieces {
                true => messages::put(c, bytes, to, *tag),
                false => Ok(false),
            };
            let sent = started.and_then(|put| match put {
                true => Ok(None),
                // SAFETY: `message` is kept (in `self.list`, or given up after an error)
                // until every send of it completed; moving the vector moves not its floats.
                false => unsafe { c.isend(bytes.as_ptr(), bytes.len(), to, *tag) }.map(Some),
            });
            match sent {
                Ok(r) => reqs.extend(r),
                Err(e) => {
                    std::mem::forget((message, reqs));
                    return Err(e);
                }
            }
        }
        let mut flight = Flight {
            to,
            message,
            reqs,
            since: Instant::now(),
        };
        match flight.complete(c) {
            Ok(true) => self.keep(flight.message),
            Ok(false) => self.list.push(flight),
            Err(e) => {
                std::mem::forget(flight);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Tests every reply in flight: the messages of those that completed are kept for the
    /// next; the worker of one older than `timeout` is the error (`Ok(Some(rank))`).
    pub(super) fn tend<C: Comm<Request = R>>(
        &mut self,
        c: &C,
        timeout: Duration,
    ) -> Result<Option<usize>, TransportError> {
        let mut i = 0;
        while i < self.list.len() {
            match self.list[i].complete(c) {
                Ok(true) => {
                    let done = self.list.swap_remove(i);
                    self.keep(done.message);
                }
                Ok(false) if self.list[i].since.elapsed() > timeout => {
                    return Ok(Some(self.list[i].to))
                }
                Ok(false) => i += 1,
                // The flight stays in the list: given up with it when the server goes.
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Waits at most `timeout` for every reply in flight (at the end of serving); the
    /// worker of one that did not complete, if any.
    pub(super) fn drain<C: Comm<Request = R>>(
        &mut self,
        c: &C,
        timeout: Duration,
    ) -> Result<Option<usize>, TransportError> {
        let mut backoff = crate::transport::comm::Backoff::polling_mpi(Duration::from_micros(50));
        while self.busy() {
            if let Some(to) = self.tend(c, timeout)? {
                return Ok(Some(to));
            }
            backoff.idle();
        }
        Ok(None)
    }
}

impl<R> Flight<R> {
    /// Tests this reply's pending sends, forgetting those that completed: true once none
    /// is pending. After an error some may be in flight still.
    fn complete<C: Comm<Request = R>>(&mut self, c: &C) -> Result<bool, TransportError> {
        let mut i = 0;
        while i < self.reqs.len() {
            match c.test(&mut self.reqs[i])? {
                Some(_) => drop(self.reqs.swap_remove(i)),
                None => i += 1,
            }
        }
        Ok(self.reqs.is_empty())
    }
}

impl<R> Drop for Flights<R> {
    /// Replies still in flight when their server goes (an error ends it): MPI may read
    /// their messages for as long as the process lives.
    fn drop(&mut self) {
        for flight in self.list.drain(..) {
            std::mem::forget(flight);
        }
    }
}
