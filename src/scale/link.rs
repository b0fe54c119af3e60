//! A link's cost, fitted to measured latencies.

use crate::observe::osu_tables::{self, ReadError};

/// The cost of one message on a link: `latency + bytes × per_byte` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Seconds per message.
    pub latency: f64,
    /// Seconds per byte (the inverse of the bandwidth).
    pub per_byte: f64,
}

/// Errors from [`Link::fit`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    #[error("a link needs measurements at 2 or more sizes, got {0}")]
    TooFewSizes(usize),
    #[error("the measured times do not grow with the size (slope {0:e} s/B)")]
    NotIncreasing(f64),
    #[error("measurement {bytes} B, {:.3} us: sizes and times must be finite, times positive", secs * 1e6)]
    Bad { bytes: f64, secs: f64 },
}

impl Link {
    /// The time of one message of `bytes`.
    pub fn time(&self, bytes: f64) -> f64 {
        self.latency + bytes * self.per_byte
    }

    /// Bytes per second.
    pub fn bandwidth(&self) -> f64 {
        1.0 / self.per_byte
    }

    /// The link of `(bytes, seconds)` measurements, in two parts as Hockney's parameters
    /// are read: the per-byte cost is the least-squares slope of the large messages (from
    /// [`Link::LARGE`] bytes; all sizes if fewer than two are that large), which the
    /// gradients of real models are; the latency is the median over the small messages
    /// (up to [`Link::SMALL`]) of their time less their bytes' cost, or the slope's
    /// intercept (at least 0) without small messages.
    pub fn fit(points: &[(f64, f64)]) -> Result<Link, FitError> {
        if let Some(&(bytes, secs)) = points
            .iter()
            .find(|(b, t)| !b.is_finite() || !t.is_finite() || *b < 0.0 || *t <= 0.0)
        {
            return Err(FitError::Bad { bytes, secs });
        }
        let distinct = |pts: &[(f64, f64)]| {
            let mut sizes: Vec<f64> = pts.iter().map(|p| p.0).collect();
            sizes.sort_by(f64::total_cmp);
            sizes.dedup();
            sizes.len()
        };
        let all = distinct(points);
        if all < 2 {
            return Err(FitError::TooFewSizes(all));
        }
        let large: Vec<(f64, f64)> = points
            .iter()
            .copied()
            .filter(|p| p.0 >= Self::LARGE)
            .collect();
        let slope_of = if distinct(&large) >= 2 {
            &large[..]
        } else {
            points
        };
        let n = slope_of.len() as f64;
        let (mean_m, mean_t) = slope_of
            .iter()
            .fold((0.0, 0.0), |(m, t), p| (m + p.0 / n, t + p.1 / n));
        let (cov, var) = slope_of.iter().fold((0.0, 0.0), |(c, v), p| {
            (
                c + (p.0 - mean_m) * (p.1 - mean_t),
                v + (p.0 - mean_m).powi(2),
            )
        });
        let per_byte = cov / var;
        if per_byte <= 0.0 || !per_byte.is_finite() {
            return Err(FitError::NotIncreasing(per_byte));
        }
        let mut small: Vec<f64> = points
            .iter()
            .filter(|p| p.0 <= Self::SMALL)
            .map(|p| p.1 - p.0 * per_byte)
            .collect();
        small.sort_by(f64::total_cmp);
        let latency = match small.get(small.len() / 2) {
            Some(t) => *t,
            None => mean_t - per_byte * mean_m,
        };
        Ok(Link {
            latency: latency.max(0.0),
            per_byte,
        })
    }

    /// Messages from this size give the per-byte cost: 64 KiB.
    pub const LARGE: f64 = 65536.0;
    /// Messages up to this size give the latency: 1 KiB.
    pub const SMALL: f64 = 1024.0;
}

/// The `(bytes, value)` rows of the first table of OSU-format output `text` (of the file
/// `file`, named in errors): `mpiflow bench`'s `--path both` prints a table per path, its
/// own first.
fn first_table(file: &str, text: &str) -> Result<Vec<(f64, f64)>, ReadError> {
    Ok(osu_tables::read(file, text)?.swap_remove(0).rows)
}

