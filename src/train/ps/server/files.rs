//! Requests whose work is a file's, done on a thread of its own while the ps goes on
//! serving: its checkpoint shard written (`Save`: the state copied at once, the state of
//! the step the chief asked at) or read (`Restore`: applied once read, all or nothing).
//!
//! A file may take longer than the peer timeout (a large shard, a parallel file system
//! under load), and so may a pull parked on a step some worker is slow to push. Neither is
//! a lost ps: while such a request waits, its worker is told every third of the timeout
//! that this ps is alive ([`Reply::Alive`]), and its deadline starts again. Nor is a
//! worker lost for its silence during a checkpoint: the chief waits for every ps task's
//! file and writes its own, and the other workers may all wait on it (hybrid training's
//! allreduce, a pipeline's stages), so from the chief's save or restore request to its
//! next request no worker is waited on, and every worker's silence counts from then.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::time::Instant;

use super::super::placement::Shard;
use super::super::protocol::{row_owner, Reply, Setup};
use super::super::{shards, PsError};
use super::Server;
use crate::model::embedding::Table;
use crate::train::checkpoint;
use crate::train::optim::{Optimizer, Slots};
use crate::train::tables::Served;
use crate::transport::comm::Comm;

/// A request's file work under way.
pub(super) struct Background {
    /// The requesting worker's rank.
    from: usize,
    job: Job,
    /// When the requester was last told this ps is alive.
    told: Instant,
}

enum Job {
    /// The shard's file `file` being written: its bytes and checksum.
    Save {
        file: String,
        written: Receiver<Result<(u64, u64), String>>,
    },
    /// A checkpoint's shard and rows being read.
    Restore {
        read: Receiver<Result<Restored, String>>,
    },
}

/// What a restore read: this ps's shards' values and optimizer state, the step, its rows.
pub(super) struct Restored {
    params: Vec<Vec<f32>>,
    slots: Vec<Slots>,
    step: u64,
    tables: Vec<Table>,
}

/// What reading a restore needs, owned by the thread that reads.
struct ToRead {
    dir: PathBuf,
    /// Every shard of every variable, and this ps's.
    all: Vec<Shard>,
    mine: Vec<Shard>,
    opt: Optimizer,
    /// A pipeline stage's variables: some of the checkpoint's.
    part: bool,
    /// The tables as configured (no rows), and this ps's index among `nps`.
    tables: Vec<Table>,
    k: usize,
    nps: usize,
}

impl ToRead {
    fn read(mut self) -> Result<Restored, String> {
        // Hybrid training's ps tasks hold rows alone: no variables to read.
        let (params, slots, step) = match self.all.is_empty() {
            true => (
                Vec::new(),
                Vec::new(),
                checkpoint::verify(&self.dir)
                    .map_err(|e| e.to_string())?
                    .step,
            ),
            false => shards::read(&self.dir, &self.mine, &self.all, &self.opt, self.part)
                .map_err(|e| e.to_string())?,
        };
        if !self.tables.is_empty() {
            let (_, files) = checkpoint::open(&self.dir).map_err(|e| e.to_string())?;
            let (k, nps) = (self.k, self.nps);
            let mine = |id| row_owner(id, nps) == k;
            checkpoint::tables::restore_rows(&mut self.tables, &files, mine)?;
        }
        Ok(Restored {
            params,
            slots,
            step,
            tables: self.tables,
        })
    }
}

