//! Heatmaps of attention weights (feature `plot`): one head, or a grid of every head of a
//! layer, with the query tokens down the left, the key tokens along the bottom, a title
//! per head and a colour bar, to PNG or SVG.
//!
//! ```no_run
//! # use mha::analysis::maps::AttentionMap;
//! # fn demo(weights: burn::tensor::Tensor<3>) -> Result<(), mha::analysis::maps::MapError> {
//! let tokens: Vec<String> = "the cat sat".split(' ').map(String::from).collect();
//! // weights: [H, Tq, Tk] of one layer and one batch row
//! let map = AttentionMap::layer(weights, &tokens, &tokens).titled("layer 0");
//! map.save("layer0.png")?;
//! map.save("layer0.svg")?;
//! # Ok(()) }
//! ```

use core::fmt;
use std::path::Path;

use burn::tensor::Tensor;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

const FONT: &[u8] = include_bytes!("../../assets/DejaVuSansMono.ttf");

/// The font family the maps draw with, registered by [`register_font`].
pub const FONT_FAMILY: &str = "sans-serif";

/// Registers the bundled font (DejaVu Sans Mono) as plotters' `sans-serif`: plotters draws
/// text only with a registered font. The maps call it themselves; call it before drawing
/// charts of your own with plotters' `ab_glyph` text.
///
/// # Errors
/// If the bundled font cannot be read (it can: it is tested).
pub fn register_font() -> Result<(), MapError> {
    plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT)
        .map_err(|_| MapError::Draw("the bundled font could not be loaded".into()))
}

/// Why a map could not be drawn or written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapError {
    /// The file's extension is neither `png` nor `svg`.
    Format(String),
    /// Drawing or writing failed.
    Draw(String),
    /// The picture is larger than the drawing can be: a side past `i32::MAX` pixels, or a
    /// bitmap (PNG, [`AttentionMap::to_rgb`]) of more than `i32::MAX` pixels in all.
    TooLarge {
        /// The picture's width in pixels.
        width: u64,
        /// Its height.
        height: u64,
        /// Whether it was to be a bitmap.
        bitmap: bool,
    },
}

impl fmt::Display for MapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MapError::Format(path) => write!(
                f,
                "attention map: cannot tell the format of {path}: name it .png or .svg"
            ),
            MapError::Draw(message) => {
                write!(f, "attention map: {message}")
            }
            MapError::TooLarge {
                width,
                height,
                bitmap,
            } => {
                let limit = match bitmap {
                    true => "a bitmap holds 2147483647 pixels (PNG, to_rgb); save it as .svg",
                    false => "a side holds 2147483647 pixels",
                };
                write!(
                    f,
                    "attention map: {width} x {height} pixels is too large: {limit}, or draw \
                     fewer tokens or heads"
                )
            }
        }
    }
}

impl std::error::Error for MapError {}

/// The weights of one head or of every head of a layer, with their labels, ready to
/// draw.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionMap {
    title: String,
    /// One `[rows][cols]` grid per head, with its caption.
    heads: Vec<(String, Vec<Vec<f32>>)>,
    rows: Vec<String>,
    cols: Vec<String>,
}

impl AttentionMap {
    /// One head's weights `[Tq, Tk]`, with a label per query (`rows`) and key (`cols`).
    ///
    /// # Panics
    /// If the labels do not match the weights' shape.
    pub fn head(weights: Tensor<2>, rows: &[String], cols: &[String]) -> Self {
        Self::layer(weights.unsqueeze_dim(0), rows, cols)
    }

    /// Every head of a layer, `[H, Tq, Tk]` (one batch row of a forward's weights), drawn
    /// as a grid of heads.
    ///
    /// # Panics
    /// If the labels do not match the weights' shape.
    pub fn layer(weights: Tensor<3>, rows: &[String], cols: &[String]) -> Self {
        let [heads, r, c] = weights.dims();
        assert!(
            r == rows.len() && c == cols.len(),
            "AttentionMap: weights [H, Tq, Tk] = [{heads}, {r}, {c}] with {} row and {} column \
             labels",
            rows.len(),
            cols.len()
        );
        let values: Vec<f32> = weights
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("a float tensor converts to f32");
        let grids = (0..heads)
            .map(|h| {
                let grid = (0..r)
                    .map(|y| values[(h * r + y) * c..(h * r + y + 1) * c].to_vec())
                    .collect();
                (format!("head {h}"), grid)
            })
            .collect();
        Self {
            title: String::new(),
            heads: grids,
            rows: rows.to_vec(),
            cols: cols.to_vec(),
        }
    }

