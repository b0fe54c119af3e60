//! Placement of variables on parameter servers (`replica_device_setter`, done better).
//!
//! - `round-robin`: variables to ps tasks in creation order (TensorFlow's default).
//! - `greedy`: each variable to the ps with the fewest bytes so far, variables taken
//!   largest first and ties broken by name, so the result does not depend on the order
//!   in which variables were created (TensorFlow's greedy strategy does).
//! - `partition`: like greedy, but a variable larger than the partition size is cut into
//!   slices of at most that many bytes (BytePS's 4 MB default), spread over the ps tasks.
//!
//! Every rank computes the same placement from the variables' names and shapes alone.

use std::fmt::Write as _;

/// A placement strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    RoundRobin,
    #[default]
    Greedy,
    Partition,
}

impl crate::named::Named for Strategy {
    const NAMES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Strategy::RoundRobin,
            "round-robin",
            "Variables to ps tasks in creation order (TensorFlow's default)",
        ),
        (
            Strategy::Greedy,
            "greedy",
            "Each variable to the ps with the fewest bytes so far, largest first",
        ),
        (
            Strategy::Partition,
            "partition",
            "Like greedy, with variables above --partition-bytes cut into slices",
        ),
    ];
}

/// A slice of one variable (elements `offset..offset+len` of the flattened tensor) on one ps.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shard {
    pub var: String,
    /// Index of the variable in creation order.
    pub var_index: usize,
    pub offset: usize,
    pub len: usize,
    pub ps: usize,
}

impl Shard {
    /// `layer0/w` or `layer0/w[0:4096]` for a slice.
    pub fn label(&self, numel: usize) -> String {
        if self.offset == 0 && self.len == numel {
            self.var.clone()
        } else {
            format!("{}[{}:{}]", self.var, self.offset, self.offset + self.len)
        }
    }
}

/// TensorFlow's `replica_device_setter`: where a model's variables go on the ps tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSetter {
    pub strategy: Strategy,
    /// With [`Strategy::Partition`], the largest slice of a variable, in bytes.
    pub partition_bytes: usize,
}

impl Default for DeviceSetter {
    fn default() -> Self {
        DeviceSetter {
            strategy: Strategy::Greedy,
            partition_bytes: 4 << 20,
        }
    }
}

impl DeviceSetter {
    /// The shards of `vars` (name, elements) on `num_ps` ps tasks.
    pub fn place(&self, vars: &[(String, usize)], num_ps: usize) -> Vec<Shard> {
        place(vars, num_ps, self.strategy, self.partition_bytes)
    }
}

/// Places `vars` (name, elements; f32) on `num_ps` ps tasks.
pub fn place(
    vars: &[(String, usize)],
    num_ps: usize,
    strategy: Strategy,
    partition_bytes: usize,
) -> Vec<Shard> {
    let num_ps = num_ps.max(1);
    let mut pieces: Vec<(usize, usize, usize)> = Vec::new(); // (var index, offset, len)
    for (i, (_, n)) in vars.iter().enumerate() {
        let max = if strategy == Strategy::Partition {
            (partition_bytes / 4).max(1)
        } else {
            usize::MAX
        };
        let parts = n.div_ceil(max).max(1);
        for k in 0..parts {
            let (a, b) = (k * n / parts, (k + 1) * n / parts);
            pieces.push((i, a, b - a));
        }
    }
    let mut shards: Vec<Shard> = Vec::with_capacity(pieces.len());
    match strategy {
        Strategy::RoundRobin => {
            for (k, (i, off, len)) in pieces.into_iter().enumerate() {
                shards.push(Shard {
                    var: vars[i].0.clone(),
                    var_index: i,
                    offset: off,
                    len,
                    ps: k % num_ps,
                });
            }
        }
        Strategy::Greedy | Strategy::Partition => {
            // Largest first, ties by (name, offset): independent of creation order.
            let mut order = pieces.clone();
            order.sort_by(|a, b| {
                b.2.cmp(&a.2)
                    .then_with(|| vars[a.0].0.cmp(&vars[b.0].0))
                    .then(a.1.cmp(&b.1))
            });
            let mut load = vec![0usize; num_ps];
            for (i, off, len) in order {
                let ps = (0..num_ps)
                    .min_by_key(|p| (load[*p], *p))
                    .expect("at least one ps");
                load[ps] += len * 4;
                shards.push(Shard {
                    var: vars[i].0.clone(),
                    var_index: i,
                    offset: off,
                    len,
                    ps,
                });
            }
            shards.sort_by_key(|s| (s.var_index, s.offset));
        }
    }
    shards
}

/// The placement report: each shard's ps and the bytes per ps.
pub fn report(shards: &[Shard], vars: &[(String, usize)], num_ps: usize) -> String {
    let mut out = String::from("# placement: variable -> ps\n");
    for s in shards {
        let _ = writeln!(
            out,
            "#   {:<24} ps:{}  {} bytes",
            s.label(vars[s.var_index].1),
            s.ps,
            s.len * 4
        );
    }
    let per: Vec<String> = (0..num_ps)
        .map(|p| {
            format!(
                "ps:{p}={}",
                shards
                    .iter()
                    .filter(|s| s.ps == p)
                    .map(|s| s.len * 4)
                    .sum::<usize>()
            )
        })
        .collect();
    let _ = writeln!(out, "# bytes per ps: {}", per.join(" "));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, usize)]) -> Vec<(String, usize)> {
        list.iter().map(|(n, k)| (n.to_string(), *k)).collect()
    }

    #[test]
    fn round_robin_follows_creation_order() {
        let v = vars(&[("a", 10), ("b", 1000), ("c", 10), ("d", 10)]);
        let s = place(&v, 2, Strategy::RoundRobin, 0);
        assert_eq!(s.iter().map(|x| x.ps).collect::<Vec<_>>(), [0, 1, 0, 1]);
    }

    #[test]
    fn greedy_balances_bytes_and_ignores_creation_order() {
        let v = vars(&[("w0", 8192), ("b0", 128), ("w1", 1280), ("b1", 10)]);
        let s = place(&v, 2, Strategy::Greedy, 0);
        let ps_of = |name: &str| s.iter().find(|x| x.var == name).unwrap().ps;
        assert_eq!(ps_of("w0"), 0);
        assert_eq!((ps_of("w1"), ps_of("b0"), ps_of("b1")), (1, 1, 1));
        let mut rev = v.clone();
        rev.reverse();
        let r = place(&rev, 2, Strategy::Greedy, 0);
        for x in &s {
            assert_eq!(
                r.iter().find(|y| y.var == x.var).unwrap().ps,
                x.ps,
                "{}",
                x.var
            );
        }
    }

    #[test]
    fn partition_slices_large_variables_over_all_ps() {
        let v = vars(&[("big", 10_000), ("small", 7)]);
        let s = place(&v, 3, Strategy::Partition, 4 * 4000);
        let big: Vec<&Shard> = s.iter().filter(|x| x.var == "big").collect();
        assert_eq!(big.len(), 3);
        assert_eq!(big.iter().map(|x| x.len).sum::<usize>(), 10_000);
        let mut ps: Vec<usize> = big.iter().map(|x| x.ps).collect();
        ps.sort_unstable();
        assert_eq!(ps, [0, 1, 2]);
        assert_eq!(big[1].label(10_000), "big[3333:6666]");
        assert!(report(&s, &v, 3).contains("# bytes per ps: ps:0="));
    }
}
