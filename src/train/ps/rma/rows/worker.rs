//! A worker's rows over windows: rows found by compare-and-swap, read by gets, their
//! gradients staged by puts (see the module's protocol).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::*;
use crate::model::embedding::{RowIndex, SparseGrad};
use crate::train::engine::{End, TrainError};
use crate::train::tables::{RowHome, RowsReport, TableReport, Tables};
use crate::transport::window::Access;

mod find;

/// A row of one lookup: where the caller wants it (`out[i]`'s `j`th row), which table and
/// ps, the bucket probed and the probes made.
#[derive(Debug, Clone, Copy)]
struct Look {
    i: usize,
    j: usize,
    t: usize,
    id: u64,
    k: usize,
    bucket: usize,
    probes: usize,
}

/// What a lookup found: the row's bucket, and whether the ps wrote its values (else they
/// are the initial ones); `None`: no such row (a read that makes none).
type Found = Option<(usize, bool)>;

/// A worker's way to the rows on the ps tasks' windows (`D`: `data`, `K`: `ctl`).
pub struct RmaRows<'a, D: Access<f32>, K: Access<i64>> {
    roles: &'a Roles,
    w: usize,
    cfg: RowsConfig,
    lay: Layout,
    data: &'a D,
    ctl: &'a K,
    /// Per table: the buckets of rows the ps wrote (they never move).
    known: RefCell<Vec<RowIndex>>,
    /// Per table: buckets claimed or found since this worker's last push, not written
    /// yet (the push names them; the ps writes them once every worker pushed).
    fresh: RefCell<Vec<HashMap<u64, usize>>>,
    /// The step the rows started at, and this worker's pushes since.
    start: u64,
    pushes: Cell<u64>,
    /// The checkpoint every rank found at the start (its step and path).
    restored: Option<(u64, PathBuf)>,
}

