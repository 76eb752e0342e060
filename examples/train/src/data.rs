//! Synthetic sequence tasks, generated on the fly from a seed: copy, reverse, sort and
//! multi-digit addition. Every example is a function of (seed, index), and a hash of the
//! input decides its split, so the held-out examples never appear in training.

use burn::config::Config;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Padding: ignored by the loss and the metrics.
pub const PAD: usize = 0;
/// Separates the input from the output (and starts the decoder's input).
pub const SEP: usize = 1;
/// Ends the output.
pub const EOS: usize = 2;
/// The first symbol's token; symbol `s` is token `FIRST + s`.
pub const FIRST: usize = 3;

/// A synthetic task.
#[derive(Config, Debug, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Task {
    /// The output is the input.
    Copy,
    /// The output is the input reversed.
    Reverse,
    /// The output is the input sorted.
    Sort,
    /// The input is `a + b` with `len` decimal digits each, the output is the sum's digits.
    Add,
}

/// What the examples look like.
#[derive(Config, Debug)]
pub struct TaskConfig {
    /// The task.
    #[config(default = "Task::Reverse")]
    pub task: Task,
    /// Shortest input (digits per operand for `add`).
    #[config(default = 8)]
    pub min_len: usize,
    /// Longest input (digits per operand for `add`).
    #[config(default = 16)]
    pub max_len: usize,
    /// Number of symbols (at least 10 for `add`, whose symbols are digits and `+`).
    #[config(default = 10)]
    pub n_symbols: usize,
}

impl TaskConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.min_len >= 1, "task.min_len must be at least 1, got 0");
        anyhow::ensure!(
            self.min_len <= self.max_len,
            "task.min_len = {} exceeds task.max_len = {}",
            self.min_len,
            self.max_len
        );
        anyhow::ensure!(
            self.n_symbols >= 2,
            "task.n_symbols must be at least 2, got {}",
            self.n_symbols
        );
        if self.task == Task::Add {
            anyhow::ensure!(
                self.n_symbols >= 10,
                "task.n_symbols must be at least 10 for add, got {}",
                self.n_symbols
            );
        }
        Ok(())
    }

    /// Tokens in the vocabulary: PAD, SEP, EOS, the symbols (and `+` for `add`).
    pub fn vocab_size(&self) -> usize {
        FIRST + self.n_symbols + usize::from(self.task == Task::Add)
    }

    /// Longest input, in tokens.
    pub fn max_input(&self) -> usize {
        match self.task {
            Task::Add => 2 * self.max_len + 1,
            _ => self.max_len,
        }
    }

    /// Longest output, in tokens, EOS excluded.
    pub fn max_output(&self) -> usize {
        match self.task {
            Task::Add => self.max_len + 1,
            _ => self.max_len,
        }
    }

    /// Example `index` of `split` under `seed`.
    pub fn example(&self, seed: u64, split: Split, index: usize) -> Example {
        let mut rng = Rng::new(seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        loop {
            let example = self.draw(&mut rng);
            if Split::of(&example.input) == split {
                return example;
            }
        }
    }

    fn draw(&self, rng: &mut Rng) -> Example {
        let len = rng.range(self.min_len, self.max_len);
        let sym = |s: usize| FIRST + s;
        let (input, output) = match self.task {
            Task::Add => {
                let a: Vec<usize> = (0..len).map(|_| rng.below(10)).collect();
                let b: Vec<usize> = (0..len).map(|_| rng.below(10)).collect();
                let sum = add_digits(&a, &b);
                let plus = FIRST + self.n_symbols;
                let input = a
                    .iter()
                    .map(|&d| sym(d))
                    .chain([plus])
                    .chain(b.iter().map(|&d| sym(d)));
                (input.collect(), sum.into_iter().map(sym).collect())
            }
            task => {
                let input: Vec<usize> = (0..len).map(|_| sym(rng.below(self.n_symbols))).collect();
                let mut output = input.clone();
                match task {
                    Task::Reverse => output.reverse(),
                    Task::Sort => output.sort_unstable(),
                    _ => {}
                }
                (input, output)
            }
        };
        Example { input, output }
    }

    /// A token as text: symbols as digits or letters, `+`, and the special tokens.
    pub fn token_label(&self, token: usize) -> String {
        match token {
            PAD => "·".into(),
            SEP => "|".into(),
            EOS => "$".into(),
            t if self.task == Task::Add && t == FIRST + self.n_symbols => "+".into(),
            t => {
                let s = t - FIRST;
                const ALPHABET: &[u8] =
                    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
                match ALPHABET.get(s) {
                    Some(&c) => (c as char).to_string(),
                    None => format!("<{s}>"),
                }
            }
        }
    }

    /// Parses an input written with [`token_label`](Self::token_label)'s symbols, e.g.
    /// `"3 1 4 1 5"` or `"31415"`.
    pub fn parse(&self, text: &str) -> anyhow::Result<Vec<usize>> {
        let vocab: Vec<(String, usize)> = (FIRST..self.vocab_size())
            .map(|t| (self.token_label(t), t))
            .collect();
        text.chars()
            .filter(|c| !c.is_whitespace())
            .map(|c| {
                vocab
                    .iter()
                    .find(|(label, _)| label.chars().eq([c]))
                    .map(|&(_, t)| t)
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "input symbol {c:?} is not in the vocabulary of task {:?}",
                            self.task
                        )
                    })
            })
            .collect()
    }
}