impl<C: Comm> Server<'_, C> {
    /// Starts writing this ps's shard into staging directory `dir` for worker rank `from`
    /// (index `w`); answered by [`Server::tend`] once written.
    pub(super) fn start_save(&mut self, from: usize, w: usize, dir: &Path) -> Result<(), PsError> {
        if self.busy(from, w)? {
            return Ok(());
        }
        let file = shards::file_of(self.k, self.stage);
        let (path, arrays) = (dir.join(&file), self.snapshot());
        let write = move || checkpoint::write_file(&path, &arrays).map_err(|e| e.to_string());
        let spawned = self.spawn(from, write)?;
        if let Some(written) = spawned {
            self.background = Some(Background::new(from, Job::Save { file, written }));
        }
        Ok(())
    }

    /// Configures this ps by `setup` and starts reading its shard and rows of checkpoint
    /// `dir` for worker rank `from` (index `w`); applied and answered by [`Server::tend`].
    pub(super) fn start_restore(
        &mut self,
        (from, w): (usize, usize),
        setup: &Setup,
        dir: &Path,
    ) -> Result<(), PsError> {
        if self.busy(from, w)? {
            return Ok(());
        }
        if let Err(e) = self.configure(setup) {
            return self.error(from, e);
        }
        let to_read = ToRead {
            dir: dir.to_path_buf(),
            all: setup.shards.clone(),
            mine: self.shards.clone(),
            opt: self.opt,
            part: self.stage.is_some(),
            tables: self.tables.clone(),
            k: self.k,
            nps: self.roles.ps.len(),
        };
        let spawned = self.spawn(from, move || to_read.read())?;
        if let Some(read) = spawned {
            self.background = Some(Background::new(from, Job::Restore { read }));
        }
        Ok(())
    }

    /// Marks the checkpoint worker rank `from` (index `w`) asked for as under way; true
    /// if this ps still works on another's file (the worker told so, nothing started).
    fn busy(&mut self, from: usize, w: usize) -> Result<bool, PsError> {
        self.excused = Some(w);
        if self.background.is_none() {
            return Ok(false);
        }
        let why = "a checkpoint was asked for while this ps still reads or writes another";
        self.error(from, why.into()).map(|()| true)
    }

    /// Runs `work` on a thread of its own for worker rank `from`; `None`: it could not
    /// start, and the worker was told why.
    fn spawn<T: Send + 'static>(
        &mut self,
        from: usize,
        work: impl FnOnce() -> Result<T, String> + Send + 'static,
    ) -> Result<Option<Receiver<Result<T, String>>>, PsError> {
        let (done, outcome) = mpsc::channel();
        #[cfg(test)]
        let slow = checkpoint::SLOW_DISK.get();
        let run = move || {
            #[cfg(test)]
            std::thread::sleep(slow);
            // The server may have stopped meanwhile: nobody to tell.
            let _ = done.send(work());
        };
        match std::thread::Builder::new()
            .name("mpiflow-ps-file".into())
            .spawn(run)
        {
            Ok(_) => Ok(Some(outcome)),
            Err(e) => {
                let why = format!("cannot start a thread for its checkpoint file: {e}");
                self.error(from, why).map(|()| None)
            }
        }
    }

    /// Answers a save or a restore whose file work is done, and tells every worker whose
    /// request has waited here for a third of the timeout since it was last told that
    /// this ps is alive.
    pub(super) fn tend(&mut self) -> Result<(), PsError> {
        let done = match self.background.as_ref().map(|b| &b.job) {
            None => None,
            Some(Job::Save { written, .. }) => outcome(written).map(|o| o.map(Done::Saved)),
            Some(Job::Restore { read }) => outcome(read).map(|o| o.map(Done::Restored)),
        };
        let Some(done) = done else {
            return self.keep_alive();
        };
        let Background { from, job, .. } = self.background.take().expect("work under way");
        let stopped = || format!("{}: the thread of its checkpoint file stopped", self.me());
        let done = done.map_err(|e| e.unwrap_or_else(stopped));
        match (job, done) {
            (Job::Save { file, .. }, Ok(Done::Saved((bytes, checksum)))) => {
                let saved = Reply::Saved {
                    file,
                    bytes,
                    checksum,
                };
                self.reply(from, &saved)
            }
            (_, Ok(Done::Restored(r))) => match self.apply_restored(r) {
                Ok(()) => {
                    self.ok(from)?;
                    self.answer_pending()
                }
                Err(e) => self.error(from, e),
            },
            (_, Ok(Done::Saved(_))) => unreachable!("a save's outcome comes from a save"),
            (_, Err(e)) => self.error(from, e),
        }
    }

    /// Makes a restore's state this ps's (its rows within the memory share).
    fn apply_restored(&mut self, r: Restored) -> Result<(), String> {
        self.tables = r.tables;
        self.served = vec![Served::default(); self.tables.len()];
        let largest = (0..self.tables.len()).max_by_key(|t| self.tables[*t].bytes());
        largest.map_or(Ok(()), |t| self.row_room(t))?;
        for (i, p) in r.params.iter().enumerate() {
            let range = self.store.range(i);
            self.store.all_mut()[range].copy_from_slice(p);
        }
        self.slots = r.slots;
        self.global_step = r.step;
        self.initialized = true;
        Ok(())
    }

    fn keep_alive(&mut self) -> Result<(), PsError> {
        if self.background.is_none() && self.pending.is_empty() {
            return Ok(()); // nobody waits here: no clock read on the serving loop
        }
        let (every, now) = (self.timeout / 3, Instant::now());
        if let Some(b) = self.background.as_mut().filter(|b| now - b.told >= every) {
            b.told = now;
            let to = b.from;
            self.reply(to, &Reply::Alive)?;
        }
        let due: Vec<usize> = (self.pending.iter_mut())
            .filter(|p| now - p.told >= every)
            .map(|p| {
                p.told = now;
                p.from
            })
            .collect();
        due.into_iter()
            .try_for_each(|to| self.reply(to, &Reply::Alive))
    }
}

