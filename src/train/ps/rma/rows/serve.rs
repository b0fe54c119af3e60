//! A ps task's rows over windows: restored into its window before it opens, then each
//! step's staged gradients summed and applied once every worker pushed (see the module's
//! protocol).

mod beside;

use std::time::Instant;

use super::worker::AGREED;
use super::*;
use crate::model::embedding::Table;
use crate::train::checkpoint::Found;
use crate::transport::window::Access;
pub(in crate::train::ps::rma) use beside::Beside;
use beside::Polled;

/// A ps's rows: its tables (values, optimizer state: what checkpoints hold), which of
/// its buckets hold written rows, the step its window is at, the newest step it saved.
pub(in crate::train::ps::rma) struct Serving {
    k: usize,
    tables: Vec<Table>,
    written: Vec<Vec<bool>>,
    /// Per table and bucket: its row's place among a step's rows, while one is applied.
    place: Vec<Vec<u32>>,
    step: u64,
    saved: u64,
    /// Per table: pushes with its rows, and the rows they named (after combining).
    served: Vec<(u64, u64)>,
    /// The `ENDED` word last read, and the words last read with when they changed.
    ended: i64,
    last: ([i64; 8], Instant),
    /// The bytes the windows take (beside the tables).
    window_bytes: u64,
    /// Asynchronous: the checkpoint step asked for that not every worker has pushed yet,
    /// and since when.
    asked: Option<(u64, Instant)>,
}

impl Serving {
    /// Ps `k`'s rows: its tables empty or restored from `restored`, the restored rows
    /// put into its window (closed: before any rank opens it), its counters at the
    /// starting step.
    pub(super) fn prepare<C: Comm>(
        k: usize,
        lay: &Layout,
        cfg: &RowsConfig,
        restored: Option<&Found>,
        windows: &mut Windows<C>,
    ) -> Result<Serving, PsError> {
        let mut tables = fresh_tables(cfg);
        let start = restored.map_or(0, |f| f.step);
        if let Some(found) = restored {
            let (_, files) = checkpoint::open(&found.path)?;
            let mine = |id| crate::train::ps::protocol::row_owner(id, lay.nps) == k;
            checkpoint::tables::restore_rows(&mut tables, &files, mine).map_err(PsError::Setup)?;
        }
        let mut ps = Serving {
            k,
            written: (0..lay.tables())
                .map(|t| vec![false; lay.buckets[t][k]])
                .collect(),
            place: (0..lay.tables())
                .map(|t| vec![u32::MAX; lay.buckets[t][k]])
                .collect(),
            tables,
            step: start,
            saved: start,
            served: vec![(0, 0); lay.tables()],
            ended: 0,
            last: ([0; 8], Instant::now()),
            window_bytes: lay.bytes(k),
            asked: None,
        };
        ps.fits(cfg, None).map_err(|(_, e)| PsError::Setup(e))?;
        let mut placed = Ok(());
        let (tables, written) = (&ps.tables, &mut ps.written);
        let mut buckets = vec![Vec::new(); lay.tables()];
        // SAFETY: no rank opens the windows before the barrier that follows preparation.
        unsafe {
            windows.ctl.with_local_mut(|ctl| {
                ctl[STEP] = start as i64;
                ctl[SAVED] = start as i64;
                ctl[SAVE_AT] = start as i64;
                for w in 0..lay.nw {
                    ctl[lay.pushed(w)] = start as i64;
                }
                for (t, table) in tables.iter().enumerate() {
                    ctl[lay.stats(t)] = table.len() as i64;
                }
                placed = place_rows(lay, k, tables, ctl, &mut buckets);
            })
        };
        placed?;
        // SAFETY: as above.
        unsafe {
            windows.data.with_local_mut(|data| {
                for (t, table) in tables.iter().enumerate() {
                    let dim = lay.dims[t];
                    for ((_, v, _), b) in table.rows().zip(&buckets[t]) {
                        let at = lay.values_at[t][k] + b * dim;
                        data[at..at + dim].copy_from_slice(v);
                        written[t][*b] = true;
                    }
                }
            })
        };
        if cfg.asynchronous {
            // The window holds the rows from now on; the tables are made from it to save.
            ps.tables = fresh_tables(cfg);
        }
        Ok(ps)
    }

    /// Why this ps's rows and windows do not fit its memory share, naming the table
    /// (`grew`: the one a step grew; else the largest), with its index.
    fn fits(&self, cfg: &RowsConfig, grew: Option<usize>) -> Result<(), (usize, String)> {
        let rows: u64 = self.tables.iter().map(|t| t.bytes() as u64).sum();
        let t = grew.unwrap_or_else(|| {
            (0..self.tables.len())
                .max_by_key(|t| self.tables[*t].spec().dim * self.written[*t].len())
                .unwrap_or(0)
        });
        let Some(table) = self.tables.get(t) else {
            return Ok(());
        };
        let who = format_args!("ps:{}", self.k);
        let held = rows + self.window_bytes;
        crate::train::tables::outgrew(&who, table, held, cfg.memory.as_ref()).map_err(|e| (t, e))
    }

