//! What the command prints: lines written in one call (so ranks' lines do not splice),
//! and failures as one line each.

use mpiflow::transport::Context;

/// `eprintln!` in one `write`: Rust's stderr is unbuffered and `eprintln!` writes its
/// pieces separately, so under mpirun the lines of several ranks could splice together.
macro_rules! say {
    ($($t:tt)*) => {{
        let mut line = format!($($t)*);
        line.push('\n');
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }};
}
pub(crate) use say;

/// Writes text in one `write` call, so lines of different ranks do not interleave.
pub(crate) fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = std::io::Write::write_all(&mut out, text.as_bytes());
    let _ = std::io::Write::flush(&mut out);
}

/// A failure to report: the message of a local error, which `main` prints with this rank's
/// number first, or `None` for an error all ranks agreed on, which rank 0 has printed.
pub(crate) struct Failure(pub(crate) Option<String>, pub(crate) u8);

impl Failure {
    pub(crate) fn local(e: impl std::fmt::Display) -> Self {
        Failure(Some(e.to_string()), 1)
    }

    /// A run stopped by a signal at a step boundary: `stopped` printed once (`print`: by
    /// the rank that knows the checkpoint, the chief), and the exit status that says it
    /// may be resumed.
    pub(crate) fn stopped(stopped: &mpiflow::train::Stopped, print: bool) -> Self {
        if print {
            say!("mpiflow: {stopped}");
        }
        Failure(None, mpiflow::train::Stopped::EXIT_STATUS)
    }

    /// An error all ranks agreed on, printed once by rank 0, right away: while MPI is still
    /// initialised, so no rank can exit (and make mpirun end the job) before it is printed.
    pub(crate) fn agreed(e: impl std::fmt::Display, ctx: &Context) -> Self {
        Failure::agreed_by(e, ctx.rank() == 0)
    }

    /// An error some ranks agreed on (those taking part), printed once by the one that
    /// `prints`, as [`Failure::agreed`].
    pub(crate) fn agreed_by(e: impl std::fmt::Display, prints: bool) -> Self {
        if prints {
            say!("mpiflow: error: {e}");
        }
        Failure(None, 1)
    }
}
