//! The metrics of click prediction: AUC (the chance that a random click is scored above a
//! random non-click) and log loss.

/// The area under the ROC curve of `scores` (any monotone score: logits or
/// probabilities) for `labels` (1 a click, 0 not), ties counted half (the Mann-Whitney
/// statistic). `None` where the labels are all of one kind.
pub fn auc(scores: &[f32], labels: &[f32]) -> Option<f64> {
    let mut order: Vec<usize> = (0..scores.len().min(labels.len())).collect();
    order.sort_unstable_by(|a, b| scores[*a].total_cmp(&scores[*b]));
    // Ranks from 1, a tie's ranks averaged; the sum of the clicks' ranks.
    let (mut rank_sum, mut clicks) = (0f64, 0usize);
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        let mean_rank = (i + j) as f64 / 2.0 + 1.0;
        for k in &order[i..=j] {
            if labels[*k] > 0.5 {
                rank_sum += mean_rank;
                clicks += 1;
            }
        }
        i = j + 1;
    }
    let others = order.len() - clicks;
    if clicks == 0 || others == 0 {
        return None;
    }
    let (p, n) = (clicks as f64, others as f64);
    Some((rank_sum - p * (p + 1.0) / 2.0) / (p * n))
}

/// The mean log loss of the click probabilities `sigmoid(logits)` for `labels`.
pub fn logloss(logits: &[f32], labels: &[f32]) -> f64 {
    let n = logits.len().min(labels.len()).max(1) as f64;
    let total: f64 = logits
        .iter()
        .zip(labels)
        .map(|(z, y)| {
            let (z, y) = (f64::from(*z), f64::from(*y));
            // log(1 + e^z) - y z, stable on both sides.
            z.max(0.0) + (-z.abs()).exp().ln_1p() - y * z
        })
        .sum();
    total / n
}

/// Click scores counted into buckets of the click probability, with the log loss's sum:
/// what ranks that evaluate their shares of the held-out samples sum
/// ([`ScoreCounts::values_mut`]) to get one AUC and log loss (TensorFlow's AUC metric,
/// with this many thresholds). Pairs within one bucket count half, so the AUC is the exact
/// one up to pairs scored within `1 / buckets` of each other.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreCounts {
    buckets: usize,
    /// Non-clicks per bucket, then clicks per bucket, then the log loss's sum and the
    /// samples.
    values: Vec<f64>,
}

impl ScoreCounts {
    /// Empty, over `buckets` buckets of the probability.
    pub fn new(buckets: usize) -> ScoreCounts {
        let buckets = buckets.max(1);
        ScoreCounts {
            buckets,
            values: vec![0.0; 2 * buckets + 2],
        }
    }

    /// Counts samples of `logits` and `labels` (1 a click).
    pub fn add(&mut self, logits: &[f32], labels: &[f32]) {
        let b = self.buckets;
        for (z, y) in logits.iter().zip(labels) {
            let p = 1.0 / (1.0 + (-f64::from(*z)).exp());
            let k = ((p * b as f64) as usize).min(b - 1);
            let click = usize::from(*y > 0.5);
            self.values[click * b + k] += 1.0;
        }
        let n = logits.len().min(labels.len());
        self.values[2 * b] += logloss(logits, labels) * n as f64;
        self.values[2 * b + 1] += n as f64;
    }

    /// The counts as one array (for a sum over ranks).
    pub fn values_mut(&mut self) -> &mut [f64] {
        &mut self.values
    }

    /// Samples counted.
    pub fn total(&self) -> usize {
        self.values[2 * self.buckets + 1] as usize
    }

    /// The mean log loss.
    pub fn logloss(&self) -> f64 {
        self.values[2 * self.buckets] / self.values[2 * self.buckets + 1].max(1.0)
    }

    /// The AUC (`None` where the samples are all of one kind).
    pub fn auc(&self) -> Option<f64> {
        let b = self.buckets;
        let (neg, pos) = (&self.values[..b], &self.values[b..2 * b]);
        let (mut below, mut pairs) = (0.0, 0.0);
        for (n, p) in neg.iter().zip(pos) {
            pairs += p * (below + n / 2.0);
            below += n;
        }
        let clicks: f64 = pos.iter().sum();
        (clicks > 0.0 && below > 0.0).then(|| pairs / (clicks * below))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucketed_counts_summed_over_parts_give_the_exact_auc_and_logloss() {
        let mut rng = crate::rng::Rng::new(3);
        let logits: Vec<f32> = (0..5000).map(|_| rng.normal() as f32 * 2.0).collect();
        let labels: Vec<f32> = (logits.iter())
            .map(|z| f32::from(rng.uniform() < 1.0 / (1.0 + (-f64::from(*z)).exp())))
            .collect();
        let (mut a, mut b) = (ScoreCounts::new(10000), ScoreCounts::new(10000));
        a.add(&logits[..1700], &labels[..1700]);
        b.add(&logits[1700..], &labels[1700..]);
        a.values_mut()
            .iter_mut()
            .zip(b.values_mut())
            .for_each(|(x, y)| *x += *y);
        let exact = auc(&logits, &labels).unwrap();
        assert!(
            (a.auc().unwrap() - exact).abs() < 1e-4,
            "{:?} {exact}",
            a.auc()
        );
        assert!((a.logloss() - logloss(&logits, &labels)).abs() < 1e-9);
        assert_eq!(a.total(), 5000);
        assert_eq!(ScoreCounts::new(10).auc(), None);
    }

    #[test]
    fn auc_counts_pairs_and_ties() {
        // Perfect, reversed, and the classic worked example.
        assert_eq!(auc(&[0.1, 0.2, 0.8, 0.9], &[0.0, 0.0, 1.0, 1.0]), Some(1.0));
        assert_eq!(auc(&[0.9, 0.8, 0.2, 0.1], &[0.0, 0.0, 1.0, 1.0]), Some(0.0));
        // Pairs (click, non-click): (0.35 > 0.1), (0.35 < 0.4), (0.8 > 0.1), (0.8 > 0.4).
        assert_eq!(
            auc(&[0.1, 0.4, 0.35, 0.8], &[0.0, 0.0, 1.0, 1.0]),
            Some(0.75)
        );
        // Every score tied: half.
        assert_eq!(auc(&[0.5; 6], &[0.0, 1.0, 0.0, 1.0, 1.0, 0.0]), Some(0.5));
        assert_eq!(auc(&[0.1, 0.2], &[1.0, 1.0]), None);
    }

    #[test]
    fn logloss_is_the_cross_entropy_of_the_probabilities() {
        let l = logloss(&[0.0, 0.0], &[1.0, 0.0]);
        assert!((l - 2f64.ln()).abs() < 1e-12);
        let far = logloss(&[100.0, -100.0], &[1.0, 0.0]);
        assert!(far < 1e-40, "{far}");
        let wrong = logloss(&[100.0], &[0.0]);
        assert!((wrong - 100.0).abs() < 1e-9, "{wrong}");
    }
}