/// Decimal addition, most significant digit first; the result has `len + 1` digits.
fn add_digits(a: &[usize], b: &[usize]) -> Vec<usize> {
    let mut out = vec![0; a.len() + 1];
    let mut carry = 0;
    for i in (0..a.len()).rev() {
        let s = a[i] + b[i] + carry;
        out[i + 1] = s % 10;
        carry = s / 10;
    }
    out[0] = carry;
    out
}

/// Training or held-out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Nine inputs in ten.
    Train,
    /// One input in ten, never trained on.
    Valid,
}

impl Split {
    /// The split an input belongs to: a hash of its tokens.
    fn of(input: &[usize]) -> Split {
        let hash = input.iter().fold(0xCBF2_9CE4_8422_2325u64, |h, &t| {
            (h ^ t as u64).wrapping_mul(0x100_0000_01B3)
        });
        if hash % 10 == 0 {
            Split::Valid
        } else {
            Split::Train
        }
    }
}

/// One example: input and output tokens (no SEP, no EOS).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    /// Input tokens.
    pub input: Vec<usize>,
    /// Output tokens.
    pub output: Vec<usize>,
}

/// `len` examples of one split, generated when asked for.
pub struct TaskDataset {
    task: TaskConfig,
    seed: u64,
    split: Split,
    len: usize,
}

impl TaskDataset {
    /// `len` examples of `split`.
    pub fn new(task: TaskConfig, seed: u64, split: Split, len: usize) -> Self {
        Self {
            task,
            seed,
            split,
            len,
        }
    }
}

impl Dataset<Example> for TaskDataset {
    fn get(&self, index: usize) -> Result<Example, DatasetError> {
        Ok(self.task.example(self.seed, self.split, index))
    }

    fn len(&self) -> usize {
        self.len
    }
}

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

/// Pads and stacks examples: to the longest of the batch, or to a [`FixedShape`].
#[derive(Clone, Debug, Default)]
pub struct SeqBatcher {
    /// Pads every batch to these widths when set.
    pub fixed: Option<FixedShape>,
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
        SeqBatch {
            joined: padded(&joined, width(FixedShape::joined), device),
            joined_targets: padded(&joined_targets, width(FixedShape::joined), device),
            source: padded(&sources, width(|s| s.input), device),
            source_lengths: sources.iter().map(Vec::len).collect(),
            decoder_input: padded(&decoder_input, width(|s| s.output + 1), device),
            decoder_targets: padded(&decoder_targets, width(|s| s.output + 1), device),
        }
    }
}

/// SplitMix64: small, seedable, the same on every platform.
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_compute_what_they_say() {
        let cfg = TaskConfig::new()
            .with_task(Task::Add)
            .with_min_len(3)
            .with_max_len(3);
        assert_eq!(add_digits(&[9, 9, 9], &[0, 0, 1]), vec![1, 0, 0, 0]);
        let ex = cfg.example(1, Split::Train, 0);
        assert_eq!(ex.input.len(), 7);
        assert_eq!(ex.output.len(), 4);
        let rev = TaskConfig::new().example(1, Split::Valid, 3);
        assert_eq!(
            rev.output,
            rev.input.iter().rev().copied().collect::<Vec<_>>()
        );
    }

    #[test]
    fn splits_are_disjoint_and_repeatable() {
        let cfg = TaskConfig::new()
            .with_min_len(2)
            .with_max_len(3)
            .with_n_symbols(4);
        let train: std::collections::HashSet<_> = (0..2000)
            .map(|i| cfg.example(7, Split::Train, i).input)
            .collect();
        let valid: Vec<_> = (0..200)
            .map(|i| cfg.example(7, Split::Valid, i).input)
            .collect();
        assert!(valid.iter().all(|v| !train.contains(v)));
        assert_eq!(
            cfg.example(7, Split::Valid, 5),
            cfg.example(7, Split::Valid, 5)
        );
    }
}
