//! Slurm's compressed host lists (`node[1,3-4]`, `rack[1-2]-n[01-02]`) and task counts
//! (`2(x3),1`), expanded the way Slurm expands them.
//!
//! Zero padding follows the lower bound of a range (`n[009-011]` gives `n009 n010 n011`);
//! with several bracket groups the first group varies slowest.

/// Errors from expanding a host list or a tasks-per-node string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostlistError {
    #[error("host list {list:?}: {why}")]
    Hosts { list: String, why: String },
    #[error("tasks per node {list:?}: {why}")]
    Tasks { list: String, why: String },
}

/// Above this many hosts a list is taken for a typo, not a cluster.
const MAX_HOSTS: usize = 1 << 20;

/// Expands a Slurm host list into host names, in order.
pub fn expand_hosts(list: &str) -> Result<Vec<String>, HostlistError> {
    let err = |why: String| HostlistError::Hosts {
        list: list.to_string(),
        why,
    };
    let mut out = Vec::new();
    for item in split_top_level(list).map_err(err)? {
        if item.is_empty() {
            return Err(err("empty host name (stray comma?)".into()));
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while !rest.is_empty() {
            match rest.find('[') {
                Some(open) => {
                    let close = rest[open..]
                        .find(']')
                        .map(|c| c + open)
                        .ok_or_else(|| err(format!("unclosed '[' in {item:?}")))?;
                    let (literal, inner) = (&rest[..open], &rest[open + 1..close]);
                    if inner.contains('[') {
                        return Err(err(format!("nested '[' in {item:?}")));
                    }
                    check_literal(literal).map_err(err)?;
                    let values = expand_ranges(inner).map_err(err)?;
                    if names.len().saturating_mul(values.len()) > MAX_HOSTS {
                        return Err(err(format!("expands to more than {MAX_HOSTS} hosts")));
                    }
                    names = names
                        .iter()
                        .flat_map(|n| values.iter().map(move |v| format!("{n}{literal}{v}")))
                        .collect();
                    rest = &rest[close + 1..];
                }
                None => {
                    check_literal(rest).map_err(err)?;
                    for n in &mut names {
                        n.push_str(rest);
                    }
                    rest = "";
                }
            }
        }
        out.extend(names);
        if out.len() > MAX_HOSTS {
            return Err(err(format!("expands to more than {MAX_HOSTS} hosts")));
        }
    }
    Ok(out)
}

/// Splits on commas that are not inside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    if list.trim().is_empty() {
        return Err("empty".into());
    }
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(format!("unmatched ']' at position {i}"));
                }
            }
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unclosed '['".into());
    }
    parts.push(&list[start..]);
    Ok(parts)
}

fn check_literal(s: &str) -> Result<(), String> {
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        Some(c) => Err(format!("invalid character {c:?} in {s:?}")),
        None => Ok(()),
    }
}

/// Expands the inside of one bracket group: `1,3-4` or `009-011`.
fn expand_ranges(inner: &str) -> Result<Vec<String>, String> {
    if inner.is_empty() {
        return Err("empty brackets '[]'".into());
    }
    let mut out = Vec::new();
    for part in inner.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let num = |s: &str| -> Result<u64, String> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.len() > 18 {
                Err(format!("{part:?} is not a number or a range a-b"))
            } else {
                Ok(s.parse().expect("digits only"))
            }
        };
        let (a, b) = (num(lo)?, num(hi)?);
        if a > b {
            return Err(format!("range {part:?} runs backwards"));
        }
        if b - a >= MAX_HOSTS as u64 {
            return Err(format!("range {part:?} has more than {MAX_HOSTS} hosts"));
        }
        let width = if lo.len() > 1 && lo.starts_with('0') {
            lo.len()
        } else {
            0
        };
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

/// Expands Slurm's tasks per node: `2(x3),1` gives `[2, 2, 2, 1]`.
pub fn expand_tasks_per_node(list: &str) -> Result<Vec<usize>, HostlistError> {
    let err = |why: String| HostlistError::Tasks {
        list: list.to_string(),
        why,
    };
    if list.trim().is_empty() {
        return Err(err("empty".into()));
    }
    let mut out = Vec::new();
    for part in list.split(',') {
        let (count, repeat) = match part.split_once('(') {
            Some((c, r)) => {
                let r = r
                    .strip_prefix('x')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| err(format!("{part:?} is not N or N(xM)")))?;
                (c, r)
            }
            None => (part, "1"),
        };
        let parse = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| err(format!("{part:?} is not N or N(xM)")))
        };
        let (count, repeat) = (parse(count)?, parse(repeat)?);
        if repeat == 0 || repeat > MAX_HOSTS || out.len() + repeat > MAX_HOSTS {
            return Err(err(format!("repeat count in {part:?} is out of range")));
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(s: &str) -> Vec<String> {
        expand_hosts(s).unwrap()
    }

    #[test]
    fn slurm_host_lists() {
        assert_eq!(hosts("n[009-011]"), ["n009", "n010", "n011"]);
        assert_eq!(hosts("n[9-11]"), ["n9", "n10", "n11"]);
        assert_eq!(hosts("node[1,3-4]"), ["node1", "node3", "node4"]);
        assert_eq!(
            hosts("rack[1-2]-n[01-02]"),
            ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
        );
        assert_eq!(hosts("gpu[01-02],cpu7"), ["gpu01", "gpu02", "cpu7"]);
        assert_eq!(hosts("single"), ["single"]);
        assert_eq!(hosts("a,b[1-2]c,d"), ["a", "b1c", "b2c", "d"]);
        assert_eq!(hosts("x[0]"), ["x0"]);
    }

    #[test]
    fn bad_host_lists() {
        for (s, want) in [
            ("", "empty"),
            ("n[1-2", "unclosed"),
            ("n1-2]", "unmatched ']'"),
            ("n[]", "empty brackets"),
            ("n[3-1]", "runs backwards"),
            ("n[a-b]", "not a number"),
            ("n[1-]", "not a number"),
            ("a,,b", "stray comma"),
            ("n[[1]]", "nested"),
            ("bad host", "invalid character"),
            ("n[1-99999999]", "more than"),
        ] {
            let e = expand_hosts(s).unwrap_err().to_string();
            assert!(e.contains(want), "{s:?}: {e}");
        }
    }

    #[test]
    fn tasks_per_node() {
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_tasks_per_node("3(x2),2,1").unwrap(), [3, 3, 2, 1]);
        assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
        for s in ["", "2(x)", "2(3)", "x", "2(x0)", "2,,1", "-1"] {
            assert!(expand_tasks_per_node(s).is_err(), "{s:?}");
        }
    }
}