impl<'a, D: Access<f32>, K: Access<i64>> RmaRows<'a, D, K> {
    pub(super) fn new(
        roles: &'a Roles,
        w: usize,
        cfg: &RowsConfig,
        lay: &Layout,
        (data, ctl): (&'a D, &'a K),
        (start, restored): (u64, Option<(u64, PathBuf)>),
    ) -> RmaRows<'a, D, K> {
        let nt = cfg.tables.len();
        RmaRows {
            roles,
            w,
            cfg: cfg.clone(),
            lay: lay.clone(),
            data,
            ctl,
            known: RefCell::new((0..nt).map(|_| RowIndex::default()).collect()),
            fresh: RefCell::new(vec![HashMap::new(); nt]),
            start,
            pushes: Cell::new(0),
            restored,
        }
    }

    fn me(&self) -> String {
        self.roles.task(self.roles.workers[self.w])
    }

    fn ps_task(&self, k: usize) -> String {
        self.roles.task(self.roles.ps[k])
    }

    fn lost(&self, k: usize, what: &str) -> PsError {
        PsError::Lost {
            task: self.me(),
            lost: format!("{} ({what})", self.ps_task(k)),
            secs: self.cfg.peer_timeout.as_secs(),
        }
    }

    /// The step every ps must have published before this worker reads rows: its own
    /// pushes applied.
    fn due(&self) -> u64 {
        self.start + self.pushes.get()
    }

    /// Waits until every ps published the steps this worker pushed (asynchronous: no ps
    /// publishes steps, every push is in when it returns); a ps's `ABORT` ends the wait
    /// with its reason.
    fn wait_published(&self) -> Result<(), PsError> {
        let due = match self.cfg.asynchronous {
            true => i64::MIN,
            false => self.due() as i64,
        };
        for k in 0..self.lay.nps {
            let rank = self.roles.ps[k];
            // STEP, ABORT and SAVED (a ps writing a checkpoint counts it down: a sign of
            // life) in one atomic read.
            let mut words = [0i64; SAVED + 1];
            let mut abort = 0;
            wait_alive(
                self.ctl,
                self.cfg.peer_timeout,
                || {
                    self.ctl.read_atomic(rank, STEP, &mut words)?;
                    abort = words[ABORT];
                    let step = if abort != 0 { i64::MAX } else { words[STEP] };
                    Ok((step, words[SAVED]))
                },
                |step| step >= due,
                || self.lost(k, &format!("step {due}'s rows not published")),
            )?;
            if abort != 0 {
                let why = aborted(abort, &self.ps_task(k), self.roles, &self.cfg.tables);
                return Err(PsError::Remote {
                    task: self.me(),
                    message: why,
                });
            }
        }
        Ok(())
    }

    /// Every ps's `ABORT` read once more: a failure it announced, or `e`.
    fn or_aborted(&self, e: PsError) -> PsError {
        match self.wait_published() {
            Err(remote @ PsError::Remote { .. }) => remote,
            _ => e,
        }
    }

    /// Asynchronous: adds `-lr x scale x` each row's gradient of `grads` into its ps's
    /// window, then counts the push and its rows on every ps.
    fn push_async(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), PsError> {
        let by = -async_lr(&self.cfg.sparse).map_err(PsError::Setup)? * scale;
        let (nps, nt, dims) = (self.lay.nps, self.lay.tables(), &self.lay.dims);
        let want: Vec<(usize, &[u64])> = grads.iter().map(|(t, g)| (*t, &g.ids[..])).collect();
        let mut looks = self.looks(&want);
        let found = self.find(&mut looks, true)?;
        // Per ps and table: the rows' places and their scaled gradients, one accumulate.
        let mut offsets = vec![Vec::<usize>::new(); nps * nt];
        let mut values = vec![Vec::<f32>::new(); nps * nt];
        for (l, f) in looks.iter().zip(&found) {
            let ((b, _), dim, g) = (f.expect("a push makes its rows"), dims[l.t], l.k * nt + l.t);
            offsets[g].push(self.lay.values_at[l.t][l.k] + b * dim);
            let row = &grads[l.i].1.values[l.j * dim..(l.j + 1) * dim];
            values[g].extend(row.iter().map(|v| v * by));
        }
        let adds = (offsets.iter().zip(&values).enumerate())
            .filter(|(_, (o, _))| !o.is_empty())
            .map(|(g, (o, v))| (self.roles.ps[g / nt], &o[..], dims[g % nt], &v[..]));
        self.data.accumulate_blocks(adds)?;
        let rows: Vec<i64> = offsets.iter().map(|o| o.len() as i64).collect();
        self.add_stats(|k, t| [0, i64::from(rows[k * nt + t] > 0), rows[k * nt + t]])?;
        for k in 0..nps {
            (self.ctl).fetch_and_add(self.roles.ps[k], self.lay.pushed(self.w), 1)?;
        }
        self.pushes.set(self.pushes.get() + 1);
        self.fresh.borrow_mut().iter_mut().for_each(HashMap::clear);
        Ok(())
    }

    /// Puts this worker's staged rows of `grads` on every ps and counts its push there.
    fn push(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), PsError> {
        if self.cfg.asynchronous {
            return self.push_async(grads, scale);
        }
        let (nps, nt, w) = (self.lay.nps, self.lay.tables(), self.w);
        let want: Vec<(usize, &[u64])> = grads.iter().map(|(t, g)| (*t, &g.ids[..])).collect();
        let mut looks = self.looks(&want);
        let found = self.find(&mut looks, true)?;
        // Per ps and table: staged (bucket, id) words and scaled values.
        let mut ids = vec![vec![Vec::<i64>::new(); nt]; nps];
        let mut values = vec![vec![Vec::<f32>::new(); nt]; nps];
        for (l, f) in looks.iter().zip(&found) {
            let (b, _) = f.expect("a push makes its rows");
            let (g, dim) = (grads[l.i].1, self.lay.dims[l.t]);
            ids[l.k][l.t].extend([b as i64, l.id as i64]);
            let row = &g.values[l.j * dim..(l.j + 1) * dim];
            values[l.k][l.t].extend(row.iter().map(|v| v * scale));
        }
        let mut counts = vec![vec![0i64; nt]; nps];
        for k in 0..nps {
            for t in 0..nt {
                let n = ids[k][t].len() / 2;
                if n > self.lay.per_push {
                    return Err(PsError::Setup(format!(
                        "{}: table {}: a push of {n} rows to {} is more than its staging area holds ({}): push_rows sizes it (the rows of a table one worker pushes in a step; the command line's, one id per sample of --batch)",
                        self.me(),
                        self.cfg.tables[t].name,
                        self.ps_task(k),
                        self.lay.per_push
                    )));
                }
                counts[k][t] = n as i64;
            }
        }
        let (mut ctl_puts, mut data_puts) = (Vec::new(), Vec::new());
        for k in 0..nps {
            let rank = self.roles.ps[k];
            ctl_puts.push((rank, self.lay.count(w, 0), &counts[k][..]));
            for t in (0..nt).filter(|t| !ids[k][*t].is_empty()) {
                ctl_puts.push((rank, self.lay.staged_ids(k, w, t), &ids[k][t][..]));
                data_puts.push((rank, self.lay.staged_values(k, w, t), &values[k][t][..]));
            }
        }
        self.ctl.puts(ctl_puts)?;
        self.data.puts(data_puts)?;
        for k in 0..nps {
            let rank = self.roles.ps[k];
            self.ctl.fetch_and_add(rank, self.lay.pushed(w), 1)?;
            self.ctl.fetch_and_add(rank, ARRIVALS, 1)?;
        }
        self.pushes.set(self.pushes.get() + 1);
        // Every row pushed is written by the time this worker reads again (reads wait for
        // the step): its bucket is known from now on.
        let mut known = self.known.borrow_mut();
        for (l, f) in looks.iter().zip(&found) {
            if let (Some((b, _)), None) = (f, known[l.t].get(l.id)) {
                known[l.t].insert(l.id, *b as u32, 0);
            }
        }
        self.fresh.borrow_mut().iter_mut().for_each(HashMap::clear);
        Ok(())
    }

    /// The rows of `want` into `out`, once every ps published this worker's pushes.
    fn pull(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), PsError> {
        self.wait_published()?;
        let mut looks = self.looks(want);
        let found = self.find(&mut looks, make)?;
        for ((t, ids), o) in want.iter().zip(out.iter_mut()) {
            o.clear();
            o.resize(ids.len() * self.lay.dims[*t], 0.0);
        }
        // Rows the ps wrote are read from its window, one gather per ps and table; the
        // others are their initial values.
        let (nt, dims) = (self.lay.tables(), &self.lay.dims);
        let mut offsets = vec![Vec::<usize>::new(); self.lay.nps * nt];
        let mut places = vec![Vec::<(usize, usize)>::new(); self.lay.nps * nt];
        for (l, f) in looks.iter().zip(&found) {
            let dim = dims[l.t];
            match f {
                Some((b, true)) => {
                    let g = l.k * nt + l.t;
                    offsets[g].push(self.lay.values_at[l.t][l.k] + b * dim);
                    places[g].push((l.i, l.j));
                }
                _ => {
                    let spec = &self.cfg.tables[l.t];
                    let row = &mut out[l.i][l.j * dim..(l.j + 1) * dim];
                    spec.init.fill(self.cfg.seed, spec, l.id, row);
                }
            }
        }
        let mut bufs: Vec<Vec<f32>> = (offsets.iter().enumerate())
            .map(|(g, o)| vec![0.0; o.len() * dims[g % nt]])
            .collect();
        let gathers = bufs.iter_mut().enumerate().map(|(g, buf)| {
            let target = self.roles.ps[g / nt];
            (target, &offsets[g][..], dims[g % nt], &mut buf[..])
        });
        self.data
            .gathers(gathers.filter(|(_, o, _, _)| !o.is_empty()))?;
        for (g, (places, buf)) in places.iter().zip(&bufs).enumerate() {
            let dim = dims[g % nt];
            for ((i, j), row) in places.iter().zip(buf.chunks_exact(dim.max(1))) {
                out[*i][j * dim..(j + 1) * dim].copy_from_slice(row);
            }
        }
        Ok(())
    }

    /// Each ps's report of its rows, read from its window.
    fn report(&self) -> Result<Vec<RowsReport>, PsError> {
        self.wait_published()?;
        let nt = self.lay.tables();
        let mut out = Vec::new();
        for k in 0..self.lay.nps {
            let mut words = vec![0i64; STATS * nt];
            self.ctl
                .get_into(self.roles.ps[k], self.lay.stats(0), &mut words)?;
            let tables = (self.cfg.tables.iter().zip(words.chunks_exact(STATS)))
                .map(|(spec, s)| TableReport {
                    table: spec.name.clone(),
                    rows: s[0] as u64,
                    bytes: s[0] as u64
                        * crate::model::embedding::Table::row_bytes(spec, &self.cfg.sparse) as u64,
                    pushes: s[1] as u64,
                    rows_pushed: s[2] as u64,
                    ..TableReport::default()
                })
                .collect();
            out.push(RowsReport {
                task: self.ps_task(k),
                tables,
            });
        }
        Ok(out)
    }

    /// The chief: every ps writes its rows of checkpoint `step` into `dir` (the
    /// checkpoint's staging directory); their files.
    fn save_rows(&self, dir: &Path) -> Result<Vec<(String, u64, u64)>, PsError> {
        let step = self.due();
        let ckpt = self.cfg.checkpoint_dir.as_deref();
        if ckpt.map(|c| checkpoint::staging_dir(c, step)).as_deref() != Some(dir) {
            return Err(PsError::Setup(format!(
                "the rows over windows are saved into {}, not {} (step {step})",
                ckpt.map_or("no checkpoint directory".into(), |c| {
                    checkpoint::staging_dir(c, step).display().to_string()
                }),
                dir.display()
            )));
        }
        // Asked once the ps applied this step: it writes nothing meanwhile.
        self.wait_published()?;
        let mut files = Vec::new();
        for k in 0..self.lay.nps {
            let rank = self.roles.ps[k];
            let asked = self.ctl.fetch_and_add(rank, SAVE_AT, 0)?;
            self.ctl.fetch_and_add(rank, SAVE_AT, step as i64 - asked)?;
        }
        for k in 0..self.lay.nps {
            let rank = self.roles.ps[k];
            let mut abort = 0;
            wait_until(
                self.ctl,
                self.cfg.peer_timeout,
                || {
                    abort = self.ctl.fetch_and_add(rank, ABORT, 0)?;
                    let saved = self.ctl.fetch_and_add(rank, SAVED, 0)?;
                    Ok(if abort != 0 { i64::MAX } else { saved })
                },
                |saved| saved >= step as i64,
                || self.lost(k, &format!("its rows of checkpoint {step} not written")),
            )?;
            if abort != 0 {
                return Err(self.or_aborted(PsError::Setup("a ps failed".into())));
            }
            let mut sums = [0i64; 2];
            self.ctl.read_atomic(rank, SAVED_BYTES, &mut sums)?;
            let file = crate::train::ps::shards::file(k);
            files.push((file, sums[0] as u64, sums[1] as u64));
        }
        Ok(files)
    }

    /// Tells every ps this worker ended: marks its pushes ended, adds to `ENDED`
    /// (`failed_alone`: its number in `WORKER_FAILED` first; an agreed failure counts
    /// [`AGREED`]), its signal in `STOPPED_BY`.
    fn ended(&self, signal: Option<i32>, failed_alone: bool, agreed: bool) -> Result<(), PsError> {
        for k in 0..self.lay.nps {
            let rank = self.roles.ps[k];
            if let Some(s) = signal {
                self.ctl
                    .compare_and_swap(rank, STOPPED_BY, 0, i64::from(s))?;
            }
            if failed_alone {
                self.ctl
                    .compare_and_swap(rank, WORKER_FAILED, 0, self.w as i64 + 1)?;
            }
            self.ctl
                .fetch_and_add(rank, self.lay.pushed(self.w), PUSHES_ENDED)?;
            let add = if agreed { AGREED } else { 1 };
            self.ctl.fetch_and_add(rank, ENDED, add)?;
        }
        Ok(())
    }
}

