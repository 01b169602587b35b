//! The picture of a `duplex eval compare`: one SVG, three panels a person reads at a glance:
//!
//! - per pack and task, the paired response-latency differences (each pair a faint dot, their
//!   mean with its 95 % interval a bar; zero marked): is the pack slower to answer?
//! - per pack and task, the share of pairs where both packs answered, neither did, or only one
//!   did (the discordant shares, McNemar's p beside them): does the pack decide differently?
//! - per pack, the share of pairs whose token streams are still identical at each moment: how
//!   soon does the pack part from the base?
//!
//! Draws what [`super::compare`] reduced; computes nothing.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::coord::ranged1d::{SegmentValue, SegmentedCoord};
use plotters::coord::types::RangedCoordusize;
use plotters::prelude::*;

use super::compare::{Parting, Row};

const FONT: &str = "sans-serif";

/// One colour per compared pack, told apart on a white page.
const PACK_COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
];

/// The rows' axis: `n` segments (`0..n - 1` makes `n` in plotters 0.3.7; one row takes two,
/// the upper left empty, since `0..0` has no key points to label).
fn rows_axis(n: usize) -> SegmentedCoord<RangedCoordusize> {
    (0..(n - 1).max(1)).into_segmented()
}

/// The series' names and marks, in the panel's upper right corner.
fn legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .label_font((FONT, 12))
        .draw()
}

