//! Embedding tables' rows over one-sided windows (`--mode hybrid --transport rma`): each
//! ps task exposes its rows of every table at fixed offsets; workers find a row's place,
//! read it with `MPI_Get` and write their sparse gradients into the ps's window with
//! `MPI_Put`. The ps's CPU works once per step, never per request: it sums the step's
//! gradients and applies the sparse optimizer (SGD, Adagrad, lazy Adam, each row's state
//! beside it on the ps).
//!
//! **Where a row is**: ps `k` holds the rows [`row_owner`](crate::train::ps::protocol::row_owner)
//! gives it, in an open-addressing table of `buckets` (a power of two, at least twice the
//! rows it may hold, [`RowsConfig::rows_per_table`]) in its `ctl` window. A bucket's word is
//! 0 while empty, else `id + 1`, marked applied once the ps wrote the row's values. A
//! worker finds row `id` by `MPI_Compare_and_swap` of 0 for `id + 1` at its home bucket
//! (Fibonacci hashing), then the next: the first swap claims a bucket for a new row, a
//! word of `id` finds it, another id sends it on. Every lookup of a batch is started
//! together, one flush per probe round (a round or two at half load). Rows never move, so
//! a worker keeps each applied row's bucket and asks for it once.
//!
//! **Values**: the bucket's row in `data` at `values_at + bucket x dim`. A row claimed but
//! not applied yet reads as its seeded initial values, computed by the worker (the ps
//! writes nothing at a claim, which it does not see).
//!
//! **A step**: every worker puts, on every ps, its sparse gradient's rows of that ps (each
//! a bucket, its id and `dim` values, scaled by the worker's share of the step) into its own
//! staging area, their count per table, then adds one to `ARRIVALS`. When every worker
//! has, the ps sums the gradients of each row, applies them to its own tables (a
//! [`Table`](crate::model::embedding::Table) per table: the rows' optimizer state and the checkpoint's rows), writes the
//! rows' new values into the window, marks their buckets applied and publishes the
//! step in `STEP`. A worker reads rows only once every ps published the steps it pushed,
//! so a pull holds every update of the steps before it (the same update as local training
//! on the global batch), and no ps writes a row while a worker reads it.
//!
//! **Asynchronous** ([`RowsConfig::asynchronous`]): no step gathers the workers' rows. A
//! worker that claims a bucket puts the row's initial values into the ps's window, then
//! marks the bucket applied (a compare-and-swap); a worker that finds a bucket claimed but
//! not marked waits for the mark (a claim in flight, microseconds). Every row a worker
//! reads is then in the window, read by gets without waiting for any step, and its push
//! adds `-lr x gradient` at the rows' places by `MPI_Accumulate` (plain SGD, applied as it
//! arrives, like the dense one-sided `--async`), counting its push and the rows' report
//! words on the ps. The ps's CPU works only for a checkpoint: asked for step `s`, it waits
//! until every worker counted `s` pushes (in hybrid training the others then wait for the
//! chief's checkpoint), reads its marked buckets and their rows from its own window and
//! writes them as synchronous rows are written (no optimizer state: SGD has none).
//!
//! **Checkpoints**: every rank finds the newest valid checkpoint before the windows open;
//! each ps restores its rows from it (its buckets filled, marked applied). The chief asks
//! ps `k` for step `s` by writing `s` into `SAVE_AT`; the ps, holding step `s` (no worker
//! pushes the next before the chief), writes its rows into the staging directory, then
//! their size, checksum and the step.
//!
//! **Ends**: a worker that ends marks its pushes ended and adds one to `ENDED` (and its signal to `STOPPED_BY`, or
//! `WORKER_FAILED` its number where it failed alone); a ps ends once every worker has. A
//! ps that fails (rows beyond its memory, a worker lost) leaves why in `ABORT` and the
//! workers waiting on it stop with it; every wait has the `--peer-timeout` deadline.

mod serve;
#[cfg(test)]
mod tests;
mod worker;

use std::path::PathBuf;
use std::time::Duration;

use super::{wait_alive, wait_until, write_saving, RmaWindow};
use crate::model::embedding::{SparseOptimizer, TableSpec};
use crate::train::checkpoint;
use crate::train::ps::{PsError, Roles};
use crate::train::resources::Share;
use crate::transport::rma::AllocateError;
use crate::transport::Comm;
use serve::{Beside, Serving};
pub use worker::RmaRows;

