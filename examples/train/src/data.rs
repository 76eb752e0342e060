//! Synthetic sequence tasks, generated on the fly from a seed: copy, reverse, sort and
//! multi-digit addition. Every example is a function of (seed, index), and a hash of the
//! input decides its split, so the held-out examples never appear in training.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::fields::{MAX_LEN, MIN_LEN, N_SYMBOLS};

/// Padding: ignored by the loss and the metrics.
pub const PAD: usize = 0;
/// Separates the input from the output (and starts the decoder's input).
pub const SEP: usize = 1;
/// Ends the output.
pub const EOS: usize = 2;
/// The first symbol's token; symbol `s` is token `FIRST + s`.
pub const FIRST: usize = 3;

/// A synthetic task; spelt in `config.json` as on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
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

impl<'de> Deserialize<'de> for Task {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::fields::by_name(deserializer, "task")
    }
}

impl Task {
    /// Its name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Task::Copy => "copy",
            Task::Reverse => "reverse",
            Task::Sort => "sort",
            Task::Add => "add",
        }
    }
}

/// What the examples look like.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TaskConfig {
    /// The task. Default: reverse.
    pub task: Task,
    /// Shortest input (digits per operand for `add`). Default: 8.
    pub min_len: usize,
    /// Longest input (digits per operand for `add`). Default: 16.
    pub max_len: usize,
    /// Number of symbols (10 for `add`, whose symbols are the digits). Default: 10.
    pub n_symbols: usize,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            task: Task::Reverse,
            min_len: 8,
            max_len: 16,
            n_symbols: 10,
        }
    }
}

/// Inputs up to this many are enumerated to check that both splits have some.
const ENUMERABLE: u128 = 1 << 20;

