//! `mpiflow launch`: run any program (a real TensorFlow script) as one task of the cluster.
//!
//! The launcher exports the task's identity and then replaces itself with the program
//! (`execve`), so `mpirun` or `srun` track the program's own process and its exit status is
//! the job's. Exported variables:
//!
//! | variable | value |
//! |---|---|
//! | `TF_CONFIG` | the task's TF_CONFIG, one line of JSON |
//! | `MPIFLOW_JOB`, `MPIFLOW_TASK_INDEX` | the task, e.g. `worker`, `1` |
//! | `MPIFLOW_RANK`, `MPIFLOW_LOCAL_RANK`, `MPIFLOW_SIZE` | where known (not from TF_CONFIG) |
//! | `MPIFLOW_ADDRESS` | the task's `host:port` |
//!
//! With `--legacy-flags`, `--ps_hosts --worker_hosts --job_name --task_index` are appended
//! to the program's arguments.
//!
//! The launcher learns the cluster without initialising MPI where the MPI launcher's
//! variables tell it (every rank on one host under `mpirun` or `mpiexec`, Slurm's step
//! under `srun`: [`crate::cluster::launched`]), so a program that initialises MPI itself
//! (mpi4py, Horovod, a C MPI code) can still do so as its rank. Elsewhere (`mpirun` across
//! hosts) it asks MPI and finalises it before the exec: the program is a new process image
//! and must not inherit an initialised MPI library, and cannot initialise it again as the
//! same rank (programs that need no MPI, like TensorFlow's gRPC servers, are unaffected).
//!
//! **Ending the job.** TensorFlow's ps tasks `join()` forever, so a job of them never ends
//! by itself. When the cluster has ps tasks, each launcher instead starts the program as
//! its child and stays until the job is over ([`lifetime`], [`child`]): once every worker
//! and chief has exited 0, the ps tasks are stopped; once any task fails, all are, and the
//! job's status is the failure's. The launchers tell each other their programs' outcomes
//! ([`notices`]) over sockets of their own where the cluster was learned without MPI
//! ([`star`]: MPI stays the program's), else over the job's MPI communicator. A program
//! that uses MPI runs with the MPI watch ([`watch`]): a worker in `MPI_Finalize` counts as
//! done, and a ps task's MPI is finalised when it is stopped. `--ps-lifetime forever`
//! keeps TensorFlow's behaviour (and the exec).

pub mod child;
pub mod lifetime;
pub mod notices;
pub mod star;
pub mod watch;

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cluster::flags::{self, FlagsError};
use crate::cluster::{Layout, RankInfo, Role, TaskId};
use lifetime::Lifetime;

/// How long the tasks that never end by themselves live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PsLifetime {
    /// Stopped when every worker and chief task has exited 0 (or any task failed).
    #[default]
    Job,
    /// Until something else ends them, as in TensorFlow.
    Forever,
}

/// Each rank's task and lifetime when some task needs stopping at the end of the job
/// (`None`: every task ends by itself, or `forever` was asked; nothing to supervise).
/// Ps tasks live as long as the job; so does the evaluator with `stop_evaluator`.
pub fn lifetimes(
    layout: &Layout,
    ps: PsLifetime,
    stop_evaluator: bool,
) -> Option<Vec<(TaskId, Lifetime)>> {
    if ps == PsLifetime::Forever {
        return None;
    }
    let tasks: Vec<(TaskId, Lifetime)> = layout
        .ranks
        .iter()
        .map(|r| {
            let lifetime = match r.task.role() {
                Ok(Role::Ps) => Lifetime::Job,
                Ok(Role::Evaluator) if stop_evaluator => Lifetime::Job,
                _ => Lifetime::Own,
            };
            (r.task.clone(), lifetime)
        })
        .collect();
    tasks
        .iter()
        .any(|(_, l)| *l == Lifetime::Job)
        .then_some(tasks)
}

/// Errors from preparing or starting the program.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    #[error("program {0:?} not found in PATH")]
    NotFound(String),
    #[error("program {0:?} is not an executable file")]
    NotExecutable(String),
    #[error("no program given (mpiflow launch [flags] -- PROGRAM ARGS...)")]
    NoProgram,
    #[error("cannot run {program:?}: {why}")]
    Exec { program: String, why: String },
    #[error("{0}")]
    Flags(#[from] FlagsError),
}

/// The variables exported for one task.
pub fn task_env(layout: &Layout, me: &RankInfo, size: Option<usize>) -> Vec<(String, String)> {
    let mut env = vec![
        ("TF_CONFIG".to_string(), layout.tf_config(me).to_json()),
        ("MPIFLOW_JOB".to_string(), me.task.job.clone()),
        ("MPIFLOW_TASK_INDEX".to_string(), me.task.index.to_string()),
        ("MPIFLOW_ADDRESS".to_string(), me.address.to_string()),
    ];
    for (k, v) in [
        ("MPIFLOW_RANK", me.rank),
        ("MPIFLOW_LOCAL_RANK", me.local_rank),
        ("MPIFLOW_SIZE", size),
    ] {
        if let Some(v) = v {
            env.push((k.to_string(), v.to_string()));
        }
    }
    env
}