const STEP: usize = 0;
const ARRIVALS: usize = 1;
const ENDED: usize = 2;
const ABORT: usize = 3;
const SAVE_AT: usize = 4;
const SAVED: usize = 5;
/// The saved rows' bytes, then their checksum.
const SAVED_BYTES: usize = 6;
const STOPPED_BY: usize = 8;
const WORKER_FAILED: usize = 9;
/// Where the per-worker words start: pushes counted, then rows staged per table, then
/// each table's report ([`STATS`] words).
const HEAD: usize = 10;
const STATS: usize = 3;

/// What a worker that ended adds to its pushes' word, so a ps tells a worker that ended
/// without pushing a step from one that pushed it first.
const PUSHES_ENDED: i64 = 1 << 40;

/// A bucket's mark once the ps wrote its row's values.
const APPLIED: i64 = 1 << 62;
/// The id bits of a bucket's word (`id + 1`).
const ID_BITS: i64 = APPLIED - 1;

/// How far a lookup probes before it calls the table full (at most half full, probes
/// are short).
const MAX_PROBES: usize = 64;

/// What a ps leaves in `ABORT`: the kind (high bits) and a table or worker index.
const ABORT_OUTGREW: i64 = 1 << 32;
const ABORT_LOST: i64 = 2 << 32;
const ABORT_FAILED: i64 = 3 << 32;
const ABORT_ENDED: i64 = 4 << 32;

/// Settings of rows over windows.
#[derive(Debug, Clone)]
pub struct RowsConfig {
    /// The tables.
    pub tables: Vec<TableSpec>,
    /// How rows are updated.
    pub sparse: SparseOptimizer,
    /// The rows' initial values' seed.
    pub seed: u64,
    /// Rows of one table one ps may hold, at most (its window is sized for them: the
    /// table's rows over the ps tasks where fewer).
    pub rows_per_table: u64,
    /// Rows of one table one worker pushes per step, at most (its staging area's size).
    pub rows_per_push: usize,
    /// How long a wait on another task lasts before that task is called lost.
    pub peer_timeout: Duration,
    /// Where checkpoints are (the ps tasks restore from and write into it).
    pub checkpoint_dir: Option<PathBuf>,
    /// A ps task's share of its node's memory (`None`: unchecked).
    pub memory: Option<Share>,
    /// Each worker's rows applied as its push arrives, plain SGD added into the ps's
    /// window by `MPI_Accumulate`, instead of every worker's step summed and applied once
    /// by the ps with the sparse optimizer (see the module's protocol).
    pub asynchronous: bool,
}

impl RowsConfig {
    /// The rows of ps training's tables (`cfg.tables`): windows of `cfg.window_rows` rows
    /// of a table per ps task, `cfg.push_rows` per push (by default a worker's share of the
    /// global batch, one id per sample and table), memory unchecked.
    pub fn of(cfg: &crate::train::ps::PsConfig, layout: &crate::cluster::Layout) -> RowsConfig {
        let nw = Roles::new(layout).map_or(1, |r| r.workers.len().max(1));
        RowsConfig {
            tables: cfg.tables.clone(),
            sparse: cfg.sparse,
            seed: cfg.train.seed,
            rows_per_table: cfg.window_rows,
            rows_per_push: (cfg.push_rows).unwrap_or(cfg.train.batch.div_ceil(nw)),
            peer_timeout: cfg.peer_timeout,
            checkpoint_dir: cfg.train.checkpoint_dir.clone(),
            memory: None,
            asynchronous: !cfg.sync,
        }
    }
}

/// The step size of asynchronous rows updated by `sparse` (plain SGD: one
/// `MPI_Accumulate` applies it), or why they cannot be asynchronous.
pub(in crate::train::ps::rma) fn async_lr(sparse: &SparseOptimizer) -> Result<f32, String> {
    match sparse {
        SparseOptimizer::Sgd { lr } => Ok(*lr),
        other => Err(format!(
            "--transport rma --async adds each push into the rows with MPI_Accumulate, plain SGD: use --sparse-optimizer sgd, or --sync (not {})",
            other.name()
        )),
    }
}

/// Where everything is in every ps's windows: computed alike on every rank.
#[derive(Debug, Clone)]
struct Layout {
    nps: usize,
    nw: usize,
    dims: Vec<usize>,
    /// Per table, per ps: its buckets, where they start in `ctl`, where their values
    /// start in `data`.
    buckets: Vec<Vec<usize>>,
    bucket_at: Vec<Vec<usize>>,
    values_at: Vec<Vec<usize>>,
    /// Per ps: where the staging areas start in `ctl` and `data`.
    stage_ids: Vec<usize>,
    stage_values: Vec<usize>,
    /// Staged rows per worker and table.
    per_push: usize,
    /// Per ps: the windows' lengths.
    ctl_len: Vec<usize>,
    data_len: Vec<usize>,
}

