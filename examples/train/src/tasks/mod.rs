//! Synthetic sequence tasks, generated on the fly from a seed. Every example is a
//! function of (seed, index), and a hash of the input decides its split, so the held-out
//! examples never appear in training.
//!
//! What sets one task apart (how its inputs are drawn, what its output is, how its inputs
//! are written and read back) is its [`TaskRules`], one file each: [`copy`], [`reverse`],
//! [`sort`], [`add`]. A new task is a new file, a variant of [`Task`] and its line in
//! [`Task::rules`]; what every task shares (lengths, splits, labels, the checks) is here.

pub mod add;
pub mod copy;
pub mod reverse;
pub mod sort;

use burn::data::dataset::{Dataset, DatasetError};
use serde::{Deserialize, Serialize};

use crate::fields::{MAX_LEN, MIN_LEN, N_SYMBOLS};
use crate::text::{echo, plural};

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
    /// Language modelling on a text, one character a token: each position predicts the
    /// next character (the Shakespeare corpus, or `--data`).
    // No synthetic rules: the trainer takes its own path for it (`crate::lm`, reading
    // `crate::corpus`).
    Text,
}

impl<'de> Deserialize<'de> for Task {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::fields::by_name(deserializer, "task")
    }
}

impl Task {
    /// What the task is: its examples, and how its inputs and outputs are written.
    ///
    /// # Panics
    /// For [`Task::Text`], which is not drawn from rules: only the synthetic tasks' kind
    /// ([`crate::kind::Synthetic`]) and what it calls read the rules.
    pub fn rules(self) -> &'static dyn TaskRules {
        match self {
            Task::Copy => &copy::CopyTask,
            Task::Reverse => &reverse::ReverseTask,
            Task::Sort => &sort::SortTask,
            Task::Add => &add::AddTask,
            Task::Text => panic!("the text task has no synthetic rules"),
        }
    }

    /// Its name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Task::Text => "text",
            task => task.rules().name(),
        }
    }
}

/// What sets a task apart. An example is drawn as symbols (numbers below
/// [`base`](Self::base)), from which the task makes the input and the output tokens; the
/// length of an input (`len`, between `min_len` and `max_len`) is counted as the task
/// counts it (symbols, or digits per operand for `add`). The defaults are those of a task
/// whose input is its symbols, written separated by spaces.
pub trait TaskRules: Sync {
    /// Its name, as on the command line.
    fn name(&self) -> &'static str;

    /// The output tokens (EOS excluded) of the drawn `symbols`.
    fn output(&self, symbols: &[usize]) -> Vec<usize>;

    /// Checks what the task asks of the configuration beyond what every task does.
    fn validate(&self, _task: &TaskConfig) -> anyhow::Result<()> {
        Ok(())
    }

    /// Symbols drawn for an input of length `len`.
    fn draws(&self, len: usize) -> usize {
        len
    }

    /// Values each drawn symbol takes.
    fn base(&self, task: &TaskConfig) -> usize {
        task.n_symbols
    }

    /// The input tokens of the drawn `symbols`.
    fn input(&self, _task: &TaskConfig, symbols: &[usize]) -> Vec<usize> {
        tokens(symbols)
    }

    /// The labels of the task's own tokens, which follow the symbols' (`add`'s `+`).
    fn own_tokens(&self) -> &'static [&'static str] {
        &[]
    }

    /// Tokens of the input and of the output (EOS excluded) at length `len`.
    fn lengths(&self, len: usize) -> [usize; 2] {
        [len, len]
    }

    /// Output tokens as text, from their labels.
    fn format_output(&self, labels: &[String]) -> String {
        labels.join(" ")
    }

    /// Parses an input in the task's grammar (its length is checked afterwards).
    ///
    /// # Errors
    /// Naming the token (or character) and its position, counted from 1.
    fn parse(&self, task: &TaskConfig, text: &str) -> anyhow::Result<Vec<usize>> {
        task.parse_symbols(text)
    }

    /// An input's length, from its tokens.
    fn length_of(&self, tokens: &[usize]) -> usize {
        tokens.len()
    }

    /// A length as [`length_of`](Self::length_of) counts it, for messages: "3 symbols".
    fn count(&self, len: usize) -> String {
        plural(len, "symbol")
    }
}

