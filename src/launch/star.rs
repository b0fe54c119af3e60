//! The supervising launchers of a job, without MPI: a star around rank 0's launcher, over
//! a Unix socket in Linux's abstract namespace for the launchers of rank 0's host (no file
//! to clean up; it is gone with its last user) and over TCP, on a port of the job's on
//! rank 0's host ([`tcp_port`]), for those of other hosts.
//!
//! Rank 0 listens; every other launcher connects, says the job's key and its rank (a
//! connection with another key is dropped: another job's, or no launcher), and sends its
//! program's outcome when it has one (and a note before it: [`super::notices`]); rank 0
//! passes each message on to all the others, and replays what it has to a launcher that
//! connects late. Messages are frames of 12 bytes: the rank whose message it is (`u32`,
//! little-endian) and the 8-byte message. The socket's name is the job's ([`job_token`]),
//! so two jobs on one host never meet.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
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

/// The variable that sets the port of the launchers' TCP star (see [`tcp_port`]).
pub const PORT_VAR: &str = "MPIFLOW_LAUNCH_PORT";

/// The TCP port rank 0's launcher listens on for launchers of other hosts:
/// `MPIFLOW_LAUNCH_PORT` if set, else one of 20000-29999 (below Linux's ephemeral ports)
/// that the job's name picks, the same in every launcher.
pub fn tcp_port(env: &BTreeMap<String, String>, token: &str) -> Result<u16, String> {
    match env.get(PORT_VAR) {
        Some(v) => v
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("{PORT_VAR}={v:?} is not a port (1-65535)")),
        None => Ok(20_000 + (crate::hash::fnv1a(token.as_bytes()) % 10_000) as u16),
    }
}