impl TaskConfig {
    /// Checks the values, and that both splits have inputs; the error names the flag and
    /// the field.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.min_len >= 1,
            "{} must be at least 1, got 0",
            MIN_LEN.name()
        );
        anyhow::ensure!(
            self.min_len <= self.max_len,
            "{} = {} exceeds {} = {}",
            MIN_LEN.name(),
            self.min_len,
            MAX_LEN.name(),
            self.max_len
        );
        anyhow::ensure!(
            self.n_symbols >= 2,
            "{} must be at least 2, got {}",
            N_SYMBOLS.name(),
            self.n_symbols
        );
        anyhow::ensure!(
            self.task != Task::Add || self.n_symbols == 10,
            "{} must be 10 for add, whose symbols are the digits, got {}",
            N_SYMBOLS.name(),
            self.n_symbols
        );
        let [train, valid] = self.split_sizes().unwrap_or([1, 1]);
        anyhow::ensure!(
            train > 0 && valid > 0,
            "inputs of {} to {} symbols out of {} give {} distinct inputs, {} of them held out \
             (about a tenth of the inputs are, chosen by a hash): the {} split would be empty; \
             use more {} or a larger {}",
            self.min_len,
            self.max_len,
            self.n_symbols,
            train + valid,
            valid,
            if valid == 0 { "held-out" } else { "training" },
            N_SYMBOLS.name(),
            MAX_LEN.name(),
        );
        Ok(())
    }

    /// The number of distinct training and held-out inputs, when the task has at most
    /// [`ENUMERABLE`] inputs (a larger one has plenty of both).
    pub fn split_sizes(&self) -> Option<[u128; 2]> {
        let lengths = self.min_len..=self.max_len;
        let per_length = |len: usize| match self.task {
            Task::Add => 10u128.checked_pow(2 * len as u32),
            _ => (self.n_symbols as u128).checked_pow(len as u32),
        };
        let total = lengths
            .clone()
            .try_fold(0u128, |sum, len| sum.checked_add(per_length(len)?))?;
        if total > ENUMERABLE {
            return None;
        }
        let mut sizes = [0u128; 2];
        for len in lengths {
            let digits = match self.task {
                Task::Add => 2 * len,
                _ => len,
            };
            let base = match self.task {
                Task::Add => 10,
                _ => self.n_symbols,
            };
            // Every sequence of `digits` symbols, as an odometer.
            let mut symbols = vec![0usize; digits];
            loop {
                let input = self.input_of(&symbols, len);
                sizes[usize::from(Split::of(&input) == Split::Valid)] += 1;
                let Some(i) = symbols.iter().rposition(|&s| s + 1 < base) else {
                    break;
                };
                symbols[i] += 1;
                symbols[i + 1..].fill(0);
            }
        }
        Some(sizes)
    }

    /// The input tokens of the symbols `symbols` (for `add`: the digits of both operands,
    /// `len` each).
    fn input_of(&self, symbols: &[usize], len: usize) -> Vec<usize> {
        let sym = |&s: &usize| FIRST + s;
        match self.task {
            Task::Add => symbols[..len]
                .iter()
                .map(sym)
                .chain([self.plus()])
                .chain(symbols[len..].iter().map(sym))
                .collect(),
            _ => symbols.iter().map(sym).collect(),
        }
    }

    /// The `+` token of `add`.
    fn plus(&self) -> usize {
        FIRST + self.n_symbols
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
    ///
    /// # Panics
    /// If the split has no input ([`validate`](Self::validate) rules that out).
    pub fn example(&self, seed: u64, split: Split, index: usize) -> Example {
        let mut rng = Rng::new(seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        // Whatever the split's share of the inputs, a million draws find one.
        for _ in 0..1 << 20 {
            let example = self.draw(&mut rng);
            if Split::of(&example.input) == split {
                return example;
            }
        }
        panic!("no {split:?} input in a million draws of {self:?}: validate() was skipped");
    }

    fn draw(&self, rng: &mut Rng) -> Example {
        let len = rng.range(self.min_len, self.max_len);
        let sym = |s: usize| FIRST + s;
        match self.task {
            Task::Add => {
                let digits: Vec<usize> = (0..2 * len).map(|_| rng.below(10)).collect();
                let sum = add_digits(&digits[..len], &digits[len..]);
                Example {
                    input: self.input_of(&digits, len),
                    output: sum.into_iter().map(sym).collect(),
                }
            }
            task => {
                let input: Vec<usize> = (0..len).map(|_| sym(rng.below(self.n_symbols))).collect();
                let mut output = input.clone();
                match task {
                    Task::Reverse => output.reverse(),
                    Task::Sort => output.sort_unstable(),
                    _ => {}
                }
                Example { input, output }
            }
        }
    }

    /// A token as text: a symbol as one of `0-9a-zA-Z` when the task has at most 62
    /// symbols, else as its number (so that every label can be typed back into
    /// [`parse`](Self::parse)); `+`, and the special tokens.
    pub fn token_label(&self, token: usize) -> String {
        const ALPHABET: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
        match token {
            PAD => "·".into(),
            SEP => "|".into(),
            EOS => "$".into(),
            t if self.task == Task::Add && t == self.plus() => "+".into(),
            t if self.n_symbols <= ALPHABET.len() => (ALPHABET[t - FIRST] as char).to_string(),
            t => (t - FIRST).to_string(),
        }
    }

    /// Output tokens as text: the digits of the sum for `add`, else the symbols' labels
    /// separated by spaces (as [`parse`](Self::parse) reads them).
    pub fn format_output(&self, tokens: &[usize]) -> String {
        let labels: Vec<String> = tokens.iter().map(|&t| self.token_label(t)).collect();
        match self.task {
            Task::Add => labels.concat(),
            _ => labels.join(" "),
        }
    }

    /// Parses an input in the task's grammar: symbols separated by spaces (`3 1 4 1 5`),
    /// or for `add` two operands of as many digits joined by `+` (`123+456`, spaces around
    /// the `+` allowed). An input longer than the trained maximum is an error; one shorter
    /// than the trained minimum is read (see [`length_warning`](Self::length_warning)).
    ///
    /// # Errors
    /// Naming the token (or character) and its position, counted from 1.
    pub fn parse(&self, text: &str) -> anyhow::Result<Vec<usize>> {
        let tokens = match self.task {
            Task::Add => self.parse_sum(text)?,
            _ => self.parse_symbols(text)?,
        };
        let len = self.operand_len(&tokens);
        anyhow::ensure!(
            len <= self.max_len,
            "the input has {len} {}; this run was trained on at most {}",
            self.unit(),
            self.max_len
        );
        Ok(tokens)
    }

    /// A warning when `tokens` (parsed input) are shorter than any input of the training.
    pub fn length_warning(&self, tokens: &[usize]) -> Option<String> {
        let len = self.operand_len(tokens);
        (len < self.min_len).then(|| {
            format!(
                "the input has {len} {}; this run was trained on {} to {}, so the answer is a guess \
                 outside what it learned",
                self.unit(),
                self.min_len,
                self.max_len
            )
        })
    }

    /// Symbols per input, or digits per operand for `add`.
    fn operand_len(&self, tokens: &[usize]) -> usize {
        match self.task {
            Task::Add => tokens.len() / 2,
            _ => tokens.len(),
        }
    }

    fn unit(&self) -> &'static str {
        match self.task {
            Task::Add => "digits per operand",
            _ => "symbols",
        }
    }

    fn parse_symbols(&self, text: &str) -> anyhow::Result<Vec<usize>> {
        let labels: Vec<String> = (0..self.n_symbols)
            .map(|s| self.token_label(FIRST + s))
            .collect();
        let words: Vec<&str> = text.split_whitespace().collect();
        anyhow::ensure!(!words.is_empty(), "the input is empty");
        words
            .iter()
            .enumerate()
            .map(|(i, word)| match labels.iter().position(|l| l == word) {
                Some(s) => Ok(FIRST + s),
                None => {
                    let spelt_out = word.chars().all(|c| labels.contains(&c.to_string()));
                    let hint = match spelt_out && word.chars().count() > 1 {
                        true => {
                            let spaced: Vec<String> = word.chars().map(String::from).collect();
                            format!(" (separate symbols by spaces: `{}`)", spaced.join(" "))
                        }
                        false => format!("; its symbols are {}", labels.join(" ")),
                    };
                    Err(anyhow::anyhow!(
                        "input token {} `{word}` is not a symbol of task {}{hint}",
                        i + 1,
                        self.task.name()
                    ))
                }
            })
            .collect()
    }

    fn parse_sum(&self, text: &str) -> anyhow::Result<Vec<usize>> {
        // Operands (a run of digits and where it starts) and `+` signs, in order.
        enum Part {
            Digits(String, usize),
            Plus(usize),
        }
        let mut parts: Vec<Part> = Vec::new();
        for (i, c) in text.chars().enumerate() {
            let at = i + 1;
            match c {
                '0'..='9' => match parts.last_mut() {
                    Some(Part::Digits(digits, start)) if *start + digits.len() == at => {
                        digits.push(c)
                    }
                    _ => parts.push(Part::Digits(c.to_string(), at)),
                },
                '+' => parts.push(Part::Plus(at)),
                c if c.is_whitespace() => {}
                c => anyhow::bail!("character {at} `{c}` is neither a digit nor `+`"),
            }
        }
        let (a, b) = match parts.as_slice() {
            [] => anyhow::bail!("the input is empty; add reads `A+B`, e.g. `123+456`"),
            [Part::Digits(a, _), Part::Plus(_), Part::Digits(b, _)] => (a, b),
            [Part::Plus(at), ..] => anyhow::bail!("`+` at character {at}: expected a digit"),
            [Part::Digits(..), Part::Digits(_, at), ..] => anyhow::bail!(
                "the digits at character {at} continue an operand after a space: write each \
                 operand without spaces"
            ),
            [Part::Digits(..)] => anyhow::bail!("no `+`: add reads `A+B`, e.g. `123+456`"),
            [Part::Digits(..), Part::Plus(at)] => {
                anyhow::bail!("nothing after `+` at character {at}: expected the second operand")
            }
            [_, _, _, Part::Plus(at), ..] | [_, Part::Plus(_), Part::Plus(at), ..] => {
                anyhow::bail!("a second `+` at character {at}: add takes two operands")
            }
            [_, _, _, Part::Digits(_, at), ..] => anyhow::bail!(
                "the digits at character {at} continue the second operand after a space"
            ),
        };
        anyhow::ensure!(
            a.len() == b.len(),
            "the operands have {} and {} digits; add takes two operands of the same length",
            a.len(),
            b.len()
        );
        let digits: Vec<usize> = a
            .chars()
            .chain(b.chars())
            .map(|c| c as usize - '0' as usize)
            .collect();
        Ok(self.input_of(&digits, a.len()))
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
    /// Decoder-only, packed ([`SeqBatcher::pack`]): where the sequences of each row of
    /// `joined` start and end, and each token's position in its sequence.
    pub packed: Option<Packed>,
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
#[derive(Clone, Debug, Default)]
pub struct SeqBatcher {
    /// Pads every batch to these widths when set.
    pub fixed: Option<FixedShape>,
    /// Packs the decoder-only sequences into rows of this many tokens (twice the longest
    /// sequence: every row but the last holds two or more), with the rows' boundaries in
    /// [`SeqBatch::packed`]. With `fixed`, the batch has `ceil(B / 2)` rows.
    pub pack: Option<usize>,
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

    fn task(task: Task, [min_len, max_len, n_symbols]: [usize; 3]) -> TaskConfig {
        TaskConfig {
            task,
            min_len,
            max_len,
            n_symbols,
        }
    }

    #[test]
    fn tasks_compute_what_they_say() {
        let add = task(Task::Add, [3, 3, 10]);
        assert_eq!(add_digits(&[9, 9, 9], &[0, 0, 1]), vec![1, 0, 0, 0]);
        let ex = add.example(1, Split::Train, 0);
        assert_eq!(ex.input.len(), 7);
        assert_eq!(ex.output.len(), 4);
        let rev = TaskConfig::default().example(1, Split::Valid, 3);
        assert_eq!(
            rev.output,
            rev.input.iter().rev().copied().collect::<Vec<_>>()
        );
    }

    #[test]
    fn splits_are_disjoint_and_repeatable() {
        let cfg = task(Task::Reverse, [2, 3, 4]);
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

    #[test]
    fn a_task_whose_held_out_split_would_be_empty_is_rejected() {
        // Two inputs, "0" and "1": neither hashes into the held-out tenth.
        let tiny = task(Task::Copy, [1, 1, 2]);
        assert_eq!(tiny.split_sizes(), Some([2, 0]));
        let err = tiny.validate().unwrap_err().to_string();
        assert!(err.contains("held-out split would be empty"), "{err}");
        assert!(err.contains("--symbols"), "{err}");
        // Counted exactly: every input of lengths 1..=3 over 4 symbols.
        let [train, valid] = task(Task::Sort, [1, 3, 4]).split_sizes().unwrap();
        assert_eq!(train + valid, 4 + 16 + 64);
        assert!(valid > 0 && train > valid);
        assert_eq!(TaskConfig::default().split_sizes(), None);
        TaskConfig::default().validate().unwrap();
    }

    #[test]
    fn inputs_parse_strictly_and_labels_read_back() {
        let rev = TaskConfig::default();
        assert_eq!(rev.parse("3 1  4").unwrap(), vec![6, 4, 7]);
        let err = rev.parse("99 12").unwrap_err().to_string();
        assert!(err.starts_with("input token 1 `99`"), "{err}");
        assert!(err.contains("`9 9`"), "{err}");
        let err = rev.parse("3 x").unwrap_err().to_string();
        assert!(err.starts_with("input token 2 `x`"), "{err}");
        let long = vec!["1"; 17].join(" ");
        assert!(
            rev.parse(&long)
                .unwrap_err()
                .to_string()
                .contains("at most 16")
        );
        assert!(rev.length_warning(&rev.parse("1 2").unwrap()).is_some());
        assert!(
            rev.length_warning(&rev.parse("1 2 3 4 5 6 7 8").unwrap())
                .is_none()
        );
        // More symbols than letters: every label is a number, and reads back.
        let wide = task(Task::Copy, [1, 4, 70]);
        let tokens: Vec<usize> = [0, 61, 62, 69].iter().map(|s| FIRST + s).collect();
        let text = wide.format_output(&tokens);
        assert_eq!(text, "0 61 62 69");
        assert_eq!(wide.parse(&text).unwrap(), tokens);

        let add = task(Task::Add, [2, 4, 10]);
        let sum = add.parse("12 + 34").unwrap();
        assert_eq!(sum, add.parse("12+34").unwrap());
        assert_eq!(add.format_output(&sum), "12+34");
        for (input, wanted) in [
            ("123+", "nothing after `+` at character 4"),
            ("1+2+3", "a second `+` at character 4"),
            ("1234+56", "4 and 2 digits"),
            ("++++", "`+` at character 1"),
            ("12 3+456", "continue an operand"),
            ("12a+45", "character 3 `a`"),
            ("", "empty"),
            ("12345+12345", "at most 4"),
        ] {
            let err = add.parse(input).unwrap_err().to_string();
            assert!(err.contains(wanted), "{input:?}: {err}");
        }
    }
}
