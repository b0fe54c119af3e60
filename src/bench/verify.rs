//! `-c` for `allreduce` and `bcast`: what each rank puts into an iteration's buffer before
//! the call, outside the timed part, and the check of what the call left there (OSU's
//! validation, with values of mpiflow's own). Each element is 0, 1 or 2 on each rank: one
//! part alternating by iteration and position (a result left over from the previous
//! iteration is wrong in every element), one by rank and position (a rank's contribution
//! lost or doubled shows), so that a sum over ranks stays small and exact in every element
//! type.

use std::fmt::Display;

/// An element type of the collectives' buffers (`-T`): its value for a small count.
pub(super) trait Value: Copy + PartialEq + Display {
    fn of(count: u32) -> Self;
}

impl Value for u8 {
    fn of(count: u32) -> u8 {
        // A byte sum wraps, in MPI's sum of MPI_CHAR and in mpiflow's alike.
        count as u8
    }
}

impl Value for i8 {
    fn of(count: u32) -> i8 {
        count as u8 as i8
    }
}

impl Value for i32 {
    fn of(count: u32) -> i32 {
        count as i32
    }
}

impl Value for f32 {
    fn of(count: u32) -> f32 {
        count as f32
    }
}

/// Rank `rank`'s element `j` in iteration `i`.
fn value(rank: usize, i: usize, j: usize) -> u32 {
    u32::from((i + j).is_multiple_of(2)) + u32::from((rank + j).is_multiple_of(2))
}

/// The sum over ranks `0..ranks` of element `j` in iteration `i`.
fn sum(ranks: usize, i: usize, j: usize) -> u32 {
    let alternating = if (i + j).is_multiple_of(2) { ranks } else { 0 };
    let by_rank = if j.is_multiple_of(2) {
        ranks.div_ceil(2)
    } else {
        ranks / 2
    };
    (alternating + by_rank) as u32
}

/// What a check found: the elements that differ, the first of them, its value and the
/// value expected.
#[derive(Debug, PartialEq)]
pub(super) struct Mismatch {
    pub(super) wrong: usize,
    pub(super) of: usize,
    pub(super) first: usize,
    pub(super) got: String,
    pub(super) want: String,
}

fn compare<T: Value>(buf: &[T], want: impl Fn(usize) -> T) -> Result<(), Mismatch> {
    let mut bad = buf.iter().enumerate().filter(|&(j, &x)| x != want(j));
    let Some((first, &got)) = bad.next() else {
        return Ok(());
    };
    Err(Mismatch {
        wrong: 1 + bad.count(),
        of: buf.len(),
        first,
        got: got.to_string(),
        want: want(first).to_string(),
    })
}

/// This rank's allreduce input for iteration `i`.
pub(super) fn fill_sum_input<T: Value>(buf: &mut [T], rank: usize, i: usize) {
    for (j, x) in buf.iter_mut().enumerate() {
        *x = T::of(value(rank, i, j));
    }
}

/// An allreduce (sum) result of iteration `i` over `ranks` ranks.
pub(super) fn check_sum<T: Value>(buf: &[T], ranks: usize, i: usize) -> Result<(), Mismatch> {
    compare(buf, |j| T::of(sum(ranks, i, j)))
}

/// A broadcast buffer before the call of iteration `i`: the root's data, or on another
/// rank a value the root never sends.
pub(super) fn fill_bcast<T: Value>(buf: &mut [T], root: bool, i: usize) {
    for (j, x) in buf.iter_mut().enumerate() {
        *x = T::of(if root { value(0, i, j) } else { 3 });
    }
}

/// A broadcast buffer after the call of iteration `i`.
pub(super) fn check_bcast<T: Value>(buf: &[T], i: usize) -> Result<(), Mismatch> {
    compare(buf, |j| T::of(value(0, i, j)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_what_the_ranks_put_in_and_change_every_iteration() {
        for ranks in 1..=9 {
            for i in 0..3 {
                let inputs: Vec<Vec<f32>> = (0..ranks)
                    .map(|r| {
                        let mut v = vec![0.0; 5];
                        fill_sum_input(&mut v, r, i);
                        v
                    })
                    .collect();
                let summed: Vec<f32> = (0..5).map(|j| inputs.iter().map(|v| v[j]).sum()).collect();
                assert_eq!(
                    check_sum(&summed, ranks, i),
                    Ok(()),
                    "{ranks} ranks, iteration {i}"
                );
                // The next iteration's check finds this result stale in every element.
                assert_eq!(check_sum(&summed, ranks, i + 1).unwrap_err().wrong, 5);
                // One rank's contribution lost.
                let short: Vec<f32> = (0..5)
                    .map(|j| inputs[1..].iter().map(|v| v[j]).sum())
                    .collect();
                assert!(
                    check_sum(&short, ranks, i).is_err(),
                    "{ranks} ranks, iteration {i}"
                );
            }
        }
    }

    #[test]
    fn a_wrong_element_is_named_with_the_count() {
        let mut v = vec![0i32; 8];
        fill_sum_input(&mut v, 0, 0);
        let mut other = vec![0i32; 8];
        fill_sum_input(&mut other, 1, 0);
        let mut summed: Vec<i32> = v.iter().zip(&other).map(|(a, b)| a + b).collect();
        assert_eq!(check_sum(&summed, 2, 0), Ok(()));
        summed[3] = 7;
        summed[5] = 9;
        assert_eq!(
            check_sum(&summed, 2, 0),
            Err(Mismatch {
                wrong: 2,
                of: 8,
                first: 3,
                got: "7".into(),
                want: "1".into()
            })
        );
        // A broadcast that did not arrive leaves the receiver's own values.
        let mut b = vec![0u8; 4];
        fill_bcast(&mut b, false, 1);
        assert_eq!(check_bcast(&b, 1).unwrap_err().wrong, 4);
        fill_bcast(&mut b, true, 1);
        assert_eq!(check_bcast(&b, 1), Ok(()));
    }
}
