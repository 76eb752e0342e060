//! What each head does, from its attention weights: how spread its weight is (entropy),
//! how far it looks, its strongest query-to-key link, and how much of its weight goes to
//! the same position, the previous one and the first token. [`HeadReport`] prints as an
//! aligned table and serialises to JSON.
//!
//! With attention sinks ([`AttentionMask::sinks`]) a row's weights over the keys sum to
//! less than 1 (the sink takes the rest) and are read as they are: a head that parks its
//! weight on its sink has small weights everywhere, and the entropy of what is left; the
//! normalised entropy reads them scaled to sum to 1 (how evenly the rest is spread).

use core::fmt;
use std::collections::BTreeMap;

use burn::tensor::{Bool, Tensor};
use serde::{Deserialize, Serialize};

use crate::mask::AttentionMask;

/// One query-to-key link and its weight.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// The query position.
    pub query: usize,
    /// The key position.
    pub key: usize,
    /// Its weight, averaged over the rows of the batch that have it.
    pub weight: f64,
}

/// The statistics of one head, averaged over the query rows of a batch that count: rows
/// past a sequence's length (padding) and rows whose keys are all blocked (by the mask's
/// boolean part, its rule, or an additive bias low enough that attention gives the row
/// zeros: -5e29 and below, -16384 and below in f16, see [`AttentionMask::bias`]) are left
/// out.
/// Positions are counted from the start of each sequence, queries' and keys' alike: a
/// query's own position is where the mask's rule places it among the keys (the last `Tq`
/// of `Tk` for a causal mask aligned bottom-right, as in a decoding step's weights), its
/// row's index where the mask has no rule (cross-attention). A sequence starts at its
/// first key that some query row sees through the mask's boolean part or a blocking
/// bias: the keys before it are left padding (a batch padded on the left for
/// generation), not positions, and where the rule places queries among the keys, the
/// rows placed on them are padding too and left out. (A window given as a boolean part or
/// a bias, not as the mask's rule, reads so too where no row sees the first keys: give
/// windows as [`AttentionMask::sliding_window`].)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeadStats {
    /// The head.
    pub head: usize,
    /// The query rows averaged.
    pub rows: usize,
    /// Mean entropy of a row's weights, in nats: `-Σ p ln p`.
    pub entropy: f64,
    /// Mean entropy divided by the log of the row's visible keys: 0 for a head that puts
    /// all its weight on one key, 1 for one that spreads it evenly (rows that see a single
    /// key count as 0). With sinks, of a row's weights over its keys scaled to sum to 1:
    /// how evenly it spreads what it does not give its sink (a row that gives it all
    /// counts as 0).
    pub normalized_entropy: f64,
    /// Mean attention distance, in positions: `Σ p |key - query|`.
    pub distance: f64,
    /// The link with the largest mean weight, among the rows that see more than one key
    /// (a row that sees one key gives it all its weight, learned or not).
    pub strongest: Option<Link>,
    /// Mean share of the weight on the query's own position.
    pub same: f64,
    /// Mean share of the weight on the position before the query's (rows at position 0,
    /// which have none, are left out of this mean).
    pub previous: f64,
    /// Mean share of the weight on the first token.
    pub first: f64,
}

/// The statistics of every head of one attention layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerStats {
    /// The layer's name, as the report prints it (`"layer 0 self"`, say).
    pub name: String,
    /// One entry per head, in order.
    pub heads: Vec<HeadStats>,
}

impl LayerStats {
    /// The statistics of the weights `[B, H, Tq, Tk]` one attention layer computed under
    /// `mask` (what blocked keys: padding, the causal rule...), over the first
    /// `query_lengths[b]` query rows of batch row `b` (all rows when `None`).
    ///
    /// Positions count from the first key of the weights: the sequence's first token,
    /// except for the weights of a step through a sliding cache once its ring has wrapped,
    /// whose first key is the window's oldest (`first` is then the share of that key, and
    /// the links' positions count from it).
    ///
    /// # Panics
    /// If `query_lengths` does not have `B` entries, or the mask does not broadcast to
    /// the weights.
    pub fn from_weights(
        name: impl Into<String>,
        weights: Tensor<4>,
        mask: &AttentionMask,
        query_lengths: Option<&[usize]>,
    ) -> Self {
        let mut stats = LayerStatsBuilder::new(name);
        stats.add(weights, mask, query_lengths);
        stats.finish()
    }
}

/// The statistics of one attention layer gathered batch by batch, so that a report over
/// many examples holds one batch's weights at a time: [`add`](Self::add) each batch's
/// weights, then [`finish`](Self::finish) gives what [`LayerStats::from_weights`] would
/// give on all the batches' rows at once (the batches may differ in size and length).
#[derive(Clone, Debug)]
pub struct LayerStatsBuilder {
    name: String,
    heads: Vec<Accumulator>,
}