/// What a file's work came to.
enum Done {
    Saved((u64, u64)),
    Restored(Restored),
}

/// A thread's outcome, once it is there; its error, or `Err(None)` when the thread
/// stopped without one (the caller names itself).
fn outcome<T>(from: &Receiver<Result<T, String>>) -> Option<Result<T, Option<String>>> {
    match from.try_recv() {
        Err(TryRecvError::Empty) => None,
        Ok(outcome) => Some(outcome.map_err(Some)),
        Err(TryRecvError::Disconnected) => Some(Err(None)),
    }
}

impl Background {
    fn new(from: usize, job: Job) -> Background {
        Background {
            from,
            job,
            told: Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::train::checkpoint::{self, SLOW_DISK};
    use crate::train::data::Dataset;
    use crate::train::ps::test_support::{cfg, layout};
    use crate::train::ps::{rma, PsConfig};
    use crate::transport::comm::Comm;
    use crate::transport::local::LocalComm;

    /// A ps whose checkpoint files take two and a half peer timeouts to write or read
    /// (workers wait two before they call a ps lost), over messages and over windows:
    /// training goes on to its end, no rank lost, every checkpoint whole, and a rerun
    /// resumes from the last. Synchronous with two workers, so the second worker's pull
    /// waits on the chief while the chief waits on the save.
    #[test]
    fn a_checkpoint_slower_to_write_than_the_peer_timeout_loses_no_task() {
        let data = Dataset::synthetic(200, 8, 3, 1);
        let (train, test) = data.split_holdout(1);
        let mlp = crate::model::mlp(8, &[4], 3).unwrap();
        let l = layout(3, 1);
        type Run = fn(
            &LocalComm,
            &crate::cluster::Layout,
            &dyn crate::model::Model,
            &PsConfig,
            &Dataset,
            &Dataset,
            &mut dyn FnMut(&crate::train::Event),
        ) -> Result<(), crate::train::ps::PsError>;
        let transports: [(&str, Run); 2] = [
            ("messages", crate::train::ps::run::<LocalComm>),
            ("windows", rma::run::<LocalComm>),
        ];
        for (transport, run) in transports {
            let dir = std::env::temp_dir().join(format!(
                "mpiflow-ps-slow-{transport}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            let mut c = cfg(6, true);
            c.peer_timeout = Duration::from_secs(1);
            c.train.checkpoint_every = 3;
            c.train.checkpoint_dir = Some(dir.clone());
            // Each rank's outcome and the steps it restored from.
            let job = |c: &PsConfig| {
                LocalComm::run(3, |comm| {
                    if comm.rank() == 0 {
                        SLOW_DISK.set(c.peer_timeout * 5 / 2);
                    }
                    let mut restored = Vec::new();
                    let events = &mut |e: &crate::train::Event| {
                        if let crate::train::Event::Restored { step, .. } = e {
                            restored.push(*step);
                        }
                    };
                    let out = run(&comm, &l, &mlp, c, &train, &test, events);
                    (out.map_err(|e| e.to_string()), restored)
                })
            };
            let newest = || {
                let (found, _) = checkpoint::latest(&dir);
                found.map(|f| checkpoint::verify(&f.path).map(|v| v.step))
            };
            let ok = (Ok(()), vec![]);
            assert_eq!(job(&c), [ok.clone(), ok.clone(), ok], "{transport}");
            assert_eq!(newest(), Some(Ok(6)), "{transport}");
            c.train.steps = 7;
            let resumed = job(&c);
            assert!(
                resumed.iter().all(|r| r.0.is_ok()),
                "{transport}: {resumed:?}"
            );
            assert_eq!(resumed[1].1, [6], "{transport}: the chief's restore");
            assert_eq!(newest(), Some(Ok(7)), "{transport}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
