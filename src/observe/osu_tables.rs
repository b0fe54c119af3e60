//! Reading OSU-format benchmark output (OSU 7.4's programs, `mpiflow bench`): its tables of
//! message size against a value, for `mpiflow plot` and `mpiflow scale`.
//!
//! A table opens at a `# Size` header and runs to the next header (`# Size`, `# OSU ...`,
//! `# mpiflow path: ...`). Its rows are lines that start with a number: a size and a value
//! (more columns, as OSU's `-f` and `Validation` print, are left). Other comment lines and
//! text lines (a progress line of stderr mixed in) are skipped; a row that starts with a
//! number but is not a size and a finite, non-negative value is an error naming its line,
//! not a row quietly dropped.

/// One table: what it measured and its rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// The `# mpiflow path: NAME` before it, if any.
    pub path: Option<String>,
    /// The test's title (`MPI Latency Test`), from the `# OSU ...` line before it.
    pub title: Option<String>,
    /// The column header after `# Size`, such as `Avg Latency(us)`.
    pub column: String,
    /// `(size, value)` per row, as printed (zeros included).
    pub rows: Vec<(f64, f64)>,
}

/// Errors of [`read`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReadError {
    #[error("{file}:{line}: {text:?}: {why}")]
    Row {
        file: String,
        line: usize,
        text: String,
        why: &'static str,
    },
    #[error("{0}: no benchmark table (a `# Size` header and rows of size and value)")]
    NoTable(String),
}

/// The tables of `text` (the contents of `file`, named in errors) that have rows, in
/// order; at least one.
pub fn read(file: &str, text: &str) -> Result<Vec<Table>, ReadError> {
    let mut tables: Vec<Table> = Vec::new();
    let (mut path, mut title) = (None::<String>, None::<String>);
    let mut open = false;
    for (n, line) in text.lines().enumerate() {
        let l = line.trim();
        if let Some(p) = l.strip_prefix("# mpiflow path:") {
            path = Some(p.trim().to_string());
            open = false;
        } else if let Some(t) = l.strip_prefix("# OSU ") {
            title = Some(t.trim_end_matches(" v7.4").to_string());
            open = false;
        } else if let Some(head) = l.strip_prefix("# Size") {
            let column = head
                .split("  ")
                .map(str::trim)
                .find(|c| !c.is_empty())
                .unwrap_or("value")
                .to_string();
            tables.push(Table {
                path: path.clone(),
                title: title.clone(),
                column,
                rows: Vec::new(),
            });
            open = true;
        } else if open && l.starts_with(|c: char| c.is_ascii_digit() || "+-.".contains(c)) {
            let row = parse_row(l).map_err(|why| ReadError::Row {
                file: file.to_string(),
                line: n + 1,
                text: l.to_string(),
                why,
            })?;
            if let Some(t) = tables.last_mut() {
                t.rows.push(row);
            }
        }
    }
    tables.retain(|t| !t.rows.is_empty());
    if tables.is_empty() {
        return Err(ReadError::NoTable(file.to_string()));
    }
    Ok(tables)
}

/// A row's size and value.
fn parse_row(l: &str) -> Result<(f64, f64), &'static str> {
    let mut f = l.split_whitespace().map(str::parse::<f64>);
    let (Some(Ok(size)), Some(Ok(value))) = (f.next(), f.next()) else {
        return Err("a row is a message size and a value");
    };
    let fine = |x: f64| x.is_finite() && x >= 0.0;
    if !fine(size) || !fine(value) {
        return Err("sizes and values are finite and not negative");
    }
    Ok((size, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_read_with_their_path_title_and_column() {
        let text = "# mpiflow path: mpi\n# OSU MPI Latency Test v7.4\n# Datatype: MPI_CHAR.\n\
            # Size         Avg Latency(us)\n0   0.38\n1                         0.39\n\
            bench: round 1 of 2\n2   0.40  Pass\n\
            # mpiflow path: mpiflow\n# Size         Avg Latency(us)\n1   0.41\n\
            # ratio mpiflow/mpi\n# Size                    Ratio\n# 1          1.05\n";
        let t = read("f", text).unwrap();
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!(t[0].path.as_deref(), Some("mpi"));
        assert_eq!(t[0].title.as_deref(), Some("MPI Latency Test"));
        assert_eq!(t[0].column, "Avg Latency(us)");
        assert_eq!(t[0].rows, [(0.0, 0.38), (1.0, 0.39), (2.0, 0.40)]);
        assert_eq!(t[1].path.as_deref(), Some("mpiflow"));
        assert_eq!(t[1].rows, [(1.0, 0.41)]);
    }

    #[test]
    fn a_bad_row_is_named_by_its_line_and_no_table_is_an_error() {
        for (bad, why) in [
            ("4 -1.5", "sizes and values are finite and not negative"),
            ("4 nan", "sizes and values are finite and not negative"),
            ("4 inf", "sizes and values are finite and not negative"),
            ("4 abc", "a row is a message size and a value"),
            ("4", "a row is a message size and a value"),
            ("-4 1.0", "sizes and values are finite and not negative"),
        ] {
            let text = format!("# Size  Avg Latency(us)\n1 0.3\n{bad}\n");
            assert_eq!(
                read("b.txt", &text).unwrap_err().to_string(),
                format!("b.txt:3: {bad:?}: {why}")
            );
        }
        for none in ["", "no table\n1 2\n", "# Size  Ratio\n# 1 1.05\n"] {
            assert_eq!(read("e.txt", none), Err(ReadError::NoTable("e.txt".into())));
        }
    }
}
