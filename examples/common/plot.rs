//! The pictures of the digits examples, drawn with `plotters` into SVG files (no font or system
//! library needed: SVG text is written as `<text>` elements for the viewer to render).
#![allow(dead_code)]

use std::error::Error;
use std::path::{Path, PathBuf};

use plotters::coord::combinators::IntoLogRange;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;

/// `target/plots` of this package, created if missing.
pub fn plot_dir() -> std::io::Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join("plots");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// One colour per run, in order: f32 first, then the half runs.
fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 4] = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
    ];
    COLORS[i % COLORS.len()]
}

/// Draws the mean training loss per epoch of each run (`(name, losses)`) on one plot with a log
/// loss axis, and writes it as an SVG file at `path`.
pub fn loss_curves(
    path: &Path,
    title: &str,
    runs: &[(&str, &[f32])],
) -> Result<(), Box<dyn Error>> {
    let epochs = runs.iter().map(|(_, l)| l.len()).max().unwrap_or(1).max(2);
    let finite: Vec<f32> = runs
        .iter()
        .flat_map(|(_, l)| l.iter().copied())
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let lo = finite.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = finite.iter().copied().fold(0.0f32, f32::max);
    let (lo, hi) = if finite.is_empty() {
        (0.01, 10.0)
    } else {
        (lo * 0.8, hi * 1.25)
    };

    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(1f32..epochs as f32, (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y}"))
        .y_desc("mean training loss (log scale)")
        .axis_desc_style(("sans-serif", 18))
        .label_style(("sans-serif", 14))
        .draw()?;
    for (i, (name, losses)) in runs.iter().enumerate() {
        let c = color(i);
        let points = losses
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite() && **l > 0.0)
            .map(|(e, &l)| ((e + 1) as f32, l));
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 18))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Draws a grouped bar chart: one group per category (`categories`), one bar per run in each
/// group (`runs`: `(name, one value per category)`), the y axis described by `y_desc`; writes it
/// as an SVG file at `path`.
pub fn grouped_bars(
    path: &Path,
    title: &str,
    y_desc: &str,
    categories: &[&str],
    runs: &[(&str, Vec<f64>)],
) -> Result<(), Box<dyn Error>> {
    let n = categories.len().max(1);
    let top = runs
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.15;

    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(Groups(n), 0f64..top)?;
    let names: Vec<String> = categories.iter().map(|c| c.to_string()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|x| {
            names
                .get(x.floor().max(0.0) as usize)
                .cloned()
                .unwrap_or_default()
        })
        .x_desc("component")
        .y_desc(y_desc)
        .axis_desc_style(("sans-serif", 18))
        .label_style(("sans-serif", 14))
        .x_label_style(("sans-serif", 16))
        .draw()?;
    let k = runs.len().max(1) as f64;
    let width = 0.8 / k;
    for (j, (name, values)) in runs.iter().enumerate() {
        let c = color(j);
        let bars = values.iter().enumerate().map(|(i, &v)| {
            let x0 = i as f64 + 0.1 + j as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width * 0.92, v)], c.filled())
        });
        chart
            .draw_series(bars)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 18))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// An x axis of `n` groups: group `i` spans `[i, i + 1)`, its tick (and label) at its centre.
struct Groups(usize);

impl Ranged for Groups {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let t = value / self.0.max(1) as f64;
        limit.0 + (t * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        (0..self.0).map(|i| i as f64 + 0.5).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        0.0..self.0 as f64
    }
}
