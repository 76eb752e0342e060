//! What `--resume` may change of a run's configuration, and the configuration it
//! continues the run with.

use serde_json::Value;

use super::TrainConfig;
use super::json::lookup;
use crate::fields::{self, EPOCHS};
use crate::text::plural;

impl TrainConfig {
    /// The configuration a `--resume` continues the run with: `requested`, the run's
    /// configuration (`self`) with the flags of the `--resume` applied, checked against the
    /// run, which has done `done` epochs. Only what [`check_resume`](Self::check_resume)
    /// allows may change. A changed `--epochs` keeps the run's warmup (within the new
    /// length); an extended run keeps its decay too, so that its extra steps train at the
    /// floor (lr x `min_lr_ratio`), and a shortened one decays to the floor by its end.
    ///
    /// # Errors
    /// As [`check_resume`](Self::check_resume); when `--epochs` asks for no more epochs
    /// than are done; and naming a value [`validate`](Self::validate) rejects.
    pub fn resumed(&self, mut requested: Self, done: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(
            requested.epochs >= 1,
            "{} must be at least 1, got 0",
            EPOCHS.name()
        );
        self.check_resume(&requested)?;
        if requested.epochs != self.epochs {
            anyhow::ensure!(
                requested.epochs > done,
                "--epochs {}: the run has done {} already",
                requested.epochs,
                plural(done, "epoch")
            );
            requested.warmup_steps = Some(self.warmup().min(requested.total_steps() - 1));
            if requested.epochs > self.epochs {
                requested.decay_steps = Some(self.decay());
            }
        }
        requested.validate()?;
        Ok(requested)
    }

    /// Checks that `requested` (the run's configuration with the flags of a `--resume`
    /// applied) changes only what `--resume` may change: how long the run goes on, how it
    /// is evaluated and how its batches are padded.
    ///
    /// # Errors
    /// Naming the first flag that would change the run, its value and the run's.
    pub fn check_resume(&self, requested: &Self) -> anyhow::Result<()> {
        let allowed: Vec<&str> = fields::FIELDS
            .iter()
            .filter(|f| f.on_resume)
            .filter_map(|f| f.flag)
            .collect();
        let [stored, asked] =
            [self, requested].map(|c| serde_json::to_value(c).expect("a config serialises"));
        for path in self.changed_fields(requested) {
            let field = fields::at(&path);
            if field.on_resume {
                continue;
            }
            let value = |v: &Value| lookup(v, &path).map(Value::to_string).unwrap_or_default();
            anyhow::bail!(
                "{} {} would change the run, which was trained with {}; --resume continues a \
                 run as it was (it takes only {}: start a new run for other settings)",
                field.flag.unwrap_or(field.path),
                value(&asked),
                value(&stored),
                allowed.join(", "),
            );
        }
        Ok(())
    }
}
