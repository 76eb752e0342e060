//! Batches: examples padded and stacked into the tensors both model kinds read
//! ([`SeqBatch`]), padded to the longest of the batch or to one fixed shape (GPU backends
//! compile kernels per shape), or for the decoder-only model packed several sequences to
//! a row (less padding on inputs of mixed lengths).

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::precision::Mixed;
use crate::tasks::{EOS, Example, PAD, SEP, Split, TaskConfig};

/// A batch, laid out for both model kinds.
#[derive(Clone, Debug)]
pub struct SeqBatch {
    /// Decoder-only: `input SEP output EOS`, right-padded, `[B, T]`.
    pub joined: Tensor<2, Int>,
    /// Decoder-only targets: the next token on output positions, PAD elsewhere, `[B, T]`.
    pub joined_targets: Tensor<2, Int>,
    /// Encoder-decoder: the inputs, right-padded, `[B, S]`.
    pub source: Tensor<2, Int>,
    /// Number of real tokens of each input.
    pub source_lengths: Vec<usize>,
    /// Encoder-decoder: `SEP output`, right-padded, `[B, U]`.
    pub decoder_input: Tensor<2, Int>,
    /// Encoder-decoder targets: `output EOS`, PAD-padded, `[B, U]`.
    pub decoder_targets: Tensor<2, Int>,
    /// Decoder-only, packed ([`SeqBatcher::pack`]): where the sequences of each row of
    /// `joined` start and end, and each token's position in its sequence.
    pub packed: Option<Packed>,
    /// How the step computes when not in f32 ([`SeqBatcher::mixed`]).
    pub mixed: Option<Mixed>,
    /// The target the loss leaves out: PAD for the synthetic tasks; none for the text
    /// task, whose every position predicts a character.
    pub ignore: Option<usize>,
    /// What the step's gradients weigh the loss by: 1, or on several devices each
    /// device's share of the step (1/N), so that the gradients Burn sums are the mean's.
    pub loss_weight: f32,
}

/// Several sequences per row: `joined` row `r` holds sequences
/// `cu_seqlens[r][s]..cu_seqlens[r][s + 1]` (FlashAttention's varlen convention), then
/// padding.
#[derive(Clone, Debug)]
pub struct Packed {
    /// Cumulative lengths per row, from 0.
    pub cu_seqlens: Vec<Vec<usize>>,
    /// Each token's position in its own sequence, `[rows][width]` (0 on padding).
    pub positions: Vec<Vec<usize>>,
}

/// The share of padding in the decoder-only batches of `task`'s first `batches` training
/// batches of `batch_size`: `[padded to the longest of each batch, packed into rows of
/// width]` (what `--pack` saves).
pub fn padding_shares(
    task: &TaskConfig,
    seed: u64,
    batch_size: usize,
    width: usize,
    batches: usize,
) -> [f64; 2] {
    let (mut tokens, mut padded, mut packed) = (0usize, 0usize, 0usize);
    for b in 0..batches {
        let lengths: Vec<usize> = (0..batch_size)
            .map(|i| {
                let ex = task.example(seed, Split::Train, b * batch_size + i);
                ex.input.len() + ex.output.len() + 2
            })
            .collect();
        tokens += lengths.iter().sum::<usize>();
        padded += batch_size * lengths.iter().max().copied().unwrap_or(0);
        packed += first_fit(&lengths, width).len() * width;
    }
    [padded, packed].map(|all| 1.0 - tokens as f64 / all.max(1) as f64)
}

/// Packs `seqs` (each at most `width / 2` long) into rows of `width` tokens, first fit in
/// order: a row takes a sequence while it has room. Every row but the last holds at least
/// two sequences, so there are at most `ceil(seqs / 2)` rows. Returns the rows' sequence
/// indices.
pub fn first_fit(lengths: &[usize], width: usize) -> Vec<Vec<usize>> {
    let mut rows: Vec<(usize, Vec<usize>)> = Vec::new();
    for (i, &len) in lengths.iter().enumerate() {
        match rows.iter_mut().find(|(used, _)| used + len <= width) {
            Some((used, members)) => {
                *used += len;
                members.push(i);
            }
            None => rows.push((len, vec![i])),
        }
    }
    rows.into_iter().map(|(_, members)| members).collect()
}

/// Widths every batch is padded to, so that a GPU backend sees one shape and compiles its
/// kernels once (a new sequence length means new kernels on wgpu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedShape {
    /// Longest input, in tokens (encoder-decoder source width).
    pub input: usize,
    /// Longest output, in tokens, EOS excluded.
    pub output: usize,
}

impl FixedShape {
    /// The shape of `task`'s longest example.
    pub fn of(task: &TaskConfig) -> Self {
        FixedShape {
            input: task.max_input(),
            output: task.max_output(),
        }
    }

    /// Decoder-only width: `input SEP output EOS`.
    pub fn joined(self) -> usize {
        self.input + self.output + 2
    }
}

/// Pads and stacks examples: to the longest of the batch, or to a [`FixedShape`]; or, for
/// the decoder-only model, packs them several to a row.
#[derive(Clone, Debug)]
pub struct SeqBatcher {
    /// Pads every batch to these widths when set.
    pub fixed: Option<FixedShape>,
    /// Packs the decoder-only sequences into rows of this many tokens (twice the longest
    /// sequence: every row but the last holds two or more), with the rows' boundaries in
    /// [`SeqBatch::packed`]. With `fixed`, the batch has `ceil(B / 2)` rows.
    pub pack: Option<usize>,
    /// The dtype (and loss scale) of the steps that read the batches, when not f32.
    pub mixed: Option<Mixed>,
    /// The devices a step's batch is shared among (each of its batches is one device's
    /// share): 1 but on several devices ([`SeqBatch::loss_weight`]).
    pub shares: usize,
}

