//! Alternated rounds of one scenario: which round stands for them all.

/// The round with the median ratio of `ratios` (one per round), printed as `label, per round:`
/// with every round's ratio.
pub(super) fn median_round(ratios: &[f64], label: &str) -> usize {
    let mut by_ratio: Vec<usize> = (0..ratios.len()).collect();
    by_ratio.sort_by(|&a, &b| ratios[a].total_cmp(&ratios[b]));
    println!(
        "  {label}, per round: {} (the median round's runs are reported)",
        (ratios.iter())
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    by_ratio[by_ratio.len() / 2]
}
