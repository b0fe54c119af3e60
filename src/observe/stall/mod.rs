//! Stall reports (`mpiflow train --stall-warning SECONDS`): when a rank has waited that
//! long in a collective, a ps step or any other transfer, the chief prints one line naming
//! the step, the operation and its tensors, who waits and who has not arrived; again every
//! interval until the stall clears, then once more to say it cleared.
//!
//! Three parts, one file each:
//! - here, the [`Board`]: what this rank does now. The training loops mark each wait on
//!   it ([`wait`], a guard), servers say when they are idle; the board costs one relaxed
//!   atomic load per mark until a watch starts.
//! - `watch`: a thread per rank on a communicator of its own. A rank whose wait passes
//!   the threshold alerts the chief; the chief then asks every rank what it does (the
//!   board) and reports. Nothing is sent while no one waits long. A rank whose chief does
//!   not answer says so itself.
//! - `report`: the chief's view of one stall and its line.
//!
//! The watch needs `MPI_THREAD_MULTIPLE` (its thread talks while training does).

pub(crate) mod report;
pub(crate) mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use report::Report;
pub use watch::{Notice, Watch, WatchConfig};

/// A wait as the code that waits describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Wait {
    /// The operation: `allreduce`, `pull`, `push`, `gather`...
    pub op: &'static str,
    /// The global step it belongs to.
    pub step: u64,
    /// Its tensors (`dense_0/kernel..dense_2/bias, 6 tensors`), shared: marking a wait
    /// allocates nothing.
    pub what: Option<Arc<str>>,
    /// Whom it waits on, when one peer (`ps:0`).
    pub peer: Option<Arc<str>>,
    /// Bytes it moves.
    pub bytes: u64,
}

/// What a rank does now, as it answers the chief.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "doing", rename_all = "snake_case")]
pub enum Doing {
    /// In a wait for `secs` seconds.
    Waiting {
        op: String,
        step: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        what: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peer: Option<String>,
        bytes: u64,
        secs: f64,
    },
    /// Working (computing, writing a checkpoint) for `secs` seconds since its last wait,
    /// which was of step `step`.
    Busy { step: Option<u64>, secs: f64 },
    /// A server with no step in progress, for `secs` seconds.
    Idle { secs: f64 },
}

impl Doing {
    /// The same state `by` later (a state seen then, told now).
    pub fn later(mut self, by: std::time::Duration) -> Doing {
        match &mut self {
            Doing::Waiting { secs, .. } | Doing::Busy { secs, .. } | Doing::Idle { secs } => {
                *secs += by.as_secs_f64()
            }
        }
        self
    }
}

#[derive(Debug)]
enum Now {
    Waiting(Wait),
    Busy,
    Idle,
}

#[derive(Debug)]
struct State {
    now: Now,
    since: Option<Instant>,
    /// The step of the last wait.
    step: Option<u64>,
}

/// What one rank does now: set by the training loop, read by the watch.
#[derive(Debug)]
pub struct Board {
    on: AtomicBool,
    state: Mutex<State>,
}

impl Default for Board {
    fn default() -> Self {
        Board::new()
    }
}

static GLOBAL: Board = Board::new();

impl Board {
    /// A board that records nothing until [`Board::enable`].
    pub const fn new() -> Board {
        Board {
            on: AtomicBool::new(false),
            state: Mutex::new(State {
                now: Now::Busy,
                since: None,
                step: None,
            }),
        }
    }

