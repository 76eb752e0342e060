//! A text corpus for character-level language modelling: the characters are the tokens
//! (the vocabulary is the corpus's distinct characters, sorted), the first 90% of the
//! characters train and the last 10% validate, and a window of a split is `block + 1`
//! consecutive characters (the model reads the first `block`, and each position predicts
//! the next character), wholly inside its split.
//!
//! The corpus in the repository, [`SHAKESPEARE`], is seven of Shakespeare's plays from
//! Project Gutenberg (public domain), about 1.07 MB of ASCII: `data/README.md` says which
//! and how they were cut, and `scripts/make_corpus.py` makes it again from its source.
//!
//! The text task ([`crate::lm`], `--task text`) trains on it, or on a user's `--data`
//! file read the same way. `scripts/train_pytorch_text.py`, the PyTorch reference it is
//! compared with, draws its batches and validation windows with the functions here
//! ([`batch_start`], [`valid_starts`], [`train_len`]).

use std::path::Path;

use anyhow::Context;

use crate::text::{echo, plural};

/// Seven of Shakespeare's plays (Hamlet, Richard III, Coriolanus, Othello, King Lear,
/// Macbeth, Romeo and Juliet), as `data/README.md` describes.
pub const SHAKESPEARE: &str = include_str!("../data/shakespeare.txt");

/// The training characters of a text of `n`: 90% of them, rounded half up, in integers
/// (the same in `scripts/train_pytorch_text.py`); the rest, at the end, validate.
pub fn train_len(n: usize) -> usize {
    (9 * n + 5) / 10
}

/// Training or validation characters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextSplit {
    /// The first 90%.
    Train,
    /// The last 10%.
    Valid,
}

/// A text as token ids, its vocabulary and its split.
#[derive(Clone, Debug, PartialEq)]
pub struct Corpus {
    /// The distinct characters, sorted: token `i` is `vocab[i]`.
    pub vocab: Vec<char>,
    /// The text, one id per character.
    pub ids: Vec<u32>,
    /// The first validation character: `ids[..split]` train, `ids[split..]` validate.
    pub split: usize,
    /// The text's checksum, as a run keeps it (`task.text_checksum`).
    pub checksum: String,
}

impl Corpus {
    /// The corpus of `text` (named `what` in errors), for windows of `block + 1`
    /// characters.
    ///
    /// # Errors
    /// When the text is empty, or a split is too short to hold one window; the error
    /// names `what`, the length and the block size.
    pub fn new(text: &str, what: &str, block: usize) -> anyhow::Result<Self> {
        // Beside the text, only its ids are held (4 bytes a character): the distinct
        // characters are gathered first, ASCII in a table, the rest in a set.
        let mut ascii = [false; 128];
        let mut others = std::collections::BTreeSet::new();
        let mut len = 0;
        for c in text.chars() {
            match usize::try_from(u32::from(c)) {
                Ok(code) if code < 128 => ascii[code] = true,
                _ => {
                    others.insert(c);
                }
            }
            len += 1;
        }
        anyhow::ensure!(len > 0, "{what} is empty: the text task needs text");
        let vocab: Vec<char> = (0u8..128)
            .filter(|&code| ascii[usize::from(code)])
            .map(char::from)
            .chain(others)
            .collect();
        let mut ascii_ids = [0u32; 128];
        for (id, c) in vocab.iter().enumerate().take_while(|(_, c)| c.is_ascii()) {
            ascii_ids[*c as usize] = id as u32;
        }
        let mut ids = Vec::with_capacity(len);
        ids.extend(text.chars().map(|c| match c.is_ascii() {
            true => ascii_ids[c as usize],
            false => vocab.binary_search(&c).expect("a character of the text") as u32,
        }));
        let split = train_len(len);
        anyhow::ensure!(
            split.min(len - split) > block,
            "{what} has {}: too short for a block size of {block}, whose windows of {} \
             must fit in the validation split (the last 10%) as in the training split; give \
             at least {} or a smaller block size",
            plural(len, "character"),
            block.saturating_add(1),
            plural(Self::shortest_text(block), "character"),
        );
        Ok(Self {
            vocab,
            ids,
            split,
            checksum: crate::run_dir::checksum(text.as_bytes())
                .trim_end()
                .to_string(),
        })
    }

