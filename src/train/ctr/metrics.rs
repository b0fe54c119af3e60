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

#[cfg(test)]
mod tests {
    use super::*;

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
