//! The run's pictures: `loss.png` (training and validation loss per step) and one
//! attention heatmap per layer (mha's [`AttentionMap`]), every head a labelled grid with
//! tokens on the axes.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use mha::analysis::maps::{self, AttentionMap, FONT_FAMILY};
use plotters::prelude::*;

use crate::config::TrainConfig;
use crate::model::ModelKind;
use crate::run_dir::{RunDir, load_model};
use crate::tasks::Split;

const FAMILY: &str = FONT_FAMILY;

/// Registers the font mha's maps bundle: plotters draws text only with a registered font.
pub fn register_font() -> anyhow::Result<()> {
    Ok(maps::register_font()?)
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
        let path = run.heatmap(i);
        let title = format!(
            "layer {i} {what}: {} of {}",
            config.task.task.name(),
            config.task.format_output(&ex.input)
        );
        AttentionMap::layer(w, &rows, &cols)
            .titled(title)
            .save(&path)?;
        paths.push(path);
    }
    Ok(paths)
}
