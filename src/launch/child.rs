//! The program as the launcher's child, when the launcher must outlive it to end the job
//! ([`super::lifetime`]).
//!
//! What the program sees stays what it would be without mpiflow, except its parent: the
//! same arguments, environment, working directory, stdin, stdout and stderr (inherited),
//! and the signals the launcher's process receives from other processes (`kill`, a
//! supervisor: SIGHUP, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGTERM, SIGCONT) passed on to
//! it, each once. The program stays in the launcher's process group, so some signals reach
//! it directly and are not passed on again:
//!
//! - those the kernel raises for a terminal (Ctrl-C), sent to the foreground group;
//! - those of the process managers that signal a task's whole process group or every
//!   process of a Slurm step ([`MANAGERS`]): Open MPI's `mpirun` and `orted` (and PRRTE's),
//!   which pass on what `mpirun` receives to each task's group unless
//!   `odls_base_signal_direct_children_only` is set; MPICH's Hydra proxy; Slurm's
//!   `slurmstepd` of a job step (`scancel -s`, `srun` passing a signal on, the time
//!   limit), whose process tracking reaches every process of the step. (The batch step's
//!   signals a launcher passes on: `--signal=B:USR1@120` and `scancel --batch` reach the
//!   batch shell alone.)
//!
//! If the launcher dies, the program gets SIGKILL (`PR_SET_PDEATHSIG`), never an orphan.
//! The launcher then exits as the program did: its status, or killed by its signal
//! ([`exit_as`]).

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::lifetime::{Outcome, Program};
use super::watch::MpiWatch;

/// The signals passed on to the program.
const FORWARDED: [libc::c_int; 7] = [
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGTERM,
    libc::SIGCONT,
];

/// Process managers, by the name the kernel gives them (`/proc/PID/comm`), whose signals
/// reach every process of a task's process group (Open MPI, PRRTE, Hydra) or of its Slurm
/// step (`slurmstepd` of a job step; its batch step signals the batch shell alone, for
/// `--signal=B:...` and `scancel --batch`): a launcher does not pass their signals on.
pub const MANAGERS: [&str; 9] = [
    "mpirun",
    "mpiexec",
    "orterun",
    "orted",
    "prte",
    "prterun",
    "prted",
    "hydra_pmi_proxy",
    "slurmstepd",
];

/// The MCA settings that make Open MPI's and PRRTE's daemons signal only their direct
/// children (the launcher), not its process group.
const DIRECT_ONLY: [&str; 2] = [
    "OMPI_MCA_odls_base_signal_direct_children_only",
    "PRTE_MCA_odls_base_signal_direct_children_only",
];

/// Whether a signal from the process named `comm`, run as `cmdline` (its arguments
/// joined), reached the launcher's whole process group (the program in it), given the
/// value of the MCA setting [`DIRECT_ONLY`] if set.
fn signals_the_group(comm: &str, cmdline: &str, direct_only: Option<&str>) -> bool {
    let direct = direct_only.is_some_and(|v| {
        ["1", "t", "true", "y", "yes", "on", "enabled"].contains(&v.to_ascii_lowercase().as_str())
    });
    match comm {
        // `slurmstepd: [JOB.STEP]`; the batch step's is `[JOB.batch]`.
        "slurmstepd" => !cmdline.contains(".batch]"),
        "hydra_pmi_proxy" => true,
        _ => MANAGERS.contains(&comm) && !direct,
    }
}

/// Whether the signal `sender` sent reached the program `child` directly: the sender is
/// one of the [`MANAGERS`] and the program is still in the launcher's process group.
fn reached_directly(sender: libc::pid_t, child: libc::pid_t) -> bool {
    // SAFETY: plain queries of process groups; a pid that is gone gives -1.
    if unsafe { libc::getpgid(child) != libc::getpgrp() } {
        return false;
    }
    let read = |what| std::fs::read(format!("/proc/{sender}/{what}")).ok();
    let (Some(comm), Some(cmdline)) = (read("comm"), read("cmdline")) else {
        return false;
    };
    let comm = String::from_utf8_lossy(&comm);
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    let direct_only = DIRECT_ONLY.iter().find_map(|k| std::env::var(k).ok());
    signals_the_group(comm.trim_end(), &cmdline, direct_only.as_deref())
}

/// A running program.
pub struct ChildProgram {
    child: Child,
    done: Option<Outcome>,
    /// Where its MPI stands, when it runs with the MPI watch.
    watch: Option<MpiWatch>,
}

impl ChildProgram {
    /// Starts `args[0]` with `args[1..]` and `env` added to this process's environment,
    /// and starts passing signals on to it.
    pub fn spawn(args: &[String], env: &[(String, String)]) -> std::io::Result<ChildProgram> {
        Self::spawn_with(args, env, std::process::Stdio::inherit())
    }

    /// [`ChildProgram::spawn`] with the MPI watch preloaded ([`super::watch`]): a program
    /// that uses MPI tells when it enters `MPI_Finalize`, and is stopped by finalising it.
    pub fn spawn_watched(
        args: &[String],
        env: &[(String, String)],
    ) -> std::io::Result<ChildProgram> {
        let watch = MpiWatch::new()?;
        let mut env = env.to_vec();
        env.extend(watch.env());
        let mut program = Self::spawn(args, &env)?;
        program.watch = Some(watch);
        Ok(program)
    }

