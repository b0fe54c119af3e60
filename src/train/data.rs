//! Training data: the UCI digits set (shipped in `data/digits.csv.gz`), Fashion-MNIST
//! (Debian's `dataset-fashion-mnist`, with its official 60,000 / 10,000 split), the MNIST
//! IDX format for users' own data, and a seeded synthetic generator; a fixed, seeded
//! held-out fifth for sets without a test split; and deterministic sharding of each
//! global batch over replicas.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::rng::Rng;

/// Errors from loading data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    #[error("data {path}: cannot read: {why}")]
    Read { path: String, why: String },
    #[error("data {path}:{line}: {why}")]
    Parse {
        path: String,
        line: usize,
        why: String,
    },
    #[error("data {path}: {why}")]
    Format { path: String, why: String },
    #[error("unknown data set {0:?} (digits, digits:PATH, fashion-mnist, fashion-mnist:DIR, synthetic, synthetic:FEATURES, or idx:IMAGES,LABELS)")]
    Unknown(String),
    #[error("data {name}: {path} is missing; install Debian's package {package} (apt-get install {package})")]
    Missing {
        name: String,
        path: String,
        package: String,
    },
}

/// Where Debian's `dataset-fashion-mnist` puts the files.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Samples as rows of `features` floats in 0..1, with labels below `classes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    pub x: Vec<f32>,
    pub y: Vec<u8>,
    pub features: usize,
    pub classes: usize,
    /// The shape of one sample (`[28, 28, 1]` for images, channels last; `[features]`
    /// for plain vectors): `features` values in all.
    pub shape: Vec<usize>,
}

/// The project's own copy of the digits data.
pub fn default_digits_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/digits.csv.gz")
}

/// `n` synthetic samples of `features` values must fit the node's available memory twice
/// over (the set, then its split into training and held-out parts), or the allocator
/// would end the process with a backtrace.
fn synthetic_fits(spec: &str, n: usize, features: usize) -> Result<(), DataError> {
    let set = (n as u64).saturating_mul(features as u64).saturating_mul(4);
    match crate::train::resources::share(1) {
        Some(room) if set.saturating_mul(2) > room.bytes => Err(DataError::Format {
            path: spec.into(),
            why: format!(
                "{n} samples of {features} features take {}, twice that while split; {}",
                crate::observe::bytes(set),
                room.why.trim_end_matches(" over 1 rank(s)")
            ),
        }),
        _ => Ok(()),
    }
}

