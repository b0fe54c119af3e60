//! Where a supervised program's own MPI stands, for ending a job of MPI programs.
//!
//! A program that uses MPI (mpi4py, Horovod, a C code) cannot end while another rank of
//! its job has initialised MPI and not finalised it: `MPI_Finalize` waits for every rank
//! (Open MPI and MPICH both). A ps task whose program waits for ever (`join()`) thus keeps
//! the workers in `MPI_Finalize`, and the launchers, which stop ps tasks when the workers
//! have ended, would wait for them for ever. So the launcher preloads a small library of
//! its own into the program (`mpi_watch.c`, built by `build.rs` and embedded here): it
//! wraps `MPI_Init`, `MPI_Init_thread` and `MPI_Finalize` and tells the launcher, over a
//! datagram socket, when the program's MPI is initialised and when it enters
//! `MPI_Finalize`. A worker entering `MPI_Finalize` counts as done for stopping the ps
//! tasks ([`super::lifetime`]); a ps program with MPI initialised is stopped by asking the
//! library to finalise MPI and exit 0 (a thread of its own does), so the workers'
//! `MPI_Finalize` completes and the job ends with the workers' statuses. A program that
//! does not end so within the stop grace gets SIGTERM, then SIGKILL, as any other.
//!
//! The library is passed as `/proc/<launcher>/fd/<n>` (a memory file the launcher keeps
//! open while its program runs): no file is written. It defines no other MPI function,
//! and none at all is called in a program that does not use MPI.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{ErrorKind, Write};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The library, as `build.rs` compiled it.
const LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libmpiflow_mpi_watch.so"));

/// The variable naming the launcher's socket to the library.
const SOCKET_VAR: &str = "MPIFLOW_MPI_WATCH";

/// The variable that makes the library's `MPI_Init` print it (if not empty) and exit 1.
const TAKEN_VAR: &str = "MPIFLOW_MPI_TAKEN";

/// The library in a new memory file (kept across `exec` unless `cloexec`).
fn library_file(cloexec: bool) -> std::io::Result<File> {
    let flags = if cloexec { libc::MFD_CLOEXEC } else { 0 };
    // SAFETY: memfd_create with a NUL-terminated name; the descriptor it returns is owned
    // by the File from here on.
    let fd = unsafe { libc::memfd_create(c"mpiflow-mpi-watch".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let mut library = unsafe { File::from_raw_fd(fd) };
    library.write_all(LIBRARY)?;
    Ok(library)
}

/// `path` first in `LD_PRELOAD`, before what the environment preloads already.
fn preload(path: String) -> (String, String) {
    let value = match std::env::var("LD_PRELOAD") {
        Ok(more) if !more.is_empty() => format!("{path}:{more}"),
        _ => path,
    };
    ("LD_PRELOAD".into(), value)
}

/// The variables of a program that must not initialise MPI, because this launcher took
/// the rank's MPI to learn the cluster: the library preloaded from a memory file that
/// survives `exec` (the program has it as its own descriptor), and `line`, which the
/// program's `MPI_Init` prints (when not empty) before it exits 1, in place of the MPI
/// library's failure at length.
pub fn mpi_taken_env(line: &str) -> std::io::Result<Vec<(String, String)>> {
    let fd = library_file(false)?.into_raw_fd();
    Ok(vec![
        preload(format!("/proc/self/fd/{fd}")),
        (TAKEN_VAR.into(), line.into()),
    ])
}

/// How far one process of the program has got with MPI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Initialized,
    Finalizing,
    Finalized,
}

/// The launcher's end: its socket, the library, each process's stage.
pub struct MpiWatch {
    socket: UnixDatagram,
    name: String,
    library: File,
    stages: BTreeMap<u32, Stage>,
}

impl MpiWatch {
    /// A socket named after this launcher, and the library in a memory file.
    pub fn new() -> std::io::Result<MpiWatch> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("mpiflow-mpi-watch-{}-{nanos:08x}", std::process::id());
        let socket = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
        socket.set_nonblocking(true)?;
        Ok(MpiWatch {
            socket,
            name,
            library: library_file(true)?,
            stages: BTreeMap::new(),
        })
    }

    /// The variables the program runs with: the library preloaded (before any the
    /// environment already preloads) and the socket's name.
    pub fn env(&self) -> Vec<(String, String)> {
        let path = format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            self.library.as_raw_fd()
        );
        vec![preload(path), (SOCKET_VAR.into(), self.name.clone())]
    }

    /// Reads what the program's processes said since the last call.
    fn read(&mut self) {
        let mut buf = [0u8; 64];
        loop {
            match self.socket.recv(&mut buf) {
                Ok(n) => {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    let mut words = text.split(' ');
                    let stage = match words.next() {
                        Some("init") => Stage::Initialized,
                        Some("finalizing") => Stage::Finalizing,
                        Some("finalized") => Stage::Finalized,
                        _ => continue,
                    };
                    if let Some(pid) = words.next().and_then(|p| p.parse().ok()) {
                        let s = self.stages.entry(pid).or_insert(stage);
                        *s = (*s).max(stage);
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }

    /// Every process of the program that initialised MPI has entered `MPI_Finalize`
    /// (and one did): the program is done but for the other ranks.
    pub fn finalizing(&mut self) -> bool {
        self.read();
        !self.stages.is_empty() && self.stages.values().all(|s| *s >= Stage::Finalizing)
    }

    /// Asks every process of the program whose MPI is initialised, and not finalising,
    /// to finalise it and exit; whether any was asked.
    pub fn ask_to_finalize(&mut self) -> bool {
        self.read();
        let mut asked = false;
        for (pid, _) in self
            .stages
            .iter()
            .filter(|(_, s)| **s == Stage::Initialized)
        {
            let name = format!("{}/{pid}", self.name);
            if let Ok(addr) = SocketAddr::from_abstract_name(name.as_bytes()) {
                asked |= self.socket.send_to_addr(b"finalize", &addr).is_ok();
            }
        }
        asked
    }
}
