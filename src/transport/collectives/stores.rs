//! How a rank copies data into shared memory that another core reads next: through its
//! cache, or with streaming (non-temporal) stores, chosen by measuring both.
//!
//! A slot of the shared-memory allreduce is written by its owner and then read by every
//! peer, so when the owner writes it again each cache line is still held by a peer's
//! cache and every store first has to take it back (a read-for-ownership). Where the
//! two cores share a cache that costs little; where they do not (two sockets, or a VM
//! whose vCPUs the host moves between core complexes) it dominates, and a cache line's
//! round trip may change several-fold within seconds. Streaming stores skip the
//! read-for-ownership and send whole lines to memory, at the price of peers reading them
//! from memory instead of from a cache, which can make a whole allreduce slower although
//! the copies cost the same (`benches/results/2026-11-23.md` and `2026-11-23b.md`).
//! Neither is best everywhere, and the topology does not tell (a VM shows one socket), so
//! the cost that counts is a whole step of the allreduce (copy in, wait, reduce, copy
//! out) per byte, which includes the peers'
//! reads: each rank uses the mode whose recent step cost is lower, and all ranks try the
//! other on the same step, one in [`EXPLORE_EVERY`] (steps are numbered alike on every
//! rank), so that step measures the other mode as every rank storing that way, and a
//! change of phase is noticed within a few calls.
//!
//! Correctness does not depend on the choice: peers read the same bytes either way.
//! Streaming stores are weakly ordered: call [`fence`] after them and before the
//! `Release` store that publishes the data, which then orders them like plain stores.

use std::cell::Cell;
use std::time::Duration;

/// How to store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreMode {
    /// Plain stores, through the cache.
    Cached,
    /// Non-temporal stores (x86-64 `MOVNTDQ`); elsewhere the same as `Cached`.
    Streaming,
}

/// Copies with streaming stores only where the CPU has them (SSE2: every x86-64).
pub const STREAMING_AVAILABLE: bool = cfg!(target_arch = "x86_64");

/// One step in this many uses the mode that currently looks slower, to keep its cost
/// current: a step in the slower mode may take twice as long, so exploring costs about
/// 1.5% of the allreduce's time at worst.
pub const EXPLORE_EVERY: u64 = 64;

/// Steps smaller than this are not timed: the clock's cost would dominate.
const MIN_TIMED: usize = 4096;

