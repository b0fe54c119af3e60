//! When a launched job ends: the tasks' agreement, over a channel between the launchers
//! ([`super::notices`]: the job's MPI communicator, or a socket of their own on one host).
//!
//! TensorFlow's ps tasks (and often its evaluator) never return: `server.join()` blocks
//! forever, so a job of them outlives its workers until a time limit kills it. Under
//! `--ps-lifetime job` every task's launcher stays as the program's parent
//! ([`super::child`]) and tells every other launcher how its program ended, in one small
//! message each. Each launcher keeps the same [`Tally`] and acts on its verdict:
//!
//! - every task that ends on its own (worker, chief, by default the evaluator) ended with
//!   status 0: the tasks that live as long as the job (ps; the evaluator if asked) are
//!   stopped (SIGTERM, SIGKILL after the grace period), and exit 0;
//! - a task failed (a non-zero status, or killed by a signal): every running program is
//!   stopped; the failed task's launcher exits with its status and names it, so the job's
//!   status is the failure's.
//!
//! A launcher exits once its own program ended and it has heard from every other task,
//! so no message is left in flight when the channel closes.

use std::time::Duration;

use super::notices::Notices;
use crate::cluster::TaskId;
use crate::transport::comm::TransportError;

/// How long a task's program lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// It ends by itself; the job waits for it (workers, the chief).
    Own,
    /// It is stopped when every [`Lifetime::Own`] task ended successfully (ps tasks that
    /// `join()` forever).
    Job,
}

/// How a task's program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It exited with this status.
    Exited(i32),
    /// A signal killed it (not one of mpiflow's stops).
    Signaled(i32),
    /// mpiflow stopped it: the job was done, or another task failed.
    Stopped,
}

impl Outcome {
    pub fn failed(self) -> bool {
        matches!(self, Outcome::Exited(c) if c != 0) || matches!(self, Outcome::Signaled(_))
    }

    /// `exited with status 3`, `was killed by signal 9 (SIGKILL)`.
    pub fn describe(self) -> String {
        match self {
            Outcome::Exited(c) => format!("exited with status {c}"),
            Outcome::Signaled(s) => {
                format!("was killed by signal {s} ({})", crate::signals::name(s))
            }
            Outcome::Stopped => "was stopped by mpiflow".into(),
        }
    }
}

/// What a launcher tells the others, in 8 bytes: how its program ended, or, before that,
/// that the program (one using MPI) has entered `MPI_Finalize` and waits there only for
/// the other ranks: it counts as done for stopping the ps tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    Ended(Outcome),
    Finalizing,
}

impl Note {
    fn encode(self) -> [u8; 8] {
        let (kind, value) = match self {
            Note::Ended(Outcome::Exited(c)) => (0u32, c),
            Note::Ended(Outcome::Signaled(s)) => (1, s),
            Note::Ended(Outcome::Stopped) => (2, 0),
            Note::Finalizing => (3, 0),
        };
        let mut m = [0u8; 8];
        m[..4].copy_from_slice(&kind.to_le_bytes());
        m[4..].copy_from_slice(&value.to_le_bytes());
        m
    }

    fn decode(m: &[u8]) -> Option<Note> {
        if m.len() != 8 {
            return None;
        }
        let kind = u32::from_le_bytes(m[..4].try_into().ok()?);
        let value = i32::from_le_bytes(m[4..8].try_into().ok()?);
        match kind {
            0 => Some(Note::Ended(Outcome::Exited(value))),
            1 => Some(Note::Ended(Outcome::Signaled(value))),
            2 => Some(Note::Ended(Outcome::Stopped)),
            3 => Some(Note::Finalizing),
            _ => None,
        }
    }
}

/// What the tasks' outcomes so far call for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Programs still run and none failed.
    Running,
    /// Every [`Lifetime::Own`] task succeeded: stop the [`Lifetime::Job`] ones.
    Done,
    /// A task failed (the first heard of): stop every program.
    Failed { rank: usize, outcome: Outcome },
}

/// Every task's lifetime and, once heard of, its outcome; the same on every launcher.
#[derive(Debug, Clone)]
pub struct Tally {
    lifetimes: Vec<Lifetime>,
    outcomes: Vec<Option<Outcome>>,
    /// The programs that entered `MPI_Finalize` (waiting for the other ranks).
    finalizing: Vec<bool>,
    first_failure: Option<(usize, Outcome)>,
}

