//! The order in which a stage runs the forward and backward passes of a step's
//! micro-batches (`--schedule`).
//!
//! - **GPipe** (Huang et al., 2019): every micro-batch forward, then every one backward
//!   (last first). A stage keeps the activations of all M micro-batches until their
//!   backward passes.
//! - **1F1B** (PipeDream-Flush, Narayanan et al., 2021): stage k of S runs `S-1-k` forward
//!   passes to fill the pipeline, then alternates one forward and one backward, then
//!   drains the backward passes. Same bubble as GPipe, but a stage keeps the activations
//!   of at most `S-k` micro-batches.
//!
//! Both keep the order of the micro-batches' forward passes (0, 1, ...) and of their
//! backward passes the same on every stage, so the messages between two stages arrive in
//! the order they are taken.

/// A pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// All forward passes, then all backward passes.
    GPipe,
    /// One forward, one backward, after a warm-up.
    OneFOneB,
}

impl crate::named::Named for Schedule {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Schedule::GPipe,
            "gpipe",
            "all forward passes, then all backward: activations of every micro-batch kept",
        ),
        (
            Schedule::OneFOneB,
            "1f1b",
            "one forward, one backward after a warm-up: at most S-k micro-batches kept",
        ),
    ];
}

/// One pass of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Forward(usize),
    Backward(usize),
}

/// Stage `stage` of `stages`' passes over `micro` micro-batches, in order.
pub fn ops(schedule: Schedule, stage: usize, stages: usize, micro: usize) -> Vec<Op> {
    match schedule {
        Schedule::GPipe => (0..micro)
            .map(Op::Forward)
            .chain((0..micro).rev().map(Op::Backward))
            .collect(),
        Schedule::OneFOneB => {
            let warm = stages.saturating_sub(stage + 1).min(micro);
            let mut out: Vec<Op> = (0..warm).map(Op::Forward).collect();
            for i in 0..micro - warm {
                out.push(Op::Forward(warm + i));
                out.push(Op::Backward(i));
            }
            out.extend((micro - warm..micro).map(Op::Backward));
            out
        }
    }
}

/// The most micro-batches whose activations a stage holds at once under `ops`.
pub fn peak_in_flight(ops: &[Op]) -> usize {
    let (mut now, mut peak) = (0usize, 0usize);
    for op in ops {
        match op {
            Op::Forward(_) => {
                now += 1;
                peak = peak.max(now);
            }
            Op::Backward(_) => now = now.saturating_sub(1),
        }
    }
    peak
}

/// The idle share of a step with equal stages and a backward pass `backward` times as long
/// as a forward pass, by simulating every stage's passes (each waits for its input from
/// the neighbouring stage and runs in its schedule's order). For GPipe and 1F1B it is
/// `(S-1)/(M+S-1)` whatever `backward` is (the tests check the schedules against it).
#[cfg(test)]
fn simulated_bubble(schedule: Schedule, stages: usize, micro: usize, backward: f64) -> f64 {
    if stages == 0 || micro == 0 {
        return 0.0;
    }
    let plans: Vec<Vec<Op>> = (0..stages)
        .map(|k| ops(schedule, k, stages, micro))
        .collect();
    // Finish times of each stage's forward and backward pass of each micro-batch.
    let mut fwd = vec![vec![f64::NAN; micro]; stages];
    let mut bwd = vec![vec![f64::NAN; micro]; stages];
    let mut next = vec![0usize; stages];
    let mut clock = vec![0.0f64; stages];
    let total = plans.iter().map(Vec::len).sum::<usize>();
    let mut done = 0;
    while done < total {
        let before = done;
        for k in 0..stages {
            while let Some(op) = plans[k].get(next[k]) {
                let (ready, cost) = match *op {
                    Op::Forward(_) if k == 0 => (Some(0.0), 1.0),
                    Op::Forward(m) => (Some(fwd[k - 1][m]).filter(|t| !t.is_nan()), 1.0),
                    Op::Backward(m) if k + 1 == stages => {
                        (Some(fwd[k][m]).filter(|t| !t.is_nan()), backward)
                    }
                    Op::Backward(m) => (Some(bwd[k + 1][m]).filter(|t| !t.is_nan()), backward),
                };
                let Some(ready) = ready else { break };
                let end = clock[k].max(ready) + cost;
                clock[k] = end;
                match *op {
                    Op::Forward(m) => fwd[k][m] = end,
                    Op::Backward(m) => bwd[k][m] = end,
                }
                next[k] += 1;
                done += 1;
            }
        }
        assert!(done > before, "a schedule that deadlocks");
    }
    let span = clock.iter().copied().fold(0.0, f64::max);
    let busy = micro as f64 * (1.0 + backward);
    1.0 - busy / span
}

/// GPipe's bubble fraction `(S-1)/(M+S-1)`.
pub fn gpipe_bubble(stages: usize, micro: usize) -> f64 {
    let (s, m) = (stages as f64, micro as f64);
    if s + m <= 1.0 {
        return 0.0;
    }
    (s - 1.0) / (m + s - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Op::{Backward as B, Forward as F};

    #[test]
    fn every_pass_once_forward_before_backward_in_the_same_order_on_every_stage() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in 1..5 {
                for micro in 1..7 {
                    let forward_order: Vec<usize> = (0..micro).collect();
                    let mut backward_order = None;
                    for k in 0..stages {
                        let o = ops(schedule, k, stages, micro);
                        assert_eq!(o.len(), 2 * micro);
                        let f: Vec<usize> = o
                            .iter()
                            .filter_map(|op| match op {
                                F(m) => Some(*m),
                                _ => None,
                            })
                            .collect();
                        let b: Vec<usize> = o
                            .iter()
                            .filter_map(|op| match op {
                                B(m) => Some(*m),
                                _ => None,
                            })
                            .collect();
                        assert_eq!(f, forward_order);
                        assert_eq!(*backward_order.get_or_insert(b.clone()), b);
                        for m in 0..micro {
                            let at = |x: Op| o.iter().position(|y| *y == x).unwrap();
                            assert!(at(F(m)) < at(B(m)), "{schedule:?} {k}/{stages} {m}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_warms_up_then_alternates_and_holds_fewer_micro_batches() {
        assert_eq!(
            ops(Schedule::OneFOneB, 0, 3, 4),
            [F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)]
        );
        assert_eq!(
            ops(Schedule::OneFOneB, 2, 3, 4),
            [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]
        );
        assert_eq!(
            ops(Schedule::GPipe, 1, 3, 3),
            [F(0), F(1), F(2), B(2), B(1), B(0)]
        );
        for k in 0..4 {
            assert_eq!(peak_in_flight(&ops(Schedule::GPipe, k, 4, 8)), 8);
            assert_eq!(peak_in_flight(&ops(Schedule::OneFOneB, k, 4, 8)), 4 - k);
        }
        // Fewer micro-batches than the warm-up: all forward, then all backward.
        assert_eq!(ops(Schedule::OneFOneB, 0, 4, 2), [F(0), F(1), B(0), B(1)]);
    }

    #[test]
    fn both_schedules_idle_as_gpipe_says() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for (s, m) in [(1, 1), (2, 1), (2, 4), (3, 6), (4, 8), (4, 2)] {
                for backward in [1.0, 2.0] {
                    let got = simulated_bubble(schedule, s, m, backward);
                    let want = gpipe_bubble(s, m);
                    assert!(
                        (got - want).abs() < 1e-9,
                        "{schedule:?} S={s} M={m} b={backward}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
