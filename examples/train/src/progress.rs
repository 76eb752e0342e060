//! What a run prints while it trains: a line every `log_every` steps (and off a terminal at
//! least every 5 seconds) (step, epoch, loss,
//! token accuracy, learning rate, tokens per second, time left) and one per epoch (the
//! epoch's training and validation loss and accuracy); in a terminal, a status line
//! between them that updates in place. The learner's summary (the model and its metrics
//! table) goes to a file of the run directory, not to the screen.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

/// Steps between two progress lines, by default.
pub const LOG_EVERY: usize = 20;

/// What the run is: the numbers the lines put progress against.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Epochs of the whole run.
    pub epochs: usize,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Mean tokens a step trains on (for tokens per second).
    pub tokens_per_step: f64,
    /// Steps between two progress lines.
    pub log_every: usize,
    /// The devices a step runs on: each reports its share of the step (its loss and
    /// accuracy), and a step is done when all have.
    pub shares: usize,
}

/// Where a run got to, shared with the trainer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reached {
    /// The last step done, counted over the whole run (0: none).
    pub step: usize,
    /// The training loss of this invocation's first step.
    pub first_loss: Option<f64>,
    /// The mean training loss of the last epoch that ended.
    pub epoch_loss: Option<f64>,
    /// The first step whose training loss was not finite: the run stops there.
    pub diverged: Option<usize>,
}

/// A running mean of per-batch values, each with its weight.
#[derive(Clone, Copy, Debug, Default)]
struct Mean {
    sum: f64,
    weight: f64,
}

impl Mean {
    fn add(&mut self, value: f64, weight: f64) {
        self.sum += value * weight;
        self.weight += weight;
    }

    fn get(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.sum / self.weight)
    }
}

/// Loss and token accuracy over a split of an epoch.
#[derive(Clone, Copy, Debug, Default)]
struct SplitMeans {
    loss: Mean,
    accuracy: Mean,
}

/// The longest a run off a terminal stays silent between two step lines.
const QUIET_AT_MOST: Duration = Duration::from_secs(5);

/// The renderer the trainer gives the learner.
pub struct Progress {
    plan: Plan,
    /// A terminal: the status line updates in place.
    interactive: bool,
    summary_file: PathBuf,
    reached: Arc<Mutex<Reached>>,
    names: HashMap<MetricId, String>,
    training: bool,
    epoch: usize,
    step_in_epoch: usize,
    /// This step's loss, accuracy and learning rate.
    loss: Option<f64>,
    accuracy: Option<f64>,
    lr: Option<f64>,
    /// The shares of the step under way reported so far: their count, and the mean of
    /// their losses and accuracies.
    shares_in: usize,
    step_means: SplitMeans,
    train: SplitMeans,
    valid: SplitMeans,
    /// The first step of this invocation and when it ended; the epoch's start.
    first: Option<(usize, Instant)>,
    epoch_started: Instant,
    drawn: Instant,
}

impl Progress {
    /// A renderer for `plan`, printing lines (with a status line in place when stdout is a
    /// terminal), writing the learner's summary to `summary_file` and where the run got
    /// to into `reached`.
    pub fn new(plan: Plan, summary_file: PathBuf, reached: Arc<Mutex<Reached>>) -> Self {
        use std::io::IsTerminal;
        Self {
            plan,
            interactive: std::io::stdout().is_terminal(),
            summary_file,
            reached,
            names: HashMap::new(),
            training: true,
            epoch: 1,
            step_in_epoch: 0,
            loss: None,
            accuracy: None,
            lr: None,
            shares_in: 0,
            step_means: SplitMeans::default(),
            train: SplitMeans::default(),
            valid: SplitMeans::default(),
            first: None,
            epoch_started: Instant::now(),
            drawn: Instant::now(),
        }
    }

    /// Whether step `step` (just done) gets a line: every `log_every` steps and the last,
    /// and off a terminal whenever the last line is [`QUIET_AT_MOST`] old, whatever the
    /// steps take.
    fn line_due(&self, step: usize) -> bool {
        step.is_multiple_of(self.plan.log_every.max(1))
            || step == self.total_steps()
            || (!self.interactive && self.drawn.elapsed() >= QUIET_AT_MOST)
    }