/// Bytes as hex digits, as a file's magic number is written.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn read_all(path: &Path) -> Result<Vec<u8>, DataError> {
    let err = |why: String| DataError::Read {
        path: path.display().to_string(),
        why,
    };
    let raw = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| err(format!("bad gzip: {e}")))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.y.len()
    }

    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// Loads a data set by name: `digits` (or `digits:PATH`), `synthetic` (64 features) or
    /// `synthetic:FEATURES` (4096 samples), `idx:IMAGES,LABELS`.
    pub fn load(spec: &str, seed: u64) -> Result<Dataset, DataError> {
        match spec.split_once(':') {
            None if spec == "digits" => Dataset::digits(&default_digits_path()),
            None if spec == "synthetic" => Ok(Dataset::synthetic(2000, 64, 10, seed)),
            Some(("digits", path)) => Dataset::digits(Path::new(path)),
            Some(("synthetic", features)) => {
                let f: usize =
                    features
                        .parse()
                        .ok()
                        .filter(|f| *f > 0)
                        .ok_or_else(|| DataError::Format {
                            path: spec.into(),
                            why: format!("FEATURES {features:?} is not a positive count"),
                        })?;
                synthetic_fits(spec, 4096, f)?;
                Ok(Dataset::synthetic(4096, f, 10, seed))
            }
            Some(("idx", files)) => {
                let (images, labels) = files
                    .split_once(',')
                    .filter(|(i, l)| !i.is_empty() && !l.is_empty())
                    .ok_or_else(|| DataError::Format {
                        path: spec.into(),
                        why: "give it as idx:IMAGES,LABELS (two files)".into(),
                    })?;
                Dataset::idx(Path::new(images), Path::new(labels))
            }
            _ => Err(DataError::Unknown(spec.into())),
        }
    }

    /// `(train, test)` of the set `spec` names: Fashion-MNIST (`fashion-mnist`, or
    /// `fashion-mnist:DIR` for a copy elsewhere) with its official split; any other set
    /// (see [`Dataset::load`]) with a seeded fifth held out.
    pub fn load_split(spec: &str, seed: u64) -> Result<(Dataset, Dataset), DataError> {
        let dir = match spec.split_once(':') {
            None if spec == "fashion-mnist" => Some(Path::new(FASHION_MNIST_DIR)),
            Some(("fashion-mnist", dir)) => Some(Path::new(dir)),
            _ => None,
        };
        let Some(dir) = dir else {
            return Ok(Dataset::load(spec, seed)?.split_holdout(seed));
        };
        let file = |name: &str| -> Result<PathBuf, DataError> {
            let p = dir.join(name);
            if p.exists() {
                Ok(p)
            } else {
                Err(DataError::Missing {
                    name: "fashion-mnist".into(),
                    path: p.display().to_string(),
                    package: "dataset-fashion-mnist".into(),
                })
            }
        };
        let part = |stem: &str| -> Result<Dataset, DataError> {
            let images = file(&format!("{stem}-images-idx3-ubyte.gz"))?;
            let labels = file(&format!("{stem}-labels-idx1-ubyte.gz"))?;
            let mut d = Dataset::idx(&images, &labels)?;
            if let Some(i) = d.y.iter().position(|&l| l >= 10) {
                return Err(DataError::Format {
                    path: labels.display().to_string(),
                    why: format!(
                        "label {} of image {i} is not one of Fashion-MNIST's 0..9",
                        d.y[i]
                    ),
                });
            }
            d.classes = 10;
            Ok(d)
        };
        Ok((part("train")?, part("t10k")?))
    }

    /// The digits CSV (optionally gzipped): 64 pixels 0..16 then the label, per line.
    pub fn digits(path: &Path) -> Result<Dataset, DataError> {
        Dataset::digits_from(path, &read_all(path)?)
    }

    /// [`Dataset::digits`] of a file's bytes (`path` names it in errors).
    pub fn digits_from(path: &Path, bytes: &[u8]) -> Result<Dataset, DataError> {
        let text = String::from_utf8_lossy(bytes);
        let p = path.display().to_string();
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: String| DataError::Parse {
                path: p.clone(),
                line: n + 1,
                why,
            };
            let vals: Vec<&str> = line.split(',').collect();
            if vals.len() != 65 {
                return Err(bad(format!(
                    "{} fields, expected 64 pixels and a label",
                    vals.len()
                )));
            }
            for v in &vals[..64] {
                let px: f32 = v
                    .trim()
                    .parse()
                    .map_err(|_| bad(format!("pixel {v:?} is not a number")))?;
                if !(0.0..=16.0).contains(&px) {
                    return Err(bad(format!("pixel {px} is outside 0..16")));
                }
                x.push(px / 16.0);
            }
            let label: u8 = vals[64]
                .trim()
                .parse()
                .ok()
                .filter(|l| *l < 10)
                .ok_or_else(|| bad(format!("label {:?} is not 0..9", vals[64])))?;
            y.push(label);
        }
        if y.is_empty() {
            return Err(DataError::Format {
                path: p,
                why: "no samples".into(),
            });
        }
        Ok(Dataset {
            x,
            y,
            features: 64,
            classes: 10,
            shape: vec![8, 8, 1],
        })
    }

    /// MNIST's IDX files (`idx3-ubyte` images, `idx1-ubyte` labels; gzipped or not).
    pub fn idx(images: &Path, labels: &Path) -> Result<Dataset, DataError> {
        Dataset::idx_from((images, &read_all(images)?), (labels, &read_all(labels)?))
    }

    /// [`Dataset::idx`] of the two files' bytes (their paths name them in errors).
    pub fn idx_from(
        (images, img): (&Path, &[u8]),
        (labels, lab): (&Path, &[u8]),
    ) -> Result<Dataset, DataError> {
        let fmt = |p: &Path, why: String| DataError::Format {
            path: p.display().to_string(),
            why,
        };
        let be =
            |b: &[u8], o: usize| u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]) as usize;
        let magic = |b: &[u8]| {
            b.get(..4)
                .map_or_else(|| format!("{} bytes", b.len()), |m| format!("0x{}", hex(m)))
        };
        if img.len() < 16 || be(img, 0) != 0x0803 {
            return Err(fmt(
                images,
                format!(
                    "not an IDX image file (it starts with {}, an IDX image file with 0x00000803 and a 16-byte header)",
                    magic(img)
                ),
            ));
        }
        if lab.len() < 8 || be(lab, 0) != 0x0801 {
            return Err(fmt(
                labels,
                format!(
                    "not an IDX label file (it starts with {}, an IDX label file with 0x00000801 and an 8-byte header)",
                    magic(lab)
                ),
            ));
        }
        let (n, rows, cols) = (be(img, 4), be(img, 8), be(img, 12));
        if n == 0 || rows == 0 || cols == 0 {
            return Err(fmt(
                images,
                format!("header says {n} images of {rows}x{cols}: no pixels to learn from"),
            ));
        }
        let pixels = n.checked_mul(rows).and_then(|p| p.checked_mul(cols));
        if pixels.and_then(|p| p.checked_add(16)) != Some(img.len()) {
            return Err(fmt(
                images,
                format!(
                    "{} bytes, header says {n} images of {rows}x{cols}",
                    img.len()
                ),
            ));
        }
        if be(lab, 4) != n || lab.len() != 8 + n {
            return Err(fmt(labels, format!("{} labels for {n} images", be(lab, 4))));
        }
        let y = lab[8..].to_vec();
        let classes = y.iter().copied().max().map_or(1, |m| m as usize + 1);
        Ok(Dataset {
            x: img[16..].iter().map(|p| f32::from(*p) / 255.0).collect(),
            y,
            features: rows * cols,
            classes,
            shape: vec![rows, cols, 1],
        })
    }

    /// Seeded, separable-with-effort data: one Gaussian cloud per class.
    pub fn synthetic(n: usize, features: usize, classes: usize, seed: u64) -> Dataset {
        let mut rng = Rng::new(seed);
        let centres: Vec<Vec<f64>> = (0..classes)
            .map(|_| (0..features).map(|_| rng.uniform()).collect())
            .collect();
        let (mut x, mut y) = (Vec::with_capacity(n * features), Vec::with_capacity(n));
        for i in 0..n {
            let c = i % classes;
            y.push(c as u8);
            x.extend(
                centres[c]
                    .iter()
                    .map(|m| (m + 0.15 * rng.normal()).clamp(0.0, 1.0) as f32),
            );
        }
        Dataset {
            x,
            y,
            features,
            classes,
            shape: vec![features],
        }
    }

    /// The rows `idx`, in that order.
    pub fn rows(&self, idx: &[usize]) -> (Vec<f32>, Vec<u8>) {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        self.rows_into(idx, &mut x, &mut y);
        (x, y)
    }

    /// [`Dataset::rows`] into a caller's buffers (their contents replaced; a training
    /// loop reuses them, allocating nothing per step).
    pub fn rows_into(&self, idx: &[usize], x: &mut Vec<f32>, y: &mut Vec<u8>) {
        x.clear();
        x.reserve(idx.len() * self.features);
        for i in idx {
            x.extend_from_slice(&self.x[i * self.features..(i + 1) * self.features]);
        }
        y.clear();
        y.extend(idx.iter().map(|i| self.y[*i]));
    }

    /// (train, held-out): a fixed, seeded fifth held out.
    pub fn split_holdout(&self, seed: u64) -> (Dataset, Dataset) {
        let perm = Rng::new(seed ^ 0x005E_ED0F_4E1D).permutation(self.len());
        let test_n = self.len() / 5;
        let pick = |idx: &[usize]| {
            let (x, y) = self.rows(idx);
            Dataset {
                x,
                y,
                features: self.features,
                classes: self.classes,
                shape: self.shape.clone(),
            }
        };
        (pick(&perm[test_n..]), pick(&perm[..test_n]))
    }
}