    /// The corpus of the UTF-8 file at `path`.
    ///
    /// # Errors
    /// When the file cannot be read or is not UTF-8 (naming the byte offset of the first
    /// bad byte), and as [`new`](Self::new).
    pub fn read(path: &Path, block: usize) -> anyhow::Result<Self> {
        let what = path.display().to_string();
        let len = std::fs::metadata(path).with_context(|| format!("cannot read {what}"))?;
        // A device or a pipe has no length to check, and may read without end.
        anyhow::ensure!(
            len.is_file(),
            "--data {what}: not a regular file (a directory, a device or a pipe); give a text \
             file"
        );
        crate::memory::check_text(&what, len.len())?;
        let bytes = std::fs::read(path).with_context(|| format!("cannot read {what}"))?;
        // UTF-16 (or UTF-32), which some editors save "Unicode" text as: with its
        // byte-order mark it is not UTF-8, and without one its ASCII reads as UTF-8 with a
        // NUL after every character, which would train as text. A NUL byte in UTF-8 is the
        // character U+0000 (never part of another), refused too.
        let utf32 =
            bytes.starts_with(&[0xff, 0xfe, 0, 0]) || bytes.starts_with(&[0, 0, 0xfe, 0xff]);
        anyhow::ensure!(
            !utf32,
            "{what} is UTF-32 text (it starts with UTF-32's byte-order mark): save it as UTF-8"
        );
        anyhow::ensure!(
            !(bytes.starts_with(&[0xff, 0xfe]) || bytes.starts_with(&[0xfe, 0xff])),
            "{what} is UTF-16 text (it starts with UTF-16's byte-order mark): save it as UTF-8"
        );
        if let Some(at) = bytes.iter().position(|&b| b == 0) {
            anyhow::bail!(
                "{what} holds a NUL character (U+0000, the byte at offset {at}), which the text \
                 task does not take: UTF-16 without a byte-order mark, or a binary file? Give \
                 UTF-8 text without NULs"
            );
        }
        let text = std::str::from_utf8(&bytes).map_err(|err| {
            let at = err.valid_up_to();
            anyhow::anyhow!(
                "{what} is not UTF-8 text: the byte at offset {at} (0x{:02x}) does not belong \
                 to a character",
                bytes[at]
            )
        })?;
        // A byte-order mark, which some editors write first, is not a character of the text.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        Self::new(text, &what, block)
    }

    /// The shortest text that holds one window of `block + 1` characters in each split
    /// (`usize::MAX` where none does).
    pub fn shortest_text(block: usize) -> usize {
        // Both splits of n characters hold block + 1: the validation split is about a
        // tenth, so the length is within 20 of ten windows; counted in u128, past usize.
        let block = block as u128;
        let from = ((block + 1) * 10).saturating_sub(20).max(block + 2);
        (from..)
            .find(|&n| {
                let split = (9 * n + 5) / 10; // `train_len`
                split.min(n - split) > block
            })
            .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// The characters of `split`, as ids.
    pub fn part(&self, split: TextSplit) -> &[u32] {
        match split {
            TextSplit::Train => &self.ids[..self.split],
            TextSplit::Valid => &self.ids[self.split..],
        }
    }

    /// How many windows of `block + 1` characters start in `split` (each start from 0 to
    /// the last one that ends inside it).
    pub fn windows(&self, split: TextSplit, block: usize) -> usize {
        (self.part(split).len() + 1).saturating_sub(block + 1)
    }

    /// The window of `block + 1` characters of `split` starting at `start` (below
    /// [`windows`](Self::windows)).
    pub fn window(&self, split: TextSplit, start: usize, block: usize) -> &[u32] {
        &self.part(split)[start..start + block + 1]
    }

    /// `text` as ids.
    ///
    /// # Errors
    /// Naming every character of `text` outside the vocabulary.
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let mut unknown: Vec<char> = text
            .chars()
            .filter(|c| self.vocab.binary_search(c).is_err())
            .collect();
        unknown.sort_unstable();
        unknown.dedup();
        if !unknown.is_empty() {
            let shown: Vec<String> = unknown.iter().map(|c| format!("{c:?}")).collect();
            anyhow::bail!(
                "{} of \"{}\" not in the run's vocabulary of {}: {}",
                match unknown.len() {
                    1 => "a character".to_string(),
                    n => format!("{n} characters"),
                },
                echo(text),
                plural(self.vocab.len(), "character"),
                echo(&shown.join(", "))
            );
        }
        Ok(text
            .chars()
            .map(|c| self.vocab.binary_search(&c).expect("checked") as u32)
            .collect())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&i| self.vocab[i as usize]).collect()
    }
}

