//! Where each existing row of a [`super::Table`] is: an open-addressing map from row id to
//! slot, built for a ps serving thousands of random ids per request from tables far
//! larger than the caches; a table of at most [`DENSE_ROWS`] rows instead indexes every id
//! of the table in an array (8 bytes a row of the table, whether it exists or not: one
//! load a lookup, no probe).
//!
//! Each id goes to its bucket by Fibonacci hashing (one multiply, the top bits), then
//! probes linearly; a bucket holds the id beside its slot, so a hit reads one cache line.
//! The map stays at most half full. [`RowIndex::prefetch`] starts loading an id's bucket
//! ahead of its lookup: a batch's lookups, each a cache miss in a large table, then
//! overlap instead of following one another (see `Table::pull_into`).

/// The most rows a table indexed by an array may have (its index then takes 8 MiB).
pub(crate) const DENSE_ROWS: u64 = 1 << 20;

/// An array index's entry of an id: its slot + 1 (0: no row), its pulls.
#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    slot: u32,
    hits: u32,
}

/// A bucket: an id, its slot and its pulls (in the bucket's line, which a pull's lookup
/// has just read, rather than a line of its own); `id == EMPTY` for none. Ids are below
/// their table's row count, so never `u64::MAX`.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Bucket {
    id: u64,
    slot: u32,
    hits: u32,
}

const EMPTY: u64 = u64::MAX;
const VACANT: Bucket = Bucket {
    id: EMPTY,
    slot: 0,
    hits: 0,
};

/// Row ids to slots. Rows are only ever added (a table never forgets a row).
#[derive(Debug, Clone, Default)]
pub(crate) struct RowIndex {
    buckets: Vec<Bucket>,
    /// `64 - log2(buckets)`: the hash's top bits pick the bucket.
    shift: u32,
    len: usize,
    /// A small table's index: an entry per id of the table (the buckets unused).
    dense: Vec<Entry>,
}

impl RowIndex {
    /// The bytes the map takes per row, at most (half full after a growth, at the least
    /// a quarter: 64 bytes of buckets per row).
    pub(super) const BYTES_PER_ROW: usize = 4 * std::mem::size_of::<Bucket>();

    /// The index of a table of `rows` rows: an array of them all if they are at most
    /// [`DENSE_ROWS`], else the map.
    pub(crate) fn for_rows(rows: u64) -> RowIndex {
        let dense = match rows <= DENSE_ROWS {
            true => vec![Entry::default(); rows as usize],
            false => Vec::new(),
        };
        RowIndex {
            dense,
            ..RowIndex::default()
        }
    }

    /// The bytes the index takes whatever the rows (an array's), and per row made.
    pub(crate) fn bytes(&self) -> (usize, usize) {
        match self.dense.is_empty() {
            true => (0, Self::BYTES_PER_ROW),
            false => (self.dense.len() * std::mem::size_of::<Entry>(), 0),
        }
    }

    fn home(&self, id: u64) -> usize {
        (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Row `id`'s slot, if the row exists.
    #[inline]
    pub(crate) fn get(&self, id: u64) -> Option<u32> {
        if !self.dense.is_empty() {
            let e = self.dense.get(id as usize)?;
            return e.slot.checked_sub(1);
        }
        self.find(id).map(|b| self.buckets[b].slot)
    }

    /// Row `id`'s slot, its pull counted, if the row exists.
    #[inline]
    pub(crate) fn pull(&mut self, id: u64) -> Option<u32> {
        let (slot, hits) = match self.dense.is_empty() {
            false => {
                let e = self.dense.get_mut(id as usize)?;
                (e.slot.checked_sub(1)?, &mut e.hits)
            }
            true => {
                let b = self.find(id)?;
                let bucket = &mut self.buckets[b];
                (bucket.slot, &mut bucket.hits)
            }
        };
        *hits = hits.saturating_add(1);
        Some(slot)
    }

    /// Each row's id and pulls, in no order.
    pub(crate) fn hits(&self) -> Box<dyn Iterator<Item = (u64, u32)> + '_> {
        match self.dense.is_empty() {
            true => Box::new(
                (self.buckets.iter())
                    .filter(|b| b.id != EMPTY)
                    .map(|b| (b.id, b.hits)),
            ),
            false => Box::new(
                (self.dense.iter().enumerate())
                    .filter(|(_, e)| e.slot > 0)
                    .map(|(id, e)| (id as u64, e.hits)),
            ),
        }
    }

    /// The bucket of row `id`, if the row exists.
    #[inline]
    fn find(&self, id: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.buckets.len() - 1;
        let mut b = self.home(id);
        loop {
            let bucket = &self.buckets[b];
            if bucket.id == id {
                return Some(b);
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
        if self.len == 0 || !self.dense.is_empty() {
            return;
        }
        let at = &self.buckets[self.home(id)];
        prefetch(std::ptr::from_ref(at).cast());
    }

    /// Adds row `id` at `slot`, pulled `hits` times; the row must not be in the index.
    pub(crate) fn insert(&mut self, id: u64, slot: u32, hits: u32) {
        debug_assert!(id != EMPTY && self.get(id).is_none());
        if let Some(e) = self.dense.get_mut(id as usize) {
            *e = Entry {
                slot: slot + 1,
                hits,
            };
            self.len += 1;
            return;
        }
        if 2 * (self.len + 1) > self.buckets.len() {
            self.grow();
        }
        self.place(Bucket { id, slot, hits });
        self.len += 1;
    }

    fn place(&mut self, bucket: Bucket) {
        let mask = self.buckets.len() - 1;
        let mut b = self.home(bucket.id);
        while self.buckets[b].id != EMPTY {
            b = (b + 1) & mask;
        }
        self.buckets[b] = bucket;
    }

    /// Twice the buckets (at least 16), every row placed anew.
    fn grow(&mut self) {
        let n = (2 * self.buckets.len()).max(16);
        let old = std::mem::replace(&mut self.buckets, vec![VACANT; n]);
        self.shift = 64 - n.trailing_zeros();
        for b in old.into_iter().filter(|b| b.id != EMPTY) {
            self.place(b);
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
                index.insert(id, slot, 0);
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

    #[test]
    fn an_array_index_finds_every_row_added_counts_pulls_and_none_other() {
        let mut index = RowIndex::for_rows(1000);
        assert_eq!(index.bytes(), (8000, 0));
        for (slot, id) in [7u64, 0, 999, 500].into_iter().enumerate() {
            assert_eq!(index.get(id), None);
            index.insert(id, slot as u32, 1);
        }
        assert_eq!(
            (index.get(7), index.get(0), index.get(999)),
            (Some(0), Some(1), Some(2))
        );
        assert_eq!(
            (index.get(1), index.get(1000), index.get(u64::MAX - 1)),
            (None, None, None)
        );
        assert_eq!(index.pull(500), Some(3));
        assert_eq!(index.pull(501), None);
        let mut hits: Vec<_> = index.hits().collect();
        hits.sort();
        assert_eq!(hits, [(0, 1), (7, 1), (500, 2), (999, 1)]);
        assert_eq!(RowIndex::for_rows(DENSE_ROWS + 1).bytes().0, 0);
    }
}