    /// The first worker whose pushes are behind this step (`ended`: only one that ended),
    /// left in `ABORT` with `kind` for the workers waiting on this ps.
    fn late(
        &self,
        lay: &Layout,
        ctl: &impl Access<i64>,
        me: usize,
        (kind, ended): (i64, bool),
    ) -> Result<Option<usize>, PsError> {
        let late = behind(lay, ctl, me, self.step, ended)?;
        if let Some(w) = late {
            ctl.compare_and_swap(me, ABORT, 0, kind | w as i64)?;
        }
        Ok(late)
    }

    /// Every worker ended (`ended`: their `ENDED` word): a failure one had alone, the
    /// stop they had, or done.
    fn finish(&self, roles: &Roles, ctl: &impl Access<i64>, ended: i64) -> Result<(), PsError> {
        let me = roles.ps[self.k];
        let failed = ctl.fetch_and_add(me, WORKER_FAILED, 0)?;
        if failed > 0 {
            let w = roles.workers[(failed - 1) as usize];
            return Err(PsError::Aborted {
                task: roles.task(me),
                message: format!("{} failed (its error says why)", roles.task(w)),
            });
        }
        if ended >= AGREED {
            return Err(PsError::Ended(
                "the workers stopped training with an error they agreed on (they print it)".into(),
            ));
        }
        match ctl.fetch_and_add(me, STOPPED_BY, 0)? {
            0 => Ok(()),
            signal => Err(PsError::Stopped(crate::train::Stopped {
                signal: crate::signals::name(signal as i32),
                step: self.step,
                checkpoint: None,
            })),
        }
    }

    /// Applies the step every worker pushed: each row's gradients summed, the tables
    /// updated, the rows' values written into the window; then the step published.
    fn apply(
        &mut self,
        roles: &Roles,
        cfg: &RowsConfig,
        lay: &Layout,
        data: &mut impl Access<f32>,
        ctl: &impl Access<i64>,
    ) -> Result<(), PsError> {
        let (me, k, nt) = (roles.ps[self.k], self.k, lay.tables());
        let mut counts = vec![0i64; lay.nw * nt];
        ctl.get_into(me, lay.count(0, 0), &mut counts)?;
        // Per worker and table: the staged (bucket, id) words.
        let mut staged: Vec<Vec<i64>> = (0..lay.nw * nt)
            .map(|i| vec![0i64; 2 * counts[i].clamp(0, lay.per_push as i64) as usize])
            .collect();
        let gets = staged
            .iter_mut()
            .enumerate()
            .map(|(i, s)| (me, lay.staged_ids(k, i / nt, i % nt), &mut s[..]));
        ctl.gets(gets.filter(|(_, _, s)| !s.is_empty()))?;
        let mut new_words: Vec<(usize, [i64; 1])> = Vec::new();
        let mut grew = None;
        // SAFETY: every worker pushed this step (its puts flushed before it counted its
        // arrival) and reads or stages nothing until STEP moves, after this returns: no
        // rank touches this window meanwhile.
        let applied = unsafe {
            data.with_local(|mem| -> Result<(), String> {
                for t in 0..nt {
                    let before = self.tables[t].len();
                    let rows = self.apply_table(lay, t, &staged, mem, &mut new_words)?;
                    if self.tables[t].len() > before {
                        grew = Some(t);
                    }
                    let pushes = (0..lay.nw).filter(|w| counts[w * nt + t] > 0).count();
                    self.served[t].0 += pushes as u64;
                    self.served[t].1 += rows as u64;
                }
                Ok(())
            })
        }?;
        if let Err(e) = applied {
            ctl.compare_and_swap(me, ABORT, 0, ABORT_FAILED)?;
            return Err(PsError::Setup(e));
        }
        if let Some(t) = grew {
            if let Err((t, e)) = self.fits(cfg, Some(t)) {
                ctl.compare_and_swap(me, ABORT, 0, ABORT_OUTGREW | t as i64)?;
                return Err(PsError::Setup(e));
            }
        }
        ctl.puts(new_words.iter().map(|(at, w)| (me, *at, &w[..])))?;
        let stats = self.stats_words();
        ctl.put(me, lay.stats(0), &stats)?;
        ctl.fetch_and_add(me, ARRIVALS, -(lay.nw as i64))?;
        ctl.fetch_and_add(me, STEP, 1)?;
        self.step += 1;
        Ok(())
    }