impl Tally {
    pub fn new(lifetimes: Vec<Lifetime>) -> Tally {
        let n = lifetimes.len();
        Tally {
            lifetimes,
            outcomes: vec![None; n],
            finalizing: vec![false; n],
            first_failure: None,
        }
    }

    /// Records what `rank` told.
    pub fn note(&mut self, rank: usize, note: Note) {
        match note {
            Note::Ended(o) => self.record(rank, o),
            Note::Finalizing => self.finalizing[rank] = true,
        }
    }

    /// Records how `rank`'s program ended (the first report of a rank counts).
    pub fn record(&mut self, rank: usize, outcome: Outcome) {
        if self.outcomes[rank].is_some() {
            return;
        }
        self.outcomes[rank] = Some(outcome);
        if outcome.failed() && self.first_failure.is_none() {
            self.first_failure = Some((rank, outcome));
        }
    }

    pub fn verdict(&self) -> Verdict {
        if let Some((rank, outcome)) = self.first_failure {
            return Verdict::Failed { rank, outcome };
        }
        let own_done = (0..self.lifetimes.len())
            .filter(|&r| self.lifetimes[r] == Lifetime::Own)
            .all(|r| self.outcomes[r].is_some() || self.finalizing[r]);
        if own_done {
            Verdict::Done
        } else {
            Verdict::Running
        }
    }

    /// True when `rank`'s program should be stopped now.
    pub fn should_stop(&self, rank: usize) -> bool {
        match self.verdict() {
            Verdict::Running => false,
            Verdict::Done => self.lifetimes[rank] == Lifetime::Job,
            Verdict::Failed { .. } => true,
        }
    }

    /// Every task's program has ended.
    pub fn all_ended(&self) -> bool {
        self.outcomes.iter().all(Option::is_some)
    }
}

/// The launched program, as the supervising loop sees it (a real child process, or a
/// stand-in in tests).
pub trait Program {
    /// The outcome if the program has ended (without blocking).
    fn try_wait(&mut self) -> std::io::Result<Option<Outcome>>;
    /// Whether the program, still running, has entered `MPI_Finalize` (an MPI program
    /// waiting there for the ranks that have not: [`super::watch`]).
    fn mpi_finalizing(&mut self) -> bool {
        false
    }
    /// Stops it: SIGTERM, SIGKILL after `grace`; returns once it is gone.
    fn stop(&mut self, grace: Duration) -> std::io::Result<()>;
    /// Passes on signals this launcher received since the last call.
    fn forward_signals(&mut self);
}

/// Errors while supervising.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error("{0}")]
    Transport(#[from] TransportError),
    #[error("rank {rank}: the launchers' channel: {what}")]
    Channel { rank: usize, what: String },
    #[error("rank {rank}: waiting for the program: {source}")]
    Wait {
        rank: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank}: from rank {peer}: not a task outcome ({len} bytes)")]
    Garbled {
        rank: usize,
        peer: usize,
        len: usize,
    },
}

/// The options of the supervising loop.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// Each rank's task and lifetime, by rank.
    pub tasks: Vec<(TaskId, Lifetime)>,
    /// How long a stopped program gets between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// How often the loop looks at the program and the messages.
    pub poll: Duration,
}

/// What the loop ended with: this task's outcome, and the first failure of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    pub mine: Outcome,
    pub verdict: Verdict,
}

