//! Memory before allocation: what a rank's part of training needs, against what it may use.
//!
//! A model too large for the machine would otherwise end in the allocator's abort (a
//! backtrace, no word on why) or in the kernel's OOM killer. Each rank works out its need
//! from the model's parameter shapes, the optimizer and the batch (nothing is allocated
//! for it) and compares it with its share of the node: the memory the kernel reports
//! available (`MemAvailable`), capped by the job's cgroup limit (Slurm's `--mem`), divided
//! among the ranks on the node. The estimate counts the large buffers only, so it is a
//! lower bound of the true use.

use std::fmt;

use crate::model::Model;
use crate::named::Named;
use crate::train::optim::{Optimizer, OptimizerKind};

/// What one rank's part of training holds, by kind, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    pub parts: Vec<(String, u64)>,
}

impl Need {
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|(_, b)| b).sum()
    }
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .parts
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|(k, b)| format!("{k} {}", bytes(*b)))
            .collect();
        write!(f, "{} ({})", bytes(self.total()), parts.join(", "))
    }
}

pub use crate::observe::bytes;

fn values_of(model: &dyn Model) -> u64 {
    model
        .parameters()
        .iter()
        .map(|p| p.shape.iter().map(|&d| d as u64).product::<u64>())
        .sum()
}

/// Moments the optimizer keeps per parameter value.
pub fn slots(opt: &Optimizer) -> u64 {
    match opt.kind {
        OptimizerKind::Sgd => 0,
        OptimizerKind::Momentum | OptimizerKind::Adagrad => 1,
        OptimizerKind::Adam => 2,
    }
}

/// A replica that trains on `batch` samples and applies its own updates (local and
/// allreduce modes): parameters, gradients, optimizer state, activations.
pub fn replica_need(model: &dyn Model, batch: usize, opt: &Optimizer) -> Need {
    let mut need = worker_need(model, batch);
    let state = values_of(model) * 4 * slots(opt);
    need.parts
        .insert(2, (format!("{} state", opt.kind.name()), state));
    need
}

/// A ps worker: parameters, gradients and activations (the ps tasks hold the optimizer).
pub fn worker_need(model: &dyn Model, batch: usize) -> Need {
    let n = values_of(model) * 4;
    Need {
        parts: vec![
            ("parameters".into(), n),
            ("gradients".into(), n),
            ("activations".into(), activations(model, batch)),
        ],
    }
}

/// A ps task holding `1/ps` of the parameters: its share, its optimizer state, and in
/// synchronous training one staged push per worker.
pub fn ps_need(model: &dyn Model, opt: &Optimizer, ps: usize, staged: usize) -> Need {
    let share = values_of(model) * 4 / ps.max(1) as u64;
    Need {
        parts: vec![
            ("parameters".into(), share),
            (format!("{} state", opt.kind.name()), share * slots(opt)),
            ("staged pushes".into(), share * staged as u64),
        ],
    }
}

fn activations(model: &dyn Model, batch: usize) -> u64 {
    model.activations_per_sample() as u64 * batch as u64 * 4
}

/// Memory one rank may use, and how that was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub bytes: u64,
    pub why: String,
}

/// This rank's share of the node's memory, with `ranks_here` ranks on the node; `None`
/// where the kernel does not say (not Linux).
pub fn share(ranks_here: usize) -> Option<Share> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let available = mem_available(&meminfo)?;
    let limit = cgroup_room();
    let (node, source) = match limit {
        Some(l) if l < available => (l, "the job's memory limit leaves"),
        _ => (available, "available on this node:"),
    };
    let n = ranks_here.max(1) as u64;
    Some(Share {
        bytes: node / n,
        why: format!("{source} {} over {n} rank(s)", bytes(node)),
    })
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Room left under this process's cgroup v2 memory limit (`memory.max - memory.current`),
/// if it has one.
fn cgroup_room() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cg.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?; // "max": no limit
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// Errors of the memory check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    #[error("{task} needs at least {need} but may use {share} ({why}): {advice}")]
    TooLarge {
        task: String,
        need: String,
        share: String,
        why: String,
        advice: String,
    },
}

/// `need` of a part of training must fit `share` (no share known: no check).
pub fn check(task: &str, need: &Need, share: Option<&Share>) -> Result<(), ResourceError> {
    check_advised(
        task,
        need,
        share,
        "use fewer ranks per node, more ps tasks, a smaller model or batch",
    )
}

/// `need` must fit `share`, else an error that ends with `advice` (what to change).
pub fn check_advised(
    task: &str,
    need: &Need,
    share: Option<&Share>,
    advice: &str,
) -> Result<(), ResourceError> {
    match share {
        Some(s) if need.total() > s.bytes => Err(ResourceError::TooLarge {
            task: task.to_string(),
            need: need.to_string(),
            share: bytes(s.bytes),
            why: s.why.clone(),
            advice: advice.to_string(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_count_parameters_optimizer_and_activations() {
        let mlp = crate::model::mlp(64, &[100], 10).unwrap();
        // 64*100 + 100 + 100*10 + 10 values.
        let values = 64 * 100 + 100 + 100 * 10 + 10;
        let adam = Optimizer::new(OptimizerKind::Adam, 0.001);
        let need = replica_need(&mlp, 32, &adam);
        assert_eq!(need.parts[0], ("parameters".to_string(), values * 4));
        assert_eq!(need.parts[2].1, 2 * values * 4);
        assert!(need.parts[3].1 >= 32 * (100 + 10) * 4, "{need:?}");
        let ps = ps_need(&mlp, &adam, 2, 3);
        assert_eq!(ps.total(), values * 4 / 2 * (1 + 2 + 3));
        assert_eq!(
            worker_need(&mlp, 32).total(),
            need.total() - need.parts[2].1
        );
    }

    #[test]
    fn a_need_beyond_the_share_is_named_with_both() {
        let huge = crate::model::mlp(64, &[100_000_000], 10).unwrap();
        let need = replica_need(&huge, 64, &Optimizer::new(OptimizerKind::Adam, 0.001));
        let share = Share {
            bytes: 8_000_000_000,
            why: "available on this node: 16.0 GB over 2 rank(s)".into(),
        };
        let e = check("worker:0", &need, Some(&share))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("worker:0 needs at least 273.6 GB (parameters 30.0 GB, gradients 30.0 GB, adam state 60.0 GB, activations 153.6 GB)"),
            "{e}"
        );
        assert!(
            e.contains("but may use 8.0 GB (available on this node: 16.0 GB over 2 rank(s))"),
            "{e}"
        );
        let small = crate::model::mlp(64, &[10], 10).unwrap();
        assert_eq!(
            check(
                "worker:0",
                &replica_need(&small, 64, &Optimizer::new(OptimizerKind::Adam, 0.001)),
                Some(&share)
            ),
            Ok(())
        );
        assert_eq!(check("worker:0", &need, None), Ok(()));
    }

    #[test]
    fn meminfo_and_share() {
        let m = "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(m), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        let s = share(2).expect("Linux");
        assert!(s.bytes > 0 && s.why.contains("over 2 rank(s)"), "{s:?}");
    }
}
