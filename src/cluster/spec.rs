//! `ClusterSpec`, task identities and roles, with TensorFlow's semantics.
//!
//! A cluster is a set of named jobs; a job is a set of tasks indexed from 0, each with a
//! `host:port` address. Jobs may be *dense* (indices `0..n`) or *sparse* (gaps allowed),
//! exactly as `tf.train.ClusterSpec`. Jobs are kept sorted by name, so every process that
//! builds the same cluster serialises it to the same bytes.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde_json::{Map, Value};

/// Errors from building or querying a [`ClusterSpec`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("invalid job name {0:?} (expected a letter followed by letters, digits or '_')")]
    BadJobName(String),
    #[error("unknown job {0:?} in the cluster")]
    UnknownJob(String),
    #[error("task {job}:{index} is not in the cluster (job {job} has tasks {have})")]
    UnknownTask {
        job: String,
        index: usize,
        have: String,
    },
    #[error("invalid address {addr:?} for {task}: {why}")]
    BadAddress {
        task: String,
        addr: String,
        why: String,
    },
    #[error("duplicate address {addr}: used by {first} and {second}")]
    DuplicateAddress {
        addr: String,
        first: String,
        second: String,
    },
    #[error("job {job}: {why}")]
    BadJob { job: String, why: String },
    #[error("unknown job type {0:?} (expected chief, worker, ps, evaluator or replica_N)")]
    UnknownRole(String),
    #[error("{job} job has {count} tasks; at most one {job} is allowed")]
    TooMany { job: String, count: usize },
}

/// The kinds of job a training cluster knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Chief,
    Worker,
    Ps,
    Evaluator,
    /// One model replica split into stages (`--stages`): jobs `replica_0`, `replica_1`,
    /// ..., each task one stage of the model ([`replica_job`]).
    Replica,
}

/// The job of model replica `r` when replicas are split into stages: `replica_r`.
pub fn replica_job(r: usize) -> String {
    format!("{REPLICA_PREFIX}{r}")
}

const REPLICA_PREFIX: &str = "replica_";

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Chief,
        Role::Worker,
        Role::Ps,
        Role::Evaluator,
        Role::Replica,
    ];

    /// The job's name, or for replica jobs the kind (`replica`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Chief => "chief",
            Role::Worker => "worker",
            Role::Ps => "ps",
            Role::Evaluator => "evaluator",
            Role::Replica => "replica",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        Role::ALL
            .into_iter()
            .find(|r| *r != Role::Replica && r.as_str() == s)
            .or_else(|| {
                // replica_N: digits without a leading zero (TensorFlow's job names allow it).
                let n = s.strip_prefix(REPLICA_PREFIX)?;
                let digits = !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
                (digits && (n == "0" || !n.starts_with('0'))).then_some(Role::Replica)
            })
            .ok_or_else(|| SpecError::UnknownRole(s.to_string()))
    }
}

/// One task of the cluster: `(job, index)`, written `job:index`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId {
    pub job: String,
    pub index: usize,
}

impl TaskId {
    pub fn new(job: impl Into<String>, index: usize) -> Self {
        TaskId {
            job: job.into(),
            index,
        }
    }

    /// The task's role, if its job is one of the known kinds.
    pub fn role(&self) -> Result<Role, SpecError> {
        self.job.parse()
    }

    /// True for an `evaluator` task (TensorFlow's side-car evaluation: no part in
    /// training).
    pub fn is_evaluator(&self) -> bool {
        self.job == Role::Evaluator.as_str()
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.job, self.index)
    }
}

/// A parsed `host:port` address; IPv6 hosts are written in brackets (`[::1]:2222`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Address {
    pub host: String,
    pub port: u16,
}

impl Address {
    /// Parses `host:port`; the error text says what is wrong (used inside `SpecError`).
    pub fn parse(s: &str) -> Result<Address, String> {
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let (h, p) = rest
                .split_once("]:")
                .ok_or("expected [ipv6]:port".to_string())?;
            (h, p)
        } else {
            s.rsplit_once(':')
                .ok_or_else(|| "expected host:port".to_string())?
        };
        if host.is_empty() {
            return Err("empty host".into());
        }
        if host
            .chars()
            .any(|c| c.is_whitespace() || c == ',' || c == '/')
        {
            return Err(format!("host {host:?} contains a forbidden character"));
        }
        let n: u64 = port
            .parse()
            .map_err(|_| format!("port {port:?} is not a number"))?;
        if n == 0 || n > 65535 {
            return Err(format!("port {n} is out of range 1-65535"));
        }
        Ok(Address {
            host: host.to_string(),
            port: n as u16,
        })
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A TensorFlow cluster: job name to (task index to address), jobs sorted by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterSpec {
    jobs: BTreeMap<String, BTreeMap<usize, Address>>,
}

fn valid_job_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl ClusterSpec {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) one task. Addresses are checked; duplicates are found by [`Self::validate`].
    pub fn add_task(&mut self, task: &TaskId, addr: &str) -> Result<(), SpecError> {
        if !valid_job_name(&task.job) {
            return Err(SpecError::BadJobName(task.job.clone()));
        }
        let parsed = Address::parse(addr).map_err(|why| SpecError::BadAddress {
            task: task.to_string(),
            addr: addr.to_string(),
            why,
        })?;
        self.jobs
            .entry(task.job.clone())
            .or_default()
            .insert(task.index, parsed);
        Ok(())
    }