/// Runs this rank's side of the agreement until its program ended and every other task
/// reported: tells its own outcome to every rank (through `notices`), stops its program
/// when the [`Tally`] says so, and prints one line when it is the failing task, or the
/// lowest-ranked task stopped because the job is done.
pub fn supervise<N: Notices, P: Program>(
    notices: &mut N,
    program: &mut P,
    how: &Supervision,
) -> Result<Ending, SuperviseError> {
    let me = notices.rank();
    let mut tally = Tally::new(how.tasks.iter().map(|(_, l)| *l).collect());
    let mut mine: Option<Outcome> = None;
    let mut told = false;
    let mut told_finalizing = false;
    let wait_err = |source| SuperviseError::Wait { rank: me, source };
    loop {
        program.forward_signals();
        if mine.is_none() {
            mine = program.try_wait().map_err(wait_err)?;
            if let Some(o) = mine.filter(|o| o.failed()) {
                eprintln!(
                    "mpiflow launch: {} (rank {me}) {}; stopping the job's other tasks",
                    how.tasks[me].0,
                    o.describe()
                );
            }
        }
        if mine.is_none() && !told_finalizing && program.mpi_finalizing() {
            notices.tell(Note::Finalizing.encode())?;
            told_finalizing = true;
            tally.note(me, Note::Finalizing);
        }
        for (peer, m) in notices.take()? {
            let note = Note::decode(&m).ok_or(SuperviseError::Garbled {
                rank: me,
                peer,
                len: m.len(),
            })?;
            tally.note(peer, note);
        }
        if mine.is_none() && tally.should_stop(me) {
            if tally.verdict() == Verdict::Done && first_stopped(&how.tasks) == Some(me) {
                eprintln!(
                    "mpiflow launch: every worker and chief task is done; stopping {}",
                    stopped_names(&how.tasks)
                );
            }
            program.stop(how.grace).map_err(wait_err)?;
            mine = Some(Outcome::Stopped);
        }
        if let Some(o) = mine {
            if !told {
                notices.tell(Note::Ended(o).encode())?;
                told = true;
            }
            tally.record(me, o);
            if tally.all_ended() {
                notices.flush()?;
                return Ok(Ending {
                    mine: o,
                    verdict: tally.verdict(),
                });
            }
        }
        std::thread::sleep(how.poll);
    }
}

fn first_stopped(tasks: &[(TaskId, Lifetime)]) -> Option<usize> {
    tasks.iter().position(|(_, l)| *l == Lifetime::Job)
}