/// Global batches: each epoch a fresh seeded permutation of the training set; step `s`
/// takes the next `batch` indices of that stream. The epoch's permutation is drawn once
/// and kept (drawn anew every step, 60,000 indices took 1.7% of a local CNN run on
/// Fashion-MNIST, and every rank of a job drew them).
#[derive(Debug, Clone)]
pub struct Batches {
    n: usize,
    batch: usize,
    seed: u64,
    /// The epoch whose permutation `order` holds.
    epoch: Option<u64>,
    order: Vec<usize>,
}

impl Batches {
    pub fn new(n: usize, batch: usize, seed: u64) -> Batches {
        Batches {
            n,
            batch: batch.clamp(1, n.max(1)),
            seed,
            epoch: None,
            order: Vec::new(),
        }
    }

    /// The sample indices of global step `step`.
    pub fn global(&mut self, step: u64) -> &[usize] {
        let per_epoch = (self.n / self.batch).max(1) as u64;
        let (epoch, k) = (step / per_epoch, (step % per_epoch) as usize);
        if self.epoch != Some(epoch) {
            let mut rng = Rng::new(self.seed.wrapping_mul(1_000_003).wrapping_add(epoch));
            self.order = rng.permutation(self.n);
            self.epoch = Some(epoch);
        }
        &self.order[k * self.batch..(k + 1) * self.batch]
    }
}