    /// This process's board: the one the training loops mark (a process is a rank).
    pub fn global() -> &'static Board {
        &GLOBAL
    }

    /// Starts recording (a watch does it).
    pub fn enable(&self) {
        self.set(Now::Busy);
        self.on.store(true, Ordering::Release);
    }

    /// Stops recording (the watch ended).
    pub fn disable(&self) {
        self.on.store(false, Ordering::Release);
    }

    /// Whether anything is recorded.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    fn set(&self, now: Now) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Now::Waiting(w) = &now {
            s.step = Some(w.step);
        }
        s.now = now;
        s.since = Some(Instant::now());
    }

    /// Marks a wait until the guard drops (then busy again); `wait` is made only when the
    /// board records.
    #[inline]
    pub fn wait(&self, wait: impl FnOnce() -> Wait) -> Waiting<'_> {
        if !self.enabled() {
            return Waiting { board: None };
        }
        self.set(Now::Waiting(wait()));
        Waiting { board: Some(self) }
    }

    /// A server with nothing in progress.
    #[inline]
    pub fn idle(&self) {
        if self.enabled() && !self.is(|n| matches!(n, Now::Idle)) {
            self.set(Now::Idle);
        }
    }

    /// A server waiting on a step in progress (kept while it stays the same wait: the
    /// time counts from when it began).
    #[inline]
    pub fn serving(&self, wait: impl FnOnce() -> Wait) {
        if !self.enabled() {
            return;
        }
        let w = wait();
        if !self.is(|n| matches!(n, Now::Waiting(v) if *v == w)) {
            self.set(Now::Waiting(w));
        }
    }

    fn is(&self, test: impl FnOnce(&Now) -> bool) -> bool {
        test(&self.state.lock().unwrap_or_else(|p| p.into_inner()).now)
    }

    /// What the rank does now.
    pub fn doing(&self) -> Doing {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let secs = s.since.map_or(0.0, |t| t.elapsed().as_secs_f64());
        match &s.now {
            Now::Waiting(w) => Doing::Waiting {
                op: w.op.to_string(),
                step: w.step,
                what: w.what.as_deref().map(str::to_string),
                peer: w.peer.as_deref().map(str::to_string),
                bytes: w.bytes,
                secs,
            },
            Now::Busy => Doing::Busy { step: s.step, secs },
            Now::Idle => Doing::Idle { secs },
        }
    }

    /// When the current wait began, if waiting (a wait's identity for the watch).
    pub(crate) fn waiting_since(&self) -> Option<Instant> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.now {
            Now::Waiting(_) => s.since,
            _ => None,
        }
    }
}

/// A wait marked on a board; dropping it marks the rank busy again.
#[must_use = "the wait ends when this drops"]
pub struct Waiting<'a> {
    board: Option<&'a Board>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.board {
            b.set(Now::Busy);
        }
    }
}

/// Marks a wait on this process's board (see [`Board::wait`]).
#[inline]
pub fn wait(wait: impl FnOnce() -> Wait) -> Waiting<'static> {
    GLOBAL.wait(wait)
}

/// "first..last, N tensors" for a list of tensor names (one name alone as itself).
pub fn tensors_label<'a>(names: impl IntoIterator<Item = &'a str>) -> Arc<str> {
    let names: Vec<&str> = names.into_iter().collect();
    match names.as_slice() {
        [] => "no tensors".into(),
        [one] => (*one).into(),
        [first, .., last] => format!("{first}..{last}, {} tensors", names.len()).into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_board_records_waits_only_once_enabled_and_a_guard_ends_its_wait() {
        let b = Board::new();
        let w = || Wait {
            op: "allreduce",
            step: 7,
            what: Some(tensors_label(["a", "b", "c"])),
            peer: None,
            bytes: 12,
        };
        drop(b.wait(w));
        assert!(matches!(b.doing(), Doing::Busy { step: None, .. }));
        b.enable();
        {
            let _g = b.wait(w);
            match b.doing() {
                Doing::Waiting { op, step, what, .. } => {
                    assert_eq!((op.as_str(), step), ("allreduce", 7));
                    assert_eq!(what.as_deref(), Some("a..c, 3 tensors"));
                }
                d => panic!("{d:?}"),
            }
            assert!(b.waiting_since().is_some());
        }
        assert!(matches!(b.doing(), Doing::Busy { step: Some(7), .. }));
        b.idle();
        assert!(matches!(b.doing(), Doing::Idle { .. }));
        // A server's wait keeps its start while it is the same wait.
        b.serving(w);
        let since = b.waiting_since();
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.serving(w);
        assert_eq!(b.waiting_since(), since);
    }
}