    /// A dense job: tasks `0..addrs.len()`.
    pub fn add_dense_job(&mut self, job: &str, addrs: &[String]) -> Result<(), SpecError> {
        if addrs.is_empty() {
            return Err(SpecError::BadJob {
                job: job.into(),
                why: "has no tasks".into(),
            });
        }
        for (i, a) in addrs.iter().enumerate() {
            self.add_task(&TaskId::new(job, i), a)?;
        }
        Ok(())
    }

    /// Builds a spec from TensorFlow's dict form: `{job: [addr, ...]}` or `{job: {"i": addr}}`.
    pub fn from_json(value: &Value) -> Result<Self, SpecError> {
        let obj = value.as_object().ok_or_else(|| SpecError::BadJob {
            job: "<cluster>".into(),
            why: "the cluster must be a JSON object of jobs".into(),
        })?;
        let mut spec = ClusterSpec::new();
        for (job, tasks) in obj {
            let bad = |why: String| SpecError::BadJob {
                job: job.clone(),
                why,
            };
            match tasks {
                Value::Array(list) => {
                    let addrs = list
                        .iter()
                        .map(|a| {
                            a.as_str()
                                .map(str::to_string)
                                .ok_or_else(|| bad(format!("address {a} is not a string")))
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    spec.add_dense_job(job, &addrs)?;
                }
                Value::Object(map) => {
                    if map.is_empty() {
                        return Err(bad("has no tasks".into()));
                    }
                    for (idx, a) in map {
                        let index: usize = idx
                            .parse()
                            .map_err(|_| bad(format!("task index {idx:?} is not a number")))?;
                        let a = a
                            .as_str()
                            .ok_or_else(|| bad(format!("address {a} is not a string")))?;
                        spec.add_task(&TaskId::new(job.as_str(), index), a)?;
                    }
                }
                other => {
                    return Err(bad(format!(
                        "expected a list or a map of addresses, got {other}"
                    )))
                }
            }
        }
        spec.validate()?;
        Ok(spec)
    }

    /// Checks that no address is used by two tasks.
    pub fn validate(&self) -> Result<(), SpecError> {
        let mut seen: BTreeMap<&Address, TaskId> = BTreeMap::new();
        for (job, tasks) in &self.jobs {
            for (i, a) in tasks {
                let t = TaskId::new(job.as_str(), *i);
                if let Some(first) = seen.get(a) {
                    return Err(SpecError::DuplicateAddress {
                        addr: a.to_string(),
                        first: first.to_string(),
                        second: t.to_string(),
                    });
                }
                seen.insert(a, t);
            }
        }
        Ok(())
    }

    /// Checks TensorFlow's role rules: only the known jobs (the four, and replica jobs), at
    /// most one chief and one evaluator.
    pub fn validate_roles(&self) -> Result<(), SpecError> {
        for job in self.jobs.keys() {
            job.parse::<Role>()?;
        }
        for job in ["chief", "evaluator"] {
            let n = self.jobs.get(job).map_or(0, BTreeMap::len);
            if n > 1 {
                return Err(SpecError::TooMany {
                    job: job.into(),
                    count: n,
                });
            }
        }
        Ok(())
    }

    /// Job names, sorted.
    pub fn jobs(&self) -> Vec<&str> {
        self.jobs.keys().map(String::as_str).collect()
    }

    pub fn has_job(&self, job: &str) -> bool {
        self.jobs.contains_key(job)
    }

    fn job(&self, job: &str) -> Result<&BTreeMap<usize, Address>, SpecError> {
        self.jobs
            .get(job)
            .ok_or_else(|| SpecError::UnknownJob(job.to_string()))
    }

    /// Number of defined tasks of `job` (gaps of sparse jobs are not counted).
    pub fn num_tasks(&self, job: &str) -> Result<usize, SpecError> {
        Ok(self.job(job)?.len())
    }

    /// Defined task indices of `job`, sorted.
    pub fn task_indices(&self, job: &str) -> Result<Vec<usize>, SpecError> {
        Ok(self.job(job)?.keys().copied().collect())
    }

    pub fn task_address(&self, job: &str, index: usize) -> Result<&Address, SpecError> {
        let tasks = self.job(job)?;
        tasks.get(&index).ok_or_else(|| SpecError::UnknownTask {
            job: job.to_string(),
            index,
            have: format!("{:?}", tasks.keys().collect::<Vec<_>>()),
        })
    }

    /// The tasks of `job` as a list of length max index + 1, `None` in the gaps.
    pub fn job_tasks(&self, job: &str) -> Result<Vec<Option<String>>, SpecError> {
        let tasks = self.job(job)?;
        let len = tasks.keys().next_back().map_or(0, |m| m + 1);
        let mut out = vec![None; len];
        for (i, a) in tasks {
            out[*i] = Some(a.to_string());
        }
        Ok(out)
    }

    /// True if the job's indices are exactly `0..n`.
    pub fn is_dense(&self, job: &str) -> Result<bool, SpecError> {
        let tasks = self.job(job)?;
        Ok(tasks.keys().enumerate().all(|(i, k)| i == *k))
    }

    /// TensorFlow's `as_dict()`: a list for dense jobs, a map index to address for sparse ones.
    pub fn as_dict(&self) -> Value {
        let mut out = Map::new();
        for (job, tasks) in &self.jobs {
            let dense = tasks.keys().enumerate().all(|(i, k)| i == *k);
            let v = if dense {
                Value::Array(tasks.values().map(|a| a.to_string().into()).collect())
            } else {
                Value::Object(
                    tasks
                        .iter()
                        .map(|(i, a)| (i.to_string(), a.to_string().into()))
                        .collect(),
                )
            };
            out.insert(job.clone(), v);
        }
        Value::Object(out)
    }

    /// Every task in (job, index) order.
    pub fn tasks(&self) -> impl Iterator<Item = (TaskId, &Address)> {
        self.jobs.iter().flat_map(|(job, tasks)| {
            tasks
                .iter()
                .map(move |(i, a)| (TaskId::new(job.as_str(), *i), a))
        })
    }

    /// The chief by TensorFlow's rule: `chief:0` if a chief job exists, else `worker:0`.
    pub fn chief(&self) -> Option<TaskId> {
        if self.has_job("chief") {
            self.task_indices("chief")
                .ok()
                .and_then(|v| v.first().map(|i| TaskId::new("chief", *i)))
        } else if self.task_address("worker", 0).is_ok() {
            Some(TaskId::new("worker", 0))
        } else {
            None
        }
    }

    /// The worker id used by collectives: the chief is 0, worker i is i + number of chiefs.
    /// The (replica, stage) a `replica_N` task is (`--stages`): replica N, stage its index.
    pub fn replica_stage(&self, task: &TaskId) -> Option<(usize, usize)> {
        let n = task.job.strip_prefix(REPLICA_PREFIX)?;
        (task.job.parse::<Role>().ok() == Some(Role::Replica))
            .then(|| n.parse().ok().map(|r| (r, task.index)))
            .flatten()
    }

    /// The replica jobs' count and their tasks' (stages'), if every replica has the same
    /// number; `None` if there are none or they differ.
    pub fn replica_shape(&self) -> Option<(usize, usize)> {
        let counts: Vec<usize> = self
            .jobs()
            .into_iter()
            .filter(|j| j.parse::<Role>().ok() == Some(Role::Replica))
            .map(|j| self.num_tasks(j).unwrap_or(0))
            .collect();
        let stages = *counts.first()?;
        let numbered = (0..counts.len()).all(|r| self.num_tasks(&replica_job(r)).is_ok());
        (numbered && counts.iter().all(|c| *c == stages)).then_some((counts.len(), stages))
    }

    /// The tasks that train on a share of the batch: the chief and every worker (those
    /// [`ClusterSpec::worker_id`] numbers).
    pub fn num_workers(&self) -> usize {
        self.num_tasks("chief").unwrap_or(0) + self.num_tasks("worker").unwrap_or(0)
    }

    pub fn worker_id(&self, task: &TaskId) -> Option<usize> {
        let chiefs = self.num_tasks("chief").unwrap_or(0);
        match task.job.as_str() {
            "chief" => Some(0),
            "worker" => Some(task.index + chiefs),
            _ => None,
        }
    }
}

impl fmt::Display for ClusterSpec {
    /// The deterministic one-line JSON form (jobs sorted by name).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.as_dict())
    }
}

#[cfg(test)]
mod tests;