    /// The same map under `title`.
    pub fn titled(mut self, title: impl Into<String>) -> Self {
        self.title = title.into();
        self
    }

    /// The same map with these captions for its heads (`"head 0"`, ... by default).
    ///
    /// # Panics
    /// If there is not one caption per head.
    pub fn captions(mut self, captions: &[String]) -> Self {
        assert_eq!(
            captions.len(),
            self.heads.len(),
            "AttentionMap::captions: {} captions for {} heads",
            captions.len(),
            self.heads.len()
        );
        for ((caption, _), new) in self.heads.iter_mut().zip(captions) {
            caption.clone_from(new);
        }
        self
    }

    /// The picture's size in pixels, `(width, height)`.
    pub fn size(&self) -> (u64, u64) {
        self.layout().size
    }

    /// The size, as the drawing takes it, when it can be drawn: each side in `i32` (the
    /// drawing's coordinates), a `bitmap`'s pixels too (its buffer's offsets).
    fn drawable(&self, bitmap: bool) -> Result<(u32, u32), MapError> {
        let (width, height) = self.size();
        let most = i32::MAX as u64;
        let fits = width <= most && height <= most && (!bitmap || width * height <= most);
        match fits {
            true => Ok((width as u32, height as u32)),
            false => Err(MapError::TooLarge {
                width,
                height,
                bitmap,
            }),
        }
    }

