//! The pictures: a run's `loss.png` (training and validation loss per step), and the
//! attention maps (mha's [`AttentionMap`]: every head a labelled grid with tokens on the
//! axes) of a finished run and of `inspect`, all drawn by [`attention_maps`].

use anyhow::Context;
use std::path::{Path, PathBuf};

use burn::tensor::Device;
use burn::train::metric::store::Split as MetricSplit;
use mha::analysis::maps::{self, AttentionMap, FONT_FAMILY};
use plotters::prelude::*;

use crate::config::TrainConfig;
use crate::model::inspect::LayerWeights;
use crate::run_dir::{RunDir, load_model};
use crate::tasks::{Split, TaskConfig};
use crate::training;

const FAMILY: &str = FONT_FAMILY;

/// Registers the font mha's maps bundle: plotters draws text only with a registered font.
pub fn register_font() -> anyhow::Result<()> {
    Ok(maps::register_font()?)
}

fn err<E: std::fmt::Debug>(what: &Path) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("cannot draw {}: {e:?}", what.display())
}

/// A finished run's pictures, as its kind draws them: its loss curve, from the learner's
/// logs, and (synthetic tasks) its attention heatmaps; returns the heatmaps' files.
pub fn draw_run(
    config: &TrainConfig,
    run: &RunDir,
    device: &Device,
) -> anyhow::Result<Vec<PathBuf>> {
    register_font()?;
    config.kind().draw(config, run, device)
}

/// Each epoch's per-step losses of `split`, as the learner logged them (on several
/// devices, the mean of each step's shares).
pub fn losses(config: &TrainConfig, run: &RunDir, split: &MetricSplit) -> Vec<Vec<f64>> {
    let devices = match split {
        MetricSplit::Train => config.devices.count(),
        _ => 1,
    };
    training::epoch_losses(&run.0, config.epochs, split, devices)
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
    // Steps on an integer axis: whole ticks, labelled `100`, not `100.0`.
    let train_points: Vec<(usize, f64)> = train
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, &l)| (i + 1, l))
        .collect();
    let valid_points: Vec<(usize, f64)> = valid
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_empty())
        .map(|(e, v)| {
            (
                (e + 1) * steps_per_epoch,
                v.iter().sum::<f64>() / v.len() as f64,
            )
        })
        .collect();
    let max_step = train_points.len().max(1);
    // A loss that is not finite (an f16 validation that overflowed) has no place on the
    // axis (an infinite one made plotters' ticks loop for ever): left out.
    let train_points: Vec<(usize, f64)> = train_points
        .into_iter()
        .filter(|p| p.1.is_finite())
        .collect();
    let valid_points: Vec<(usize, f64)> = valid_points
        .into_iter()
        .filter(|p| p.1.is_finite())
        .collect();
    let max_loss = train_points
        .iter()
        .chain(&valid_points)
        .map(|p| p.1)
        .fold(0.1, f64::max)
        * 1.05;

    // Drawn under a temporary name (`loss.partial.png`: the extension says the format),
    // then renamed.
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let drawn = path.with_file_name(format!("{stem}.partial.png"));
    let root = BitMapBackend::new(&drawn, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err(path))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FAMILY, 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0..max_step, 0.0..max_loss)
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
    drop(chart);
    drop(root);
    std::fs::rename(&drawn, path).with_context(|| format!("cannot write {}", path.display()))
}

/// The heatmaps of the first held-out example, one PNG per layer, from the run's model
/// ([`Model::attention_maps`](crate::model::Model::attention_maps)): self-attention for
/// the decoder-only model, the decoder's cross-attention for the encoder-decoder.
pub fn attention_heatmaps(
    config: &TrainConfig,
    run: &RunDir,
    device: &Device,
) -> anyhow::Result<Vec<PathBuf>> {
    let model = load_model(config, &run.model(), device)?;
    let ex = config.task.example(config.seed, Split::Valid, 0);
    let layers = model.attention_maps(&ex.input, &ex.output, device);
    attention_maps(&config.task, &ex.input, layers, |i| vec![run.heatmap(i)])
}

/// Draws the map of each of `layers` (every head a labelled grid, the tokens of `task` on
/// the axes), titled `<layer>: <task> of <input>`, into the files `paths(i)` of layer `i`
/// (PNG or SVG by their extension); returns every file.
pub fn attention_maps(
    task: &TaskConfig,
    input: &[usize],
    layers: Vec<LayerWeights>,
    paths: impl Fn(usize) -> Vec<PathBuf>,
) -> anyhow::Result<Vec<PathBuf>> {
    let label = |ts: &[usize]| -> Vec<String> { ts.iter().map(|&t| task.token_label(t)).collect() };
    let mut written = Vec::new();
    for (i, layer) in layers.into_iter().enumerate() {
        let title = format!(
            "{}: {} of {}",
            layer.name,
            task.task.name(),
            task.format_output(input)
        );
        let map = AttentionMap::layer(layer.weights, &label(&layer.rows), &label(&layer.cols))
            .titled(title);
        for path in paths(i) {
            map.save(&path)?;
            written.push(path);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_loss_that_is_not_finite_is_left_out_of_the_curve() {
        super::register_font().unwrap();
        let dir = std::env::temp_dir().join(format!("mha-loss-curve-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.png");
        let train = [vec![2.0, 1.5], vec![f64::NAN, 1.0]];
        let valid = [vec![1.8], vec![f64::INFINITY]];
        super::loss_curve(&path, &train, &valid, "a loss that overflowed").unwrap();
        let drawn = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(drawn > 1000, "loss.png of {drawn} bytes");
    }
}