/// The tokens of `symbols`.
pub fn tokens(symbols: &[usize]) -> Vec<usize> {
    symbols.iter().map(|&s| FIRST + s).collect()
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
    /// Text task: characters a model reads at once (the windows are one longer: each
    /// position predicts the next character). Default: 64.
    pub block_size: usize,
    /// Text task: the UTF-8 file to train on. Default (`None`): the Shakespeare corpus in
    /// the repository ([`crate::corpus::SHAKESPEARE`]).
    pub data: Option<std::path::PathBuf>,
    /// Text task: the vocabulary, the text's distinct characters in order (token `i` is
    /// its `i`-th character), written by the trainer when the run starts; a configuration
    /// that gives it must give the text's own.
    pub vocab: Option<String>,
    /// Text task: the text's checksum (`fnv1a-64 <hash> <bytes>` of its UTF-8), written by
    /// the trainer when the run starts: `--resume` refuses a text that changed since.
    pub text_checksum: Option<String>,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            task: Task::Reverse,
            min_len: 8,
            max_len: 16,
            n_symbols: 10,
            block_size: 64,
            data: None,
            vocab: None,
            text_checksum: None,
        }
    }
}

/// The labels of the symbols of a task with at most 62 of them, one character each.
const ALPHABET: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";

/// Inputs up to this many are enumerated to check that both splits have some.
const ENUMERABLE: u128 = 1 << 20;

/// The longest input a synthetic task takes (`--max-len`): far past what a model learns
/// here, and short of the lengths whose counts of tokens and inputs overflow.
const LONGEST: usize = 1 << 20;
/// The most symbols a synthetic task takes.
const MOST_SYMBOLS: usize = 1 << 32;

