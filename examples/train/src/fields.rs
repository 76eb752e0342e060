//! Which command-line flag sets which field of a run's configuration, what else users
//! call it, and whether `--resume` may change it: the one table that error messages,
//! the help's defaults, the check of config files and the check of `--resume` read.
//! Code names a field by its constant ([`D_MODEL`]), so a misspelt field is a compile
//! error; only paths read from JSON are looked up ([`at`]).

/// A field of `config.json`.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    /// Its dotted path in `config.json`, e.g. `model.d_model`.
    pub path: &'static str,
    /// The flag that sets it, if one does.
    pub flag: Option<&'static str>,
    /// Other names a user may write for it (suggested when a config file has them).
    pub aliases: &'static [&'static str],
    /// Whether `--resume` may change it: it changes how long the run goes on, how it is
    /// evaluated or how its batches are padded, never what a step computes.
    pub on_resume: bool,
}

const fn field(
    path: &'static str,
    flag: Option<&'static str>,
    aliases: &'static [&'static str],
    on_resume: bool,
) -> Field {
    Field {
        path,
        flag,
        aliases,
        on_resume,
    }
}

// Messages name a field by one of these constants, so a misspelt field does not compile.

/// `task.task`.
pub const TASK: Field = field("task.task", Some("--task"), &[], false);
/// `task.min_len`.
pub const MIN_LEN: Field = field("task.min_len", Some("--min-len"), &["min_length"], false);
/// `task.max_len`.
pub const MAX_LEN: Field = field("task.max_len", Some("--max-len"), &["max_length"], false);
/// `task.n_symbols`.
pub const N_SYMBOLS: Field = field(
    "task.n_symbols",
    Some("--symbols"),
    &["symbols", "vocab"],
    false,
);
/// `task.block_size`.
pub const BLOCK_SIZE: Field = field(
    "task.block_size",
    Some("--block-size"),
    &["block", "context", "context_length"],
    false,
);
/// `task.data`.
pub const DATA: Field = field(
    "task.data",
    Some("--data"),
    &["text", "corpus", "file"],
    false,
);
/// `task.vocab`.
pub const VOCAB: Field = field("task.vocab", None, &["vocabulary"], false);
/// `task.text_checksum`.
pub const TEXT_CHECKSUM: Field = field("task.text_checksum", None, &["checksum"], false);
/// `model.kind`.
pub const MODEL_KIND: Field = field("model.kind", Some("--model"), &["model"], false);
/// `model.d_model`.
pub const D_MODEL: Field = field("model.d_model", Some("--d-model"), &["width", "dim"], false);
/// `model.n_layers`.
pub const N_LAYERS: Field = field(
    "model.n_layers",
    Some("--layers"),
    &["layers", "blocks"],
    false,
);
/// `model.n_heads`.
pub const N_HEADS: Field = field("model.n_heads", Some("--heads"), &["heads"], false);
/// `model.dropout`.
pub const DROPOUT: Field = field("model.dropout", Some("--dropout"), &[], false);
/// `model.positions`.
pub const POSITIONS: Field = field("model.positions", Some("--positions"), &["position"], false);
/// `batch_size`.
pub const BATCH_SIZE: Field = field("batch_size", Some("--batch-size"), &["batch"], false);
/// `lr`.
pub const LR: Field = field(
    "lr",
    Some("--lr"),
    &["learning_rate", "learning-rate"],
    false,
);
/// `warmup_steps`.
pub const WARMUP_STEPS: Field = field("warmup_steps", Some("--warmup"), &["warmup"], false);
/// `decay_steps`.
pub const DECAY_STEPS: Field = field("decay_steps", None, &[], false);
/// `min_lr_ratio`.
pub const MIN_LR_RATIO: Field = field("min_lr_ratio", None, &["min_lr", "lr_floor"], false);
/// `adam_beta2`.
pub const ADAM_BETA2: Field = field("adam_beta2", None, &["beta2", "betas"], false);
/// `adam_epsilon`.
pub const ADAM_EPSILON: Field = field("adam_epsilon", None, &["epsilon", "eps"], false);
/// `decay_vectors`.
pub const DECAY_VECTORS: Field = field("decay_vectors", None, &[], false);
/// `clip_global`.
pub const CLIP_GLOBAL: Field = field("clip_global", None, &["global_clip"], false);
/// `weight_decay`.
pub const WEIGHT_DECAY: Field = field("weight_decay", None, &[], false);
/// `grad_clip`.
pub const GRAD_CLIP: Field = field("grad_clip", None, &["clip"], false);
/// `steps_per_epoch`.
pub const STEPS_PER_EPOCH: Field = field(
    "steps_per_epoch",
    Some("--steps-per-epoch"),
    &["steps"],
    false,
);
/// `epochs`.
pub const EPOCHS: Field = field("epochs", Some("--epochs"), &[], true);
/// `valid_examples`.
pub const VALID_EXAMPLES: Field = field("valid_examples", None, &[], false);
/// `eval_examples`.
pub const EVAL_EXAMPLES: Field = field("eval_examples", Some("--eval-examples"), &[], true);
/// `seed`.
pub const SEED: Field = field("seed", Some("--seed"), &[], false);
/// `pack`.
pub const PACK: Field = field("pack", Some("--pack"), &["packing", "packed"], false);
/// `dtype`.
pub const DTYPE: Field = field("dtype", Some("--dtype"), &["precision", "float"], false);
/// `devices`.
pub const DEVICES: Field = field("devices", Some("--devices"), &["device", "gpus"], false);
/// `fixed_shapes`.
pub const FIXED_SHAPES: Field = field("fixed_shapes", Some("--fixed-shapes"), &[], true);