/// Rows of a table of `rows` that ps `k` of `nps` holds ([`row_owner`]: `id % nps`).
///
/// [`row_owner`]: crate::train::ps::protocol::row_owner
fn owned(rows: u64, k: usize, nps: usize) -> u64 {
    let nps = nps as u64;
    rows / nps + u64::from((k as u64) < rows % nps)
}

impl Layout {
    fn new(cfg: &RowsConfig, nps: usize, nw: usize) -> Result<Layout, String> {
        let nt = cfg.tables.len();
        let mut l = Layout {
            nps,
            nw,
            dims: cfg.tables.iter().map(|t| t.dim).collect(),
            buckets: vec![Vec::new(); nt],
            bucket_at: vec![Vec::new(); nt],
            values_at: vec![Vec::new(); nt],
            stage_ids: Vec::new(),
            stage_values: Vec::new(),
            per_push: cfg.rows_per_push.max(1),
            ctl_len: Vec::new(),
            data_len: Vec::new(),
        };
        for k in 0..nps {
            let (mut ctl, mut data) = (HEAD + nw + nw * nt + STATS * nt, 0);
            for (t, spec) in cfg.tables.iter().enumerate() {
                let held = owned(spec.rows, k, nps).min(cfg.rows_per_table).max(1);
                let n = (2 * held).next_power_of_two() as usize;
                if n > 1 << 31 {
                    return Err(format!(
                        "table {}: {held} rows per ps task are more than one window holds (2^30)",
                        spec.name
                    ));
                }
                l.buckets[t].push(n);
                l.bucket_at[t].push(ctl);
                l.values_at[t].push(data);
                ctl += n;
                data += n * spec.dim;
            }
            l.stage_ids.push(ctl);
            l.stage_values.push(data);
            ctl += nw * nt * 2 * l.per_push;
            data += nw * l.per_push * l.dims.iter().sum::<usize>();
            l.ctl_len.push(ctl);
            l.data_len.push(data);
        }
        Ok(l)
    }

    fn tables(&self) -> usize {
        self.dims.len()
    }

    /// The word counting worker `w`'s pushes.
    fn pushed(&self, w: usize) -> usize {
        HEAD + w
    }

    /// The word counting worker `w`'s staged rows of table `t`.
    fn count(&self, w: usize, t: usize) -> usize {
        HEAD + self.nw + w * self.tables() + t
    }

    /// Where table `t`'s report starts in `ctl` (rows held, pushes, rows pushed).
    fn stats(&self, t: usize) -> usize {
        HEAD + self.nw + self.nw * self.tables() + STATS * t
    }

    /// Where worker `w`'s staged rows of table `t` (each a bucket and an id) start in ps
    /// `k`'s `ctl`.
    fn staged_ids(&self, k: usize, w: usize, t: usize) -> usize {
        self.stage_ids[k] + (w * self.tables() + t) * 2 * self.per_push
    }

    /// Where worker `w`'s staged values of table `t` start in ps `k`'s `data`.
    fn staged_values(&self, k: usize, w: usize, t: usize) -> usize {
        let before: usize = self.dims[..t].iter().sum();
        let all: usize = self.dims.iter().sum();
        self.stage_values[k] + self.per_push * (w * all + before)
    }

    /// Row `id`'s home bucket in ps `k`'s table `t`.
    fn home(&self, t: usize, k: usize, id: u64) -> usize {
        let bits = self.buckets[t][k].trailing_zeros();
        (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - bits).min(63)) as usize
            & (self.buckets[t][k] - 1)
    }

    /// The bytes ps `k`'s windows take.
    fn bytes(&self, k: usize) -> u64 {
        8 * self.ctl_len[k] as u64 + 4 * self.data_len[k] as u64
    }
}

/// The windows of rows over windows, allocated on every rank (empty but on ps tasks).
struct Windows<C: Comm> {
    data: C::Window<f32>,
    ctl: C::Window<i64>,
}

impl<C: Comm> Windows<C> {
    /// Allocates them (a collective over `comm`).
    fn open(comm: &C, roles: &Roles, lay: &Layout) -> Result<Windows<C>, PsError> {
        let (ctl, data) = match roles.ps_index(comm.rank()) {
            Some(k) => (lay.ctl_len[k], lay.data_len[k]),
            None => (0, 0),
        };
        let setup = |e: AllocateError| PsError::Setup(e.to_string());
        Ok(Windows {
            data: comm.window::<f32>(data).map_err(setup)?,
            ctl: comm.window::<i64>(ctl).map_err(setup)?,
        })
    }
}

