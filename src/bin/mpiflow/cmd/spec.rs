//! `mpiflow spec`: the cluster, as a table or per rank (JSON, TF_CONFIG, flags).

use std::collections::BTreeMap;

use serde_json::json;

use mpiflow::cluster::flags;
use mpiflow::cluster::Resolved;
use mpiflow::named::Named;

use super::resolve;
use crate::args::{Format, SpecArgs};
use crate::out::{emit, Failure};

fn rank_line(resolved: &Resolved, who: usize, format: Format) -> Result<String, String> {
    let layout = &resolved.layout;
    let r = &layout.ranks[who];
    Ok(match format {
        Format::Json => json!({
            "rank": r.rank,
            "size": resolved.size,
            "host": r.host,
            "local_rank": r.local_rank,
            "task": {"type": r.task.job, "index": r.task.index},
            "address": r.address.to_string(),
            "source": resolved.source.name(),
            "cluster": layout.spec.as_dict(),
        })
        .to_string(),
        Format::TfConfig => layout.tf_config(r).to_json(),
        Format::Flags => flags::emit(&layout.tf_config(r))
            .map_err(|e| e.to_string())?
            .join(" "),
        Format::Table => unreachable!("tables are not per rank"),
    })
}

pub(crate) fn run(args: &SpecArgs, env: &BTreeMap<String, String>) -> Result<(), Failure> {
    let (resolved, ctx) = resolve(&args.cluster, env)?;
    let leader = match (&ctx, resolved.me) {
        (Some(c), _) => c.rank() == 0,
        (None, Some(me)) => resolved.layout.ranks[me].rank.unwrap_or(0) == 0,
        (None, None) => true,
    };
    if args.format == Format::Table {
        if leader {
            emit(&resolved.layout.table(resolved.source.name()));
        }
        return Ok(());
    }
    let mine: Vec<usize> = match resolved.me {
        Some(me) => vec![me],
        None => (0..resolved.layout.ranks.len()).collect(),
    };
    let lines: Result<Vec<String>, String> = mine
        .iter()
        .map(|w| rank_line(&resolved, *w, args.format))
        .collect();
    let lines = match &ctx {
        Some(c) => c.agree(lines).map_err(|e| Failure::agreed(e, c))?,
        None => lines.map_err(Failure::local)?,
    };
    emit(&(lines.join("\n") + "\n"));
    Ok(())
}