impl LayerStatsBuilder {
    /// No rows yet, for the layer `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            heads: Vec::new(),
        }
    }

    /// Adds the rows of one batch: the weights `[B, H, Tq, Tk]` the layer computed under
    /// `mask`, over the first `query_lengths[b]` query rows of batch row `b` (all rows
    /// when `None`).
    ///
    /// # Panics
    /// If `query_lengths` does not have `B` entries, the mask does not broadcast to the
    /// weights, or `H` differs from an earlier batch's.
    pub fn add(
        &mut self,
        weights: Tensor<4>,
        mask: &AttentionMask,
        query_lengths: Option<&[usize]>,
    ) {
        let dims = weights.dims();
        let [batch, heads, queries, keys] = dims;
        mask.check(dims, &weights.device());
        if let Some(lengths) = query_lengths {
            assert_eq!(
                lengths.len(),
                batch,
                "LayerStats::from_weights: {} query lengths for a batch of {batch}",
                lengths.len()
            );
        }
        if self.heads.is_empty() {
            self.heads = (0..heads).map(|_| Accumulator::default()).collect();
        }
        assert_eq!(
            self.heads.len(),
            heads,
            "LayerStatsBuilder::add: weights of {heads} heads after batches of {}",
            self.heads.len()
        );
        // Read as integers: backends store booleans as bytes or as u32.
        let read = |b: Tensor<4, Bool>| -> Vec<bool> {
            b.expand(dims)
                .int()
                .into_data()
                .convert::<i64>()
                .try_into_vec::<i64>()
                .expect("an integer tensor converts to i64")
                .into_iter()
                .map(|x| x != 0)
                .collect()
        };
        // An additive bias of -inf blocks its key too (PyTorch's float masks), as does one
        // low enough that attention reads it so for scores of the weights' dtype.
        let or = |a: Option<Vec<bool>>, b: Option<Vec<bool>>| match (a, b) {
            (Some(a), Some(b)) => Some(a.into_iter().zip(b).map(|(a, b)| a || b).collect()),
            (a, b) => a.or(b),
        };
        let by_rule = mask.to_blocked(queries, keys, &weights.device()).map(read);
        let by_bias = mask.blocking_bias(weights.dtype()).map(read);
        // What the given tensors block (the boolean part and a blocking bias), apart from
        // the rule: the keys before the first one some row of a sequence sees there are
        // its left padding.
        let given = or(mask.blocked().cloned().map(read), by_bias.clone());
        let blocked = or(by_rule, by_bias);
        let w: Vec<f32> = weights
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("a float tensor converts to f32");
        // Positions counted from each packed sequence's start; query `q` at key
        // `q + offset` where the mask places queries among the keys (a causal or windowed
        // rule, or an alignment: a decoding step's `Tq` queries are the last of `Tk`
        // keys), at key `q` elsewhere.
        let visibility = mask.visibility(queries, keys);
        let placed = visibility.blocks() || mask.is_aligned();
        let offset = match placed {
            true => visibility.offset,
            false => 0,
        };
        let rows_of = |b: usize| query_lengths.map_or(queries, |l| l[b].min(queries));
        // Per batch row, its first key that some row of some head sees through the given
        // tensors (0 where they block nothing, or every key).
        let padded: Vec<usize> = (0..batch)
            .map(|b| {
                let Some(given) = &given else { return 0 };
                (0..heads)
                    .flat_map(|h| {
                        (0..rows_of(b)).map(move |q| ((b * heads + h) * queries + q) * keys)
                    })
                    .filter_map(|at| given[at..at + keys].iter().position(|&x| !x))
                    .min()
                    .unwrap_or(0)
            })
            .collect();
        for (h, acc) in self.heads.iter_mut().enumerate() {
            for (b, &pad) in padded.iter().enumerate() {
                for q in 0..rows_of(b) {
                    let own = (q as i64).saturating_add(offset);
                    let start = visibility.sequence_start(b, q).max(pad);
                    if placed && pad > 0 && own < pad as i64 {
                        // A query placed on a key of the left padding: padding itself.
                        continue;
                    }
                    let at = ((b * heads + h) * queries + q) * keys;
                    let blocked = blocked.as_ref().map(|blocked| &blocked[at..at + keys]);
                    let visible = match blocked {
                        Some(blocked) => blocked.iter().filter(|&&x| !x).count(),
                        None => keys,
                    };
                    if visible > 0 {
                        let row = Row {
                            own,
                            start,
                            blocked,
                            visible,
                        };
                        acc.row(row, &w[at..at + keys]);
                    }
                }
            }
        }
    }

    /// The layer's statistics over every row added.
    pub fn finish(self) -> LayerStats {
        LayerStats {
            name: self.name,
            heads: self
                .heads
                .into_iter()
                .enumerate()
                .map(|(h, acc)| acc.finish(h))
                .collect(),
        }
    }
}

/// One query row of a head's weights, as [`Accumulator::row`] reads it.
struct Row<'a> {
    /// The key at the query's own position (may lie before or past the keys).
    own: i64,
    /// The first key of the query's sequence.
    start: usize,
    /// Which keys the row does not see, where some may be blocked.
    blocked: Option<&'a [bool]>,
    /// Keys it sees.
    visible: usize,
}

