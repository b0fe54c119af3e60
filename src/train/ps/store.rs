//! A ps task's parameter memory: its shards end to end in one aligned buffer, what pulls
//! are answered from and initial values are received into, in place.

use crate::tensor::AlignedBuf;

/// The parameters of a ps's shards, end to end.
pub(super) struct Store {
    buf: AlignedBuf,
    /// Where each shard starts, in floats; the last entry is the total.
    offsets: Vec<usize>,
}

impl Store {
    /// Zeroed parameters for shards of these lengths.
    pub(super) fn new(lens: impl IntoIterator<Item = usize>) -> Store {
        let mut offsets = vec![0];
        for len in lens {
            offsets.push(offsets.last().copied().unwrap_or(0) + len);
        }
        let total = offsets.last().copied().unwrap_or(0);
        Store {
            buf: AlignedBuf::zeroed(4 * total),
            offsets,
        }
    }

    /// Floats of all shards.
    pub(super) fn len(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// Every shard's parameters, end to end.
    pub(super) fn all(&self) -> &[f32] {
        // SAFETY: the buffer holds 4 * len initialised bytes and is 64-byte aligned; every
        // bit pattern is an f32.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast(), self.len()) }
    }

    /// [`Store::all`], writable.
    pub(super) fn all_mut(&mut self) -> &mut [f32] {
        let len = self.len();
        // SAFETY: as in `all`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().cast(), len) }
    }

    /// The range of shard `i` in [`Store::all`].
    pub(super) fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// Each shard's parameters.
    pub(super) fn shards(&self) -> Vec<&[f32]> {
        let all = self.all();
        (0..self.offsets.len() - 1)
            .map(|i| &all[self.range(i)])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_lie_end_to_end() {
        let mut s = Store::new([3, 2]);
        assert_eq!(s.len(), 5);
        s.all_mut().copy_from_slice(&[1., 2., 3., 4., 5.]);
        assert_eq!(s.shards(), [&[1., 2., 3.][..], &[4., 5.][..]]);
        assert_eq!(s.range(1), 3..5);
        assert_eq!(Store::new([]).shards().len(), 0);
        assert!(Store::new([]).all().is_empty());
    }
}