/// Writes the picture of `rows` (each pack against `base`) and `divergences` (per pack, where
/// each pair's streams first part) to `path`.
pub(super) fn draw(
    path: &Path,
    base: &str,
    rows: &[Row],
    divergences: &BTreeMap<String, Parting>,
) -> anyhow::Result<()> {
    // The rows over all seeds where there are several seeds, else the rows there are.
    let shown: Vec<&Row> = if rows.iter().any(|r| r.seed == "all") {
        rows.iter().filter(|r| r.seed == "all").collect()
    } else {
        rows.iter().collect()
    };
    let n = shown.len().max(1);
    let labels: Vec<String> = shown
        .iter()
        .map(|r| format!("{} · {}", r.pack, r.task))
        .collect();
    let label_w = labels.iter().map(|l| l.chars().count()).max().unwrap_or(8) as u32 * 7 + 16;
    let top_h = 110 + 34 * n as u32;
    let (w, h) = (1280, top_h + 300);
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(top_h);
    let (left, right) = top.split_horizontally(w * 11 / 20);
    let colour = |pack: &str| {
        let k = divergences.keys().position(|p| p == pack).unwrap_or(0);
        PACK_COLOURS[k % PACK_COLOURS.len()]
    };
    let at = |k: usize| SegmentValue::CenterOf(n - 1 - k);
    let label_of = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(y) if *y < n => labels[n - 1 - *y].clone(),
        _ => String::new(),
    };

    // Response latency differences.
    let mut xs: Vec<f64> = vec![0.0];
    for r in &shown {
        xs.extend(&r.response_diffs);
        if let Some(d) = &r.response_latency {
            xs.extend([d.low, d.high]);
        }
    }
    let (lo, hi) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let pad = ((hi - lo) * 0.08).max(0.05);
    let mut chart = ChartBuilder::on(&left)
        .caption(
            format!("response latency, pack − {base} (s): each pair, mean, 95 % interval"),
            (FONT, 15),
        )
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(label_w)
        .build_cartesian_2d((lo - pad)..(hi + pad), rows_axis(n))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(TRANSPARENT)
        .y_labels(n)
        .y_label_formatter(&label_of)
        .x_desc("seconds (negative: the pack answers sooner)")
        .draw()?;
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(0.0, SegmentValue::Exact(0)), (0.0, SegmentValue::Last)],
        BLACK.stroke_width(1),
    )))?;
    if shown.iter().all(|r| r.response_diffs.is_empty()) {
        chart.draw_series(std::iter::once(Text::new(
            "no pair where both packs answered",
            (lo - pad * 0.5, at(0)),
            (FONT, 14),
        )))?;
    }
    for (k, r) in shown.iter().enumerate() {
        let c = colour(&r.pack);
        chart.draw_series(
            r.response_diffs
                .iter()
                .map(|&d| Circle::new((d, at(k)), 3, c.mix(0.3).filled())),
        )?;
        if let Some(d) = &r.response_latency {
            chart.draw_series(std::iter::once(ErrorBar::new_horizontal(
                at(k),
                d.low,
                d.mean,
                d.high,
                c.stroke_width(2),
                12,
            )))?;
            chart.draw_series(std::iter::once(Circle::new((d.mean, at(k)), 5, c.filled())))?;
        }
    }

    // Answering: agreement shares.
    let mut chart = ChartBuilder::on(&right)
        .caption(
            format!("answers after the user: both, neither, only {base}, only the pack"),
            (FONT, 15),
        )
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(8)
        .build_cartesian_2d(0.0..1.75, rows_axis(n))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(TRANSPARENT)
        // (No labels: the left panel's rows are these rows. Zero labels would loop forever in
        // plotters 0.3.7's key points.)
        .y_labels(1)
        .y_label_formatter(&|_| String::new())
        .x_labels(6)
        .x_label_formatter(&|x| {
            if *x <= 1.0 + 1e-9 {
                format!("{:.0} %", x * 100.0)
            } else {
                String::new()
            }
        })
        .x_desc("share of pairs")
        .draw()?;
    let parts: [(&str, RGBColor); 4] = [
        ("both", RGBColor(96, 170, 96)),
        ("neither", RGBColor(200, 200, 200)),
        ("base only", RGBColor(230, 140, 50)),
        ("only the pack", RGBColor(70, 120, 200)),
    ];
    for (k, r) in shown.iter().enumerate() {
        let a = &r.responds;
        let total = a.total().max(1) as f64;
        let counts = [a.both, a.neither, a.first_only, a.second_only];
        let y = n - 1 - k;
        let mut x = 0.0;
        for ((_, c), count) in parts.iter().zip(counts) {
            let dx = count as f64 / total;
            if dx > 0.0 {
                chart.draw_series(std::iter::once(Rectangle::new(
                    [
                        (x, SegmentValue::Exact(y)),
                        (x + dx, SegmentValue::Exact(y + 1)),
                    ],
                    c.filled(),
                )))?;
            }
            x += dx;
        }
        chart.draw_series(std::iter::once(Text::new(
            format!("p = {:.3}", r.responds_p),
            (1.03, at(k)),
            (FONT, 13),
        )))?;
    }
    for &(name, c) in &parts {
        chart
            .draw_series(std::iter::empty::<Circle<(f64, SegmentValue<usize>), i32>>())?
            .label(match name {
                "base only" => format!("only {base}"),
                other => other.to_string(),
            })
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    legend(&mut chart)?;

    // Token streams still identical.
    let frames = divergences
        .values()
        .map(|d| d.frames)
        .max()
        .unwrap_or(1)
        .max(1);
    let seconds = frames as f64 * 0.08;
    let mut chart = ChartBuilder::on(&bottom)
        .caption(
            format!(
                "token streams still identical to {base}'s (share of pairs; thick: the text, thin: every token)"
            ),
            (FONT, 15),
        )
        .margin(12)
        .x_label_area_size(34)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..seconds, 0.0..1.05)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .x_desc("seconds into the conversation")
        .y_label_formatter(&|y| format!("{:.0} %", y * 100.0))
        .draw()?;
    let curve = |parted: &[Option<usize>]| {
        let total = parted.len().max(1) as f64;
        let still =
            |f: usize| parted.iter().filter(|d| d.is_none_or(|k| k > f)).count() as f64 / total;
        let mut points = Vec::with_capacity(2 * frames);
        for f in 0..frames {
            let s = still(f);
            points.push((f as f64 * 0.08, s));
            points.push(((f + 1) as f64 * 0.08, s));
        }
        points
    };
    for (pack, parting) in divergences {
        if parting.any.is_empty() {
            // A served run: no token logs.
            continue;
        }
        let c = colour(pack);
        chart.draw_series(std::iter::once(PathElement::new(
            curve(&parting.any),
            c.mix(0.6).stroke_width(1),
        )))?;
        chart
            .draw_series(std::iter::once(PathElement::new(
                curve(&parting.text),
                c.stroke_width(3),
            )))?
            .label(pack.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(3)));
    }
    legend(&mut chart)?;
    root.present()?;
    Ok(())
}
