//! Checking a configuration before anything is built or written: every value, the
//! task's and the model's included, and no field set that the run's task ignores.

use serde_json::Value;

use super::TrainConfig;
use super::json::lookup;
use crate::fields::{
    ADAM_BETA2, ADAM_EPSILON, BATCH_SIZE, DATA, DECAY_STEPS, DEVICES, DTYPE, EPOCHS, EVAL_EXAMPLES,
    GRAD_CLIP, LR, MIN_LR_RATIO, MODEL_KIND, PACK, STEPS_PER_EPOCH, VALID_EXAMPLES, WARMUP_STEPS,
    WEIGHT_DECAY,
};
use crate::model::ModelKind;
use crate::precision::Precision;
use crate::text::echo;

impl TrainConfig {
    /// Checks every value, the task's and the model's included, before anything is built
    /// or written; the error names the flag and the field.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.check_paths()?;
        self.check_scope()?;
        self.task.validate()?;
        self.model.validate()?;
        self.kind().validate(self)?;
        anyhow::ensure!(
            self.min_lr_ratio > 0.0 && self.min_lr_ratio <= 1.0,
            "{} must be in (0, 1], got {}",
            MIN_LR_RATIO.name(),
            self.min_lr_ratio
        );
        anyhow::ensure!(
            self.adam_epsilon > 0.0 && self.adam_epsilon.is_finite(),
            "{} must be positive and finite, got {}",
            ADAM_EPSILON.name(),
            self.adam_epsilon
        );
        anyhow::ensure!(
            self.adam_beta2 > 0.0 && self.adam_beta2 < 1.0,
            "{} must be in (0, 1), got {}",
            ADAM_BETA2.name(),
            self.adam_beta2
        );
        for (field, value) in [
            (BATCH_SIZE, self.batch_size),
            (STEPS_PER_EPOCH, self.steps_per_epoch),
            (EPOCHS, self.epochs),
            (VALID_EXAMPLES, self.valid_examples),
            (EVAL_EXAMPLES, self.eval_examples),
        ] {
            anyhow::ensure!(value >= 1, "{} must be at least 1, got 0", field.name());
        }
        anyhow::ensure!(
            self.lr > 0.0 && self.lr <= 1.0,
            "{} must be in (0, 1], got {}",
            LR.name(),
            self.lr
        );
        anyhow::ensure!(
            self.grad_clip > 0.0 && self.grad_clip.is_finite(),
            "{} must be positive and finite, got {}",
            GRAD_CLIP.name(),
            self.grad_clip
        );
        anyhow::ensure!(
            self.weight_decay >= 0.0 && self.weight_decay.is_finite(),
            "{} must be finite and not negative, got {}",
            WEIGHT_DECAY.name(),
            self.weight_decay
        );
        // Every step's examples are numbered: (epoch x steps + step) x batch + row.
        let examples = self
            .epochs
            .checked_mul(self.steps_per_epoch)
            .and_then(|steps| steps.checked_mul(self.batch_size))
            .filter(|&n| n < 1 << 53);
        anyhow::ensure!(
            examples.is_some(),
            "{} {} x {} {} x {} {} is more training examples than can be counted (at most \
             2^53)",
            EPOCHS.name(),
            self.epochs,
            STEPS_PER_EPOCH.name(),
            self.steps_per_epoch,
            BATCH_SIZE.name(),
            self.batch_size
        );
        if let Some(warmup) = self.warmup_steps {
            anyhow::ensure!(
                warmup < self.total_steps(),
                "{} = {warmup} must be below the run's {} steps ({} x {}); leave it out for \
                 a tenth of the run",
                WARMUP_STEPS.name(),
                self.total_steps(),
                EPOCHS.name(),
                STEPS_PER_EPOCH.name(),
            );
        }
        anyhow::ensure!(
            !self.pack || self.model.kind == ModelKind::DecoderOnly,
            "{} packs the decoder-only model's sequences; the encoder-decoder ({}) trains on \
             padded batches",
            PACK.name(),
            MODEL_KIND.name(),
        );
        if let Some(decay) = self.decay_steps {
            anyhow::ensure!(decay >= 1, "{} must be at least 1", DECAY_STEPS.name());
        }
        // The schedule's own refusals (Burn's, of its rates), before anything is written.
        self.lr_schedule()?;
        let n = self.devices.count();
        anyhow::ensure!(
            n >= 1,
            "{} must name at least one device, got {}",
            DEVICES.name(),
            self.devices
        );
        if n > 1 {
            anyhow::ensure!(
                self.batch_size.is_multiple_of(n),
                "{} = {}: the batch is shared among {} {}, which needs a multiple of {n}",
                BATCH_SIZE.name(),
                self.batch_size,
                DEVICES.name(),
                self.devices
            );
            anyhow::ensure!(
                self.dtype != Precision::F16,
                "{} f16 with {} {}: f16's loss scale is one for the whole step, and the \
                 devices would each change it; use bf16 (no loss scale) or one device",
                DTYPE.name(),
                DEVICES.name(),
                self.devices
            );
        }
        Ok(())
    }

    /// Refuses a field that has no effect on the run's task (`--block-size` on a synthetic
    /// task, `--max-len` on text, ...; the table is [`fields::TEXT_ONLY`] and
    /// [`fields::SYNTHETIC_ONLY`]): set to anything but the task's default, it would be
    /// stored and ignored.
    fn check_scope(&self) -> anyhow::Result<()> {
        let (ignored, whose, hint) = self.kind().ignored_fields();
        let [given, defaults] = [self, &Self::defaults(self.task.task)]
            .map(|c| serde_json::to_value(c).unwrap_or(Value::Null));
        for field in ignored {
            let value = lookup(&given, field.path);
            if value == lookup(&defaults, field.path) {
                continue;
            }
            let value = value.map(|v| match v {
                Value::String(text) => echo(text),
                v => echo(&v.to_string()),
            });
            anyhow::bail!(
                "{} = {}: has no effect on the {} task ({whose}); leave it out{hint}",
                field.name(),
                value.unwrap_or_default(),
                self.task.task.name(),
            );
        }
        Ok(())
    }

    /// Checks that the paths of the configuration are UTF-8, as `config.json` must hold
    /// them.
    pub(super) fn check_paths(&self) -> anyhow::Result<()> {
        if let Some(data) = &self.task.data {
            anyhow::ensure!(
                data.to_str().is_some(),
                "{} {}: the path is not UTF-8, and a run's config.json (JSON) cannot hold it; \
                 rename the file or a folder on its path",
                DATA.name(),
                echo(&data.to_string_lossy())
            );
        }
        Ok(())
    }
}
