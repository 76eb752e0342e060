//! Sort: the output is the input sorted.

use super::{TaskRules, tokens};

/// The output is the input sorted.
pub struct SortTask;

impl TaskRules for SortTask {
    fn name(&self) -> &'static str {
        "sort"
    }

    fn output(&self, symbols: &[usize]) -> Vec<usize> {
        let mut output = tokens(symbols);
        output.sort_unstable();
        output
    }
}
