//! The watch: one thread per rank, on a communicator of its own, that turns long waits
//! into stall reports at the chief.
//!
//! The protocol (JSON messages, two tags):
//! - a rank whose wait passes the threshold sends the chief one `alert` (per wait);
//! - the chief, alerted or waiting that long itself, sends every rank a `query` and
//!   gathers the `answer`s (each rank's [`super::Board`], answered by its watch thread
//!   while its training thread waits or works) for up to [`GRACE`]; a rank that does not
//!   answer is reported as such (stopped, or stuck outside MPI);
//! - while the stall lasts the chief asks again every half threshold (0.5 to 5 s) and
//!   reports every threshold; once no rank waits that long any more, it reports the
//!   stall cleared;
//! - a rank that ends its watch says `gone` (finished ranks are not stalls);
//! - a rank that alerted and is not asked within the threshold (the chief is stopped or
//!   stuck) reports that itself.
//!
//! Nothing is sent while no wait is long. The watch never fails training: a transport
//! error ends the watch, silently.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::report::{Report, Seen};
use super::{Board, Doing};
use crate::observe::metrics::Record;
use crate::transport::comm::{Comm, TransportError, ANY_SOURCE};

/// Messages to the chief.
const TO_CHIEF: i32 = 1;
/// Messages from the chief.
const FROM_CHIEF: i32 = 2;
/// How long the chief waits for the answers to a query.
pub const GRACE: Duration = Duration::from_secs(1);
/// How long a message that has started to arrive may take to complete.
const COMPLETE_WITHIN: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "m", rename_all = "snake_case")]
enum Message {
    Alert,
    Gone,
    Query { seq: u64 },
    Answer { seq: u64, doing: Doing },
}

/// What a watch is told.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchConfig {
    /// A wait this long is a stall.
    pub threshold: Duration,
    /// The chief's rank.
    pub chief: usize,
    /// Every rank's task name (`worker:1`), by rank.
    pub tasks: Vec<String>,
}

impl WatchConfig {
    /// How often a watch looks at its board.
    fn tick(&self) -> Duration {
        (self.threshold / 8).clamp(Duration::from_millis(10), Duration::from_millis(250))
    }
}

/// How often the chief asks again while a stall lasts.
fn poll(threshold: Duration) -> Duration {
    (threshold / 2).clamp(Duration::from_millis(500), Duration::from_secs(5))
}

/// What a watch tells its rank's reporter.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    /// The chief's report of a stall (again every threshold while it lasts).
    Stall(Report),
    /// The stall at `step` cleared, `secs` after its longest wait began; `missing`: who
    /// had not arrived when it was last reported.
    Cleared {
        step: u64,
        op: String,
        secs: f64,
        missing: Vec<String>,
    },
    /// This rank (`task`, not the chief) has waited as `doing` says and the chief
    /// (`chief`) has not asked.
    Unanswered {
        task: String,
        doing: Doing,
        chief: String,
    },
}

impl std::fmt::Display for Notice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Notice::Stall(r) => write!(f, "{r}"),
            Notice::Cleared { step, op, secs, .. } => write!(
                f,
                "stall at step {step} cleared: {op} ended after {:.0} s",
                secs.floor()
            ),
            Notice::Unanswered { task, doing, chief } => {
                let wait = match doing {
                    Doing::Waiting { op, step, secs, .. } => {
                        format!("waited {:.0} s in {op} at step {step}", secs.floor())
                    }
                    _ => "waited".into(),
                };
                write!(
                    f,
                    "stall: {task} has {wait}; the chief ({chief}) does not answer"
                )
            }
        }
    }
}

impl Notice {
    /// The notice as a metrics record, `wall_s` seconds into the run (a rank's own
    /// complaint is no record: the chief writes the metrics).
    pub fn record(&self, wall_s: f64) -> Option<Record> {
        match self {
            Notice::Stall(r) => Some(Record::Stall {
                step: r.step,
                wall_s,
                waited_s: r.secs,
                op: r.op.clone(),
                waiting: r.waiting(),
                missing: r.missing(),
                cleared: false,
            }),
            Notice::Cleared { step, op, secs, .. } => Some(Record::Stall {
                step: *step,
                wall_s,
                waited_s: *secs,
                op: op.clone(),
                waiting: Vec::new(),
                missing: Vec::new(),
                cleared: true,
            }),
            Notice::Unanswered { .. } => None,
        }
    }
}

