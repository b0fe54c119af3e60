//! Embedding tables in checkpoints: the rows that exist, never the whole table. Per table
//! three arrays, `table:NAME:ids` (each id as its low and high 32 bits, stored as the
//! bits of two floats), `:values` and `:state` (the rows' optimizer state), the rows in the
//! same order. They sit beside the dense variables' arrays in whichever file holds the
//! rows (a ps task's shard file, the local mode's one file); model restores skip them.

use super::{Arrays, TABLE_ARRAYS};
use crate::model::embedding::Table;

/// The arrays that hold `tables`' rows.
pub fn table_arrays(tables: &[Table]) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    for t in tables {
        let name = |part: &str| format!("{TABLE_ARRAYS}{}:{part}", t.spec().name);
        let (mut ids, mut values, mut state) = (Vec::new(), Vec::new(), Vec::new());
        for (id, v, s) in t.rows() {
            ids.extend([f32::from_bits(id as u32), f32::from_bits((id >> 32) as u32)]);
            values.extend_from_slice(v);
            state.extend_from_slice(s);
        }
        out.extend([
            (name("ids"), ids),
            (name("values"), values),
            (name("state"), state),
        ]);
    }
    out
}

/// Puts into `tables` the rows a checkpoint's `files` hold that `mine` keeps (a ps task
/// keeps those it holds now: a restore may have another number of ps tasks). An error if
/// a table has no rows in any file, or rows of another shape.
pub fn restore_rows(
    tables: &mut [Table],
    files: &[Arrays],
    mine: impl Fn(u64) -> bool,
) -> Result<(), String> {
    for t in tables.iter_mut() {
        let name = t.spec().name.clone();
        let (dim, mut found) = (t.spec().dim, false);
        for f in files {
            let get = |part: &str| f.get(&format!("{TABLE_ARRAYS}{name}:{part}"));
            let (Some(ids), Some(values), Some(state)) = (get("ids"), get("values"), get("state"))
            else {
                continue;
            };
            found = true;
            let n = ids.len() / 2;
            let per = state.len().checked_div(n).unwrap_or(0);
            if values.len() != n * dim || state.len() != n * per {
                return Err(format!(
                    "table {name}: the checkpoint holds {} values and {} of state for {n} rows of {dim}",
                    values.len(),
                    state.len()
                ));
            }
            for i in 0..n {
                let id =
                    u64::from(ids[2 * i].to_bits()) | (u64::from(ids[2 * i + 1].to_bits()) << 32);
                if mine(id) {
                    let (v, s) = (
                        &values[i * dim..(i + 1) * dim],
                        &state[i * per..(i + 1) * per],
                    );
                    t.insert(id, v, s).map_err(|e| e.to_string())?;
                }
            }
        }
        if !found {
            return Err(format!(
                "table {name}: the checkpoint holds none of its rows"
            ));
        }
    }
    Ok(())
}