/// A window of `T` of communicator `C`, open for one-sided operations.
pub type Open<'a, C, T> = <<C as Comm>::Window<T> as RmaWindow<T>>::Open<'a>;

/// A worker's rows over this job's windows (lives inside [`scope`]).
pub type Rows<'a, 'w, C> = RmaRows<'a, Open<'w, C, f32>, Open<'w, C, i64>>;

/// The rows' windows of a job (allocated on every rank, empty but on ps tasks) with their
/// settings and layout.
pub(in crate::train::ps::rma) struct Job<C: Comm> {
    cfg: RowsConfig,
    lay: Layout,
    windows: Windows<C>,
}

impl<C: Comm> Job<C> {
    /// Allocates the windows for `cfg`'s tables (a collective over `comm`).
    pub(in crate::train::ps::rma) fn open(
        comm: &C,
        roles: &Roles,
        cfg: RowsConfig,
    ) -> Result<Job<C>, PsError> {
        let lay = Layout::new(&cfg, roles.ps.len(), roles.workers.len()).map_err(PsError::Setup)?;
        let windows = Windows::open(comm, roles, &lay)?;
        Ok(Job { cfg, lay, windows })
    }

    /// Ps `k`'s rows, restored from checkpoint `restored` into its windows (before any
    /// rank opens them).
    pub(in crate::train::ps::rma) fn prepare(
        &mut self,
        k: usize,
        restored: Option<&checkpoint::Found>,
    ) -> Result<Serving, PsError> {
        Serving::prepare(k, &self.lay, &self.cfg, restored, &mut self.windows)
    }

    /// The windows open for one-sided operations.
    pub(in crate::train::ps::rma) fn open_windows(&mut self) -> Result<Opened<'_, C>, PsError>
    where
        C::Window<f32>: 'static,
        C::Window<i64>: 'static,
    {
        Ok(Opened {
            data: self.windows.data.open()?,
            ctl: self.windows.ctl.open()?,
            cfg: &self.cfg,
            lay: &self.lay,
        })
    }

    /// Frees the windows (a collective: every rank must be past its last operation).
    pub(in crate::train::ps::rma) fn free(self) -> Result<(), PsError> {
        self.windows.data.free()?;
        self.windows.ctl.free()?;
        Ok(())
    }
}

/// A job's rows' windows, open.
pub(in crate::train::ps::rma) struct Opened<'w, C: Comm>
where
    C::Window<f32>: 'w,
    C::Window<i64>: 'w,
{
    data: Open<'w, C, f32>,
    ctl: Open<'w, C, i64>,
    cfg: &'w RowsConfig,
    lay: &'w Layout,
}

impl<'w, C: Comm> Opened<'w, C>
where
    C::Window<f32>: 'w,
    C::Window<i64>: 'w,
{
    /// A ps task's rows, served from these windows.
    pub(in crate::train::ps::rma) fn beside<'a>(
        &'a mut self,
        ps: Serving,
        roles: &'a Roles,
    ) -> Beside<'a, Open<'w, C, f32>, Open<'w, C, i64>> {
        Beside {
            ps,
            roles,
            cfg: self.cfg,
            lay: self.lay,
            data: &mut self.data,
            ctl: &self.ctl,
        }
    }

    /// Worker `w`'s way to the rows, which start at checkpoint `restored` (its step and
    /// path) or step 0.
    pub(in crate::train::ps::rma) fn worker<'a>(
        &'a self,
        roles: &'a Roles,
        w: usize,
        restored: Option<&checkpoint::Found>,
    ) -> Rows<'a, 'w, C> {
        let start = restored.map_or(0, |f| f.step);
        let found = restored.map(|f| (f.step, f.path.clone()));
        RmaRows::new(
            roles,
            w,
            self.cfg,
            self.lay,
            (&self.data, &self.ctl),
            (start, found),
        )
    }
}