/// A rank's watch thread; dropping it ends the thread (within a tick, or a query's grace
/// on the chief).
pub struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    /// Starts watching `board` on `comm` (a communicator of the watch's own, every rank
    /// of the job, made collectively: `comm.split(0, rank)`), telling `sink` what it
    /// sees. Every rank starts one.
    pub fn start<C: Comm + Send + 'static>(
        comm: C,
        board: &'static Board,
        cfg: WatchConfig,
        sink: Box<dyn FnMut(Notice) + Send>,
    ) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        board.enable();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("mpiflow-stall-watch".into())
            .spawn(move || {
                let mut w = Watcher {
                    comm,
                    board,
                    cfg,
                    sink,
                    pending: Vec::new(),
                };
                // A transport error ends the watch; training goes on.
                let mut gone = vec![false; w.comm.size()];
                let _ = w.run(&flag, &mut gone);
                w.leave(&mut gone);
            })
            .expect("a thread starts");
        Watch {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

struct Watcher<C: Comm> {
    comm: C,
    board: &'static Board,
    cfg: WatchConfig,
    sink: Box<dyn FnMut(Notice) + Send>,
    /// Sends in flight and their bytes.
    pending: Vec<(C::Request, Vec<u8>)>,
}

/// The chief's stall being reported.
struct Episode {
    step: u64,
    op: String,
    missing: Vec<String>,
    began: Instant,
    reported: Instant,
    polled: Instant,
}

/// A rank's memory of its own long wait.
struct Alerted {
    /// The wait (its start).
    wait: Instant,
    /// When the rank last said the chief does not answer.
    complained: Option<Instant>,
}

impl<C: Comm> Watcher<C> {
    /// Watches until `stop`; `gone` marks the ranks that said they left (the chief's).
    fn run(&mut self, stop: &AtomicBool, gone: &mut [bool]) -> Result<(), TransportError> {
        let chief = self.comm.rank() == self.cfg.chief;
        let (mut episode, mut seq) = (None, 0u64);
        let (mut alerted, mut asked) = (None::<Alerted>, Instant::now());
        while !stop.load(Ordering::Acquire) {
            // Woken early when the watch is dropped.
            std::thread::park_timeout(self.cfg.tick());
            if stop.load(Ordering::Acquire) {
                break;
            }
            self.reap();
            if chief {
                self.chief_tick(gone, &mut episode, &mut seq)?;
            } else {
                self.rank_tick(&mut alerted, &mut asked)?;
            }
        }
        Ok(())
    }

    fn send(&mut self, m: &Message, to: usize, tag: i32) -> Result<(), TransportError> {
        let bytes = serde_json::to_vec(m).expect("a message serializes");
        // SAFETY: the bytes live in `pending` (their heap buffer does not move with the
        // Vec) until the request completes, or are leaked.
        let r = unsafe { self.comm.isend(bytes.as_ptr(), bytes.len(), to, tag)? };
        self.pending.push((r, bytes));
        Ok(())
    }

    /// Drops the sends that completed.
    fn reap(&mut self) {
        let comm = &self.comm;
        self.pending
            .retain_mut(|(r, _)| matches!(comm.test(r), Ok(None)));
    }

    fn receive(&self, from: usize, tag: i32) -> Result<Option<(usize, Message)>, TransportError> {
        loop {
            let Some((src, bytes)) = self.comm.try_receive(from, tag, COMPLETE_WITHIN)? else {
                return Ok(None);
            };
            // A message that is not ours cannot come on this communicator; skip it.
            if let Ok(m) = serde_json::from_slice(&bytes) {
                return Ok(Some((src, m)));
            }
        }
    }

    /// A rank: answers the chief's queries, alerts it once per long wait, and says so
    /// itself when the chief does not ask.
    fn rank_tick(
        &mut self,
        alerted: &mut Option<Alerted>,
        asked: &mut Instant,
    ) -> Result<(), TransportError> {
        let chief = self.cfg.chief;
        while let Some((_, m)) = self.receive(chief, FROM_CHIEF)? {
            if let Message::Query { seq } = m {
                let doing = self.board.doing();
                self.send(&Message::Answer { seq, doing }, chief, TO_CHIEF)?;
                *asked = Instant::now();
            }
        }
        let Some(since) = self.board.waiting_since() else {
            return Ok(());
        };
        let threshold = self.cfg.threshold;
        if since.elapsed() < threshold {
            return Ok(());
        }
        match alerted {
            Some(a) if a.wait == since => {
                // The chief asks every poll (and a grace) while it reports a stall:
                // silence for longer than a report interval and two polls means it
                // cannot.
                let silence = threshold + 2 * (poll(threshold) + GRACE);
                let quiet = asked.elapsed() >= silence
                    && since.elapsed() >= silence
                    && a.complained.is_none_or(|c| c.elapsed() >= threshold);
                if quiet {
                    a.complained = Some(Instant::now());
                    let me = self.comm.rank();
                    (self.sink)(Notice::Unanswered {
                        task: self.cfg.tasks[me].clone(),
                        doing: self.board.doing(),
                        chief: self.cfg.tasks[chief].clone(),
                    });
                }
            }
            _ => {
                self.send(&Message::Alert, chief, TO_CHIEF)?;
                *alerted = Some(Alerted {
                    wait: since,
                    complained: None,
                });
            }
        }
        Ok(())
    }

    /// The chief: reads alerts, asks every rank when one came (or its own wait is long),
    /// and reports the stall until it clears.
    fn chief_tick(
        &mut self,
        gone: &mut [bool],
        episode: &mut Option<Episode>,
        seq: &mut u64,
    ) -> Result<(), TransportError> {
        let threshold = self.cfg.threshold;
        let mut alert = false;
        while let Some((src, m)) = self.receive(ANY_SOURCE, TO_CHIEF)? {
            match m {
                Message::Alert => alert = true,
                Message::Gone => gone[src] = true,
                _ => {}
            }
        }
        let own = self
            .board
            .waiting_since()
            .is_some_and(|t| t.elapsed() >= threshold);
        let due = match episode {
            None => alert || own,
            Some(e) => e.polled.elapsed() >= poll(threshold),
        };
        if !due {
            return Ok(());
        }
        *seq += 1;
        let mut report = self.ask(*seq, gone)?;
        if report.as_ref().is_some_and(Report::passed) {
            // Answered at different moments: a rank already past the longest wait's
            // step may mean that wait ended meanwhile. A second look tells a wait that
            // ended from ranks that stand at different steps (a ps replying to a
            // stopped worker holds back the others' replies).
            *seq += 1;
            report = self.ask(*seq, gone)?;
        }
        let report = report.filter(|r| r.secs >= threshold.as_secs_f64());
        let now = Instant::now();
        if let Some(e) = episode.as_mut() {
            // The same stall while its longest wait was already going on at the last
            // look (which rank waits longest may change among ranks that began together).
            let same = report
                .as_ref()
                .is_some_and(|r| now - Duration::from_secs_f64(r.secs) <= e.polled);
            e.polled = now;
            if !same {
                let e = episode.take().expect("an episode");
                (self.sink)(Notice::Cleared {
                    step: e.step,
                    op: e.op,
                    secs: (now - e.began).as_secs_f64(),
                    missing: e.missing,
                });
            } else if e.reported.elapsed() < threshold {
                return Ok(());
            }
        }
        let Some(r) = report else {
            return Ok(());
        };
        let began = now - Duration::from_secs_f64(r.secs);
        let e = episode.get_or_insert(Episode {
            step: r.step,
            op: r.op.clone(),
            missing: Vec::new(),
            began,
            reported: now,
            polled: now,
        });
        e.reported = now;
        e.missing = r.missing();
        (self.sink)(Notice::Stall(r));
        Ok(())
    }

    /// Asks every rank not gone what it does; the report of their answers.
    fn ask(&mut self, seq: u64, gone: &mut [bool]) -> Result<Option<Report>, TransportError> {
        let (me, size) = (self.comm.rank(), self.comm.size());
        for r in (0..size).filter(|r| *r != me && !gone[*r]) {
            self.send(&Message::Query { seq }, r, FROM_CHIEF)?;
        }
        // Each answer and when it came: its times are brought up to the report's.
        let mut answers: Vec<Option<(Doing, Instant)>> = vec![None; size];
        let start = Instant::now();
        let open = |answers: &[Option<(Doing, Instant)>], gone: &[bool]| {
            (0..size).any(|r| r != me && !gone[r] && answers[r].is_none())
        };
        while open(&answers, gone) && start.elapsed() < GRACE {
            match self.receive(ANY_SOURCE, TO_CHIEF)? {
                Some((src, Message::Answer { seq: s, doing })) if s == seq => {
                    answers[src] = Some((doing, Instant::now()))
                }
                Some((src, Message::Gone)) => gone[src] = true,
                Some(_) => {}
                None => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        answers[me] = Some((self.board.doing(), Instant::now()));
        let seen = (0..size)
            .filter(|r| !gone[*r])
            .map(|r| Seen {
                rank: r,
                task: self.cfg.tasks[r].clone(),
                doing: answers[r].take().map(|(d, at)| d.later(at.elapsed())),
            })
            .collect();
        Ok(Report::of(seen))
    }

    /// Ends the watch: a rank says it is gone, and the chief takes every rank's word that
    /// it is gone (no message is left unreceived at `MPI_Finalize`, which UCX reports);
    /// either waits a second at most, then leaves the sends still in flight to MPI (their
    /// bytes leaked, never freed under it).
    fn leave(&mut self, gone: &mut [bool]) {
        self.board.disable();
        let (me, chief) = (self.comm.rank(), self.cfg.chief);
        match me == chief {
            false => drop(self.send(&Message::Gone, chief, TO_CHIEF)),
            true => gone[me] = true,
        }
        let start = Instant::now();
        let waiting = |gone: &[bool], pending: &[_]| {
            !pending.is_empty() || (me == chief && gone.contains(&false))
        };
        while waiting(gone, &self.pending) && start.elapsed() < Duration::from_secs(1) {
            self.reap();
            while let Some((src, m)) = (me == chief)
                .then(|| self.receive(ANY_SOURCE, TO_CHIEF).ok().flatten())
                .flatten()
            {
                gone[src] |= matches!(m, Message::Gone);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        std::mem::forget(std::mem::take(&mut self.pending));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::stall::Wait;
    use crate::transport::local::LocalComm;
    use std::sync::mpsc;

    fn cfg(ms: u64) -> WatchConfig {
        WatchConfig {
            threshold: Duration::from_millis(ms),
            chief: 0,
            tasks: (0..3).map(|r| format!("worker:{r}")).collect(),
        }
    }

    fn wait(step: u64) -> impl Fn() -> Wait {
        move || Wait {
            op: "allreduce",
            step,
            what: Some("grads".into()),
            peer: None,
            bytes: 64,
        }
    }

    /// Ranks 0 and 1 wait at step 5 while rank 2 works: the chief reports rank 2 as not
    /// arrived, again while it lasts, then the stall cleared.
    #[test]
    fn the_chief_names_the_rank_that_has_not_arrived_and_then_the_clearing() {
        let (tx, rx) = mpsc::channel();
        LocalComm::run(3, |c| {
            let rank = c.rank();
            let board: &'static Board = Box::leak(Box::new(Board::new()));
            let tx = tx.clone();
            let sink = Box::new(move |n: Notice| {
                let _ = tx.send((rank, n));
            });
            let watch = Watch::start(c.split(0, rank).unwrap(), board, cfg(300), sink);
            if rank < 2 {
                let _w = board.wait(wait(5));
                std::thread::sleep(Duration::from_millis(1500));
            } else {
                std::thread::sleep(Duration::from_millis(1500));
                drop(board.wait(wait(5)));
            }
            std::thread::sleep(Duration::from_millis(1500));
            drop(watch);
        });
        drop(tx);
        let notices: Vec<(usize, Notice)> = rx.iter().collect();
        let stalls: Vec<&Report> = notices
            .iter()
            .filter_map(|(r, n)| match n {
                Notice::Stall(s) if *r == 0 => Some(s),
                _ => None,
            })
            .collect();
        assert!(stalls.len() >= 2, "{notices:?}");
        for s in &stalls {
            assert_eq!(s.step, 5);
            assert_eq!(s.missing(), ["worker:2"], "{s}");
            assert_eq!(s.waiting(), ["worker:0", "worker:1"], "{s}");
        }
        let cleared: Vec<&Notice> = notices
            .iter()
            .map(|(_, n)| n)
            .filter(|n| matches!(n, Notice::Cleared { step: 5, .. }))
            .collect();
        assert_eq!(cleared.len(), 1, "{notices:?}");
        if let Notice::Cleared { secs, .. } = cleared[0] {
            assert!((1.0..3.5).contains(secs), "{secs}");
        }
        assert!(notices
            .iter()
            .all(|(r, n)| *r == 0 || matches!(n, Notice::Unanswered { .. })));
        assert!(notices
            .iter()
            .all(|(_, n)| !matches!(n, Notice::Unanswered { .. })));
    }

    /// The chief runs no watch (as if stopped): a rank that waits long says so itself.
    #[test]
    fn a_rank_whose_chief_does_not_answer_says_so() {
        let (tx, rx) = mpsc::channel();
        LocalComm::run(2, |c| {
            let rank = c.rank();
            let watch_comm = c.split(0, rank).unwrap();
            if rank == 0 {
                std::thread::sleep(Duration::from_millis(4200));
                return;
            }
            let board: &'static Board = Box::leak(Box::new(Board::new()));
            let tx = tx.clone();
            let sink = Box::new(move |n: Notice| {
                let _ = tx.send(n);
            });
            let watch = Watch::start(watch_comm, board, cfg(200), sink);
            let _w = board.wait(wait(9));
            std::thread::sleep(Duration::from_millis(4000));
            drop(watch);
        });
        drop(tx);
        let got: Vec<String> = rx.iter().map(|n| n.to_string()).collect();
        assert!(!got.is_empty());
        assert!(
            got[0].starts_with("stall: worker:1 has waited 3 s in allreduce at step 9; the chief (worker:0) does not answer"),
            "{got:?}"
        );
    }
}
