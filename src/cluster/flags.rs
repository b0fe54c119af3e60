//! The legacy TF 1.x command-line flags: `--ps_hosts --worker_hosts --job_name --task_index`.
//!
//! These flags can describe only `ps` and `worker` jobs; a cluster with a chief or an
//! evaluator cannot be written as legacy flags, and saying so is an error rather than a
//! silent drop of tasks.

use super::spec::{ClusterSpec, SpecError, TaskId};
use super::tf_config::TfConfig;

/// Errors from parsing or emitting the legacy flags.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagsError {
    #[error("legacy flags: missing {0}")]
    Missing(&'static str),
    #[error("legacy flags: {flag} given twice")]
    Repeated { flag: String },
    #[error("legacy flags: {flag} needs a value")]
    NoValue { flag: String },
    #[error("legacy flags: --task_index {0:?} is not a non-negative integer")]
    BadIndex(String),
    #[error("legacy flags: --job_name {0:?} must be ps or worker")]
    BadJob(String),
    #[error("legacy flags cannot express a {0} job (only ps and worker); use TF_CONFIG")]
    Inexpressible(String),
    #[error("legacy flags: {0}")]
    Spec(#[from] SpecError),
}

/// The seeds' flags: `--ps_hosts --worker_hosts --job_name --task_index`.
pub const FLAG_NAMES: [&str; 4] = ["--ps_hosts", "--worker_hosts", "--job_name", "--task_index"];

/// Parses the four legacy flags out of `args` (as `--f=v` or `--f v`); other arguments are ignored.
pub fn parse(args: &[String]) -> Result<TfConfig, FlagsError> {
    let mut values: [Option<String>; 4] = Default::default();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (arg.as_str(), None),
        };
        if let Some(k) = FLAG_NAMES.iter().position(|f| *f == name) {
            let v = match inline {
                Some(v) => v,
                None => {
                    i += 1;
                    args.get(i)
                        .filter(|v| !v.starts_with("--"))
                        .cloned()
                        .ok_or_else(|| FlagsError::NoValue { flag: name.into() })?
                }
            };
            if values[k].replace(v).is_some() {
                return Err(FlagsError::Repeated { flag: name.into() });
            }
        }
        i += 1;
    }
    let [ps, worker, job, index] = values;
    let job = job.ok_or(FlagsError::Missing("--job_name"))?;
    let index = index.ok_or(FlagsError::Missing("--task_index"))?;
    let index: usize = index.parse().map_err(|_| FlagsError::BadIndex(index))?;
    if job != "ps" && job != "worker" {
        return Err(FlagsError::BadJob(job));
    }
    let mut spec = ClusterSpec::new();
    for (name, hosts) in [("ps", ps), ("worker", worker)] {
        let list: Vec<String> = hosts
            .iter()
            .flat_map(|h| h.split(','))
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if !list.is_empty() {
            spec.add_dense_job(name, &list)?;
        }
    }
    if !spec.has_job("worker") {
        return Err(FlagsError::Missing("--worker_hosts"));
    }
    spec.validate()?;
    let task = TaskId::new(job, index);
    spec.task_address(&task.job, task.index)?;
    Ok(TfConfig::new(spec, task))
}

/// The legacy flags for `config`, one `--flag=value` per element.
pub fn emit(config: &TfConfig) -> Result<Vec<String>, FlagsError> {
    let spec = &config.cluster;
    for job in spec.jobs() {
        if job != "ps" && job != "worker" {
            return Err(FlagsError::Inexpressible(job.into()));
        }
    }
    if config.task.job != "ps" && config.task.job != "worker" {
        return Err(FlagsError::Inexpressible(config.task.job.clone()));
    }
    let mut out = Vec::new();
    for job in ["ps", "worker"] {
        if !spec.has_job(job) {
            continue;
        }
        if !spec.is_dense(job)? {
            return Err(FlagsError::Spec(SpecError::BadJob {
                job: job.into(),
                why: "is sparse; legacy flags need tasks 0..n".into(),
            }));
        }
        let hosts: Vec<String> = spec
            .job_tasks(job)?
            .into_iter()
            .flatten()
            .collect::<Vec<_>>();
        out.push(format!("--{job}_hosts={}", hosts.join(",")));
    }
    out.push(format!("--job_name={}", config.task.job));
    out.push(format!("--task_index={}", config.task.index));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn parse_both_spellings_and_round_trip() {
        let c = parse(&args(
            "train.py --ps_hosts=a:2222,b:2222 --worker_hosts c:2222,d:2222 --job_name=ps --task_index 1 --lr=3",
        ))
        .unwrap();
        assert_eq!(c.task, TaskId::new("ps", 1));
        assert_eq!(
            c.cluster.task_address("worker", 1).unwrap().to_string(),
            "d:2222"
        );
        let out = emit(&c).unwrap();
        assert_eq!(
            out,
            args("--ps_hosts=a:2222,b:2222 --worker_hosts=c:2222,d:2222 --job_name=ps --task_index=1")
        );
        assert_eq!(parse(&out).unwrap(), c);
    }

    #[test]
    fn bad_flags() {
        for (a, want) in [
            ("--worker_hosts=a:1 --task_index=0", "missing --job_name"),
            (
                "--worker_hosts=a:1 --job_name=worker",
                "missing --task_index",
            ),
            (
                "--worker_hosts=a:1 --job_name=worker --task_index=x",
                "not a non-negative",
            ),
            (
                "--worker_hosts=a:1 --job_name=chief --task_index=0",
                "must be ps or worker",
            ),
            (
                "--worker_hosts=a:1 --job_name=worker --task_index=3",
                "worker:3 is not in",
            ),
            (
                "--ps_hosts=a:1 --job_name=ps --task_index=0",
                "missing --worker_hosts",
            ),
            (
                "--worker_hosts=a:1,a:1 --job_name=worker --task_index=0",
                "duplicate address",
            ),
            (
                "--worker_hosts=a:1 --worker_hosts=b:1 --job_name=worker --task_index=0",
                "given twice",
            ),
            (
                "--worker_hosts=a:1 --job_name --task_index=0",
                "needs a value",
            ),
        ] {
            let e = parse(&args(a)).unwrap_err().to_string();
            assert!(e.contains(want), "{a}: {e}");
        }
    }

    #[test]
    fn chief_cannot_be_emitted() {
        let c = TfConfig::parse(
            r#"{"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap();
        assert_eq!(
            emit(&c).unwrap_err(),
            FlagsError::Inexpressible("chief".into())
        );
    }
}
