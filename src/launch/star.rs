//! The supervising launchers of a job on one host, without MPI: a star around rank 0's
//! launcher over a Unix socket in Linux's abstract namespace (no file to clean up; it is
//! gone with its last user).
//!
//! Rank 0 listens; every other launcher connects, says its rank, and sends its program's
//! outcome when it has one (and a note before it: [`super::notices`]); rank 0 passes each
//! message on to all the others, and replays
//! what it has to a launcher that connects late. Messages are frames of 12 bytes: the rank
//! whose outcome it is (`u32`, little-endian) and the 8-byte outcome. The socket's name is
//! the job's ([`job_token`]), so two jobs on one host never meet.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use super::lifetime::SuperviseError;
use super::notices::Notices;

/// Bytes of a frame: a rank and its outcome.
const FRAME: usize = 12;

/// How long a launcher waits for rank 0's to listen before it calls it missing.
pub const CONNECT_WITHIN: Duration = Duration::from_secs(60);

/// A name for the job's socket, the same in every launcher of the job and different from
/// any other job's running on the host: the MPI launcher's own identity where it exports
/// one (Open MPI's `mpirun` address, Slurm's job and step), else the launchers' common
/// parent (MPICH's proxy), with the cluster (`spec`, its description) and the job's size.
pub fn job_token(env: &BTreeMap<String, String>, spec: &str, size: usize) -> String {
    let job = match (env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")) {
        _ if env.contains_key("OMPI_MCA_orte_hnp_uri") => env["OMPI_MCA_orte_hnp_uri"].clone(),
        (Some(job), Some(step)) => format!("slurm {job}.{step}"),
        _ => format!("parent {}", std::os::unix::process::parent_id()),
    };
    let h = crate::hash::fnv1a(format!("{job}\n{size}\n{spec}").as_bytes());
    format!("mpiflow-launch-{h:016x}")
}

/// One connection's bytes not yet read as frames.
struct Peer {
    stream: UnixStream,
    buf: Vec<u8>,
    /// Its end of the connection closed.
    closed: bool,
}

impl Peer {
    fn new(stream: UnixStream) -> Peer {
        Peer {
            stream,
            buf: Vec::new(),
            closed: false,
        }
    }

