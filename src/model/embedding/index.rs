//! Where each existing row of a [`super::Table`] is: an open-addressing map from row id to
//! slot, built for a ps serving thousands of random ids per request from tables far
//! larger than the caches.
//!
//! Each id goes to its bucket by Fibonacci hashing (one multiply, the top bits), then
//! probes linearly; a bucket holds the id beside its slot, so a hit reads one cache line.
//! The map stays at most half full. [`RowIndex::prefetch`] starts loading an id's bucket
//! ahead of its lookup: a batch's lookups, each a cache miss in a large table, then
//! overlap instead of following one another (see `Table::pull_into`).

/// A bucket: an id and its slot; `id == EMPTY` for none. Ids are below their table's row
/// count, so never `u64::MAX`.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Bucket {
    id: u64,
    slot: u32,
}

const EMPTY: u64 = u64::MAX;
const VACANT: Bucket = Bucket { id: EMPTY, slot: 0 };

/// Row ids to slots. Rows are only ever added (a table never forgets a row).
#[derive(Debug, Clone, Default)]
pub(crate) struct RowIndex {
    buckets: Vec<Bucket>,
    /// `64 - log2(buckets)`: the hash's top bits pick the bucket.
    shift: u32,
    len: usize,
}

impl RowIndex {
    /// The bytes the index takes per row, at most (half full after a growth, at the
    /// least a quarter: 64 bytes of buckets per row).
    pub(super) const BYTES_PER_ROW: usize = 4 * std::mem::size_of::<Bucket>();

    fn home(&self, id: u64) -> usize {
        (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Row `id`'s slot, if the row exists.
    #[inline]
    pub(crate) fn get(&self, id: u64) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let mask = self.buckets.len() - 1;
        let mut b = self.home(id);
        loop {
            let bucket = &self.buckets[b];
            if bucket.id == id {
                return Some(bucket.slot);
            }
            if bucket.id == EMPTY {
                return None;
            }
            b = (b + 1) & mask;
        }
    }

    /// Starts loading the bucket row `id` is looked up in (a hint: nothing if the target
    /// has no prefetch instruction).
    #[inline]
    pub(crate) fn prefetch(&self, id: u64) {
        if self.len == 0 {
            return;
        }
        let at = &self.buckets[self.home(id)];
        prefetch(std::ptr::from_ref(at).cast());
    }

    /// Adds row `id` at `slot`; the row must not be in the index.
    pub(crate) fn insert(&mut self, id: u64, slot: u32) {
        debug_assert!(id != EMPTY && self.get(id).is_none());
        if 2 * (self.len + 1) > self.buckets.len() {
            self.grow();
        }
        self.place(id, slot);
        self.len += 1;
    }

    fn place(&mut self, id: u64, slot: u32) {
        let mask = self.buckets.len() - 1;
        let mut b = self.home(id);
        while self.buckets[b].id != EMPTY {
            b = (b + 1) & mask;
        }
        self.buckets[b] = Bucket { id, slot };
    }

    /// Twice the buckets (at least 16), every row placed anew.
    fn grow(&mut self) {
        let n = (2 * self.buckets.len()).max(16);
        let old = std::mem::replace(&mut self.buckets, vec![VACANT; n]);
        self.shift = 64 - n.trailing_zeros();
        for b in old.into_iter().filter(|b| b.id != EMPTY) {
            self.place(b.id, b.slot);
        }
    }
}

/// Starts loading the cache line at `p` into every level of the cache.
#[inline]
fn prefetch(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// [`prefetch`] of every cache line of the values `v` (a row's, before it is read or
/// updated).
#[inline]
pub(super) fn prefetch_values(v: &[f32]) {
    let p = v.as_ptr().cast::<i8>();
    let (first, bytes) = (p as usize & 63, std::mem::size_of_val(v));
    for at in (0..first + bytes).step_by(64) {
        // Lines from the one holding the first value's, through the last's.
        prefetch(p.wrapping_add(at).wrapping_sub(first));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn finds_every_row_added_and_none_other_across_growths() {
        let mut index = RowIndex::default();
        let mut truth = HashMap::new();
        // Sequential, strided and scattered ids: every pattern a click log gives.
        let ids = (0..3000u64)
            .chain((0..3000).map(|i| i * 1024))
            .chain((0..3000).map(|i: u64| i.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 1));
        for id in ids {
            let slot = truth.len() as u32;
            if let std::collections::hash_map::Entry::Vacant(e) = truth.entry(id) {
                e.insert(slot);
                index.insert(id, slot);
            }
        }
        assert_eq!(index.len, truth.len());
        assert!(2 * index.len <= index.buckets.len());
        for (id, slot) in &truth {
            assert_eq!(index.get(*id), Some(*slot), "row {id}");
        }
        for id in [1u64 << 40, 3001, 7 * 1024 + 1, u64::MAX - 1] {
            assert_eq!(index.get(id), truth.get(&id).copied(), "row {id}");
        }
        assert_eq!(RowIndex::default().get(5), None);
    }
}