/// SplitMix64's output for state `x` (Steele, Lea and Flood's generator, as Java's
/// `SplittableRandom` mixes).
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Where row `row` of training step `step`'s batch starts, among `windows` starts: a
/// function of the seed, the step and the row alone (a resumed run draws the batches of
/// the uninterrupted one), and the same in `scripts/train_pytorch_text.py`, so that both
/// train on the same batches.
pub fn batch_start(seed: u64, step: u64, row: u64, windows: usize) -> usize {
    let h = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ row);
    (h % windows as u64) as usize
}

/// `count` window starts spread evenly over `windows`, the first and the last included:
/// the fixed validation windows (as in `scripts/train_pytorch_text.py`).
pub fn valid_starts(count: usize, windows: usize) -> Vec<usize> {
    if count <= 1 || windows <= 1 {
        return vec![0; count.min(windows)];
    }
    (0..count)
        .map(|i| i * (windows - 1) / (count - 1))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vocabulary_is_the_sorted_characters_and_ids_round_trip() {
        let corpus = Corpus::new("to be, or not to be: that is the question.", "t", 3).unwrap();
        assert_eq!(corpus.vocab.iter().collect::<String>(), " ,.:abehinoqrstu");
        assert_eq!(
            corpus.decode(&corpus.ids),
            "to be, or not to be: that is the question."
        );
        // Each id is the character's place in the vocabulary.
        let places: Vec<u32> = "be it"
            .chars()
            .map(|c| corpus.vocab.iter().position(|&v| v == c).unwrap() as u32)
            .collect();
        assert_eq!(corpus.encode("be it").unwrap(), places);
        assert_eq!(corpus.decode(&corpus.encode("be it").unwrap()), "be it");
        let err = corpus.encode("Be quiet!").unwrap_err().to_string();
        assert!(err.contains("2 characters"), "{err}");
        assert!(err.contains("'!', 'B'"), "{err}");
    }

    #[test]
    fn characters_past_ascii_sort_after_it_and_round_trip() {
        let text = "日本 été, naïve café: 🦀 zèbre Ωmega\tend\n";
        let corpus = Corpus::new(text, "t", 1).unwrap();
        let mut sorted: Vec<char> = text.chars().collect();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(corpus.vocab, sorted);
        assert_eq!(corpus.ids.len(), text.chars().count());
        for (&id, c) in corpus.ids.iter().zip(text.chars()) {
            assert_eq!(corpus.vocab[id as usize], c);
        }
        assert_eq!(corpus.decode(&corpus.ids), text);
    }

    #[test]
    fn windows_stay_inside_their_split() {
        let text: String = (0..1000)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        for block in [1, 8, 64, 99] {
            let corpus = Corpus::new(&text, "t", block).unwrap();
            assert_eq!(corpus.split, 900);
            assert_eq!(corpus.part(TextSplit::Train).len(), 900);
            assert_eq!(corpus.part(TextSplit::Valid).len(), 100);
            for split in [TextSplit::Train, TextSplit::Valid] {
                let n = corpus.windows(split, block);
                assert_eq!(n, corpus.part(split).len() - block);
                let last = corpus.window(split, n - 1, block);
                assert_eq!(last.len(), block + 1);
                assert_eq!(
                    last.last(),
                    corpus.part(split).last(),
                    "the last window ends the split"
                );
            }
            // The last training window ends before the first validation character.
            let train_end = corpus.windows(TextSplit::Train, block) - 1 + block + 1;
            assert_eq!(train_end, corpus.split);
        }
        assert!(
            Corpus::new(&text, "t", 100).is_err(),
            "100 + 1 do not fit in 100"
        );
    }

    #[test]
    fn empty_short_and_non_utf8_texts_are_named() {
        let err = Corpus::new("", "empty.txt", 8).unwrap_err().to_string();
        assert_eq!(err, "empty.txt is empty: the text task needs text");
        let err = Corpus::new("short text", "short.txt", 8)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("short.txt has 10 characters: too short for a block size of 8"),
            "{err}"
        );
        // The shortest text against a search from the block up.
        for block in (0..3000).chain([123_456]) {
            let fits = |n: usize| train_len(n).min(n - train_len(n)) > block;
            let searched = (block + 2..).find(|&n| fits(n)).unwrap();
            assert_eq!(Corpus::shortest_text(block), searched, "block {block}");
        }
        // A block of a trillion: at once, not a search of ten trillion lengths.
        assert_eq!(Corpus::shortest_text(1_000_000_000_000), 10_000_000_000_006);
        assert_eq!(Corpus::shortest_text(usize::MAX), usize::MAX);
        let shortest = Corpus::shortest_text(8);
        assert!(
            err.contains(&format!("at least {shortest} characters")),
            "{err}"
        );
        let text = "x".repeat(shortest);
        assert!(Corpus::new(&text, "t", 8).is_ok());
        assert!(Corpus::new(&text[1..], "t", 8).is_err());

        let dir = std::env::temp_dir().join(format!("mha-corpus-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("latin1.txt");
        std::fs::write(&path, b"caf\xe9 au lait").unwrap();
        let err = Corpus::read(&path, 1).unwrap_err().to_string();
        assert!(
            err.ends_with(
                "is not UTF-8 text: the byte at offset 3 (0xe9) does not belong to a character"
            ),
            "{err}"
        );
        // UTF-16 with and without its byte-order mark (little- and big-endian), a NUL
        // inside UTF-8 text, and UTF-32 with its mark.
        let utf16 = |big: bool, mark: bool| -> Vec<u8> {
            let units = mark
                .then_some(0xfeff)
                .into_iter()
                .chain("To be, or not".encode_utf16());
            units
                .flat_map(|u: u16| {
                    if big {
                        u.to_be_bytes()
                    } else {
                        u.to_le_bytes()
                    }
                })
                .collect()
        };
        for (bytes, wanted) in [
            (
                utf16(false, true),
                "is UTF-16 text (it starts with UTF-16's byte-order mark)",
            ),
            (
                utf16(true, true),
                "is UTF-16 text (it starts with UTF-16's byte-order mark)",
            ),
            (
                utf16(false, false),
                "holds a NUL character (U+0000, the byte at offset 1)",
            ),
            (
                utf16(true, false),
                "holds a NUL character (U+0000, the byte at offset 0)",
            ),
            (
                b"To be\0 or not".to_vec(),
                "holds a NUL character (U+0000, the byte at offset 5), which the text task does \
                 not take: UTF-16 without a byte-order mark, or a binary file? Give UTF-8 text \
                 without NULs",
            ),
            (
                [&[0xff, 0xfe, 0, 0][..], b"T\0\0\0"].concat(),
                "is UTF-32 text (it starts with UTF-32's byte-order mark)",
            ),
        ] {
            std::fs::write(&path, bytes).unwrap();
            let err = Corpus::read(&path, 1).unwrap_err().to_string();
            assert!(err.contains(wanted), "{err}");
        }
        // A folder, or a device (which has no length to check and may read without end).
        let mut others = vec![dir.clone()];
        if cfg!(unix) {
            others.push("/dev/zero".into());
        }
        for path in others {
            let err = Corpus::read(&path, 1).unwrap_err().to_string();
            assert_eq!(
                err,
                format!(
                    "--data {}: not a regular file (a directory, a device or a pipe); give a \
                     text file",
                    path.display()
                )
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn batches_and_validation_windows_are_those_of_the_pytorch_reference() {
        // SplitMix64's first output from state 0, as published with the generator.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        // Printed by scripts/train_pytorch_text.py's batch_start and valid_starts (steps
        // 0, 1 and 1999, rows 0, 1 and 11, the training windows of the Shakespeare corpus
        // at block 64).
        let starts: Vec<usize> = [0, 1, 1999]
            .into_iter()
            .flat_map(|step| [0, 1, 11].map(|row| batch_start(42, step, row, 959_520)))
            .collect();
        assert_eq!(
            starts,
            [
                880550, 94078, 488779, 70604, 86658, 346038, 297214, 421580, 535257
            ]
        );
        assert_eq!(valid_starts(5, 106_556), [0, 26638, 53277, 79916, 106555]);
        assert_eq!(valid_starts(1, 10), [0]);
        assert_eq!(valid_starts(3, 1), [0]);
        let corpus = Corpus::new(SHAKESPEARE, "shakespeare", 64).unwrap();
        assert_eq!(corpus.windows(TextSplit::Train, 64), 959_520);
        assert_eq!(corpus.windows(TextSplit::Valid, 64), 106_556);
    }

    #[test]
    fn the_shakespeare_corpus_is_the_documented_one() {
        let corpus = Corpus::new(SHAKESPEARE, "shakespeare", 256).unwrap();
        assert_eq!(SHAKESPEARE.len(), 1_066_204);
        assert_eq!(corpus.vocab.len(), 73);
        assert!(SHAKESPEARE.starts_with("HAMLET, PRINCE OF DENMARK"));
        assert!(SHAKESPEARE.is_ascii() && !SHAKESPEARE.contains('\r'));
    }
}