    fn total_steps(&self) -> usize {
        self.plan.epochs * self.plan.steps_per_epoch
    }

    fn step(&self) -> usize {
        (self.epoch - 1) * self.plan.steps_per_epoch + self.step_in_epoch
    }

    /// `step 120/800  epoch 2/8  loss 1.8342  acc 41.21%  lr 2.95e-3  46.7k tok/s  ETA 0:42`
    fn status(&self) -> String {
        let step = self.step();
        let mut line = format!(
            "step {step:>w$}/{}  epoch {}/{}",
            self.total_steps(),
            self.epoch,
            self.plan.epochs,
            w = self.total_steps().to_string().len(),
        );
        if let Some(loss) = self.loss {
            line += &format!("  loss {loss:.4}");
        }
        if let Some(accuracy) = self.accuracy {
            line += &format!("  acc {accuracy:.2}%");
        }
        if let Some(lr) = self.lr {
            line += &format!("  lr {lr:.2e}");
        }
        if let Some((first, at)) = self.first {
            // The clock started as step `first` ended: the steps done since.
            let steps = (step - first) as f64;
            let seconds = at.elapsed().as_secs_f64().max(1e-9);
            let rate = steps / seconds;
            let tokens = rate * self.plan.tokens_per_step;
            let left = (self.total_steps() - step) as f64 / rate;
            if step > first {
                line += &format!("  {}  ETA {}", per_second(tokens), clock(left));
            }
        }
        line
    }

    /// Prints a line that stays (clearing the status line in a terminal).
    fn print(&self, line: &str) {
        let mut out = std::io::stdout().lock();
        let clear = if self.interactive { "\r\x1b[2K" } else { "" };
        let _ = writeln!(out, "{clear}{line}");
        let _ = out.flush();
    }

    fn record(&mut self, state: MetricState) {
        let MetricState::Numeric(entry, Some(value)) = state else {
            return;
        };
        let Some(name) = self.names.get(&entry.metric_id).cloned() else {
            return;
        };
        let (value, weight, last) = match value {
            NumericEntry::Value(v) => (v, 1.0, false),
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (aggregated_value, count as f64, false),
            NumericEntry::Final(v) => (v, 0.0, true),
        };
        let means = match self.training {
            true => &mut self.train,
            false => &mut self.valid,
        };
        let mean = match name.as_str() {
            "Loss" => &mut means.loss,
            "Accuracy" => &mut means.accuracy,
            _ => {
                if self.training && name == "Learning Rate" && !last {
                    self.lr = Some(value);
                }
                return;
            }
        };
        match last {
            // The epoch's own value replaces the running mean.
            true => {
                *mean = Mean {
                    sum: value,
                    weight: 1.0,
                }
            }
            false => mean.add(value, weight),
        }
        if self.training && !last {
            match name.as_str() {
                "Loss" => self.step_means.loss.add(value, 1.0),
                _ => self.step_means.accuracy.add(value, 1.0),
            }
        }
    }
}

/// `46.7k tok/s`.
fn per_second(tokens: f64) -> String {
    match tokens >= 1e4 {
        true => format!("{:.1}k tok/s", tokens / 1e3),
        false => format!("{tokens:.0} tok/s"),
    }
}

/// `1:02:03` or `2:03`.
fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s >= 3600 {
        true => format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60),
        false => format!("{}:{:02}", s / 60, s % 60),
    }
}

impl MetricsRendererTraining for Progress {
    fn update_train(&mut self, state: MetricState) {
        self.record(state);
    }

    fn update_valid(&mut self, state: MetricState) {
        self.record(state);
    }

    fn on_train_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        if let Some(summary) = summary {
            crate::run_dir::write_atomically(
                &self.summary_file,
                format!("{summary}\n").as_bytes(),
            )?;
        }
        Ok(())
    }
}

impl TrainingProgressLogger for Progress {
    fn start(
        &mut self,
        _total_epochs: usize,
        starting_epoch: usize,
        _total_items: Option<usize>,
        _label: Option<&str>,
    ) {
        self.epoch = starting_epoch.max(1);
    }