/// The `(bytes, seconds)` rows of OSU-format latency output (`osu_latency`, `mpiflow bench
/// latency`): one-way times, from microseconds. What [`Link::fit`] takes.
pub fn latency_rows(file: &str, text: &str) -> Result<Vec<(f64, f64)>, ReadError> {
    Ok(first_table(file, text)?
        .into_iter()
        .map(|(m, us)| (m, us * 1e-6))
        .collect())
}

/// The `(bytes, seconds)` rows of OSU-format bidirectional bandwidth output (`osu_bibw -W
/// 1`, `mpiflow bench bibw -W 1`): the time of an exchange of `bytes` each way, from the
/// MB/s both directions carried together (rows of 0 MB/s skipped).
pub fn exchange_rows(file: &str, text: &str) -> Result<Vec<(f64, f64)>, ReadError> {
    Ok(first_table(file, text)?
        .into_iter()
        .filter(|(_, mbs)| *mbs > 0.0)
        .map(|(m, mbs)| (m, 2.0 * m / (mbs * 1e6)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::*;

    #[test]
    fn a_fit_recovers_the_link_it_was_measured_on_and_refuses_nonsense() {
        let sizes = [8.0, 1024.0, 65536.0, 1048576.0, 4194304.0];
        let points: Vec<(f64, f64)> = sizes.iter().map(|m| (*m, NET.time(*m))).collect();
        let fit = Link::fit(&points).unwrap();
        assert!((fit.latency - NET.latency).abs() < 1e-9, "{fit:?}");
        assert!((fit.per_byte / NET.per_byte - 1.0).abs() < 1e-9, "{fit:?}");
        // Noise of ±5% still gives both within 10%.
        let noisy: Vec<(f64, f64)> = points
            .iter()
            .enumerate()
            .map(|(i, (m, t))| (*m, t * if i % 2 == 0 { 1.05 } else { 0.95 }))
            .collect();
        let fit = Link::fit(&noisy).unwrap();
        assert!((fit.latency / NET.latency - 1.0).abs() < 0.1, "{fit:?}");
        assert!((fit.per_byte / NET.per_byte - 1.0).abs() < 0.1, "{fit:?}");
        // Pure bandwidth: the latency clamps at 0.
        let fit = Link::fit(&[(1e6, 1e-3), (2e6, 2e-3), (4e6, 4.1e-3)]).unwrap();
        assert_eq!(fit.latency, 0.0);
        assert_eq!(
            Link::fit(&[(8.0, 1e-6), (8.0, 2e-6)]),
            Err(FitError::TooFewSizes(1))
        );
        assert!(matches!(
            Link::fit(&[(8.0, 2e-6), (1e6, 1e-6)]),
            Err(FitError::NotIncreasing(_))
        ));
        assert!(matches!(
            Link::fit(&[(8.0, 0.0), (16.0, 1e-6)]),
            Err(FitError::Bad { .. })
        ));
    }

    #[test]
    fn osu_output_gives_the_first_tables_rows_in_seconds() {
        let text = "# OSU MPI Latency Test v7.4\n# Size          Latency (us)\n\
                    1                       5.92\n4096                    9.07\n\
                    bench: round 1 of 1\n1048576               423.23\n\
                    # mpiflow path: mpi\n# Size          Latency (us)\n1  99.0\n8  99.0\n";
        let rows = latency_rows("lat.txt", text).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].0, 1.0);
        assert!((rows[2].1 - 423.23e-6).abs() < 1e-12);
        // A two-host TCP link's latencies (benches/results/2026-11-24-hosts.md): microseconds.
        let fit = Link::fit(&rows).unwrap();
        assert!(fit.latency > 4e-6 && fit.latency < 8e-6, "{fit:?}");
        // Both ways at once: the bandwidth is of both directions together.
        let text = "# OSU MPI Bi-Directional Bandwidth Test v7.4\n# Size      Bandwidth (MB/s)\n\
                    1 0.00\n1048576 2027.49\n4194304 1978.39\n";
        let rows = exchange_rows("bibw.txt", text).unwrap();
        assert_eq!(rows.len(), 2);
        assert!(
            (rows[1].1 - 2.0 * 4194304.0 / 1978.39e6).abs() < 1e-12,
            "{rows:?}"
        );
    }
}
