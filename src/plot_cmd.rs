//! `pagedweight plot`: PNG figures of a `bench-serve` record, one per run (model × policy):
//! the experts' committed bytes by bit-width over time above the memory split (experts, KV
//! cache and the budget they share) and the requests queued and running.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};
use serde_json::Value;

/// Options of `plot`.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// A `bench-serve` JSON file (an array of runs, or `{"records": [...]}`).
    #[arg(long)]
    pub from: PathBuf,
    /// Directory for the PNGs (`MODEL-POLICY.png`).
    #[arg(long)]
    pub out: PathBuf,
    /// TrueType font for the labels.
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    pub font: PathBuf,
}

/// Registers the TTF at `path` as plotters' "sans-serif" (read at run time, so building needs
/// no system font libraries).
pub fn register_label_font(path: &Path) -> Result<()> {
    let font = std::fs::read(path)
        .with_context(|| format!("reading the label font {} (give --font FILE.ttf)", path.display()))?;
    // ab_glyph wants a 'static font; a plotting process registers it once.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    if register_font("sans-serif", FontStyle::Normal, font).is_err() {
        bail!("{}: not a TrueType/OpenType font", path.display());
    }
    Ok(())
}

/// One sample of a run's time line.
struct Sample {
    t: f64,
    /// Committed expert GB at 3..=8 bits.
    by_bits: [f64; 6],
    kv_gb: f64,
    queue: f64,
    active: f64,
}

/// Plots every run of `args.from`; returns the files written.
pub fn plot(args: &PlotArgs) -> Result<Vec<PathBuf>> {
    let path = &args.from;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let runs = match &v {
        Value::Array(a) => a.clone(),
        Value::Object(o) => match o.get("records") {
            Some(Value::Array(a)) => a.clone(),
            _ => bail!(
                "{}: expected an array of bench-serve runs or an object with \"records\"",
                path.display()
            ),
        },
        _ => bail!("{}: expected an array of bench-serve runs", path.display()),
    };
    if runs.is_empty() {
        bail!("{}: no runs to plot", path.display());
    }
    register_label_font(&args.font)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let mut written = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let field =
            |k: &str| run[k].as_str().with_context(|| format!("{} run {i}: no \"{k}\"", path.display()));
        let (model, policy) = (field("model")?, field("policy")?);
        let samples =
            samples(run).with_context(|| format!("{} run {i} ({model}, {policy})", path.display()))?;
        let png = args.out.join(format!("{model}-{policy}.png"));
        draw(&png, model, policy, run, &samples)?;
        written.push(png);
    }
    Ok(written)
}

fn samples(run: &Value) -> Result<Vec<Sample>> {
    let mix = run["bit_mix"].as_array().context("no \"bit_mix\" time line (a bench-serve record has one)")?;
    let mut out = Vec::with_capacity(mix.len());
    for (j, s) in mix.iter().enumerate() {
        let num = |k: &str| s[k].as_f64().with_context(|| format!("bit_mix[{j}]: no number \"{k}\""));
        let gb = s["expert_gb_by_bits_3_to_8"]
            .as_array()
            .filter(|a| a.len() == 6)
            .with_context(|| format!("bit_mix[{j}]: \"expert_gb_by_bits_3_to_8\" is not 6 numbers"))?;
        let mut by_bits = [0.0; 6];
        for (b, x) in by_bits.iter_mut().zip(gb) {
            *b = x.as_f64().with_context(|| format!("bit_mix[{j}]: a bit-width's GB is not a number"))?;
        }
        out.push(Sample {
            t: num("t_s")?,
            by_bits,
            kv_gb: num("kv_gb")?,
            queue: num("queue")?,
            active: num("active")?,
        });
    }
    if out.is_empty() {
        bail!("the \"bit_mix\" time line is empty");
    }
    Ok(out)
}

/// Colours of 3..=8 bits, red (fewest) to green (most).
const BITS: [RGBColor; 6] = [
    RGBColor(215, 48, 39),
    RGBColor(252, 141, 89),
    RGBColor(254, 224, 139),
    RGBColor(217, 239, 139),
    RGBColor(145, 207, 96),
    RGBColor(26, 152, 80),
];

