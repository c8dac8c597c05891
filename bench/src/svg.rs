//! Small SVG charts, drawn by hand: line charts (throughput over time) and bar charts
//! (latency distributions). Plain SVG 1.1 that any browser or image viewer shows.
//!
//! Not `plotters`: its SVG backend is light, but laying out axis text needs one of its font
//! backends (`ttf`: font-kit and the system's fonts, or `ab_glyph` with a font file embedded),
//! more than three charts are worth.

use std::fmt::Write;

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 5] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A tidy axis maximum and its tick step for values up to `max`.
fn ticks(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 0.2);
    }
    let magnitude = 10f64.powf(max.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude / 5.0)
        .find(|step| max / step <= 6.0)
        .unwrap_or(magnitude);
    ((max / step).ceil() * step, step)
}

fn label(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.1}M", value / 1e6)
    } else if value >= 1e3 {
        format!("{:.0}k", value / 1e3)
    } else if value >= 10.0 || value == 0.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    }
}

fn frame(out: &mut String, title: &str, x_label: &str, y_label: &str) {
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="24" font-size="16" text-anchor="middle">{}</text><text x="{}" y="{}" text-anchor="middle">{}</text><text transform="translate(18,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        escape(title),
        LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
        HEIGHT - 14.0,
        escape(x_label),
        TOP + (HEIGHT - TOP - BOTTOM) / 2.0,
        escape(y_label),
    );
}

fn y_axis(out: &mut String, y_max: f64, step: f64) {
    let plot_h = HEIGHT - TOP - BOTTOM;
    let mut v = 0.0;
    while v <= y_max + step / 2.0 {
        let y = TOP + plot_h - v / y_max * plot_h;
        let _ = write!(
            out,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            label(v)
        );
        v += step;
    }
}

/// A line chart of named series of (x, y) points.
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let mut out = String::new();
    frame(&mut out, title, x_label, y_label);
    let x_max_raw = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(x, _)| *x))
        .fold(0.0, f64::max);
    let y_max_raw = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
        .fold(0.0, f64::max);
    let (x_max, x_step) = ticks(x_max_raw);
    let (y_max, y_step) = ticks(y_max_raw);
    y_axis(&mut out, y_max, y_step);
    let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let mut x = 0.0;
    while x <= x_max + x_step / 2.0 {
        let px = LEFT + x / x_max * plot_w;
        let _ = write!(
            out,
            r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + plot_h + 18.0,
            label(x)
        );
        x += x_step;
    }
    for (i, (name, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = points
            .iter()
            .map(|(x, y)| {
                format!(
                    "{:.1},{:.1}",
                    LEFT + x / x_max * plot_w,
                    TOP + plot_h - y / y_max * plot_h
                )
            })
            .collect();
        let _ = write!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/><rect x="{:.1}" y="{:.1}" width="12" height="12" fill="{color}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            path.join(" "),
            LEFT + 10.0,
            TOP + 8.0 + 18.0 * i as f64,
            LEFT + 28.0,
            TOP + 18.0 + 18.0 * i as f64,
            escape(name)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// A bar chart: one bar per labelled bucket.
pub fn bar_chart(title: &str, x_label: &str, y_label: &str, bars: &[(String, f64)]) -> String {
    let mut out = String::new();
    frame(&mut out, title, x_label, y_label);
    let (y_max, y_step) = ticks(bars.iter().map(|(_, v)| *v).fold(0.0, f64::max));
    y_axis(&mut out, y_max, y_step);
    let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let slot = plot_w / bars.len().max(1) as f64;
    for (i, (name, value)) in bars.iter().enumerate() {
        let h = value / y_max * plot_h;
        let x = LEFT + slot * i as f64;
        let _ = write!(
            out,
            r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"#,
            x + slot * 0.1,
            TOP + plot_h - h,
            slot * 0.8,
            COLORS[0],
            x + slot / 2.0,
            TOP + plot_h + 16.0,
            escape(name)
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_end_on_round_numbers() {
        assert_eq!(ticks(930_000.0), (1_000_000.0, 200_000.0));
        assert_eq!(ticks(7.3), (8.0, 2.0));
        assert_eq!(ticks(0.0), (1.0, 0.2));
    }

    #[test]
    fn charts_are_well_formed_svg() {
        let line = line_chart(
            "t",
            "x",
            "y",
            &[("a<b".to_owned(), vec![(0.0, 1.0), (1.0, 3.0)])],
        );
        assert!(line.starts_with("<svg") && line.trim_end().ends_with("</svg>"));
        assert!(line.contains("a&lt;b"));
        let bars = bar_chart("t", "x", "y", &[("1ms".to_owned(), 4.0)]);
        assert!(bars.contains("<rect"));
    }
}