/// Copies `src` into `dst` (same length) with `mode`'s stores; streaming stores need a
/// [`fence`] before the copy is published.
pub fn copy(mode: StoreMode, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy lengths");
    if mode == StoreMode::Cached || !STREAMING_AVAILABLE {
        dst.copy_from_slice(src);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    stream_copy(dst, src);
}

#[cfg(target_arch = "x86_64")]
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // Streaming stores need 16-byte aligned destinations: plain copies for the ends.
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    let body = (dst.len() - head) / 16 * 16;
    dst[..head].copy_from_slice(&src[..head]);
    for k in (head..head + body).step_by(16) {
        // SAFETY: k + 16 <= head + body <= len for both slices; the destination is
        // 16-byte aligned from `head` on; SSE2 is part of x86-64.
        unsafe {
            let v = _mm_loadu_si128(src.as_ptr().add(k).cast::<__m128i>());
            _mm_stream_si128(dst.as_mut_ptr().add(k).cast::<__m128i>(), v);
        }
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

/// After streaming stores, before publishing what they wrote: `SFENCE`, which orders
/// them before every later store. Nothing to do after cached stores.
pub fn fence(mode: StoreMode) {
    #[cfg(target_arch = "x86_64")]
    if mode == StoreMode::Streaming {
        // SAFETY: SFENCE has no operands and only orders stores; SSE is part of x86-64.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = mode;
}

/// Picks a store mode per step from measured costs (one per rank and shared segment).
#[derive(Debug)]
pub struct StoreChooser {
    /// Recent nanoseconds per byte of a step in each mode (`Cached`, `Streaming`); 0: not
    /// measured.
    cost: [Cell<f64>; 2],
    /// Always this mode instead (tests; or a user who measured).
    forced: Cell<Option<StoreMode>>,
}

impl Default for StoreChooser {
    fn default() -> Self {
        StoreChooser {
            cost: [Cell::new(0.0), Cell::new(0.0)],
            forced: Cell::new(None),
        }
    }
}

fn index(mode: StoreMode) -> usize {
    match mode {
        StoreMode::Cached => 0,
        StoreMode::Streaming => 1,
    }
}

impl StoreChooser {
    /// From now on always `mode`; `None`: choose by measurement again.
    pub fn force(&self, mode: Option<StoreMode>) {
        self.forced.set(mode);
    }

    /// The mode for step `step` (numbered alike on every rank) of `bytes`. Ranks that
    /// recorded the same steps measure each mode first on the same steps and explore on
    /// the same steps; between explorations each keeps what it measured to be cheaper.
    pub fn pick(&self, step: u64, bytes: usize) -> StoreMode {
        if let Some(m) = self.forced.get() {
            return m;
        }
        if !STREAMING_AVAILABLE || bytes < MIN_TIMED {
            return StoreMode::Cached;
        }
        let [cached, streaming] = [self.cost[0].get(), self.cost[1].get()];
        // Measure each mode once before comparing.
        if cached == 0.0 {
            return StoreMode::Cached;
        }
        if streaming == 0.0 {
            return StoreMode::Streaming;
        }
        let (best, other) = if streaming < cached {
            (StoreMode::Streaming, StoreMode::Cached)
        } else {
            (StoreMode::Cached, StoreMode::Streaming)
        };
        if step % EXPLORE_EVERY == EXPLORE_EVERY - 1 {
            other
        } else {
            best
        }
    }

    /// Records that a step of `bytes` with `mode` took `took`.
    pub fn record(&self, mode: StoreMode, bytes: usize, took: Duration) {
        if self.forced.get().is_some() || bytes < MIN_TIMED {
            return;
        }
        let sample = took.as_nanos() as f64 / bytes as f64;
        let cost = &self.cost[index(mode)];
        let old = cost.get();
        // Down at once, up as a moving average over ~4 steps. A step only ever takes
        // longer than its mode's cost (a peer preempted, ranks sharing cores), so a
        // cheaper sample is news: one exploring step that finds the other mode cheaper
        // (the phase changed) switches at once, where an average would keep the wrong
        // mode for several explorations. A costlier sample moves the cost by at most its
        // own value.
        cost.set(if old == 0.0 || sample < old {
            sample.max(f64::MIN_POSITIVE)
        } else {
            old + (sample.min(5.0 * old) - old) / 4.0
        });
    }

    /// The recent cost per byte of `mode` in nanoseconds, if measured.
    pub fn cost(&self, mode: StoreMode) -> Option<f64> {
        Some(self.cost[index(mode)].get()).filter(|&c| c > 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copy_is_a_copy_at_every_alignment() {
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 % 251) as u8).collect();
        for off in 0..17 {
            for len in [0, 1, 15, 16, 17, 100, 283 - off] {
                let mut dst = vec![0u8; 300];
                copy(StoreMode::Streaming, &mut dst[off..off + len], &src[..len]);
                fence(StoreMode::Streaming);
                assert_eq!(&dst[off..off + len], &src[..len], "off {off} len {len}");
                assert!(dst[..off].iter().chain(&dst[off + len..]).all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn the_chooser_measures_both_then_keeps_the_cheaper_and_explores() {
        if !STREAMING_AVAILABLE {
            return;
        }
        let c = StoreChooser::default();
        let kib = 64 << 10;
        let us = Duration::from_micros;
        assert_eq!(c.pick(0, kib), StoreMode::Cached);
        c.record(StoreMode::Cached, kib, us(12)); // the slow phase: cached costs more
        assert_eq!(c.pick(1, kib), StoreMode::Streaming);
        c.record(StoreMode::Streaming, kib, us(4));
        let picks: Vec<StoreMode> = (2..2 + 2 * EXPLORE_EVERY).map(|g| c.pick(g, kib)).collect();
        let explored: Vec<u64> = (2..)
            .zip(&picks)
            .filter(|&(_, &m)| m == StoreMode::Cached)
            .map(|(g, _)| g)
            .collect();
        // On the steps numbered alike on every rank, whatever each measured.
        assert_eq!(explored, [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]);
        // The phase turns: one exploring step that finds cached cheap switches at once.
        assert_eq!(c.pick(EXPLORE_EVERY - 1, kib), StoreMode::Cached);
        c.record(StoreMode::Cached, kib, us(1));
        assert!(c.cost(StoreMode::Cached) < c.cost(StoreMode::Streaming));
        assert_eq!(c.pick(5, kib), StoreMode::Cached);
        // ...and back when the mode in use gets dearer: a few steps, not one outlier.
        c.record(StoreMode::Cached, kib, us(40));
        assert_eq!(
            c.pick(6, kib),
            StoreMode::Cached,
            "one slow step is not news"
        );
        for _ in 0..4 {
            c.record(StoreMode::Cached, kib, us(12));
        }
        assert_eq!(c.pick(7, kib), StoreMode::Streaming);
        c.record(StoreMode::Cached, kib, us(2));
        assert_eq!(c.pick(EXPLORE_EVERY - 1, kib), StoreMode::Streaming);
        // Small steps are plain and untimed.
        assert_eq!(c.pick(EXPLORE_EVERY - 1, 100), StoreMode::Cached);
        c.record(StoreMode::Streaming, 100, us(1000));
        assert!(c.cost(StoreMode::Streaming).unwrap() < 0.1);
        // Forced: always that mode, nothing recorded.
        c.force(Some(StoreMode::Streaming));
        assert_eq!(c.pick(5, kib), StoreMode::Streaming);
        c.record(StoreMode::Streaming, kib, us(1000));
        assert!(c.cost(StoreMode::Streaming).unwrap() < 0.1);
    }

    #[test]
    fn one_outlier_at_most_doubles_the_cost() {
        let c = StoreChooser::default();
        c.record(StoreMode::Cached, 1 << 20, Duration::from_micros(100));
        let before = c.cost(StoreMode::Cached).unwrap();
        c.record(StoreMode::Cached, 1 << 20, Duration::from_millis(50));
        let after = c.cost(StoreMode::Cached).unwrap();
        assert!(after <= before * 2.0 + 1e-12, "{before} -> {after}");
    }
}