/// Sums over the rows of one head.
#[derive(Clone, Debug, Default)]
struct Accumulator {
    rows: usize,
    entropy: f64,
    normalized: f64,
    distance: f64,
    same: f64,
    previous: f64,
    previous_rows: usize,
    first: f64,
    /// Per link, by query position, then key position: sum of weights, rows (only the
    /// query positions some row was at: a decoding step's one query may be at any).
    links: BTreeMap<usize, Vec<(f64, usize)>>,
}

impl Accumulator {
    fn row(&mut self, row: Row, weights: &[f32]) {
        let Row {
            own,
            start,
            blocked,
            visible,
        } = row;
        let at = |key: i64| {
            usize::try_from(key)
                .ok()
                .and_then(|k| weights.get(k))
                .map_or(0.0, |&p| p as f64)
        };
        let mut entropy = 0.0;
        let mut distance = 0.0;
        let mut total = 0.0;
        for (k, &p) in weights.iter().enumerate() {
            let p = p as f64;
            total += p;
            if p > 0.0 {
                entropy -= p * p.ln();
            }
            distance += p * (k as i64 - own).unsigned_abs() as f64;
            // The link of a key the row sees (a blocked one would count a weight of 0),
            // between positions counted from the sequence's start.
            let seen = blocked.is_none_or(|blocked| !blocked[k]);
            if visible > 1 && seen && k >= start && own >= start as i64 {
                let query = own as usize - start;
                let row = self.links.entry(query).or_default();
                if row.len() < weights.len() - start {
                    row.resize(weights.len() - start, (0.0, 0));
                }
                let link = &mut row[k - start];
                link.0 += p;
                link.1 += 1;
            }
        }
        self.rows += 1;
        self.entropy += entropy;
        if visible > 1 && total > 0.0 {
            // Of the weights over the keys made to sum to 1 (with sinks they sum to
            // `total` < 1): `H(p / s) = H(p) / s + ln s`.
            let spread = entropy / total + total.ln();
            self.normalized += spread / (visible as f64).ln();
        }
        self.distance += distance;
        self.same += at(own);
        if own > start as i64 && own - 1 < weights.len() as i64 {
            self.previous += at(own - 1);
            self.previous_rows += 1;
        }
        self.first += at(start as i64);
    }

    fn finish(self, head: usize) -> HeadStats {
        let mean = |sum: f64, n: usize| if n == 0 { 0.0 } else { sum / n as f64 };
        let strongest =
            self.links
                .iter()
                .flat_map(|(&query, row)| {
                    row.iter().enumerate().filter(|(_, (_, n))| *n > 0).map(
                        move |(key, &(sum, n))| Link {
                            query,
                            key,
                            weight: sum / n as f64,
                        },
                    )
                })
                .fold(None, |best: Option<Link>, link| match best {
                    Some(b) if b.weight >= link.weight => Some(b),
                    _ => Some(link),
                });
        HeadStats {
            head,
            rows: self.rows,
            entropy: mean(self.entropy, self.rows),
            normalized_entropy: mean(self.normalized, self.rows),
            distance: mean(self.distance, self.rows),
            strongest,
            same: mean(self.same, self.rows),
            previous: mean(self.previous, self.previous_rows),
            first: mean(self.first, self.rows),
        }
    }
}

/// The statistics of every head of a module, layer by layer. `Display` prints an aligned
/// table; `serde` writes JSON.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HeadReport {
    /// One entry per attention layer.
    pub layers: Vec<LayerStats>,
}

impl HeadReport {
    /// A report of `layers`.
    pub fn new(layers: Vec<LayerStats>) -> Self {
        Self { layers }
    }
}

impl fmt::Display for HeadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .layers
            .iter()
            .map(|l| l.name.len())
            .chain([5])
            .max()
            .unwrap_or(5);
        writeln!(
            f,
            "{:<width$}  {:>4}  {:>7}  {:>7}  {:>8}  {:>17}  {:>5}  {:>5}  {:>5}",
            "layer",
            "head",
            "entropy",
            "/ln(k)",
            "distance",
            "strongest q->k",
            "same",
            "prev",
            "first"
        )?;
        for layer in &self.layers {
            for h in &layer.heads {
                let strongest = match h.strongest {
                    Some(l) => format!("{:>3}->{:<3} ({:.2})", l.query, l.key, l.weight),
                    None => "-".into(),
                };
                writeln!(
                    f,
                    "{:<width$}  {:>4}  {:>7.3}  {:>7.3}  {:>8.2}  {:>17}  {:>5.2}  {:>5.2}  {:>5.2}",
                    layer.name,
                    h.head,
                    h.entropy,
                    h.normalized_entropy,
                    h.distance,
                    strongest,
                    h.same,
                    h.previous,
                    h.first
                )?;
            }
        }
        Ok(())
    }
}
