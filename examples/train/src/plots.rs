//! The run's pictures: `loss.png` (training and validation loss per step) and one
//! attention heatmap per layer, every head a labelled grid with tokens on the axes.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use plotters::prelude::*;

use crate::config::TrainConfig;
use crate::data::Split;
use crate::model::ModelKind;
use crate::run_dir::{RunDir, load_model};
use plotters::style::FontStyle;

const FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");
const FAMILY: &str = "sans-serif";

/// Registers the bundled font once: plotters draws text only with a registered font.
pub fn register_font() -> anyhow::Result<()> {
    plotters::style::register_font(FAMILY, FontStyle::Normal, FONT)
        .map_err(|_| anyhow::anyhow!("the bundled font could not be loaded"))
}

fn err<E: std::fmt::Debug>(what: &Path) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("cannot draw {}: {e:?}", what.display())
}

/// Training loss per step (a point per step) and validation loss per epoch (at the
/// epoch's last step).
pub fn loss_curve(
    path: &Path,
    train: &[Vec<f64>],
    valid: &[Vec<f64>],
    title: &str,
) -> anyhow::Result<()> {
    let steps_per_epoch = train.first().map(Vec::len).unwrap_or(1).max(1);
    let train_points: Vec<(f64, f64)> = train
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, &l)| ((i + 1) as f64, l))
        .collect();
    let valid_points: Vec<(f64, f64)> = valid
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_empty())
        .map(|(e, v)| {
            (
                ((e + 1) * steps_per_epoch) as f64,
                v.iter().sum::<f64>() / v.len() as f64,
            )
        })
        .collect();
    let max_step = train_points.len().max(1) as f64;
    let max_loss = train_points
        .iter()
        .chain(&valid_points)
        .map(|p| p.1)
        .fold(0.1, f64::max)
        * 1.05;

    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err(path))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FAMILY, 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_step, 0.0..max_loss)
        .map_err(err(path))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("cross-entropy loss")
        .label_style((FAMILY, 15))
        .axis_desc_style((FAMILY, 17))
        .draw()
        .map_err(err(path))?;
    chart
        .draw_series(LineSeries::new(train_points, BLUE.stroke_width(2)))
        .map_err(err(path))?
        .label("training")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(valid_points.clone(), RED.stroke_width(2)))
        .map_err(err(path))?
        .label("validation (held-out)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart
        .draw_series(
            valid_points
                .iter()
                .map(|&p| Circle::new(p, 4, RED.filled())),
        )
        .map_err(err(path))?;
    chart
        .configure_series_labels()
        .label_font((FAMILY, 16))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err(path))?;
    root.present().map_err(err(path))?;
    Ok(())
}

/// White (0) to dark blue (1).
fn colour(w: f32) -> RGBColor {
    let w = w.clamp(0.0, 1.0);
    let lerp = |a: f32, b: f32| (a + (b - a) * w) as u8;
    RGBColor(lerp(255.0, 8.0), lerp(255.0, 48.0), lerp(255.0, 107.0))
}