    /// Reads what has arrived (without waiting).
    fn read_available(&mut self) -> std::io::Result<()> {
        let mut chunk = [0u8; 256];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    self.closed = true;
                    return Ok(());
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The whole frames read so far.
    fn frames(&mut self) -> Vec<(usize, [u8; 8])> {
        let whole = self.buf.len() / FRAME * FRAME;
        let frames = self.buf[..whole]
            .chunks_exact(FRAME)
            .map(|f| {
                let rank = u32::from_le_bytes(f[..4].try_into().expect("4 bytes")) as usize;
                (rank, f[4..].try_into().expect("8 bytes"))
            })
            .collect();
        self.buf.drain(..whole);
        frames
    }

    fn send(&mut self, rank: usize, message: &[u8; 8]) -> std::io::Result<()> {
        let mut frame = [0u8; FRAME];
        frame[..4].copy_from_slice(&(rank as u32).to_le_bytes());
        frame[4..].copy_from_slice(message);
        write_all(&mut self.stream, &frame)
    }
}

/// Writes all of `bytes` to a non-blocking stream (a frame fits any socket buffer; a full
/// one is waited out).
fn write_all(stream: &mut UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match stream.write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Rank 0's side: the listener, each rank's connection, every outcome so far.
struct Hub {
    listener: UnixListener,
    /// Connections whose rank is not read yet.
    greeting: Vec<Peer>,
    peers: Vec<Option<Peer>>,
    told: Vec<(usize, [u8; 8])>,
}

/// Another rank's side: its connection to rank 0, once made.
struct Spoke {
    addr: SocketAddr,
    hub: Option<Peer>,
    /// What this rank told before it reached rank 0.
    pending: Vec<[u8; 8]>,
    since: Instant,
}

enum Side {
    Hub(Hub),
    Spoke(Spoke),
}

/// One launcher of the star.
pub struct Star {
    rank: usize,
    side: Side,
}

impl Star {
    /// Joins the star of the job named `token` (see [`job_token`]) as `rank` of `size`:
    /// rank 0 listens at once (an error if another process holds the name), the others
    /// connect as soon as it does.
    pub fn join(token: &str, rank: usize, size: usize) -> Result<Star, SuperviseError> {
        let channel = |what: String| SuperviseError::Channel { rank, what };
        let addr = SocketAddr::from_abstract_name(token.as_bytes())
            .map_err(|e| channel(format!("socket name {token}: {e}")))?;
        let side = if rank == 0 {
            let listener = UnixListener::bind_addr(&addr)
                .map_err(|e| channel(format!("cannot listen on @{token}: {e}")))?;
            listener
                .set_nonblocking(true)
                .map_err(|e| channel(e.to_string()))?;
            Side::Hub(Hub {
                listener,
                greeting: Vec::new(),
                peers: (0..size).map(|_| None).collect(),
                told: Vec::new(),
            })
        } else {
            let mut spoke = Spoke {
                addr,
                hub: None,
                pending: Vec::new(),
                since: Instant::now(),
            };
            spoke.connect(rank).map_err(|e| channel(e.to_string()))?;
            Side::Spoke(spoke)
        };
        Ok(Star { rank, side })
    }
}

impl Spoke {
    /// Connects to rank 0 if it listens by now, and says this rank (and its outcome, if
    /// known); `Ok` also while rank 0 does not listen yet.
    fn connect(&mut self, rank: usize) -> std::io::Result<()> {
        if self.hub.is_some() {
            return Ok(());
        }
        let mut stream = match UnixStream::connect_addr(&self.addr) {
            Ok(s) => s,
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound) => {
                return Ok(())
            }
            Err(e) => return Err(e),
        };
        stream.set_nonblocking(true)?;
        write_all(&mut stream, &(rank as u32).to_le_bytes())?;
        let mut hub = Peer::new(stream);
        for m in self.pending.drain(..) {
            hub.send(rank, &m)?;
        }
        self.hub = Some(hub);
        Ok(())
    }

    /// The error of a rank 0 that never listened within [`CONNECT_WITHIN`].
    fn missing(&self) -> Option<String> {
        (self.hub.is_none() && self.since.elapsed() > CONNECT_WITHIN).then(|| {
            format!(
                "rank 0's launcher did not listen within {} s (is every rank started by `mpiflow launch` under the same launcher?)",
                CONNECT_WITHIN.as_secs()
            )
        })
    }
}

impl Hub {
    /// Takes new connections and their greetings; replays what was told to each.
    fn admit(&mut self, size: usize) -> Result<(), String> {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(true).map_err(|e| e.to_string())?;
                    self.greeting.push(Peer::new(stream));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        let mut i = 0;
        while i < self.greeting.len() {
            let p = &mut self.greeting[i];
            p.read_available().map_err(|e| e.to_string())?;
            if p.buf.len() < 4 {
                if p.closed {
                    self.greeting.swap_remove(i);
                } else {
                    i += 1;
                }
                continue;
            }
            let mut p = self.greeting.swap_remove(i);
            let r = u32::from_le_bytes(p.buf[..4].try_into().expect("4 bytes")) as usize;
            p.buf.drain(..4);
            if r == 0 || r >= size || self.peers[r].is_some() {
                return Err(format!(
                    "a launcher said it is rank {r} of {size}, which is taken or no rank"
                ));
            }
            for (who, m) in &self.told {
                p.send(*who, m).map_err(|e| e.to_string())?;
            }
            self.peers[r] = Some(p);
        }
        Ok(())
    }

    /// Records `rank`'s outcome and passes it on to every other connected launcher.
    fn relay(&mut self, rank: usize, message: [u8; 8]) -> Result<(), String> {
        self.told.push((rank, message));
        for (r, p) in self.peers.iter_mut().enumerate() {
            if let Some(p) = p.as_mut().filter(|_| r != rank) {
                // A launcher that already left (it had heard from everyone) needs nothing.
                if let Err(e) = p.send(rank, &message) {
                    if e.kind() != ErrorKind::BrokenPipe {
                        return Err(e.to_string());
                    }
                }
            }
        }
        Ok(())
    }
}

impl Notices for Star {
    fn rank(&self) -> usize {
        self.rank
    }

    fn take(&mut self) -> Result<Vec<(usize, Vec<u8>)>, SuperviseError> {
        let rank = self.rank;
        let channel = |what: String| SuperviseError::Channel { rank, what };
        let mut got = Vec::new();
        match &mut self.side {
            Side::Hub(hub) => {
                let size = hub.peers.len();
                hub.admit(size).map_err(channel)?;
                let mut arrived = Vec::new();
                for (r, p) in hub.peers.iter_mut().enumerate() {
                    let Some(p) = p else { continue };
                    p.read_available().map_err(|e| channel(e.to_string()))?;
                    arrived.extend(p.frames().into_iter().map(|(_, m)| (r, m)));
                }
                for (r, m) in arrived {
                    hub.relay(r, m).map_err(channel)?;
                    got.push((r, m.to_vec()));
                }
            }
            Side::Spoke(spoke) => {
                spoke.connect(rank).map_err(|e| channel(e.to_string()))?;
                if let Some(what) = spoke.missing() {
                    return Err(channel(what));
                }
                let Some(hub) = spoke.hub.as_mut() else {
                    return Ok(got);
                };
                if hub.closed {
                    return Err(channel("rank 0's launcher is gone".into()));
                }
                hub.read_available().map_err(|e| channel(e.to_string()))?;
                got.extend(hub.frames().into_iter().map(|(r, m)| (r, m.to_vec())));
            }
        }
        Ok(got)
    }