/// What an agreed failure adds to `ENDED` (a plain end adds one).
pub(super) const AGREED: i64 = 1 << 20;

impl<D: Access<f32>, K: Access<i64>> Tables for RmaRows<'_, D, K> {
    fn table_specs(&self) -> &[TableSpec] {
        &self.cfg.tables
    }

    fn pull_tables(
        &self,
        want: &[(usize, &[u64])],
        out: &mut [Vec<f32>],
        make: bool,
    ) -> Result<(), TrainError> {
        self.pull(want, out, make)
            .map_err(|e| self.or_aborted(e).into())
    }

    fn push_tables(&self, grads: &[(usize, &SparseGrad)], scale: f32) -> Result<(), TrainError> {
        self.push(grads, scale)
            .map_err(|e| self.or_aborted(e).into())
    }

    /// Every worker's share of the step: the ps sums them.
    fn push_scale(&self) -> f32 {
        1.0 / self.lay.nw.max(1) as f32
    }

    fn rows_report(&self) -> Result<Vec<RowsReport>, TrainError> {
        Ok(self.report()?)
    }

    /// Each ps applies a step once every worker pushed it.
    fn pushes_every_step(&self) -> bool {
        true
    }
}

impl<D: Access<f32>, K: Access<i64>> RowHome for RmaRows<'_, D, K> {
    /// The ps tasks restored the checkpoint every rank found; the chief checks that it is
    /// the one its mode restores.
    fn start(&mut self, restore: Option<&Path>) -> Result<(), TrainError> {
        let mine = self.restored.as_ref().map(|r| r.1.as_path());
        if mine != restore {
            let name = |p: Option<&Path>| p.map_or("none".into(), |p| p.display().to_string());
            return Err(TrainError::Setup(format!(
                "the ps tasks restored the rows of checkpoint {} but the chief restores {}: the checkpoint directory changed during the start",
                name(mine),
                name(restore)
            )));
        }
        Ok(())
    }

    fn save(&mut self, dir: &Path) -> Result<Vec<(String, u64, u64)>, TrainError> {
        Ok(self.save_rows(dir)?)
    }

    fn end(&mut self, how: &End<'_>) -> Result<(), TrainError> {
        let told = match how {
            End::Done => self.ended(None, false, false),
            End::Stopped(signal) => self.ended(Some(*signal), false, false),
            End::Failed(e) if e.is_agreed() => self.ended(None, false, true),
            End::Failed(_) | End::Abandoned => self.ended(None, true, false),
        };
        Ok(told?)
    }
}