    fn update_epoch(&mut self, epoch: usize) {
        let (train, valid) = (self.train, self.valid);
        let part = |m: SplitMeans| match (m.loss.get(), m.accuracy.get()) {
            (Some(loss), Some(acc)) => format!("loss {loss:.4} acc {acc:.2}%"),
            // The text task: nats and bits per character.
            (Some(loss), None) => {
                format!("loss {loss:.4} ({:.3} bits)", loss / std::f64::consts::LN_2)
            }
            _ => "—".into(),
        };
        self.print(&format!(
            "epoch {epoch}/{} done: train {}, valid {} ({:.1} s)",
            self.plan.epochs,
            part(train),
            part(valid),
            self.epoch_started.elapsed().as_secs_f64()
        ));
        if let Ok(mut reached) = self.reached.lock() {
            reached.epoch_loss = train.loss.get();
        }
        self.epoch = epoch + 1;
        self.step_in_epoch = 0;
        self.train = SplitMeans::default();
        self.valid = SplitMeans::default();
        self.epoch_started = Instant::now();
    }

    fn start_split(&mut self, split: &str, _total_items: usize) {
        self.training = split.eq_ignore_ascii_case("train");
    }

    fn update_split(&mut self, items_processed: usize) {
        if !self.training {
            return;
        }
        // On several devices, each reports its share of the step: the step is done when
        // all have, its loss and accuracy the mean of theirs.
        self.shares_in += 1;
        if self.shares_in < self.plan.shares.max(1) {
            return;
        }
        self.shares_in = 0;
        let step = std::mem::take(&mut self.step_means);
        self.loss = step.loss.get();
        self.accuracy = step.accuracy.get().or(self.accuracy);
        self.step_in_epoch = items_processed.div_ceil(self.plan.batch_size);
        let step = self.step();
        if self.first.is_none() {
            self.first = Some((step, Instant::now()));
        }
        if let Ok(mut reached) = self.reached.lock() {
            reached.step = step;
            if reached.first_loss.is_none() {
                reached.first_loss = self.loss;
            }
            if reached.diverged.is_none() && self.loss.is_some_and(|l| !l.is_finite()) {
                reached.diverged = Some(step);
                crate::interrupt::stop_learner("the training loss is not finite");
            }
        }
        if self.line_due(step) {
            self.print(&self.status());
            self.drawn = Instant::now();
        } else if self.interactive && self.drawn.elapsed() > Duration::from_millis(100) {
            let mut out = std::io::stdout().lock();
            let _ = write!(out, "\r\x1b[2K{}", self.status());
            let _ = out.flush();
            self.drawn = Instant::now();
        }
    }

    fn end_split(&mut self) {}

    fn end(&mut self) {
        if self.interactive {
            self.print("");
        }
    }

    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for Progress {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRendererEvaluation for Progress {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl MetricsRenderer for Progress {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names
            .insert(definition.metric_id, definition.name.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_rates_read_well() {
        assert_eq!(clock(42.4), "0:42");
        assert_eq!(clock(3723.0), "1:02:03");
        assert_eq!(per_second(46_728.0), "46.7k tok/s");
        assert_eq!(per_second(812.0), "812 tok/s");
    }

    #[test]
    fn off_a_terminal_a_line_comes_at_least_every_five_seconds() {
        let plan = Plan {
            epochs: 2,
            steps_per_epoch: 1000,
            batch_size: 8,
            tokens_per_step: 64.0,
            log_every: 100,
            shares: 1,
        };
        let file = std::env::temp_dir().join("mha-progress-unused.txt");
        let mut progress = Progress::new(plan, file, Arc::default());
        progress.interactive = false;
        assert!(progress.line_due(100) && progress.line_due(2000));
        assert!(!progress.line_due(101), "a line just drawn");
        progress.drawn = Instant::now() - QUIET_AT_MOST;
        assert!(progress.line_due(101), "five seconds without a line");
        // In a terminal the status line updates in place instead.
        progress.interactive = true;
        assert!(!progress.line_due(101));
    }
}
