//! Where a worker's rows are in the ps tasks' windows: each row's bucket known from an
//! earlier lookup, or found by rounds of batched compare-and-swaps (an empty bucket
//! claimed for a new row), then remembered.

use super::*;

impl<D: Access<f32>, K: Access<i64>> RmaRows<'_, D, K> {
    /// Where each of `looks`' rows is: known and fresh rows at once, the others by
    /// rounds of compare-and-swaps (`make`: an empty bucket is claimed for the row).
    /// Asynchronous, where `make`: every row found is written (see [`RmaRows::settle`]).
    pub(super) fn find(&self, looks: &mut [Look], make: bool) -> Result<Vec<Found>, PsError> {
        let (mut found, claimed) = self.probe(looks, make)?;
        if self.cfg.asynchronous && make {
            self.settle(looks, &mut found, &claimed)?;
        }
        self.remember(looks, &found);
        Ok(found)
    }

    /// [`RmaRows::find`]'s rounds of compare-and-swaps; with what they found, the looks
    /// whose rows this worker claimed.
    pub(super) fn probe(
        &self,
        looks: &mut [Look],
        make: bool,
    ) -> Result<(Vec<Found>, Vec<usize>), PsError> {
        let (mut found, mut claimed) = (vec![None; looks.len()], Vec::new());
        let mut pending = Vec::new();
        {
            let known = self.known.borrow();
            let fresh = self.fresh.borrow();
            for (n, l) in looks.iter_mut().enumerate() {
                self.cfg.tables[l.t]
                    .check(l.id)
                    .map_err(|e| PsError::Setup(format!("{}: {e}", self.me())))?;
                if let Some(b) = known[l.t].get(l.id) {
                    found[n] = Some((b as usize, true));
                } else if let Some(b) = fresh[l.t].get(&l.id) {
                    found[n] = Some((*b, false));
                } else {
                    pending.push(n);
                }
            }
        }
        let (mut ops, mut cmp, mut swap, mut old) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        while !pending.is_empty() {
            ops.clear();
            swap.clear();
            for n in &pending {
                let l = &looks[*n];
                let at = self.lay.bucket_at[l.t][l.k] + l.bucket;
                ops.push((self.roles.ps[l.k], at));
                swap.push(if make { l.id as i64 + 1 } else { 0 });
            }
            cmp.resize(ops.len(), 0);
            old.resize(ops.len(), 0);
            self.ctl.compare_and_swaps(&ops, &cmp, &swap, &mut old)?;
            let mut next = Vec::new();
            for (n, was) in pending.iter().zip(&old) {
                let l = &mut looks[*n];
                if *was == 0 {
                    found[*n] = make.then_some((l.bucket, false));
                    claimed.extend(make.then_some(*n));
                } else if was & ID_BITS == l.id as i64 + 1 {
                    found[*n] = Some((l.bucket, was & APPLIED != 0));
                } else {
                    l.probes += 1;
                    if l.probes >= MAX_PROBES {
                        return Err(self.full(l));
                    }
                    l.bucket = (l.bucket + 1) & (self.lay.buckets[l.t][l.k] - 1);
                    next.push(*n);
                }
            }
            pending = next;
        }
        Ok((found, claimed))
    }

    /// Asynchronous: the rows this worker `claimed` get their initial values in their ps's
    /// window, then their buckets' marks, so that every push lands on a written row; rows
    /// another worker claimed and has not marked yet are waited for. Every row of `found`
    /// is written after it.
    pub(super) fn settle(
        &self,
        looks: &[Look],
        found: &mut [Found],
        claimed: &[usize],
    ) -> Result<(), PsError> {
        let (dims, nt) = (&self.lay.dims, self.lay.tables());
        if !claimed.is_empty() {
            let rows: Vec<Vec<f32>> = (claimed.iter().map(|n| &looks[*n]))
                .map(|l| {
                    let spec = &self.cfg.tables[l.t];
                    let mut row = vec![0.0; dims[l.t]];
                    spec.init.fill(self.cfg.seed, spec, l.id, &mut row);
                    row
                })
                .collect();
            // A claimed row's bucket is the one its look probed.
            let at = |l: &Look| self.lay.values_at[l.t][l.k] + l.bucket * dims[l.t];
            let puts = (claimed.iter().zip(&rows))
                .map(|(n, row)| (self.roles.ps[looks[*n].k], at(&looks[*n]), &row[..]));
            // Flushed before the marks: a row is written before any worker finds it so.
            self.data.puts(puts)?;
            let mine = claimed.iter().map(|n| (&looks[*n], looks[*n].bucket));
            let (ops, cmp, swap) = self.marks(mine, true);
            self.ctl
                .compare_and_swaps(&ops, &cmp, &swap, &mut vec![0; ops.len()])?;
            // Each ps's report: the rows it holds.
            let mut held = vec![0i64; self.lay.nps * nt];
            claimed
                .iter()
                .for_each(|n| held[looks[*n].k * nt + looks[*n].t] += 1);
            self.add_stats(|k, t| [held[k * nt + t], 0, 0])?;
        }
        for n in claimed {
            found[*n] = Some((looks[*n].bucket, true));
        }
        self.await_marks(looks, found)
    }

    /// The words of rows' buckets (each a look and its bucket), with the word before and
    /// after the mark where `applied` (else 0 and 0: a read): `(target, offset)`, compare,
    /// swap.
    #[allow(clippy::type_complexity)]
    pub(super) fn marks<'l>(
        &self,
        rows: impl Iterator<Item = (&'l Look, usize)>,
        applied: bool,
    ) -> (Vec<(usize, usize)>, Vec<i64>, Vec<i64>) {
        let (mut ops, mut cmp, mut swap) = (Vec::new(), Vec::new(), Vec::new());
        for (l, bucket) in rows {
            let word = l.id as i64 + 1;
            ops.push((self.roles.ps[l.k], self.lay.bucket_at[l.t][l.k] + bucket));
            cmp.push(if applied { word } else { 0 });
            swap.push(if applied { word | APPLIED } else { 0 });
        }
        (ops, cmp, swap)
    }

    /// Asynchronous: waits until every row of `found` that another worker claimed is
    /// marked written (its claim in flight); the deadline is the peer timeout.
    pub(super) fn await_marks(&self, looks: &[Look], found: &mut [Found]) -> Result<(), PsError> {
        let mut backoff =
            crate::transport::comm::Backoff::new(std::time::Duration::from_micros(50));
        let since = std::time::Instant::now();
        loop {
            let waiting: Vec<(usize, usize)> = (found.iter().enumerate())
                .filter_map(|(n, f)| match f {
                    Some((b, false)) => Some((n, *b)),
                    _ => None,
                })
                .collect();
            let Some(first) = waiting.first().map(|(n, _)| &looks[*n]) else {
                return Ok(());
            };
            if since.elapsed() > self.cfg.peer_timeout {
                return Err(self.lost(
                    first.k,
                    &format!(
                        "row {} of table {} claimed by a worker that never wrote it",
                        first.id, self.cfg.tables[first.t].name
                    ),
                ));
            }
            // A compare-and-swap of 0 with 0 reads each word atomically.
            let rows = waiting.iter().map(|(n, b)| (&looks[*n], *b));
            let (ops, cmp, swap) = self.marks(rows, false);
            let mut words = vec![0; ops.len()];
            self.ctl.compare_and_swaps(&ops, &cmp, &swap, &mut words)?;
            for ((n, b), word) in waiting.iter().zip(&words) {
                if word & APPLIED != 0 {
                    found[*n] = Some((*b, true));
                }
            }
            backoff.idle();
        }
    }

    /// Adds `words(k, t)` (rows held, pushes, rows pushed) to every ps's report words of
    /// every table.
    pub(super) fn add_stats(
        &self,
        words: impl Fn(usize, usize) -> [i64; STATS],
    ) -> Result<(), PsError> {
        let nt = self.lay.tables();
        let stats: Vec<Vec<i64>> = (0..self.lay.nps)
            .map(|k| (0..nt).flat_map(|t| words(k, t)).collect())
            .collect();
        let adds = (stats.iter().enumerate())
            .filter(|(_, s)| s.iter().any(|v| *v != 0))
            .map(|(k, s)| (self.roles.ps[k], self.lay.stats(0), &s[..]));
        Ok(self.ctl.accumulates(adds)?)
    }

    /// The buckets `found` for `looks`, kept: written rows for good, the others until
    /// this worker's next push.
    pub(super) fn remember(&self, looks: &[Look], found: &[Found]) {
        let (mut known, mut fresh) = (self.known.borrow_mut(), self.fresh.borrow_mut());
        for (l, f) in looks.iter().zip(found) {
            match f {
                Some((b, true)) if known[l.t].get(l.id).is_none() => {
                    known[l.t].insert(l.id, *b as u32, 0);
                }
                Some((b, false)) => {
                    fresh[l.t].insert(l.id, *b);
                }
                _ => {}
            }
        }
    }

    pub(super) fn full(&self, l: &Look) -> PsError {
        PsError::Setup(format!(
            "{}: table {}: its window on {} is full ({} buckets for at most {} rows): a larger --window-rows, or more ps tasks",
            self.me(),
            self.cfg.tables[l.t].name,
            self.ps_task(l.k),
            self.lay.buckets[l.t][l.k],
            self.lay.buckets[l.t][l.k] / 2
        ))
    }

    /// A lookup of every id of `want` (`(table, ids)`), each at its ps's home bucket.
    pub(super) fn looks(&self, want: &[(usize, &[u64])]) -> Vec<Look> {
        let nps = self.lay.nps;
        let mut looks = Vec::new();
        for (i, (t, ids)) in want.iter().enumerate() {
            for (j, id) in ids.iter().enumerate() {
                let k = crate::train::ps::protocol::row_owner(*id, nps);
                looks.push(Look {
                    i,
                    j,
                    t: *t,
                    id: *id,
                    k,
                    bucket: self.lay.home(*t, k, *id),
                    probes: 0,
                });
            }
        }
        looks
    }
}