/// One of the figure's three charts: seconds against a value.
type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// Draws a chart's legend box at `at`.
fn legend<'a, 'b: 'a>(c: &mut Chart<'a, 'b>, at: SeriesLabelPosition) -> Result<(), String> {
    c.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(at)
        .draw()
        .map_err(|e| e.to_string())
}

fn draw(png: &Path, model: &str, policy: &str, run: &Value, s: &[Sample]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", png.display());
    let root = BitMapBackend::new(png, (1100, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (top, rest) = root.split_vertically(380);
    let (middle, bottom) = rest.split_vertically(300);
    let t1 = s.last().map_or(1.0, |x| x.t).max(1.0);
    let title = format!("{model}, {policy}: experts' bits and the memory split over time");

    // The bit mix: committed expert GB stacked from 8 bits (bottom) to 3 bits (top).
    let expert_top = s.iter().map(|x| x.by_bits.iter().sum::<f64>()).fold(0.0, f64::max).max(1e-6);
    let mut c = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t1, 0.0..expert_top * 1.05)
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .y_desc("expert GB by committed bits")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| err(&e))?;
    for (k, &colour) in BITS.iter().enumerate() {
        // Band k stacks 8, 7, … down to 3 + k bits; drawn largest first so smaller ones cover it.
        let stack = |x: &Sample| (0..6 - k).map(|b| x.by_bits[5 - b]).sum::<f64>();
        let bits = 3 + k;
        c.draw_series(AreaSeries::new(s.iter().map(|x| (x.t, stack(x))), 0.0, colour.filled()))
            .map_err(|e| err(&e))?
            .label(format!("{bits} bits"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], colour.filled()));
    }
    legend(&mut c, SeriesLabelPosition::LowerLeft).map_err(|e| err(&e))?;

    // The memory split: experts + KV stacked, against the GPU memory limit less the dense
    // weights and step buffers where the record says it.
    let budget = run["budget_gb"].as_f64();
    let mem_top =
        s.iter().map(|x| x.by_bits.iter().sum::<f64>() + x.kv_gb).fold(budget.unwrap_or(0.0), f64::max);
    let mut c = ChartBuilder::on(&middle)
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t1, 0.0..mem_top.max(1e-6) * 1.08)
        .map_err(|e| err(&e))?;
    c.configure_mesh().y_desc("GB").label_style(("sans-serif", 13)).draw().map_err(|e| err(&e))?;
    let kv_colour = RGBColor(215, 48, 39);
    let ex_colour = RGBColor(69, 117, 180);
    c.draw_series(AreaSeries::new(
        s.iter().map(|x| (x.t, x.by_bits.iter().sum::<f64>() + x.kv_gb)),
        0.0,
        kv_colour.mix(0.6).filled(),
    ))
    .map_err(|e| err(&e))?
    .label("KV cache")
    .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], kv_colour.mix(0.6).filled()));
    c.draw_series(AreaSeries::new(
        s.iter().map(|x| (x.t, x.by_bits.iter().sum::<f64>())),
        0.0,
        ex_colour.mix(0.7).filled(),
    ))
    .map_err(|e| err(&e))?
    .label("experts")
    .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], ex_colour.mix(0.7).filled()));
    if let Some(b) = budget {
        c.draw_series(LineSeries::new([(0.0, b), (t1, b)], BLACK.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("budget (experts + KV)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], BLACK.stroke_width(2)));
    }
    legend(&mut c, SeriesLabelPosition::LowerRight).map_err(|e| err(&e))?;

    // Requests queued and running.
    let q_top = s.iter().map(|x| x.queue.max(x.active)).fold(1.0, f64::max);
    let mut c = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t1, 0.0..q_top * 1.1)
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc("requests")
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| err(&e))?;
    for (name, colour, f) in [
        ("queued", RGBColor(152, 78, 163), (|x: &Sample| x.queue) as fn(&Sample) -> f64),
        ("running", RGBColor(255, 127, 0), |x: &Sample| x.active),
    ] {
        c.draw_series(LineSeries::new(s.iter().map(|x| (x.t, f(x))), colour.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], colour.stroke_width(2)));
    }
    legend(&mut c, SeriesLabelPosition::UpperRight).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