impl Default for SeqBatcher {
    /// Padded to the longest of each batch, not packed, in f32, on one device.
    fn default() -> Self {
        Self {
            fixed: None,
            pack: None,
            mixed: None,
            shares: 1,
        }
    }
}

/// Right-pads `rows` with PAD to `width` (at least the longest row) and stacks them.
pub fn padded(rows: &[Vec<usize>], width: Option<usize>, device: &Device) -> Tensor<2, Int> {
    let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width = width.unwrap_or(0).max(longest);
    let mut data = Vec::with_capacity(rows.len() * width);
    for row in rows {
        data.extend(row.iter().map(|&t| t as i64));
        data.extend(std::iter::repeat_n(PAD as i64, width - row.len()));
    }
    Tensor::from_data(TensorData::new(data, [rows.len(), width]), device)
}

impl Batcher<Example, SeqBatch> for SeqBatcher {
    fn batch(&self, items: Vec<Example>, device: &Device) -> SeqBatch {
        let mut joined = Vec::new();
        let mut joined_targets = Vec::new();
        let mut decoder_input = Vec::new();
        let mut decoder_targets = Vec::new();
        for ex in &items {
            let out_eos: Vec<usize> = ex.output.iter().copied().chain([EOS]).collect();
            // input SEP output EOS; position i predicts token i + 1 on the output part.
            let seq: Vec<usize> = ex
                .input
                .iter()
                .copied()
                .chain([SEP])
                .chain(out_eos.iter().copied())
                .collect();
            let mut targets = vec![PAD; seq.len()];
            let start = ex.input.len(); // the SEP position predicts the first output token
            targets[start..start + out_eos.len()].copy_from_slice(&out_eos);
            joined.push(seq);
            joined_targets.push(targets);
            decoder_input.push([SEP].into_iter().chain(ex.output.iter().copied()).collect());
            decoder_targets.push(out_eos);
        }
        let sources: Vec<Vec<usize>> = items.iter().map(|e| e.input.clone()).collect();
        let width = |f: fn(FixedShape) -> usize| self.fixed.map(f);
        let mut packed = None;
        if let Some(row_width) = self.pack {
            let lengths: Vec<usize> = joined.iter().map(Vec::len).collect();
            let mut rows = first_fit(&lengths, row_width);
            if self.fixed.is_some() {
                rows.resize(items.len().div_ceil(2).max(rows.len()), Vec::new());
            }
            let concat = |parts: &[Vec<usize>], members: &[usize]| -> Vec<usize> {
                members
                    .iter()
                    .flat_map(|&i| parts[i].iter().copied())
                    .collect()
            };
            let mut cu_seqlens = Vec::with_capacity(rows.len());
            let mut positions = Vec::with_capacity(rows.len());
            for members in &rows {
                let mut cumulative = vec![0];
                let mut at = Vec::with_capacity(row_width);
                for &i in members {
                    cumulative.push(cumulative[cumulative.len() - 1] + lengths[i]);
                    at.extend(0..lengths[i]);
                }
                at.resize(row_width, 0);
                cu_seqlens.push(cumulative);
                positions.push(at);
            }
            joined = rows.iter().map(|m| concat(&joined, m)).collect();
            joined_targets = rows.iter().map(|m| concat(&joined_targets, m)).collect();
            packed = Some(Packed {
                cu_seqlens,
                positions,
            });
        }
        let joined_width = self.pack.or(width(FixedShape::joined));
        SeqBatch {
            packed,
            joined: padded(&joined, joined_width, device),
            joined_targets: padded(&joined_targets, joined_width, device),
            source: padded(&sources, width(|s| s.input), device),
            source_lengths: sources.iter().map(Vec::len).collect(),
            decoder_input: padded(&decoder_input, width(|s| s.output + 1), device),
            decoder_targets: padded(&decoder_targets, width(|s| s.output + 1), device),
            mixed: self.mixed.clone(),
            ignore: Some(PAD),
            loss_weight: 1.0 / self.shares.max(1) as f32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_leaves_less_padding_on_mixed_lengths() {
        let task = TaskConfig::default(); // 18 to 34 tokens
        let [padded, packed] = padding_shares(&task, 42, 64, 68, 10);
        assert!(padded > 0.2 && packed < 0.6 * padded, "{padded} {packed}");
        let same = TaskConfig {
            min_len: 4,
            max_len: 4,
            ..TaskConfig::default()
        };
        assert_eq!(padding_shares(&same, 42, 8, 20, 3), [0.0, 0.0]);
    }

    #[test]
    fn first_fit_fills_rows_in_order() {
        assert_eq!(
            first_fit(&[5, 4, 3, 5, 2], 10),
            vec![vec![0, 1], vec![2, 3, 4]]
        );
        // Sequences of at most half a row: two or more per row but the last.
        let lengths: Vec<usize> = (0..50).map(|i| 1 + (i * 7) % 17).collect();
        let rows = first_fit(&lengths, 34);
        assert!(rows.len() <= 25, "{rows:?}");
        let mut all: Vec<usize> = rows.concat();
        all.sort();
        assert_eq!(all, (0..50).collect::<Vec<_>>());
        assert!(
            rows.iter()
                .all(|r| r.iter().map(|&i| lengths[i]).sum::<usize>() <= 34)
        );
    }
}