/// The program's full argument list (legacy flags appended when asked).
pub fn task_args(
    layout: &Layout,
    me: &RankInfo,
    program: &[String],
    legacy_flags: bool,
) -> Result<Vec<String>, LaunchError> {
    let mut args = program.to_vec();
    if args.is_empty() {
        return Err(LaunchError::NoProgram);
    }
    if legacy_flags {
        args.extend(flags::emit(&layout.tf_config(me))?);
    }
    Ok(args)
}

/// Finds `program` as `execvp` would: a path if it contains a slash, else in `PATH`.
pub fn find_program(program: &str, path_var: Option<&OsString>) -> Result<PathBuf, LaunchError> {
    let is_exec = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if is_exec(&p) {
            Ok(p)
        } else if p.exists() {
            Err(LaunchError::NotExecutable(program.into()))
        } else {
            Err(LaunchError::NotFound(program.into()))
        };
    }
    path_var
        .map(std::env::split_paths)
        .into_iter()
        .flatten()
        .map(|d| d.join(program))
        .find(|p| is_exec(p))
        .ok_or_else(|| LaunchError::NotFound(program.into()))
}

/// Replaces this process with the program; returns only on failure.
pub fn exec(args: &[String], env: &[(String, String)]) -> LaunchError {
    let err = Command::new(&args[0])
        .args(&args[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .exec();
    LaunchError::Exec {
        program: args[0].clone(),
        why: err.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::mapping::{assign_roles, MappingOptions};

    fn layout() -> Layout {
        let hosts: Vec<String> = ["a", "a", "b"].iter().map(|s| s.to_string()).collect();
        let tasks = assign_roles(
            &hosts,
            &MappingOptions {
                ps: 1,
                ..Default::default()
            },
        )
        .unwrap();
        Layout::from_ranks(&hosts, &[2222, 2223, 2222], tasks).unwrap()
    }

    #[test]
    fn env_and_args_of_a_task() {
        let l = layout();
        let me = &l.ranks[2];
        let env = task_env(&l, me, Some(3));
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(
            get("TF_CONFIG"),
            Some(
                r#"{"cluster":{"ps":["a:2222"],"worker":["a:2223","b:2222"]},"task":{"type":"worker","index":1}}"#
            )
        );
        assert_eq!(get("MPIFLOW_JOB"), Some("worker"));
        assert_eq!(get("MPIFLOW_TASK_INDEX"), Some("1"));
        assert_eq!(get("MPIFLOW_RANK"), Some("2"));
        assert_eq!(get("MPIFLOW_LOCAL_RANK"), Some("0"));
        let args = task_args(&l, me, &["prog".into(), "x".into()], true).unwrap();
        assert_eq!(
            args,
            [
                "prog",
                "x",
                "--ps_hosts=a:2222",
                "--worker_hosts=a:2223,b:2222",
                "--job_name=worker",
                "--task_index=1"
            ]
        );
        assert_eq!(task_args(&l, me, &[], false), Err(LaunchError::NoProgram));
    }

    #[test]
    fn ps_tasks_live_as_long_as_the_job_unless_forever() {
        let l = layout();
        let got = lifetimes(&l, PsLifetime::Job, false).unwrap();
        let kinds: Vec<(String, Lifetime)> = got.iter().map(|(t, l)| (t.to_string(), *l)).collect();
        assert_eq!(
            kinds,
            [
                ("ps:0".to_string(), Lifetime::Job),
                ("worker:0".to_string(), Lifetime::Own),
                ("worker:1".to_string(), Lifetime::Own)
            ]
        );
        assert_eq!(lifetimes(&l, PsLifetime::Forever, false), None);
        let hosts = vec!["a".to_string(), "a".to_string()];
        let no_ps = assign_roles(&hosts, &MappingOptions::default()).unwrap();
        let l = Layout::from_ranks(&hosts, &[1, 2], no_ps).unwrap();
        assert_eq!(lifetimes(&l, PsLifetime::Job, true), None);
    }

    #[test]
    fn finding_programs() {
        let path = Some(OsString::from("/nonexistent:/bin:/usr/bin"));
        assert!(find_program("sh", path.as_ref()).is_ok());
        assert_eq!(
            find_program("no-such-program-xyz", path.as_ref()),
            Err(LaunchError::NotFound("no-such-program-xyz".into()))
        );
        assert_eq!(
            find_program("/etc/passwd", path.as_ref()),
            Err(LaunchError::NotExecutable("/etc/passwd".into()))
        );
    }
}