/// Every field of `config.json`.
pub const FIELDS: &[Field] = &[
    TASK,
    MIN_LEN,
    MAX_LEN,
    N_SYMBOLS,
    BLOCK_SIZE,
    DATA,
    VOCAB,
    TEXT_CHECKSUM,
    MODEL_KIND,
    D_MODEL,
    N_LAYERS,
    N_HEADS,
    DROPOUT,
    POSITIONS,
    BATCH_SIZE,
    LR,
    WARMUP_STEPS,
    DECAY_STEPS,
    MIN_LR_RATIO,
    ADAM_BETA2,
    ADAM_EPSILON,
    WEIGHT_DECAY,
    DECAY_VECTORS,
    GRAD_CLIP,
    CLIP_GLOBAL,
    STEPS_PER_EPOCH,
    EPOCHS,
    VALID_EXAMPLES,
    EVAL_EXAMPLES,
    SEED,
    PACK,
    DTYPE,
    DEVICES,
    FIXED_SHAPES,
];

/// The fields that only the text task reads: set on a synthetic task, they are refused.
pub const TEXT_ONLY: &[Field] = &[BLOCK_SIZE, DATA, VOCAB, TEXT_CHECKSUM];

/// The fields that only the synthetic tasks read: set on the text task (whose examples are
/// windows of its text, validated by their loss), they are refused.
pub const SYNTHETIC_ONLY: &[Field] = &[MIN_LEN, MAX_LEN, N_SYMBOLS, EVAL_EXAMPLES, FIXED_SHAPES];

impl Field {
    /// How messages name the field: its flag and its path, e.g. "`--warmup`
    /// (`warmup_steps`)", or its path alone when no flag sets it.
    pub fn name(&self) -> String {
        match self.flag {
            Some(flag) => format!("`{flag}` (`{}`)", self.path),
            None => format!("`{}`", self.path),
        }
    }
}

/// The field at `path` (a dotted path read from a configuration's JSON).
///
/// # Panics
/// If no field has that path (a bug in the table).
pub fn at(path: &str) -> Field {
    *FIELDS
        .iter()
        .find(|f| f.path == path)
        .unwrap_or_else(|| panic!("no field {path}"))
}

/// The known field nearest to `key` (found at `path`, dotted, in a config file): the one
/// whose name or alias is within a few edits of it, if any.
pub fn nearest(key: &str) -> Option<Field> {
    let candidates = FIELDS.iter().flat_map(|f| {
        let last = f.path.rsplit('.').next().unwrap_or(f.path);
        let flag = f.flag.map(|flag| flag.trim_start_matches('-'));
        [Some(last), flag]
            .into_iter()
            .flatten()
            .chain(f.aliases.iter().copied())
            .map(move |name| (edits(&name.replace('-', "_"), &key.replace('-', "_")), *f))
    });
    let (distance, field) = candidates.min_by_key(|(d, _)| *d)?;
    (distance <= 2.max(key.len() / 3)).then_some(field)
}

/// Deserialises one of a command-line enum's values, spelt as on the command line
/// (`decoder-only`); the capitalised spellings of earlier versions (`DecoderOnly`) are
/// read too. `what` names the value in the error.
pub fn by_name<'de, D, T>(deserializer: D, what: &str) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: clap::ValueEnum,
{
    use serde::de::Error;
    let text = <String as serde::Deserialize>::deserialize(deserializer)?;
    let plain = |s: &str| s.replace(['-', '_'], "").to_lowercase();
    let names: Vec<String> = T::value_variants()
        .iter()
        .filter_map(|v| Some(v.to_possible_value()?.get_name().to_string()))
        .collect();
    T::value_variants()
        .iter()
        .zip(&names)
        .find(|(_, name)| plain(name) == plain(&text))
        .map(|(value, _)| value.clone())
        .ok_or_else(|| {
            let (last, rest) = names.split_last().expect("an enum has values");
            D::Error::custom(format!(
                "unknown {what} `{}`: expected {} or {last}",
                crate::text::echo(&text),
                rest.join(", ")
            ))
        })
}

/// The edit (Levenshtein) distance between two strings.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misspelt_and_aliased_fields_find_their_field() {
        assert_eq!(edits("dropuot", "dropout"), 2);
        assert_eq!(nearest("dropuot").map(|f| f.path), Some("model.dropout"));
        assert_eq!(nearest("learning_rate").map(|f| f.path), Some("lr"));
        assert_eq!(nearest("warmup").map(|f| f.path), Some("warmup_steps"));
        assert_eq!(nearest("d-model").map(|f| f.path), Some("model.d_model"));
        assert_eq!(nearest("zzzzzzzz").map(|f| f.path), None);
        assert_eq!(MIN_LEN.name(), "`--min-len` (`task.min_len`)");
        assert_eq!(VALID_EXAMPLES.name(), "`valid_examples`");
    }
}
