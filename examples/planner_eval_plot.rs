//! Turns the rows of `benches/planner_eval.sh` (one `eval-ppl` JSON line each) into the
//! committed evidence of issue 7: a JSON array, a markdown table and a PNG plot of perplexity
//! vs expert bytes per policy (plotters' bitmap backend; text drawn with ab_glyph from a TTF
//! read at run time, so building needs no system font libraries).
//!
//! `cargo run --release --example planner_eval_plot -- --rows ROWS.jsonl --png OUT.png
//! --json OUT.json --md OUT.md [--font FILE.ttf]`

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use plotters::prelude::*;
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(about = "Plot and tabulate eval-ppl rows under expert budgets")]
struct Args {
    /// JSON lines written by benches/planner_eval.sh.
    #[arg(long)]
    rows: PathBuf,
    /// PNG to write.
    #[arg(long)]
    png: PathBuf,
    /// JSON array to write (the rows as they are).
    #[arg(long)]
    json: PathBuf,
    /// Markdown table to write.
    #[arg(long)]
    md: PathBuf,
    /// TrueType font for the labels.
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
    /// Plot title.
    #[arg(long, default_value = "held-out perplexity vs expert bytes")]
    title: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let text =
        std::fs::read_to_string(&args.rows).with_context(|| format!("reading {}", args.rows.display()))?;
    let rows: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{} line {}", args.rows.display(), i + 1))
        })
        .collect::<Result<_>>()?;
    std::fs::write(&args.json, serde_json::to_string_pretty(&rows)? + "\n")
        .with_context(|| format!("writing {}", args.json.display()))?;
    let fp16 = rows
        .iter()
        .find(|r| r["policy"] == "fp16")
        .with_context(|| format!("{}: no fp16 row", args.rows.display()))?;
    let fp16_ppl = fp16["ppl"].as_f64().context("fp16 row: no ppl")?;
    let fp16_bytes = fp16["expert_bytes"].as_f64().context("fp16 row: no expert_bytes")?;

    // Columns: the budgeted rows' policies, in the order they first appear.
    let mut policies: Vec<String> = Vec::new();
    for r in rows.iter().filter(|r| r["budget_pct"].is_u64()) {
        let p = r["policy"].as_str().unwrap_or_default().to_string();
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    // Table: one row per budget, one column per policy; ppl (Δ% vs fp16) and MB.
    let mut by_pct: BTreeMap<u64, BTreeMap<String, &Value>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r["budget_pct"].is_u64()) {
        let pct = r["budget_pct"].as_u64().unwrap_or_default();
        by_pct.entry(pct).or_default().insert(r["policy"].as_str().unwrap_or_default().to_string(), r);
    }
    let mut md = format!(
        "FP16: ppl {fp16_ppl:.4}, expert bytes {:.2} MB. Cells: ppl (Δ vs FP16) / expert MB / bits \
         histogram.\n\n| budget | {} |\n|---|{}\n",
        fp16_bytes / 1e6,
        policies.join(" | "),
        "---|".repeat(policies.len())
    );
    for (pct, cells) in &by_pct {
        let budget = cells.values().next().and_then(|r| r["budget_bytes"].as_f64()).unwrap_or_default();
        md.push_str(&format!("| {pct}% ({:.2} MB) |", budget / 1e6));
        for p in &policies {
            let cell = match cells.get(p) {
                None => "–".to_string(),
                Some(r) if r["infeasible"] == true => "infeasible".to_string(),
                Some(r) => {
                    let ppl = r["ppl"].as_f64().unwrap_or(f64::NAN);
                    let hist = r["bits_histogram"]
                        .as_object()
                        .map(|h| h.iter().map(|(b, n)| format!("{b}:{n}")).collect::<Vec<_>>().join(" "))
                        .unwrap_or_default();
                    format!(
                        "{ppl:.4} ({:+.2}%) / {:.2} / {hist}",
                        100.0 * (ppl / fp16_ppl - 1.0),
                        r["expert_bytes"].as_f64().unwrap_or_default() / 1e6
                    )
                }
            };
            md.push_str(&format!(" {cell} |"));
        }
        md.push('\n');
    }
    std::fs::write(&args.md, &md).with_context(|| format!("writing {}", args.md.display()))?;
    print!("{md}");

    plot(&args, &rows, &policies, fp16_ppl, fp16_bytes)
}

fn plot(args: &Args, rows: &[Value], policies: &[String], fp16_ppl: f64, fp16_bytes: f64) -> Result<()> {
    pagedweight::plot_cmd::register_label_font(&args.font)?;
    let series: Vec<(&str, Vec<(f64, f64)>)> = policies
        .iter()
        .map(|p| {
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r["policy"] == p.as_str() && r["ppl"].is_f64())
                .map(|r| {
                    (
                        r["expert_bytes"].as_f64().unwrap_or_default() / 1e6,
                        r["ppl"].as_f64().unwrap_or_default(),
                    )
                })
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (p.as_str(), pts)
        })
        .collect();
    let fp16_point = [(fp16_bytes / 1e6, fp16_ppl)];
    let all = series.iter().flat_map(|(_, s)| s.iter()).chain(fp16_point.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        bail!("{}: no rows to plot", args.rows.display());
    }
    let (dy, dx) = ((y1 - y0).max(1e-3) * 0.08, (x1 - x0).max(1e-3) * 0.05);
    let root = BitMapBackend::new(&args.png, (1000, 650)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", args.png.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(&args.title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 - dx)..(x1 + dx), (y0 - dy)..(y1 + dy))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("expert bytes (MB, planes + LUTs)")
        .y_desc("held-out perplexity")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    let colours = [
        BLACK,
        RED,
        BLUE,
        GREEN,
        MAGENTA,
        RGBColor(230, 140, 0),
        RGBColor(120, 70, 20),
        RGBColor(0, 150, 150),
        RGBColor(128, 128, 128),
    ];
    for (n, (name, pts)) in series.iter().enumerate() {
        let colour = colours[n % colours.len()];
        if pts.is_empty() {
            continue;
        }
        let style = colour.stroke_width(2);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), style))
            .map_err(|e| err(&e))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, colour.filled()))).map_err(|e| err(&e))?;
    }
    chart
        .draw_series([Cross::new((fp16_bytes / 1e6, fp16_ppl), 7, CYAN.stroke_width(3))])
        .map_err(|e| err(&e))?
        .label("fp16")
        .legend(|(x, y)| Cross::new((x + 10, y), 5, CYAN.stroke_width(3)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    eprintln!("wrote {}", args.png.display());
    Ok(())
}
