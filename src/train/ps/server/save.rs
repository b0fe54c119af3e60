//! Checkpoints written beside serving. A `Save` request's shard is copied at once (the
//! state of the step the chief asked at) and written by a helper thread while this ps
//! goes on serving; the chief gets `Saved` once the file is durable.
//!
//! A write may take longer than the peer timeout (a large shard, a parallel file system
//! under load), and so may a pull parked on a step some worker is slow to push. Neither is
//! a lost ps: while such a request waits, its worker is told every third of the timeout
//! that this ps is alive ([`Reply::Alive`]), and its deadline starts again. Nor is the
//! chief lost while it waits for the other ps tasks' files or writes its own: the worker
//! whose latest request was a save is not waited on until its next request.

use std::path::Path;
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::time::Instant;

use super::super::protocol::Reply;
use super::super::{shards, PsError};
use super::Server;
use crate::train::checkpoint;
use crate::transport::comm::Comm;

/// A shard being written.
pub(super) struct Saving {
    /// The requesting worker's rank.
    from: usize,
    /// The file's name in the checkpoint.
    file: String,
    /// The writer's outcome: the file's bytes and checksum.
    written: Receiver<Result<(u64, u64), String>>,
    /// When the requester was last told this ps is alive.
    told: Instant,
}

impl<C: Comm> Server<'_, C> {
    /// Starts writing this ps's shard into staging directory `dir` for worker rank `from`
    /// (index `w`); answered by [`Server::tend`] once written.
    pub(super) fn start_save(&mut self, from: usize, w: usize, dir: &Path) -> Result<(), PsError> {
        self.saver = Some(w);
        if self.saving.is_some() {
            let why = "a checkpoint was asked for while this ps still writes the previous one";
            return self.error(from, why.into());
        }
        let file = shards::file_of(self.k, self.stage);
        let (path, arrays) = (dir.join(&file), self.snapshot());
        let (done, written) = mpsc::channel();
        #[cfg(test)]
        let slow = checkpoint::SLOW_DISK.get();
        let writer = move || {
            #[cfg(test)]
            std::thread::sleep(slow);
            let outcome = checkpoint::write_file(&path, &arrays).map_err(|e| e.to_string());
            // The server may have stopped meanwhile: nobody to tell.
            let _ = done.send(outcome);
        };
        let spawned = std::thread::Builder::new()
            .name("mpiflow-ps-save".into())
            .spawn(writer);
        if let Err(e) = spawned {
            return self.error(from, format!("cannot start a thread to write {file}: {e}"));
        }
        self.saving = Some(Saving {
            from,
            file,
            written,
            told: Instant::now(),
        });
        Ok(())
    }

    /// Answers a save whose shard is written, and tells every worker whose request has
    /// waited here for a third of the timeout since it was last told that this ps is
    /// alive.
    pub(super) fn tend(&mut self) -> Result<(), PsError> {
        let outcome = match self.saving.as_ref().map(|s| s.written.try_recv()) {
            None | Some(Err(TryRecvError::Empty)) => None,
            Some(Ok(outcome)) => Some(outcome),
            Some(Err(TryRecvError::Disconnected)) => Some(Err(format!(
                "{}: the thread writing its checkpoint file stopped",
                self.me()
            ))),
        };
        if let Some(outcome) = outcome {
            let Saving { from, file, .. } = self.saving.take().expect("a save was under way");
            return match outcome {
                Ok((bytes, checksum)) => {
                    let saved = Reply::Saved {
                        file,
                        bytes,
                        checksum,
                    };
                    self.reply(from, &saved)
                }
                Err(e) => self.error(from, e),
            };
        }
        self.keep_alive()
    }

    fn keep_alive(&mut self) -> Result<(), PsError> {
        let (every, now) = (self.timeout / 3, Instant::now());
        if let Some(s) = self.saving.as_mut().filter(|s| now - s.told >= every) {
            s.told = now;
            let to = s.from;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::train::checkpoint::{self, SLOW_DISK};
    use crate::train::data::Dataset;
    use crate::train::ps::test_support::{cfg, layout};
    use crate::train::ps::{rma, PsConfig};
    use crate::transport::comm::Comm;
    use crate::transport::local::LocalComm;

    /// A ps whose checkpoint files take two and a half peer timeouts to write (workers
    /// wait two before they call a ps lost), over messages and over windows: training
    /// goes on to its end, no rank lost, and every checkpoint is whole. Synchronous with
    /// two workers, so the second worker's pull waits on the chief while the chief waits
    /// on the save.
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
            let out = LocalComm::run(3, |comm| {
                if comm.rank() == 0 {
                    SLOW_DISK.set(c.peer_timeout * 5 / 2);
                }
                run(&comm, &l, &mlp, &c, &train, &test, &mut |_| {}).map_err(|e| e.to_string())
            });
            assert_eq!(out, vec![Ok(()), Ok(()), Ok(())], "{transport}");
            let (found, _) = checkpoint::latest(&dir);
            let steps = found.map(|f| checkpoint::verify(&f.path).map(|v| v.step));
            assert_eq!(steps, Some(Ok(6)), "{transport}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