/// A launcher's connection: within rank 0's host, or from another.
enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn set_nonblocking(&self) -> std::io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(true),
            Stream::Tcp(s) => {
                s.set_nodelay(true)?;
                s.set_nonblocking(true)
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Bytes of a greeting: the job's key (`u64`) and the rank (`u32`), little-endian.
const GREETING: usize = 12;

/// The job's key, from its name: what a connection must say first.
fn key(token: &str) -> u64 {
    crate::hash::fnv1a(format!("star {token}").as_bytes())
}

/// One connection's bytes not yet read as frames.
struct Peer {
    stream: Stream,
    buf: Vec<u8>,
    /// Its end of the connection closed.
    closed: bool,
}

impl Peer {
    fn new(stream: Stream) -> Peer {
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
fn write_all(stream: &mut Stream, mut bytes: &[u8]) -> std::io::Result<()> {
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

/// Rank 0's side: the listeners, each rank's connection, every outcome so far.
struct Hub {
    key: u64,
    listener: UnixListener,
    /// For launchers on other hosts.
    tcp: Option<TcpListener>,
    /// Connections whose rank is not read yet.
    greeting: Vec<Peer>,
    peers: Vec<Option<Peer>>,
    told: Vec<(usize, [u8; 8])>,
}

/// Another rank's side: its connection to rank 0, once made.
struct Spoke {
    key: u64,
    /// Rank 0's Unix socket, if this launcher may be on its host.
    addr: Option<SocketAddr>,
    /// Rank 0's host and TCP port, when some launcher is on another host.
    tcp: Option<(String, u16)>,
    /// Why rank 0's TCP address could not be reached yet, for the error if it never is.
    tcp_error: Option<String>,
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
    /// rank 0 listens at once (an error if another process holds the name or the port),
    /// the others connect as soon as it does. `tcp`: rank 0's host and the port
    /// ([`tcp_port`]), when some launcher runs on another host than rank 0's.
    pub fn join(
        token: &str,
        rank: usize,
        size: usize,
        tcp: Option<(String, u16)>,
    ) -> Result<Star, SuperviseError> {
        Self::join_by(token, rank, size, tcp, true)
    }

    /// [`Star::join`]; a spoke tries rank 0's Unix socket only if `unix` (the tests reach
    /// rank 0 over TCP from its own host).
    fn join_by(
        token: &str,
        rank: usize,
        size: usize,
        tcp: Option<(String, u16)>,
        unix: bool,
    ) -> Result<Star, SuperviseError> {
        let channel = |what: String| SuperviseError::Channel { rank, what };
        let addr = SocketAddr::from_abstract_name(token.as_bytes())
            .map_err(|e| channel(format!("socket name {token}: {e}")))?;
        let side = if rank == 0 {
            let listener = UnixListener::bind_addr(&addr)
                .map_err(|e| channel(format!("cannot listen on @{token}: {e}")))?;
            listener
                .set_nonblocking(true)
                .map_err(|e| channel(e.to_string()))?;
            let tcp = match tcp {
                Some((_, port)) => Some(listen_tcp(port).map_err(channel)?),
                None => None,
            };
            Side::Hub(Hub {
                key: key(token),
                listener,
                tcp,
                greeting: Vec::new(),
                peers: (0..size).map(|_| None).collect(),
                told: Vec::new(),
            })
        } else {
            let mut spoke = Spoke {
                key: key(token),
                addr: unix.then_some(addr),
                tcp,
                tcp_error: None,
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

/// Rank 0's TCP listener for the launchers of other hosts, on every address of its host.
fn listen_tcp(port: u16) -> Result<TcpListener, String> {
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
        format!("cannot listen on TCP port {port} for the launchers of other hosts: {e} (set {PORT_VAR} to a free port, the same for every rank)")
    })?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(listener)
}

/// Whether a connection error means rank 0 does not listen (yet).
fn not_listening(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::NotFound | ErrorKind::TimedOut
    )
}

impl Spoke {
    /// A connection to rank 0: within its host, else over TCP; `None` while it does not
    /// listen (or cannot be reached: see `tcp_error`).
    fn reach(&mut self) -> std::io::Result<Option<Stream>> {
        if let Some(addr) = &self.addr {
            match UnixStream::connect_addr(addr) {
                Ok(s) => return Ok(Some(Stream::Unix(s))),
                Err(e) if not_listening(&e) => {}
                Err(e) => return Err(e),
            }
        }
        let Some((host, port)) = &self.tcp else {
            return Ok(None);
        };
        let addrs = match (host.as_str(), *port).to_socket_addrs() {
            Ok(a) => a,
            Err(e) => {
                self.tcp_error = Some(format!("{host}: {e}"));
                return Ok(None);
            }
        };
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(1)) {
                Ok(s) => return Ok(Some(Stream::Tcp(s))),
                Err(e) => self.tcp_error = Some(format!("{host} ({a}): {e}")),
            }
        }
        Ok(None)
    }

    /// Connects to rank 0 if it listens by now, and says the job's key and this rank (and
    /// what this rank told, if anything); `Ok` also while rank 0 does not listen yet.
    fn connect(&mut self, rank: usize) -> std::io::Result<()> {
        if self.hub.is_some() {
            return Ok(());
        }
        let Some(mut stream) = self.reach()? else {
            return Ok(());
        };
        stream.set_nonblocking()?;
        let mut greeting = [0u8; GREETING];
        greeting[..8].copy_from_slice(&self.key.to_le_bytes());
        greeting[8..].copy_from_slice(&(rank as u32).to_le_bytes());
        write_all(&mut stream, &greeting)?;
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
            let tcp = match (&self.tcp, &self.tcp_error) {
                (Some((host, port)), Some(e)) => format!("; TCP port {port} on {host}: {e}"),
                _ => String::new(),
            };
            format!(
                "rank 0's launcher did not listen within {} s (is every rank started by `mpiflow launch` under the same launcher?){tcp}",
                CONNECT_WITHIN.as_secs()
            )
        })
    }
}

impl Hub {
    /// Takes the connections waiting on both listeners.
    fn accept(&mut self) -> Result<(), String> {
        loop {
            let accepted = match self.listener.accept() {
                Ok((s, _)) => Ok(Stream::Unix(s)),
                Err(e) => match self.tcp.as_ref().map(TcpListener::accept) {
                    Some(Ok((s, _))) => Ok(Stream::Tcp(s)),
                    Some(Err(t)) if e.kind() == ErrorKind::WouldBlock => Err(t),
                    _ => Err(e),
                },
            };
            match accepted {
                Ok(stream) => {
                    stream.set_nonblocking().map_err(|e| e.to_string())?;
                    self.greeting.push(Peer::new(stream));
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Takes new connections and their greetings; replays what was told to each.
    fn admit(&mut self, size: usize) -> Result<(), String> {
        self.accept()?;
        let mut i = 0;
        while i < self.greeting.len() {
            let p = &mut self.greeting[i];
            p.read_available().map_err(|e| e.to_string())?;
            let foreign = p.buf.len() >= 8 && p.buf[..8] != self.key.to_le_bytes();
            if p.buf.len() < GREETING && !foreign {
                if p.closed {
                    self.greeting.swap_remove(i);
                } else {
                    i += 1;
                }
                continue;
            }
            let mut p = self.greeting.swap_remove(i);
            if foreign {
                continue;
            }
            let r = u32::from_le_bytes(p.buf[8..GREETING].try_into().expect("4 bytes")) as usize;
            p.buf.drain(..GREETING);
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
mod tests;