impl TaskConfig {
    /// Checks the values (as the task's kind does); the error names the flag and the
    /// field.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.task.kind().validate_task(self)
    }

    /// A synthetic task's values, and that both splits have inputs.
    pub(crate) fn validate_synthetic(&self) -> anyhow::Result<()> {
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
            self.max_len <= LONGEST,
            "{} must be at most {LONGEST}, got {}",
            MAX_LEN.name(),
            self.max_len
        );
        anyhow::ensure!(
            self.n_symbols >= 2,
            "{} must be at least 2, got {}",
            N_SYMBOLS.name(),
            self.n_symbols
        );
        // Past any vocabulary memory holds (the memory check refuses far fewer), and far
        // from overflowing the vocabulary's size.
        anyhow::ensure!(
            self.n_symbols <= MOST_SYMBOLS,
            "{} must be at most {MOST_SYMBOLS}, got {}",
            N_SYMBOLS.name(),
            self.n_symbols
        );
        self.task.rules().validate(self)?;
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
    /// 2^20 inputs (`ENUMERABLE`; a larger one has plenty of both).
    pub fn split_sizes(&self) -> Option<[u128; 2]> {
        let rules = self.task.rules();
        let base = rules.base(self);
        let lengths = self.min_len..=self.max_len;
        let per_length = |len: usize| {
            let draws = u32::try_from(rules.draws(len)).ok()?;
            (base as u128).checked_pow(draws)
        };
        let total = lengths
            .clone()
            .try_fold(0u128, |sum, len| sum.checked_add(per_length(len)?))?;
        if total > ENUMERABLE {
            return None;
        }
        let mut sizes = [0u128; 2];
        for len in lengths {
            // Every draw of `draws(len)` symbols, as an odometer.
            let mut symbols = vec![0usize; rules.draws(len)];
            loop {
                let input = rules.input(self, &symbols);
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

    /// Tokens in the vocabulary: PAD, SEP, EOS, the symbols and the task's own; for the
    /// text task, its characters (0 until the run's vocabulary is set).
    pub fn vocab_size(&self) -> usize {
        self.task.kind().vocab_size(self)
    }

    /// Longest input, in tokens.
    pub fn max_input(&self) -> usize {
        self.task.rules().lengths(self.max_len)[0]
    }

    /// Longest output, in tokens, EOS excluded.
    pub fn max_output(&self) -> usize {
        self.task.rules().lengths(self.max_len)[1]
    }

    /// Mean tokens per sequence a model processes (`input SEP output EOS`), for
    /// throughput: lengths are uniform, and tokens grow with them linearly.
    pub fn mean_tokens(&self) -> f64 {
        let rules = self.task.rules();
        let tokens = |len| rules.lengths(len).iter().sum::<usize>() as f64;
        (tokens(self.min_len) + tokens(self.max_len)) / 2.0 + 2.0
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
        let rules = self.task.rules();
        let len = rng.range(self.min_len, self.max_len);
        let base = rules.base(self);
        let symbols: Vec<usize> = (0..rules.draws(len)).map(|_| rng.below(base)).collect();
        Example {
            input: rules.input(self, &symbols),
            output: rules.output(&symbols),
        }
    }

    /// A token as text: a symbol as one of `0-9a-zA-Z` when the task has at most 62
    /// symbols, else as its number (so that every label can be typed back into
    /// [`parse`](Self::parse)); the task's own tokens (`+`), and the special tokens.
    pub fn token_label(&self, token: usize) -> String {
        match token {
            PAD => "·".into(),
            SEP => "|".into(),
            EOS => "$".into(),
            t if t >= FIRST + self.n_symbols => {
                self.task.rules().own_tokens()[t - FIRST - self.n_symbols].into()
            }
            t if self.n_symbols <= ALPHABET.len() => (ALPHABET[t - FIRST] as char).to_string(),
            t => (t - FIRST).to_string(),
        }
    }

    /// Output tokens as text, as the task writes them (the digits of the sum for `add`,
    /// else the symbols' labels separated by spaces, as [`parse`](Self::parse) reads them).
    pub fn format_output(&self, tokens: &[usize]) -> String {
        let labels: Vec<String> = tokens.iter().map(|&t| self.token_label(t)).collect();
        self.task.rules().format_output(&labels)
    }

    /// Parses an input in the task's grammar: symbols separated by spaces (`3 1 4 1 5`),
    /// or for `add` two operands of as many digits joined by `+` (`123+456`, spaces around
    /// the `+` allowed). An input longer than the trained maximum is an error; one shorter
    /// than the trained minimum is read (see [`length_warning`](Self::length_warning)).
    ///
    /// # Errors
    /// Naming the token (or character) and its position, counted from 1.
    pub fn parse(&self, text: &str) -> anyhow::Result<Vec<usize>> {
        let rules = self.task.rules();
        let tokens = rules.parse(self, text)?;
        let len = rules.length_of(&tokens);
        anyhow::ensure!(
            len <= self.max_len,
            "the input has {}; this run was trained on at most {}",
            rules.count(len),
            self.max_len
        );
        Ok(tokens)
    }

    /// A warning when `tokens` (parsed input) are shorter than any input of the training.
    pub fn length_warning(&self, tokens: &[usize]) -> Option<String> {
        let rules = self.task.rules();
        let len = rules.length_of(tokens);
        (len < self.min_len).then(|| {
            format!(
                "the input has {}; this run was trained on {} to {}, so the answer is a guess \
                 outside what it learned",
                rules.count(len),
                self.min_len,
                self.max_len
            )
        })
    }

    /// The labels of the symbols, as runs: "0 to 9 and a to f", "0 to 69".
    pub fn symbol_range(&self) -> String {
        let label = |s: usize| self.token_label(FIRST + s);
        let run = |first: usize, last: usize| match first == last {
            true => label(first),
            false => format!("{} to {}", label(first), label(last)),
        };
        let last = self.n_symbols - 1;
        let runs: Vec<String> = match self.n_symbols {
            n if n <= 10 || n > 62 => vec![run(0, last)],
            n if n <= 36 => vec![run(0, 9), run(10, last)],
            _ => vec![run(0, 9), run(10, 35), run(36, last)],
        };
        match runs.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => runs.concat(),
        }
    }

    /// Symbols separated by spaces, each as [`token_label`](Self::token_label) writes it.
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
                    // Several one-character symbols written together (`314`).
                    let spelt_out = self.n_symbols <= ALPHABET.len()
                        && word.chars().all(|c| labels.contains(&c.to_string()));
                    let spaced = match spelt_out && word.chars().count() > 1 {
                        true => {
                            let spaced: Vec<String> = word.chars().map(String::from).collect();
                            format!(" (separate symbols by spaces: `{}`)", echo(&spaced.join(" ")))
                        }
                        false => String::new(),
                    };
                    Err(anyhow::anyhow!(
                        "input token {} `{}` is not a symbol of task {}: its symbols are {}{spaced}",
                        i + 1,
                        echo(word),
                        self.task.name(),
                        self.symbol_range(),
                    ))
                }
            })
            .collect()
    }
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

    fn task(task: Task, [min_len, max_len, n_symbols]: [usize; 3]) -> TaskConfig {
        TaskConfig {
            task,
            min_len,
            max_len,
            n_symbols,
            ..TaskConfig::default()
        }
    }

    #[test]
    fn every_task_is_named_as_on_the_command_line() {
        use clap::ValueEnum;
        for task in Task::value_variants() {
            let flag = task.to_possible_value().unwrap();
            assert_eq!(flag.get_name(), task.name());
        }
    }

    #[test]
    fn tasks_compute_what_they_say() {
        let add = task(Task::Add, [3, 3, 10]);
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
        assert!(err.contains("its symbols are 0 to 9"), "{err}");
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
        assert_eq!(wide.symbol_range(), "0 to 69");
        let err = wide.parse("70").unwrap_err().to_string();
        assert!(err.ends_with("its symbols are 0 to 69"), "{err}");
        assert_eq!(
            task(Task::Copy, [1, 4, 16]).symbol_range(),
            "0 to 9 and a to f"
        );
        assert_eq!(
            task(Task::Copy, [1, 4, 40]).symbol_range(),
            "0 to 9, a to z and A to D"
        );
    }
}