    fn tell(&mut self, message: [u8; 8]) -> Result<(), SuperviseError> {
        let rank = self.rank;
        let channel = |what: String| SuperviseError::Channel { rank, what };
        match &mut self.side {
            Side::Hub(hub) => hub.relay(0, message).map_err(channel),
            Side::Spoke(spoke) => match spoke.hub.as_mut() {
                Some(hub) => hub.send(rank, &message).map_err(|e| channel(e.to_string())),
                None => {
                    spoke.pending.push(message);
                    Ok(())
                }
            },
        }
    }

    /// Frames are written whole as they are told; a spoke that never reached rank 0 waits
    /// for it (its outcome must arrive).
    fn flush(&mut self) -> Result<(), SuperviseError> {
        let rank = self.rank;
        if let Side::Spoke(spoke) = &mut self.side {
            while !spoke.pending.is_empty() {
                spoke.connect(rank).map_err(|e| SuperviseError::Channel {
                    rank,
                    what: e.to_string(),
                })?;
                if let Some(what) = spoke.missing() {
                    return Err(SuperviseError::Channel { rank, what });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::TaskId;
    use crate::launch::lifetime::stand_in::supervise_one;
    use crate::launch::lifetime::{Lifetime, Outcome, Verdict};

    /// Threads as launchers of one job (rank 0 a ps that never ends by itself), joined to
    /// the star in the order `order` (a late rank 0 included).
    fn run(programs: &[(Option<usize>, i32)], order: &[usize]) -> Vec<(Outcome, Verdict, bool)> {
        let token = format!("mpiflow-test-star-{}-{:?}", std::process::id(), order);
        let n = programs.len();
        let tasks: Vec<(TaskId, Lifetime)> = (0..n)
            .map(|i| match i {
                0 => (TaskId::new("ps", 0), Lifetime::Job),
                i => (TaskId::new("worker", i - 1), Lifetime::Own),
            })
            .collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = order
                .iter()
                .map(|&r| {
                    let (token, tasks) = (token.clone(), tasks.clone());
                    let (ends_after, status) = programs[r];
                    let h = s.spawn(move || {
                        let mut star = Star::join(&token, r, n).unwrap();
                        let (end, stopped) = supervise_one(&mut star, (ends_after, status), tasks);
                        (r, (end.mine, end.verdict, stopped))
                    });
                    std::thread::sleep(Duration::from_millis(20));
                    h
                })
                .collect();
            let mut out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            out.sort_by_key(|(r, _)| *r);
            out.into_iter().map(|(_, o)| o).collect()
        })
    }

    #[test]
    fn the_ps_is_stopped_once_the_workers_are_done_whoever_connects_first() {
        for order in [[0, 1, 2], [2, 1, 0]] {
            let out = run(&[(None, 0), (Some(3), 0), (Some(30), 0)], &order);
            assert_eq!(out[0], (Outcome::Stopped, Verdict::Done, true), "{order:?}");
            assert_eq!(out[1], (Outcome::Exited(0), Verdict::Done, false));
            assert_eq!(out[2], (Outcome::Exited(0), Verdict::Done, false));
        }
    }

    #[test]
    fn a_failing_worker_stops_everyone() {
        let out = run(&[(None, 0), (Some(2), 3), (None, 0)], &[1, 0, 2]);
        let failed = Verdict::Failed {
            rank: 1,
            outcome: Outcome::Exited(3),
        };
        assert_eq!(out[0], (Outcome::Stopped, failed.clone(), true));
        assert_eq!(out[1], (Outcome::Exited(3), failed.clone(), false));
        assert_eq!(out[2], (Outcome::Stopped, failed, true));
    }

    #[test]
    fn jobs_have_tokens_of_their_own() {
        let env = |pairs: &[(&str, &str)]| crate::test_support::env(pairs);
        let a = env(&[("OMPI_MCA_orte_hnp_uri", "1.0;tcp://a:1")]);
        let b = env(&[("OMPI_MCA_orte_hnp_uri", "2.0;tcp://a:2")]);
        assert_eq!(job_token(&a, "spec", 3), job_token(&a, "spec", 3));
        assert_ne!(job_token(&a, "spec", 3), job_token(&b, "spec", 3));
        assert_ne!(job_token(&a, "spec", 3), job_token(&a, "spec", 4));
    }
}