    /// Writes the map to `path`, as PNG or SVG after its extension.
    ///
    /// # Errors
    /// [`MapError::Format`] for another extension, [`MapError::TooLarge`] for a picture
    /// larger than the format can be (checked before anything is written),
    /// [`MapError::Draw`] when drawing or writing fails.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), MapError> {
        let path = path.as_ref();
        let extension = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        // Drawn under a temporary name beside the file (its extension kept: it says the
        // format), then renamed: a crash leaves the old file or none, never half a map.
        let stem = path.file_stem().unwrap_or_default().to_string_lossy();
        let ext = path.extension().unwrap_or_default().to_string_lossy();
        let drawn = path.with_file_name(format!("{stem}.partial.{ext}"));
        let result = match extension.as_deref() {
            Some("png") => {
                let size = self.drawable(true)?;
                self.draw(BitMapBackend::new(&drawn, size).into_drawing_area())
            }
            Some("svg") => {
                let size = self.drawable(false)?;
                self.draw(SVGBackend::new(&drawn, size).into_drawing_area())
            }
            _ => return Err(MapError::Format(path.display().to_string())),
        };
        result
            .and_then(|()| {
                std::fs::rename(&drawn, path)
                    .map_err(|e| MapError::Draw(format!("cannot write {}: {e}", path.display())))
            })
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&drawn);
            })
    }

    /// The map as SVG text.
    ///
    /// # Errors
    /// [`MapError::TooLarge`] for a side past `i32::MAX` pixels, [`MapError::Draw`] when
    /// drawing fails.
    pub fn to_svg(&self) -> Result<String, MapError> {
        let size = self.drawable(false)?;
        let mut svg = String::new();
        self.draw(SVGBackend::with_string(&mut svg, size).into_drawing_area())?;
        Ok(svg)
    }

    /// The map's pixels, RGB row by row, `3 · width · height` bytes (see
    /// [`size`](Self::size)).
    ///
    /// # Errors
    /// [`MapError::TooLarge`] for more than `i32::MAX` pixels (checked before the buffer is
    /// allocated), [`MapError::Draw`] when drawing fails.
    pub fn to_rgb(&self) -> Result<Vec<u8>, MapError> {
        let (w, h) = self.drawable(true)?;
        let mut pixels = vec![0u8; 3 * w as usize * h as usize];
        self.draw(BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area())?;
        Ok(pixels)
    }

    fn layout(&self) -> Layout {
        let heads = self.heads.len().max(1);
        let per_row = heads.min(4);
        let grid_rows = heads.div_ceil(per_row);
        // In u64: a picture too large to draw is measured, then refused (`drawable`).
        let cell = (520 / self.cols.len().max(1) as u64).clamp(10, 22);
        let panel_w = 60 + cell * self.cols.len() as u64 + 20;
        let panel_h = 50 + cell * self.rows.len() as u64 + 40;
        let title = if self.title.is_empty() { 10 } else { 50 };
        Layout {
            size: (
                panel_w * per_row as u64 + BAR_WIDTH,
                panel_h * grid_rows as u64 + title,
            ),
            per_row,
            grid_rows,
            cell,
        }
    }

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<(), MapError> {
        register_font()?;
        let layout = self.layout();
        let (rows, cols) = (&self.rows, &self.cols);
        root.fill(&WHITE).map_err(draw)?;
        let (main, scale) = root.split_horizontally((layout.size.0 - BAR_WIDTH) as u32);
        let main = match self.title.is_empty() {
            true => main.margin(10, 0, 0, 0),
            false => main.titled(&self.title, (FONT_FAMILY, 22)).map_err(draw)?,
        };
        let panels = main.split_evenly((layout.grid_rows, layout.per_row));
        let cell = layout.cell;
        let font = (FONT_FAMILY, (cell as f64 * 0.7).clamp(9.0, 15.0) as i32);
        for ((caption, grid), panel) in self.heads.iter().zip(&panels) {
            let mut chart = ChartBuilder::on(panel)
                .caption(caption, (FONT_FAMILY, 17))
                .margin(5)
                .x_label_area_size(cell.max(18) as u32)
                .y_label_area_size(cell.max(18) as u32)
                .build_cartesian_2d(0..cols.len(), 0..rows.len())
                .map_err(draw)?;
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
                .map_err(draw)?;
            let n_rows = rows.len();
            chart
                .draw_series(grid.iter().enumerate().flat_map(|(r, row)| {
                    row.iter().enumerate().map(move |(c, &w)| {
                        // Row 0 at the top.
                        let y = n_rows - 1 - r;
                        Rectangle::new([(c, y), (c + 1, y + 1)], colour(w).filled())
                    })
                }))
                .map_err(draw)?;
        }
        // The colour bar: 0 at the bottom, 1 at the top.
        let mut bar = ChartBuilder::on(&scale)
            .margin_top(50)
            .margin_bottom(40)
            .margin_right(10)
            .y_label_area_size(45)
            .caption("weight", (FONT_FAMILY, 15))
            .build_cartesian_2d(0.0..1.0, 0.0..1.0)
            .map_err(draw)?;
        bar.configure_mesh()
            .disable_mesh()
            .disable_x_axis()
            .y_labels(6)
            .label_style((FONT_FAMILY, 13))
            .draw()
            .map_err(draw)?;
        bar.draw_series((0..100).map(|i| {
            let lo = i as f64 / 100.0;
            Rectangle::new(
                [(0.0, lo), (1.0, lo + 0.01)],
                colour(lo as f32 + 0.005).filled(),
            )
        }))
        .map_err(draw)?;
        root.present().map_err(draw)?;
        Ok(())
    }
}

/// The width of the colour bar's column, in pixels.
const BAR_WIDTH: u64 = 110;

struct Layout {
    size: (u64, u64),
    per_row: usize,
    grid_rows: usize,
    cell: u64,
}

fn draw<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> MapError {
    MapError::Draw(format!("{e:?}"))
}

/// White (0) to dark blue (1).
fn colour(w: f32) -> RGBColor {
    let w = w.clamp(0.0, 1.0);
    let lerp = |a: f32, b: f32| (a + (b - a) * w) as u8;
    RGBColor(lerp(255.0, 8.0), lerp(255.0, 48.0), lerp(255.0, 107.0))
}