/// Replica `r` of `n`'s share of a global batch: a contiguous slice, sizes differing by at
/// most one, together covering the batch exactly once.
pub fn shard(global: &[usize], r: usize, n: usize) -> &[usize] {
    &global[r * global.len() / n..(r + 1) * global.len() / n]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_sets_beyond_the_node_are_refused_before_allocation() {
        // 4096 samples of 10^11 features: 1.6 PB (the allocator aborted with a backtrace).
        let e = Dataset::load("synthetic:100000000000", 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("data synthetic:100000000000: 4096 samples of 100000000000 features take 1638400.0 GB, twice that while split; "),
            "{e}"
        );
        assert_eq!(Dataset::load("synthetic:3", 0).unwrap().features, 3);
    }

    #[test]
    fn malformed_set_names_say_what_is_wrong() {
        let e = |spec: &str| Dataset::load(spec, 0).unwrap_err().to_string();
        assert_eq!(
            e("synthetic:0"),
            "data synthetic:0: FEATURES \"0\" is not a positive count"
        );
        assert_eq!(
            e("synthetic:x"),
            "data synthetic:x: FEATURES \"x\" is not a positive count"
        );
        for spec in ["idx:", "idx:a", "idx:,b", "idx:a,"] {
            assert_eq!(
                e(spec),
                format!("data {spec}: give it as idx:IMAGES,LABELS (two files)")
            );
        }
        assert!(e("cifar").starts_with("unknown data set \"cifar\" (digits, "));
    }

    #[test]
    fn digits_load_and_split() {
        let d = Dataset::load("digits", 0).unwrap();
        assert_eq!((d.len(), d.features, d.classes), (1797, 64, 10));
        assert!(d.x.iter().all(|v| (0.0..=1.0).contains(v)));
        let (tr, te) = d.split_holdout(1);
        assert_eq!((tr.len(), te.len()), (1438, 359));
        assert_eq!(
            d.split_holdout(1).1,
            te,
            "the held-out fifth is fixed by the seed"
        );
    }

    #[test]
    fn batches_and_shards_cover_each_sample_once_per_epoch() {
        let mut b = Batches::new(100, 10, 3);
        let mut seen: Vec<usize> = (0..10).flat_map(|s| b.global(s).to_vec()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        let first = b.global(0).to_vec();
        assert_ne!(first, b.global(10), "a new order each epoch");
        // Kept or drawn again, an epoch's order is the same (a resumed run goes back).
        assert_eq!(b.global(3), Batches::new(100, 10, 3).global(3));
        let g = b.global(4).to_vec();
        let parts: Vec<usize> = (0..3).flat_map(|r| shard(&g, r, 3).to_vec()).collect();
        assert_eq!(parts, g);
        assert_eq!(shard(&g, 0, 3).len(), 3);
    }

    #[test]
    fn idx_round_trip_and_bad_files() {
        let dir = std::env::temp_dir().join(format!("mpiflow-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut img = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2];
        img.extend([0, 255, 255, 0, 10, 20, 30, 40]);
        let lab = vec![0, 0, 8, 1, 0, 0, 0, 2, 3, 7];
        let (ip, lp) = (dir.join("img"), dir.join("lab"));
        std::fs::write(&ip, &img).unwrap();
        std::fs::write(&lp, &lab).unwrap();
        let d = Dataset::idx(&ip, &lp).unwrap();
        assert_eq!((d.len(), d.features, d.classes), (2, 4, 8));
        assert_eq!(d.x[1], 1.0);
        std::fs::write(&lp, &lab[..9]).unwrap();
        assert!(Dataset::idx(&ip, &lp)
            .unwrap_err()
            .to_string()
            .contains("labels for 2 images"));
        std::fs::write(&ip, b"junk").unwrap();
        assert!(Dataset::idx(&ip, &lp)
            .unwrap_err()
            .to_string()
            .contains("not an IDX image file"));
        // Counts whose product wraps a usize to the body's length (0) are not believed:
        // 4 images of 2^31 x 2^31 pixels in a 16-byte file.
        let mut wrap = vec![0, 0, 8, 3, 0, 0, 0, 4, 128, 0, 0, 0, 128, 0, 0, 0];
        let four = [0, 0, 8, 1, 0, 0, 0, 4, 1, 2, 3, 4];
        let e = Dataset::idx_from((&ip, &wrap), (&lp, &four)).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("16 bytes, header says 4 images of 2147483648x2147483648"),
            "{e}"
        );
        wrap[7] = 0;
        let e = Dataset::idx_from((&ip, &wrap), (&lp, &four)).unwrap_err();
        assert!(e.to_string().contains("0 images"), "{e}");
        std::fs::write(&ip, "1,2\n").unwrap();
        assert!(Dataset::digits(&ip)
            .unwrap_err()
            .to_string()
            .contains(":1: 2 fields"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fashion_mnist_has_its_official_split_or_names_the_package() {
        let e = Dataset::load_split("fashion-mnist:/nonexistent", 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "data fashion-mnist: /nonexistent/train-images-idx3-ubyte.gz is missing; install Debian's package dataset-fashion-mnist (apt-get install dataset-fashion-mnist)"
        );
        // A copy whose labels are not Fashion-MNIST's ten classes (the files need not be
        // gzipped under their names).
        let dir = std::env::temp_dir().join(format!("mpiflow-fashion-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = [0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 1, 7, 9];
        for stem in ["train", "t10k"] {
            std::fs::write(dir.join(format!("{stem}-images-idx3-ubyte.gz")), img).unwrap();
            let lab = [
                0,
                0,
                8,
                1,
                0,
                0,
                0,
                2,
                3,
                if stem == "train" { 12 } else { 4 },
            ];
            std::fs::write(dir.join(format!("{stem}-labels-idx1-ubyte.gz")), lab).unwrap();
        }
        let e = Dataset::load_split(&format!("fashion-mnist:{}", dir.display()), 0).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("train-labels-idx1-ubyte.gz: label 12 of image 1 is not one of Fashion-MNIST's 0..9"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        if !Path::new(FASHION_MNIST_DIR).exists() {
            return; // the test script installs it; plain `cargo test` may run without
        }
        let (train, test) = Dataset::load_split("fashion-mnist", 0).unwrap();
        assert_eq!((train.len(), test.len()), (60_000, 10_000));
        assert_eq!(
            (train.features, train.classes, &train.shape[..]),
            (784, 10, &[28, 28, 1][..])
        );
        assert!(train.x.iter().all(|v| (0.0..=1.0).contains(v)));
        // Balanced classes: 6,000 of each in train, 1,000 in test.
        for c in 0..10u8 {
            assert_eq!(train.y.iter().filter(|y| **y == c).count(), 6000);
            assert_eq!(test.y.iter().filter(|y| **y == c).count(), 1000);
        }
    }
}