    /// Table `t`'s staged gradients (every worker's, `staged` and the window's values)
    /// summed per row and applied; the rows' new values written into `mem`, the buckets
    /// newly written noted in `new_words` (their `ctl` offset and word). The rows pushed.
    fn apply_table(
        &mut self,
        lay: &Layout,
        t: usize,
        staged: &[Vec<i64>],
        mem: &mut [f32],
        new_words: &mut Vec<(usize, [i64; 1])>,
    ) -> Result<usize, String> {
        let (k, nt, dim) = (self.k, lay.tables(), lay.dims[t]);
        let nb = lay.buckets[t][k];
        // Each bucket's place among the step's rows (`u32::MAX`: none yet), reset below.
        let place = &mut self.place[t];
        let (mut ids, mut buckets, mut sum) = (Vec::new(), Vec::<usize>::new(), Vec::<f32>::new());
        for w in 0..lay.nw {
            let words = &staged[w * nt + t];
            let at = lay.staged_values(k, w, t);
            for (r, pair) in words.chunks_exact(2).enumerate() {
                let (b, id) = (pair[0] as usize, pair[1] as u64);
                if b >= nb {
                    return Err(format!(
                        "table {}: a worker staged bucket {b} of {nb}",
                        self.tables[t].spec().name
                    ));
                }
                let g = &mem[at + r * dim..at + (r + 1) * dim];
                if place[b] == u32::MAX {
                    place[b] = ids.len() as u32;
                    ids.push(id);
                    buckets.push(b);
                    sum.resize(sum.len() + dim, 0.0);
                }
                let n = place[b] as usize;
                sum[n * dim..(n + 1) * dim]
                    .iter_mut()
                    .zip(g)
                    .for_each(|(s, g)| *s += g);
            }
        }
        buckets.iter().for_each(|b| place[*b] = u32::MAX);
        let table = &mut self.tables[t];
        table
            .apply_rows(&ids, &sum, 1.0)
            .map_err(|e| e.to_string())?;
        for (id, b) in ids.iter().zip(&buckets) {
            let row = table.row(*id).expect("a row just applied exists");
            let at = lay.values_at[t][k] + b * dim;
            mem[at..at + dim].copy_from_slice(row);
            if !self.written[t][*b] {
                self.written[t][*b] = true;
                new_words.push((lay.bucket_at[t][k] + b, [(*id as i64 + 1) | APPLIED]));
            }
        }
        Ok(ids.len())
    }

    /// Asynchronous: checkpoint `asked` (the chief's `SAVE_AT`) written once every worker
    /// counted that many pushes (the chief's own are in; in hybrid training the others
    /// then wait for its checkpoint); a worker that has not within the peer timeout of
    /// the ask is lost.
    fn save_when_pushed(
        &mut self,
        (roles, cfg, lay): (&Roles, &RowsConfig, &Layout),
        data: &impl Access<f32>,
        ctl: &impl Access<i64>,
        asked: u64,
    ) -> Result<Polled, PsError> {
        if asked <= self.saved {
            return Ok(Polled::Idle);
        }
        let me = roles.ps[self.k];
        let Some(late) = behind(lay, ctl, me, asked - 1, false)? else {
            self.asked = None;
            self.step = asked;
            self.read_window((cfg, lay, me), data, ctl)?;
            self.save(cfg, ctl, me)?;
            self.tables = fresh_tables(cfg);
            return Ok(Polled::Worked);
        };
        let since = match self.asked {
            Some((step, t)) if step == asked => t,
            _ => self.asked.insert((asked, Instant::now())).1,
        };
        if since.elapsed() <= cfg.peer_timeout {
            return Ok(Polled::Idle);
        }
        ctl.compare_and_swap(me, ABORT, 0, ABORT_LOST | late as i64)?;
        Err(PsError::Lost {
            task: roles.task(me),
            lost: format!(
                "{} (its push of step {asked}, which checkpoint {asked} waits for)",
                roles.task(roles.workers[late])
            ),
            secs: cfg.peer_timeout.as_secs(),
        })
    }