    /// [`ChildProgram::spawn`] with its stdout as `stdout` says (piped: read it with
    /// [`ChildProgram::take_stdout`]).
    pub fn spawn_with(
        args: &[String],
        env: &[(String, String)],
        stdout: std::process::Stdio,
    ) -> std::io::Result<ChildProgram> {
        let mut cmd = Command::new(&args[0]);
        cmd.args(&args[1..])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(stdout);
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe calls (prctl, getppid, kill on itself).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died between fork and prctl: no death signal would come.
                if libc::getppid() != parent {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
                Ok(())
            });
        }
        // Before the fork: a signal in between is noted, not fatal (exec resets the
        // child's handlers to the defaults). A terminal's signals already reached the
        // program (same process group): only those other processes send are passed on.
        crate::signals::catch(&FORWARDED, true)?;
        let child = cmd.spawn()?;
        Ok(ChildProgram {
            child,
            done: None,
            watch: None,
        })
    }

    /// The program's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its stdout, if spawned with a pipe (once).
    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.stdout.take()
    }

    fn outcome(status: std::process::ExitStatus) -> Outcome {
        match (status.code(), status.signal()) {
            (Some(c), _) => Outcome::Exited(c),
            (None, Some(s)) => Outcome::Signaled(s),
            (None, None) => Outcome::Exited(1),
        }
    }

    /// Whether the program ended within `grace` (it is polled meanwhile).
    fn ended_within(&mut self, grace: Duration) -> std::io::Result<bool> {
        let since = Instant::now();
        while self.try_wait()?.is_none() {
            if since.elapsed() >= grace {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(true)
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill with our own child's pid; it is not reaped before `done` is set,
        // so the pid cannot belong to another process.
        unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
    }
}

impl Program for ChildProgram {
    fn try_wait(&mut self) -> std::io::Result<Option<Outcome>> {
        if self.done.is_none() {
            self.done = self.child.try_wait()?.map(Self::outcome);
        }
        Ok(self.done)
    }

    fn mpi_finalizing(&mut self) -> bool {
        self.watch.as_mut().is_some_and(MpiWatch::finalizing)
    }

    /// A program with MPI initialised is first asked to finalise it and exit (the other
    /// ranks' `MPI_Finalize` waits for that); then, as any other, SIGTERM, and SIGKILL
    /// after `grace`.
    fn stop(&mut self, grace: Duration) -> std::io::Result<()> {
        if self.try_wait()?.is_some() {
            return Ok(());
        }
        if self.watch.as_mut().is_some_and(MpiWatch::ask_to_finalize) && self.ended_within(grace)? {
            return Ok(());
        }
        self.signal(libc::SIGTERM);
        if !self.ended_within(grace)? {
            self.signal(libc::SIGKILL);
            self.done = Some(Self::outcome(self.child.wait()?));
        }
        Ok(())
    }

    fn forward_signals(&mut self) {
        let pending = crate::signals::take();
        if pending == 0 || self.done.is_some() {
            return;
        }
        let child = self.child.id() as libc::pid_t;
        for sig in FORWARDED.into_iter().filter(|s| pending & (1 << s) != 0) {
            if !crate::signals::sender(sig).is_some_and(|s| reached_directly(s, child)) {
                self.signal(sig);
            }
        }
    }
}

/// Ends this process as `outcome` says its program ended: with its exit status, or killed
/// by its signal (without a core file of the launcher's own); a program mpiflow stopped
/// ends as status 0.
pub fn exit_as(outcome: Outcome) -> ! {
    match outcome {
        Outcome::Exited(c) => std::process::exit(c),
        Outcome::Stopped => std::process::exit(0),
        Outcome::Signaled(s) => {
            // SAFETY: plain libc calls on this process: no core file, the default action
            // for `s`, then the signal itself.
            unsafe {
                let none = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::setrlimit(libc::RLIMIT_CORE, &none);
                libc::signal(s, libc::SIG_DFL);
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, s);
                libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                libc::raise(s);
            }
            // A signal whose default is not to end the process.
            std::process::exit(128 + s)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_of_process_managers_are_known_to_reach_the_group() {
        let step = "slurmstepd: [42.0]";
        for comm in ["orted", "mpirun", "prted", "hydra_pmi_proxy", "slurmstepd"] {
            assert!(signals_the_group(comm, step, None), "{comm}");
            assert!(signals_the_group(comm, step, Some("0")), "{comm}");
        }
        // Open MPI told to signal direct children only: the launcher passes them on.
        assert!(!signals_the_group("orted", "orted", Some("1")));
        assert!(!signals_the_group("mpirun", "mpirun", Some("true")));
        // Hydra and Slurm do not read Open MPI's setting.
        assert!(signals_the_group("slurmstepd", step, Some("1")));
        // Slurm's batch step signals the batch shell alone (`--signal=B:USR1@120`,
        // `scancel --batch`): a launcher that is that shell passes it on.
        assert!(!signals_the_group(
            "slurmstepd",
            "slurmstepd: [42.batch]",
            None
        ));
        // A shell's `kill PID`, a supervisor, an unknown tool: passed on.
        for comm in ["bash", "sh", "python3", "timeout", "mpiflow", "srun"] {
            assert!(!signals_the_group(comm, comm, None), "{comm}");
        }
    }
}
