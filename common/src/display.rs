//! Rendering counts the way people read them: `9,847`, `10.2K`, `10.2M`, `2.3B`.
//!
//! Compact counts are truncated, never rounded up: a post with 10,299 likes shows `10.2K`, not
//! `10.3K`, so a displayed count is never more than the real one.

use crate::namespace::DisplayStyle;

/// `count` rendered in `style`.
pub fn display(count: i64, style: DisplayStyle) -> String {
    match style {
        DisplayStyle::Exact => grouped(count),
        DisplayStyle::Compact => compact(count),
    }
}

/// Every digit, with a comma between thousands: `10,293,847`.
fn grouped(count: i64) -> String {
    let digits = count.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if count < 0 {
        out.push('-');
    }
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(d);
    }
    out
}

/// Below 10,000 every digit; above, one truncated decimal and a unit.
fn compact(count: i64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1_000_000_000_000, "T"),
        (1_000_000_000, "B"),
        (1_000_000, "M"),
        (1_000, "K"),
    ];
    let abs = count.unsigned_abs();
    if abs < 10_000 {
        return grouped(count);
    }
    let (scale, unit) = UNITS
        .iter()
        .copied()
        .find(|(scale, _)| abs >= *scale)
        .unwrap_or((1_000, "K"));
    let tenths = abs / (scale / 10);
    let (whole, tenth) = (tenths / 10, tenths % 10);
    let sign = if count < 0 { "-" } else { "" };
    if tenth == 0 {
        format!("{sign}{}{unit}", grouped(whole as i64))
    } else {
        format!("{sign}{}.{tenth}{unit}", grouped(whole as i64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_counts_read_like_a_social_app() {
        let cases = [
            (0, "0"),
            (7, "7"),
            (9_847, "9,847"),
            (10_000, "10K"),
            (10_299, "10.2K"),
            (999_999, "999.9K"),
            (1_000_000, "1M"),
            (10_200_000, "10.2M"),
            (2_345_678_901, "2.3B"),
            (1_500_000_000_000, "1.5T"),
            (-12_345, "-12.3K"),
            (i64::MAX, "9,223,372T"),
        ];
        for (count, shown) in cases {
            assert_eq!(display(count, DisplayStyle::Compact), shown, "{count}");
        }
    }

    #[test]
    fn exact_counts_group_every_three_digits() {
        assert_eq!(display(10_293_847, DisplayStyle::Exact), "10,293,847");
        assert_eq!(display(-1_000, DisplayStyle::Exact), "-1,000");
        assert_eq!(display(999, DisplayStyle::Exact), "999");
        assert_eq!(
            display(i64::MIN, DisplayStyle::Exact),
            "-9,223,372,036,854,775,808"
        );
    }
}