    /// Asynchronous: this ps's tables made anew from its window, every marked bucket's
    /// row (no optimizer state: plain SGD has none), read atomically while pushes may
    /// still land (a snapshot, as an asynchronous ps's checkpoint is). A bucket marked
    /// when its mark is read was written before its mark.
    fn read_window(
        &mut self,
        (cfg, lay, me): (&RowsConfig, &Layout, usize),
        data: &impl Access<f32>,
        ctl: &impl Access<i64>,
    ) -> Result<(), PsError> {
        let k = self.k;
        for (t, spec) in cfg.tables.iter().enumerate() {
            let dim = lay.dims[t];
            let mut words = vec![0i64; lay.buckets[t][k]];
            ctl.read_atomic(me, lay.bucket_at[t][k], &mut words)?;
            let mut table = Table::new(spec.clone(), cfg.seed, cfg.sparse);
            // A chunk of buckets at a time, skipping those with no row.
            let per = (crate::transport::rma::ATOMIC_CHUNK / dim.max(1)).max(1);
            let mut values = vec![0.0f32; per.min(words.len()) * dim];
            for (c, marks) in words.chunks(per).enumerate() {
                if marks.iter().all(|w| w & APPLIED == 0) {
                    continue;
                }
                let values = &mut values[..marks.len() * dim];
                data.read_atomic(me, lay.values_at[t][k] + c * per * dim, values)?;
                let rows = marks.iter().zip(values.chunks_exact(dim.max(1)));
                for (word, row) in rows.filter(|(w, _)| *w & APPLIED != 0) {
                    let id = ((word & ID_BITS) - 1) as u64;
                    table
                        .insert(id, row, &[])
                        .map_err(|e| PsError::Setup(e.to_string()))?;
                }
            }
            self.tables[t] = table;
        }
        Ok(())
    }

    /// Each table's report words: rows held, pushes with rows of it, rows pushed.
    fn stats_words(&self) -> Vec<i64> {
        (self.tables.iter().zip(&self.served))
            .flat_map(|(t, s)| [t.len() as i64, s.0 as i64, s.1 as i64])
            .collect()
    }

    /// Writes this ps's rows of checkpoint `self.step` into its staging directory; then
    /// their size and checksum, and the step, for the chief.
    fn save(&mut self, cfg: &RowsConfig, ctl: &impl Access<i64>, me: usize) -> Result<(), PsError> {
        let step = self.step;
        let dir = cfg.checkpoint_dir.as_deref().ok_or_else(|| {
            PsError::Setup("a checkpoint was asked for without a checkpoint directory".into())
        })?;
        let mut arrays = crate::train::ps::shards::arrays(self.k, &[], &[], &[], step);
        arrays
            .arrays
            .extend(checkpoint::tables::table_arrays(&self.tables));
        let at = (dir, step, self.k);
        let written = write_saving(ctl, (me, SAVED), cfg.peer_timeout, at, &arrays)?;
        let (bytes, sum) = match written {
            Ok(w) => w,
            Err(e) => {
                ctl.compare_and_swap(me, ABORT, 0, ABORT_FAILED)?;
                return Err(checkpoint::abandoned(dir, step, e).into());
            }
        };
        ctl.put(me, SAVED_BYTES, &[bytes as i64, sum as i64])?;
        let before = ctl.fetch_and_add(me, SAVED, 0)?;
        ctl.fetch_and_add(me, SAVED, step as i64 - before)?;
        self.saved = step;
        Ok(())
    }
}

/// The first worker whose pushes on ps rank `me` have not reached step `step` (counted
/// `step` or fewer; `ended`: only one that ended).
fn behind(
    lay: &Layout,
    ctl: &impl Access<i64>,
    me: usize,
    step: u64,
    ended: bool,
) -> Result<Option<usize>, PsError> {
    for w in 0..lay.nw {
        let word = ctl.fetch_and_add(me, lay.pushed(w), 0)?;
        if word % PUSHES_ENDED <= step as i64 && (!ended || word >= PUSHES_ENDED) {
            return Ok(Some(w));
        }
    }
    Ok(None)
}

/// `cfg`'s tables, empty.
fn fresh_tables(cfg: &RowsConfig) -> Vec<Table> {
    (cfg.tables.iter())
        .map(|s| Table::new(s.clone(), cfg.seed, cfg.sparse))
        .collect()
}

/// Puts `tables`' rows (restored) into ps `k`'s buckets in `ctl`, marked written; each
/// table's buckets, in the order of its rows, into `buckets`.
fn place_rows(
    lay: &Layout,
    k: usize,
    tables: &[Table],
    ctl: &mut [i64],
    buckets: &mut [Vec<usize>],
) -> Result<(), PsError> {
    for (t, table) in tables.iter().enumerate() {
        let nb = lay.buckets[t][k];
        if 2 * table.len() > nb {
            return Err(PsError::Setup(format!(
                "table {}: the checkpoint holds {} of ps:{k}'s rows, more than its window holds ({}): a larger --window-rows",
                table.spec().name,
                table.len(),
                nb / 2
            )));
        }
        for (id, _, _) in table.rows() {
            let mut b = lay.home(t, k, id);
            while ctl[lay.bucket_at[t][k] + b] != 0 {
                b = (b + 1) & (nb - 1);
            }
            ctl[lay.bucket_at[t][k] + b] = (id as i64 + 1) | APPLIED;
            buckets[t].push(b);
        }
    }
    Ok(())
}
