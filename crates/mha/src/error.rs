//! Errors a user can cause through a configuration.

use core::fmt;

/// A configuration value was rejected by `try_init`.
///
/// The message names the configuration, the field and the values, e.g.
/// `MultiHeadAttentionConfig.d_model: 100 is not divisible by n_heads = 3`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The configuration type, e.g. `MultiHeadAttentionConfig`.
    pub config: &'static str,
    /// The offending field.
    pub field: &'static str,
    /// What is wrong, with the values.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}: {}", self.config, self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// Checks shared by the configurations; each returns the error naming `config.field`.
pub(crate) struct Check(pub &'static str);

impl Check {
    fn err(&self, field: &'static str, message: String) -> ConfigError {
        ConfigError {
            config: self.0,
            field,
            message,
        }
    }

    /// `value > 0`.
    pub fn nonzero(&self, field: &'static str, value: usize) -> Result<(), ConfigError> {
        if value == 0 {
            return Err(self.err(field, "must be at least 1, got 0".into()));
        }
        Ok(())
    }

    /// `value % by == 0`.
    pub fn divisible(
        &self,
        field: &'static str,
        value: usize,
        by_name: &str,
        by: usize,
    ) -> Result<(), ConfigError> {
        if by != 0 && !value.is_multiple_of(by) {
            return Err(self.err(
                field,
                format!("{value} is not divisible by {by_name} = {by}"),
            ));
        }
        Ok(())
    }

    /// A probability in `[0, 1)`.
    pub fn probability(&self, field: &'static str, value: f64) -> Result<(), ConfigError> {
        if !(0.0..1.0).contains(&value) {
            return Err(self.err(field, format!("must be in [0, 1), got {value}")));
        }
        Ok(())
    }

    /// A finite value above 0.
    pub fn positive(&self, field: &'static str, value: f64) -> Result<(), ConfigError> {
        if !(value.is_finite() && value > 0.0) {
            return Err(self.err(field, format!("must be positive and finite, got {value}")));
        }
        Ok(())
    }
}
