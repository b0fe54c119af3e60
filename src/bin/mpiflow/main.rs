//! The `mpiflow` command: a thin layer over the library, one module per command
//! ([`cmd`]), its flags apart ([`args`]).
//!
//! Errors become one line on stderr (`mpiflow: error: ...`) and a non-zero exit. Under MPI,
//! an error found on any rank is agreed by all ranks first (see
//! [`mpiflow::transport::Context::agree`]), printed once by rank 0, and every rank exits
//! non-zero, so `mpirun` ends the whole job instead of leaving ranks waiting.

mod args;
mod cmd;
mod env;
mod out;
mod report;

use std::collections::BTreeMap;
use std::process::ExitCode;

use mpiflow::cluster::resolve::{launcher_rank_hint, rank_of_one_command};

use args::Cmd;
use out::say;

fn main() -> ExitCode {
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let prefix = launcher_rank_hint(&env)
        .map(|r| format!("rank {r}: "))
        .unwrap_or_default();
    // A bug must still give one line and a non-zero exit, never a backtrace or a hang:
    // exiting ends this rank, and mpirun then ends the job.
    let panic_prefix = prefix.clone();
    std::panic::set_hook(Box::new(move |info| {
        say!("mpiflow: internal error: {panic_prefix}{info}");
        std::process::exit(70);
    }));
    let argv = args::normalise_args(std::env::args());
    let cli = match args::parse(&argv) {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let line = args::one_line(&e.render().to_string(), &argv);
            match rank_of_one_command(&env) {
                // Every rank was given these arguments and fails alike: rank 0 says it for
                // all, and mpirun ends the job when it exits; the others wait for that (a
                // bounded wait) so that none ends it before the line is out.
                Some(0) => say!("mpiflow: all ranks: {line}"),
                Some(_) => std::thread::sleep(std::time::Duration::from_secs(10)),
                None => say!("mpiflow: {prefix}{line}"),
            }
            return ExitCode::from(2);
        }
    };
    // Before MPI starts: what OpenBLAS and OpenMPI must find in the environment.
    env::reexec_with_env(&cli.cmd, cli.rdma_stack, &env, &prefix);
    let result = match &cli.cmd {
        Cmd::Spec(a) => cmd::spec::run(a, &env),
        Cmd::Launch(a) => cmd::launch::run(a, &env),
        Cmd::Check(a) => cmd::check::run(a, &env),
        Cmd::Bench(a) => cmd::bench::run(a),
        Cmd::Train(a) => cmd::train::run(a, &env),
        Cmd::Topo(a) => cmd::topo::run(a),
        Cmd::Supervise(a) => cmd::supervise::run(a),
        Cmd::Plot(a) => cmd::plot::run(a),
        Cmd::Scale(a) => cmd::scale::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            if let Some(message) = f.0 {
                say!("mpiflow: error: {prefix}{message}");
            }
            ExitCode::from(f.1)
        }
    }
}