/// One PNG for a layer: a grid per head (`weights[h][row][col]`), row tokens on the
/// left, column tokens below, a title per head and a colour scale.
pub fn heatmap(
    path: &Path,
    title: &str,
    weights: &[Vec<Vec<f32>>],
    rows: &[String],
    cols: &[String],
) -> anyhow::Result<()> {
    let heads = weights.len();
    let per_row = heads.min(4);
    let grid_rows = heads.div_ceil(per_row);
    let cell = 22u32.min(520 / cols.len().max(1) as u32).max(10);
    let panel_w = 60 + cell * cols.len() as u32 + 20;
    let panel_h = 50 + cell * rows.len() as u32 + 40;
    let width = panel_w * per_row as u32 + 110;
    let height = panel_h * grid_rows as u32 + 60;
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err(path))?;
    let (main, scale) = root.split_horizontally(width - 110);
    let main = main.titled(title, (FAMILY, 22)).map_err(err(path))?;
    let panels = main.split_evenly((grid_rows, per_row));
    let font = (FAMILY, (cell as f64 * 0.7).clamp(9.0, 15.0) as i32);
    for (h, panel) in panels.iter().enumerate().take(heads) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("head {h}"), (FAMILY, 17))
            .margin(5)
            .x_label_area_size(cell.max(18))
            .y_label_area_size(cell.max(18))
            .build_cartesian_2d(0..cols.len(), 0..rows.len())
            .map_err(err(path))?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(cols.len())
            .y_labels(rows.len())
            .x_label_formatter(&|&i| cols.get(i).cloned().unwrap_or_default())
            .y_label_formatter(&|&i| {
                rows.len()
                    .checked_sub(i + 1)
                    .and_then(|r| rows.get(r))
                    .cloned()
                    .unwrap_or_default()
            })
            .x_label_offset(cell as i32 / 2)
            .y_label_offset(-(cell as i32) / 2)
            .label_style(font)
            .draw()
            .map_err(err(path))?;
        let n_rows = rows.len();
        chart
            .draw_series(weights[h].iter().enumerate().flat_map(|(r, row)| {
                row.iter().enumerate().map(move |(c, &w)| {
                    // Row 0 at the top.
                    let y = n_rows - 1 - r;
                    Rectangle::new([(c, y), (c + 1, y + 1)], colour(w).filled())
                })
            }))
            .map_err(err(path))?;
    }
    // Colour scale: 0 at the bottom, 1 at the top.
    let mut bar = ChartBuilder::on(&scale)
        .margin_top(50)
        .margin_bottom(40)
        .margin_right(10)
        .y_label_area_size(45)
        .caption("weight", (FAMILY, 15))
        .build_cartesian_2d(0.0..1.0, 0.0..1.0)
        .map_err(err(path))?;
    bar.configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_labels(6)
        .label_style((FAMILY, 13))
        .draw()
        .map_err(err(path))?;
    bar.draw_series((0..100).map(|i| {
        let lo = i as f64 / 100.0;
        Rectangle::new(
            [(0.0, lo), (1.0, lo + 0.01)],
            colour(lo as f32 + 0.005).filled(),
        )
    }))
    .map_err(err(path))?;
    root.present().map_err(err(path))?;
    Ok(())
}

/// The heatmaps of the first held-out example, one PNG per layer, from the run's model:
/// self-attention for the decoder-only model, the decoder's cross-attention for the
/// encoder-decoder.
pub fn attention_heatmaps(
    config: &TrainConfig,
    run: &RunDir,
    device: &Device,
) -> anyhow::Result<Vec<PathBuf>> {
    let model = load_model(config, &run.model(), device)?;
    let ex = config.task.example(config.seed, Split::Valid, 0);
    let (layers, rows, cols) = model.attention_maps(&ex.input, &ex.output, device);
    let label = |ts: &[usize]| {
        ts.iter()
            .map(|&t| config.task.token_label(t))
            .collect::<Vec<_>>()
    };
    let (rows, cols) = (label(&rows), label(&cols));
    let what = match config.model.kind {
        ModelKind::DecoderOnly => "self-attention",
        ModelKind::EncoderDecoder => "decoder cross-attention",
    };
    let mut paths = Vec::new();
    for (i, w) in layers.into_iter().enumerate() {
        let [heads, r, c] = w.dims();
        let values = w
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let grid: Vec<Vec<Vec<f32>>> = (0..heads)
            .map(|h| {
                (0..r)
                    .map(|y| values[(h * r + y) * c..(h * r + y + 1) * c].to_vec())
                    .collect()
            })
            .collect();
        let path = run.heatmap(i);
        let title = format!(
            "layer {i} {what}: {} of {}",
            config.task.task.name(),
            config.task.format_output(&ex.input)
        );
        heatmap(&path, &title, &grid, &rows, &cols)?;
        paths.push(path);
    }
    Ok(paths)
}
