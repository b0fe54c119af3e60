//! Where a rank's time goes: compute, communication, waiting for other ranks, and the
//! rest, summed over a window of steps (the log interval).
//!
//! A training loop charges each phase as it ends ([`Clock::charge`], [`Clock::since`]);
//! [`Clock::take`] closes the window, with whatever was not charged as `other` (data,
//! checkpoints, logging). Collective operations cannot tell communication from waiting on
//! one rank: every rank leaves an allreduce together, so [`split_collective`] calls the
//! least time any rank spent in it communication and each rank's excess waiting.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::timeline::{self, Detail};

/// A phase of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Gradients, the update, any arithmetic.
    Compute,
    /// Moving bytes: collectives, pushes, pulls.
    Comm,
    /// Blocked on other ranks (a straggler, a synchronous step not yet complete).
    Wait,
}

/// Seconds in each phase over a window of steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Times {
    pub compute: f64,
    pub comm: f64,
    pub wait: f64,
    /// The window's time not charged to a phase.
    pub other: f64,
    /// Steps in the window (this rank's own: a ps task counts the updates it applied).
    pub steps: u64,
}

impl Times {
    /// The size of [`Times::to_bytes`].
    pub const BYTES: usize = 40;

    /// The window's length.
    pub fn total(&self) -> f64 {
        self.compute + self.comm + self.wait + self.other
    }

    /// Fixed-size little-endian bytes, for a collective that gathers every rank's.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        let fields = [self.compute, self.comm, self.wait, self.other];
        for (chunk, v) in b.chunks_exact_mut(8).zip(fields) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        b[32..].copy_from_slice(&self.steps.to_le_bytes());
        b
    }

    /// The inverse of [`Times::to_bytes`]; `None` if `b` is not [`Times::BYTES`] long.
    pub fn from_bytes(b: &[u8]) -> Option<Times> {
        if b.len() != Self::BYTES {
            return None;
        }
        let f = |i: usize| f64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        Some(Times {
            compute: f(0),
            comm: f(1),
            wait: f(2),
            other: f(3),
            steps: u64::from_le_bytes(b[32..].try_into().expect("8 bytes")),
        })
    }

    /// Adds another window of the same rank (reports that arrive more often than logs).
    pub fn add(&mut self, o: &Times) {
        self.compute += o.compute;
        self.comm += o.comm;
        self.wait += o.wait;
        self.other += o.other;
        self.steps += o.steps;
    }
}

/// One rank's window, named as the metrics show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankTimes {
    pub rank: usize,
    /// Its task (`worker:1`, `ps:0`).
    pub task: String,
    #[serde(flatten)]
    pub times: Times,
}

/// Charges time to phases over a window.
#[derive(Debug, Clone)]
pub struct Clock {
    start: Instant,
    window: Times,
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

impl Clock {
    /// A window starting now.
    pub fn new() -> Clock {
        Clock {
            start: Instant::now(),
            window: Times::default(),
        }
    }

    /// Charges `d` to `phase`.
    #[inline]
    pub fn charge(&mut self, phase: Phase, d: Duration) {
        let s = d.as_secs_f64();
        match phase {
            Phase::Compute => self.window.compute += s,
            Phase::Comm => self.window.comm += s,
            Phase::Wait => self.window.wait += s,
        }
    }

    /// Charges the time since `t` to `phase`, and returns now (the next phase's start);
    /// the timeline, if on, records it as a span named after the phase.
    #[inline]
    pub fn since(&mut self, phase: Phase, t: Instant) -> Instant {
        self.since_as(phase, t, timeline::category(phase), Detail::default())
    }

    /// [`Clock::since`], the span named `name` with `detail`.
    #[inline]
    pub fn since_as(
        &mut self,
        phase: Phase,
        t: Instant,
        name: &'static str,
        detail: Detail,
    ) -> Instant {
        let now = Instant::now();
        self.charge(phase, now - t);
        timeline::span(name, timeline::category(phase), t, now, detail);
        now
    }

    /// The seconds charged to `phase` so far in the window.
    #[inline]
    pub fn charged(&self, phase: Phase) -> f64 {
        match phase {
            Phase::Compute => self.window.compute,
            Phase::Comm => self.window.comm,
            Phase::Wait => self.window.wait,
        }
    }

    /// Counts `n` steps in the window.
    #[inline]
    pub fn steps(&mut self, n: u64) {
        self.window.steps += n;
    }

    /// The window so far (the uncharged rest as `other`), without closing it.
    pub fn peek(&self) -> Times {
        let mut t = self.window;
        let charged = t.compute + t.comm + t.wait;
        t.other = (self.start.elapsed().as_secs_f64() - charged).max(0.0);
        t
    }

    /// Closes the window: its times, and a new window starts now.
    pub fn take(&mut self) -> Times {
        let t = self.peek();
        *self = Clock::new();
        t
    }
}

/// Splits the ranks' times in one collective operation (`comm` of each) into
/// communication, the least any rank spent, and waiting, each rank's excess: every rank
/// leaves together, so a rank that arrived early spent the difference waiting for the
/// last. Moves the excess from `comm` to `wait` in place.
pub fn split_collective(ranks: &mut [Times]) {
    let least = ranks.iter().map(|t| t.comm).fold(f64::INFINITY, f64::min);
    if !least.is_finite() {
        return;
    }
    for t in ranks {
        t.wait += t.comm - least;
        t.comm = least;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_through_bytes_and_reject_other_lengths() {
        let t = Times {
            compute: 1.5,
            comm: 0.25,
            wait: 1e-9,
            other: 3.0,
            steps: 250,
        };
        assert_eq!(Times::from_bytes(&t.to_bytes()), Some(t));
        assert_eq!(Times::from_bytes(&[0u8; 39]), None);
    }

    #[test]
    fn a_window_charges_phases_and_leaves_the_rest_as_other() {
        let mut c = Clock::new();
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let t1 = c.since(Phase::Compute, t0);
        c.charge(Phase::Comm, Duration::from_millis(5));
        std::thread::sleep(Duration::from_millis(10));
        c.steps(3);
        let _ = t1;
        let w = c.take();
        assert!(w.compute >= 0.020, "{w:?}");
        assert_eq!(w.comm, 0.005);
        // The 10 ms slept after the compute lap were not charged (the 5 ms of comm were
        // charged by hand, not slept).
        assert!(w.other >= 0.004, "{w:?}");
        assert!((w.total() - (w.compute + 0.005 + w.other)).abs() < 1e-12);
        assert_eq!(w.steps, 3);
        assert_eq!(c.peek().steps, 0, "a new window");
    }

    #[test]
    fn a_collective_is_the_least_time_and_the_rest_is_waiting() {
        let mut ranks = [0.5, 0.2, 0.3].map(|comm| Times {
            comm,
            ..Times::default()
        });
        split_collective(&mut ranks);
        assert_eq!(ranks.map(|t| t.comm), [0.2; 3]);
        let waits = ranks.map(|t| t.wait);
        assert!((waits[0] - 0.3).abs() < 1e-12 && waits[1] == 0.0);
        assert!((waits[2] - 0.1).abs() < 1e-12);
        split_collective(&mut []);
    }
}