fn stopped_names(tasks: &[(TaskId, Lifetime)]) -> String {
    tasks
        .iter()
        .filter(|(_, l)| *l == Lifetime::Job)
        .map(|(t, _)| t.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A stand-in for a program in the tests of the supervising loop.
#[cfg(test)]
pub(crate) mod stand_in {
    use super::*;

    /// A program that ends by itself after `ends_after` polls (never if `None`), with
    /// `status`; stopping it ends it at once.
    pub(crate) struct StandIn {
        pub polls: usize,
        pub ends_after: Option<usize>,
        pub status: i32,
        pub stopped: bool,
    }

    impl Program for StandIn {
        fn try_wait(&mut self) -> std::io::Result<Option<Outcome>> {
            self.polls += 1;
            Ok(match self.ends_after {
                Some(n) if self.polls >= n => Some(Outcome::Exited(self.status)),
                _ => None,
            })
        }
        fn stop(&mut self, _grace: Duration) -> std::io::Result<()> {
            self.stopped = true;
            Ok(())
        }
        fn forward_signals(&mut self) {}
    }

    /// Supervises a stand-in that ends after `ends_after` polls with `status` (never by
    /// itself if `None`) as task `me` of `tasks`, over `notices`; how it ended, and whether
    /// it was stopped.
    pub(crate) fn supervise_one<N: Notices>(
        notices: &mut N,
        (ends_after, status): (Option<usize>, i32),
        tasks: Vec<(TaskId, Lifetime)>,
    ) -> (Ending, bool) {
        let mut p = StandIn {
            polls: 0,
            ends_after,
            status,
            stopped: false,
        };
        let how = Supervision {
            tasks,
            grace: Duration::ZERO,
            poll: Duration::from_millis(1),
        };
        let end = supervise(notices, &mut p, &how).unwrap();
        (end, p.stopped)
    }
}

#[cfg(test)]
mod tests {
    use super::stand_in::supervise_one;
    use super::*;
    use crate::transport::comm::Comm;
    use crate::transport::local::LocalComm;

    #[test]
    fn notes_cross_as_eight_bytes_and_nothing_else_decodes() {
        for o in [
            Outcome::Exited(0),
            Outcome::Exited(3),
            Outcome::Signaled(9),
            Outcome::Stopped,
        ] {
            assert_eq!(Note::decode(&Note::Ended(o).encode()), Some(Note::Ended(o)));
        }
        let f = Note::Finalizing;
        assert_eq!(Note::decode(&f.encode()), Some(f));
        assert_eq!(Note::decode(&[0; 7]), None);
        assert_eq!(Note::decode(&[9, 0, 0, 0, 0, 0, 0, 0]), None);
        assert!(Outcome::Exited(3).failed() && Outcome::Signaled(15).failed());
        assert!(!Outcome::Exited(0).failed() && !Outcome::Stopped.failed());
    }

    #[test]
    fn the_tally_stops_ps_after_the_workers_and_everyone_after_a_failure() {
        use Lifetime::*;
        let mut t = Tally::new(vec![Job, Own, Own]);
        assert_eq!(t.verdict(), Verdict::Running);
        t.record(1, Outcome::Exited(0));
        assert!(!t.should_stop(0));
        t.record(2, Outcome::Exited(0));
        assert_eq!(t.verdict(), Verdict::Done);
        assert!(t.should_stop(0) && !t.should_stop(1));
        t.record(0, Outcome::Stopped);
        assert!(t.all_ended());

        let mut t = Tally::new(vec![Job, Own, Own]);
        t.record(2, Outcome::Exited(3));
        t.record(1, Outcome::Signaled(15));
        let failed = Verdict::Failed {
            rank: 2,
            outcome: Outcome::Exited(3),
        };
        assert_eq!(t.verdict(), failed);
        assert!(t.should_stop(0) && t.should_stop(1));
    }

    #[test]
    fn a_worker_in_mpi_finalize_counts_as_done_until_it_ends() {
        use Lifetime::*;
        let mut t = Tally::new(vec![Job, Own, Own]);
        t.note(1, Note::Finalizing);
        assert_eq!(t.verdict(), Verdict::Running);
        t.note(2, Note::Ended(Outcome::Exited(0)));
        assert_eq!(t.verdict(), Verdict::Done);
        assert!(t.should_stop(0) && !t.should_stop(1));
        t.note(0, Note::Ended(Outcome::Stopped));
        assert!(!t.all_ended());
        // It fails on its way out: the job's status is its.
        t.note(1, Note::Ended(Outcome::Exited(3)));
        assert!(t.all_ended());
        let failed = Verdict::Failed {
            rank: 1,
            outcome: Outcome::Exited(3),
        };
        assert_eq!(t.verdict(), failed);
    }

    fn run(programs: Vec<(Lifetime, Option<usize>, i32)>) -> Vec<(Ending, bool)> {
        let n = programs.len();
        let tasks: Vec<(TaskId, Lifetime)> = programs
            .iter()
            .enumerate()
            .map(|(i, (l, _, _))| {
                let job = if *l == Lifetime::Job { "ps" } else { "worker" };
                (TaskId::new(job, i), *l)
            })
            .collect();
        LocalComm::run(n, move |c| {
            let (_, ends_after, status) = programs[c.rank()];
            let mut notices = crate::launch::notices::OverMpi::new(&c, 5).unwrap();
            supervise_one(&mut notices, (ends_after, status), tasks.clone())
        })
    }

    #[test]
    fn ps_tasks_are_stopped_once_every_worker_succeeded() {
        use Lifetime::*;
        let out = run(vec![(Job, None, 0), (Own, Some(3), 0), (Own, Some(20), 0)]);
        let stopped: Vec<bool> = out.iter().map(|(_, s)| *s).collect();
        assert_eq!(stopped, [true, false, false]);
        assert_eq!(out[0].0.mine, Outcome::Stopped);
        assert_eq!(out[2].0.mine, Outcome::Exited(0));
        assert!(out.iter().all(|(e, _)| e.verdict == Verdict::Done));
    }

    #[test]
    fn a_failing_worker_stops_everyone_and_its_status_is_the_jobs() {
        use Lifetime::*;
        let out = run(vec![
            (Job, None, 0),
            (Own, Some(2), 3),
            (Own, None, 0),
            (Own, None, 0),
        ]);
        let stopped: Vec<bool> = out.iter().map(|(_, s)| *s).collect();
        assert_eq!(stopped, [true, false, true, true]);
        assert_eq!(out[1].0.mine, Outcome::Exited(3));
        for (e, _) in &out {
            assert_eq!(
                e.verdict,
                Verdict::Failed {
                    rank: 1,
                    outcome: Outcome::Exited(3)
                }
            );
        }
    }
}