/// Rows over windows on every rank of `comm` (a collective: every rank allocates the
/// windows): a ps task restores its rows and serves the workers until they end (`None`);
/// a worker hands its rows to `drive`, whose result it returns; another task (an
/// evaluator) only comes to the windows' allocation and release. The windows are freed
/// when it returns.
pub fn scope<C: Comm, R>(
    comm: &C,
    roles: &Roles,
    cfg: &RowsConfig,
    drive: impl for<'a, 'w> FnOnce(Rows<'a, 'w, C>) -> Result<R, crate::train::engine::TrainError>,
) -> Result<Option<R>, PsError>
where
    C::Window<f32>: 'static,
    C::Window<i64>: 'static,
{
    let me = comm.rank();
    if cfg.asynchronous {
        // The same verdict on every rank, before any collective.
        async_lr(&cfg.sparse).map_err(PsError::Setup)?;
    }
    // Every rank finds the same one: the directory does not change before training.
    let restored = match cfg.checkpoint_dir.as_deref() {
        Some(dir) => {
            checkpoint::prepare_dir(dir)?;
            checkpoint::latest(dir).0
        }
        None => None,
    };
    let mut job = Job::<C>::open(comm, roles, cfg.clone())?;
    // A ps that cannot set up must not leave the others waiting: every rank learns
    // whether all are ready before any opens the windows.
    let prepared = roles
        .ps_index(me)
        .map(|k| job.prepare(k, restored.as_ref()))
        .transpose();
    let everyone = crate::transport::Collectives::new(comm.split(0, me)?);
    let ready = ready_everywhere(&everyone, prepared.is_ok());
    let serving = prepared?;
    ready?;
    let result = {
        let mut open = job.open_windows()?;
        match (serving, roles.worker_index(me)) {
            (Some(ps), _) => open.beside(ps, roles).serve().map(|()| None),
            (None, Some(w)) => drive(open.worker(roles, w, restored.as_ref()))
                .map(Some)
                .map_err(PsError::from),
            (None, None) => Ok(None),
        }
    };
    if ended(&result) {
        // Everyone is past its last operation: the collective frees cannot wait on a
        // failure.
        job.free()?;
    }
    result
}

/// Whether every rank of `everyone` set up (`ok` on this one), then a barrier before any
/// opens the windows; where one did not, an error on every rank and no barrier (the rank
/// that failed says its own error instead).
pub(in crate::train::ps::rma) fn ready_everywhere<C: Comm>(
    everyone: &crate::transport::Collectives<C>,
    ok: bool,
) -> Result<(), PsError> {
    let failed = everyone.allgather_varlen(&[u8::from(!ok)])?;
    if failed.iter().any(|f| f[0] != 0) {
        return Err(PsError::Setup(
            "another rank could not set up one-sided training (its error says why)".into(),
        ));
    }
    everyone.barrier()?;
    Ok(())
}

/// Whether a rank's run ended so that every rank reaches the windows' release: done, or
/// an end every rank shares.
pub(in crate::train::ps::rma) fn ended<R>(result: &Result<R, PsError>) -> bool {
    match result {
        Ok(_) => true,
        Err(e) => matches!(
            e,
            PsError::Stopped(_) | PsError::NotApplied(_) | PsError::Ended(_)
        ),
    }
}

/// A ps task's rows served beside its dense shards (`--mode ps --transport rma` with
/// tables): the dense ps polls them while it waits, brings them to a step before it
/// writes that step's checkpoint, and puts their arrays into its shard file.
pub(in crate::train::ps::rma) trait RowsOnPs {
    /// Serves what has come (a step every worker pushed is applied).
    fn poll(&mut self) -> Result<(), PsError>;
    /// Serves until the rows hold step `step`'s update (every worker pushed it).
    fn reach(&mut self, step: u64) -> Result<(), PsError>;
    /// The rows' arrays for a checkpoint's shard file.
    fn arrays(&self) -> Vec<(String, Vec<f32>)>;
    /// Asynchronous: the rows' arrays for a checkpoint's shard file, read from the window
    /// as the pushes land (a snapshot).
    fn snapshot(&mut self) -> Result<Vec<(String, Vec<f32>)>, PsError>;
    /// Serves until every worker ended; how they ended.
    fn finish(&mut self) -> Result<(), PsError>;
}

/// The line a worker gives for a ps's `ABORT` word `word` (ps task `ps`).
fn aborted(word: i64, ps: &str, roles: &Roles, specs: &[TableSpec]) -> String {
    let (kind, index) = (word & !((1 << 32) - 1), (word & ((1 << 32) - 1)) as usize);
    let worker = |w: usize| roles.task(roles.workers[w.min(roles.workers.len() - 1)]);
    match kind {
        ABORT_OUTGREW => format!(
            "{ps}: table {}'s rows outgrew the task's memory share (its error says more)",
            specs.get(index).map_or("?", |s| s.name.as_str())
        ),
        ABORT_LOST => format!("{ps}: lost {}: it pushed no step", worker(index)),
        ABORT_FAILED => format!("{ps}: {} failed (its error says why)", worker(index)),
        ABORT_ENDED => format!("{ps}: {} ended at a step the others pushed", worker(index)),
        _ => format!("{ps} stopped serving rows (its error says why)"),
    }
}
