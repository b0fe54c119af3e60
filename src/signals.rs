//! Signals noted, not acted on in the handler: a handler only sets a bit, and the code that
//! owns the process (a launcher passing them on, a training loop at its next step boundary)
//! reads and clears the bits when it is ready to act.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

/// Signals received and not yet taken, one bit per signal number.
static PENDING: AtomicU64 = AtomicU64::new(0);
/// The process that sent each signal last (0: the kernel, or none yet), by signal number.
static SENDERS: [AtomicI32; 64] = [const { AtomicI32::new(0) }; 64];
/// Whether signals a terminal raised (Ctrl-C) are left out of [`PENDING`].
static SKIP_TERMINAL: AtomicBool = AtomicBool::new(false);
/// Whether a signal a terminal raised was left out.
static TERMINAL_SEEN: AtomicBool = AtomicBool::new(false);

extern "C" fn note(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let code = unsafe { (*info).si_code };
    if code == libc::SI_KERNEL && SKIP_TERMINAL.load(Ordering::Relaxed) {
        TERMINAL_SEEN.store(true, Ordering::SeqCst);
        return;
    }
    // Async-signal-safe: atomic operations only. `si_pid` is set for signals a process
    // sent (kill, sigqueue, tgkill: codes of 0 and below).
    let sender = if code <= 0 {
        // SAFETY: as above; for these codes the kernel filled in the sender's pid.
        unsafe { (*info).si_pid() }
    } else {
        0
    };
    if let Some(slot) = usize::try_from(sig).ok().and_then(|s| SENDERS.get(s)) {
        slot.store(sender, Ordering::SeqCst);
    }
    PENDING.fetch_or(1 << sig, Ordering::SeqCst);
}

/// From now on `sigs` are noted instead of taking their default action. With
/// `skip_terminal`, those a terminal raises (they reached the whole foreground process
/// group, children too) are dropped.
pub fn catch(sigs: &[libc::c_int], skip_terminal: bool) -> std::io::Result<()> {
    SKIP_TERMINAL.store(skip_terminal, Ordering::Relaxed);
    for &sig in sigs {
        // SAFETY: a zeroed sigaction is valid; the handler only does atomic operations.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = note as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Whether a signal a terminal raised reached this process while skipped (it reached the
/// whole foreground process group: the children got it themselves).
pub fn terminal_seen() -> bool {
    TERMINAL_SEEN.load(Ordering::SeqCst)
}

/// The signals noted since the last call, as a bit set; clears them.
pub fn take() -> u64 {
    PENDING.swap(0, Ordering::SeqCst)
}

/// The process that sent the last `sig` noted, if a process sent it (not the kernel).
pub fn sender(sig: libc::c_int) -> Option<libc::pid_t> {
    let slot = SENDERS.get(usize::try_from(sig).ok()?)?;
    Some(slot.load(Ordering::SeqCst)).filter(|&p| p > 0)
}

/// The lowest-numbered signal noted so far (not cleared), if any.
pub fn first() -> Option<libc::c_int> {
    let bits = PENDING.load(Ordering::SeqCst);
    (bits != 0).then(|| bits.trailing_zeros() as libc::c_int)
}

/// The signals that ask a training job to stop at a step boundary, with a checkpoint:
/// SIGTERM (Slurm's time limit, `scancel`, a preemption, `kill`), SIGINT (Ctrl-C) and
/// SIGUSR1 (Slurm's early warning, `--signal=B:USR1@120`, which mpirun passes on).
pub const STOP: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1];

/// From now on the [`STOP`] signals are noted instead of ending the process: a training
/// session with `stop_on_signal` stops every rank at a step boundary, with a checkpoint.
pub fn catch_stop_signals() -> std::io::Result<()> {
    catch(&STOP, false)
}

/// The lowest-numbered stop signal ([`STOP`]) noted so far (not cleared), if any.
pub fn stop_requested() -> Option<libc::c_int> {
    let bits = PENDING.load(Ordering::SeqCst);
    let stops = STOP.iter().fold(0u64, |m, s| m | 1 << s);
    let asked = bits & stops;
    (asked != 0).then(|| asked.trailing_zeros() as libc::c_int)
}

/// [`stop_requested`] for a job that stops on signals (`watch`, a config's
/// `stop_on_signal`), else nothing.
pub fn stop_requested_if(watch: bool) -> Option<libc::c_int> {
    watch.then(stop_requested).flatten()
}

/// The usual name of a signal number.
pub fn name(s: i32) -> String {
    let known = [
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGXCPU, "SIGXCPU"),
    ];
    known
        .iter()
        .find(|(n, _)| *n == s)
        .map_or_else(|| format!("signal {s}"), |(_, name)| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caught_signal_is_noted_not_fatal() {
        catch(&[libc::SIGUSR2], false).unwrap();
        // SAFETY: raising a signal this process catches.
        unsafe { libc::raise(libc::SIGUSR2) };
        assert_eq!(first(), Some(libc::SIGUSR2));
        assert_eq!(
            sender(libc::SIGUSR2),
            Some(std::process::id() as libc::pid_t)
        );
        assert_eq!(take(), 1 << libc::SIGUSR2);
        assert_eq!(first(), None);
    }
}
