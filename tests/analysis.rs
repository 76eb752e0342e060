//! Looking inside: head statistics against values computed by hand, head masks that
//! change nothing when they keep every head, pruned modules equal to masked ones (values
//! and gradients, GQA, positions, blocks and stacks, saved and loaded), importance that
//! finds the head a test makes decisive, and attention maps that draw what they are given.

use burn::module::{Module, Param};
use burn::tensor::{Bool, Device, Tensor, TensorData};
use mha::analysis::{
    HeadImportance, HeadMask, HeadReport, Heads, Inspect, LayerStats, LayerStatsBuilder, PrunePlan,
};
use mha::{
    AttentionMask, AttentionWeights, Decoder, DecoderBlockConfig, DecoderConfig,
    EncoderBlockConfig, EncoderConfig, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
    Positions, PruneError, StackInput,
};

use crate::util::{Backend, assert_close, backends, panic_message, randn};

fn close(what: &str, got: f64, want: f64) {
    assert!((got - want).abs() < 1e-6, "{what}: got {got}, want {want}");
}

/// `[1, 4, 4, 4]` weights of four heads over four causal positions: uniform over the
/// visible keys, all on the first token, all on the same position, all on the previous
/// one (the first row on itself).
fn fixed_weights() -> Vec<f32> {
    let mut w = vec![0.0f32; 4 * 16];
    for q in 0..4 {
        for k in 0..=q {
            w[q * 4 + k] = 1.0 / (q + 1) as f32;
        }
        w[16 + q * 4] = 1.0;
        w[32 + q * 4 + q] = 1.0;
        w[48 + q * 4 + q.saturating_sub(1)] = 1.0;
    }
    w
}

/// A bias of -inf blocks in the statistics as the causal rule does, and so does one at
/// the scores' blocked value or below (-1e30, -1e35), which attention blocks too.
#[test]
fn a_bias_of_minus_infinity_blocks_in_the_statistics_as_the_causal_rule_does() {
    for be in backends() {
        for blocked in [f32::NEG_INFINITY, -1e30, -1e35] {
            let weights =
                Tensor::<4>::from_data(TensorData::new(fixed_weights(), [1, 4, 4, 4]), &be.device);
            // The causal rule as PyTorch's float mask: -inf above the diagonal.
            let above: Vec<f32> = (0..16)
                .map(|i| match i % 4 > i / 4 {
                    true => blocked,
                    false => 0.0,
                })
                .collect();
            let bias = Tensor::<4>::from_data(TensorData::new(above, [1, 1, 4, 4]), &be.device);
            let by_rule =
                LayerStats::from_weights("l", weights.clone(), &AttentionMask::causal(), None);
            let by_bias = LayerStats::from_weights("l", weights, &AttentionMask::bias(bias), None);
            assert_eq!(by_bias, by_rule, "[{}] {blocked}", be.name);
        }
        // Read at the weights' dtype, as attention reads it: an f32 bias of -1e9 blocks
        // in f16 (it is -inf there), -65504 in f16 weights too, but not in f32 weights.
        let f16 = burn::tensor::FloatDType::F16;
        if be.other_float_dtypes().contains(&f16) {
            let bias_of = |value: f32| {
                let above: Vec<f32> = (0..16)
                    .map(|i| if i % 4 > i / 4 { value } else { 0.0 })
                    .collect();
                Tensor::<4>::from_data(TensorData::new(above, [1, 1, 4, 4]), &be.device)
            };
            let weights =
                Tensor::<4>::from_data(TensorData::new(fixed_weights(), [1, 4, 4, 4]), &be.device);
            let stats = |weights: Tensor<4>, mask: &AttentionMask| {
                LayerStats::from_weights("l", weights, mask, None)
            };
            let half = weights.clone().cast(f16);
            let by_rule = stats(half.clone(), &AttentionMask::causal());
            for value in [-1e9, -65504.0] {
                let by_bias = stats(half.clone(), &AttentionMask::bias(bias_of(value)));
                assert_eq!(by_bias, by_rule, "[{}] f16 weights, bias {value}", be.name);
            }
            let f32_rule = stats(weights.clone(), &AttentionMask::causal());
            let by_bias = stats(weights, &AttentionMask::bias(bias_of(-65504.0)));
            assert_ne!(by_bias, f32_rule, "[{}] f32 weights, bias -65504", be.name);
        }
    }
}

#[test]
fn the_normalised_entropy_of_rows_with_sinks_is_that_of_their_keys_share() {
    // Rows whose sink took 0.1, 0.5 and all: spread evenly over two keys (1), all on one
    // key (0), nothing left to spread (0); the entropy reads the weights as they are.
    for be in backends() {
        let weights = [0.45, 0.45, 0.5, 0.0, 0.0, 0.0];
        let weights =
            Tensor::<4>::from_data(TensorData::new(weights.to_vec(), [3, 1, 1, 2]), &be.device);
        let stats = LayerStats::from_weights("l", weights, &AttentionMask::none(), None);
        let head = &stats.heads[0];
        let name = |s: &str| format!("[{}] {s}", be.name);
        close(&name("normalised"), head.normalized_entropy, 1.0 / 3.0);
        let entropy = -(2.0 * 0.45 * 0.45f64.ln() + 0.5 * 0.5f64.ln()) / 3.0;
        close(&name("entropy"), head.entropy, entropy);
    }
}

#[test]
fn head_statistics_match_values_computed_by_hand() {
    for be in backends() {
        let weights =
            Tensor::<4>::from_data(TensorData::new(fixed_weights(), [1, 4, 4, 4]), &be.device);
        let stats = LayerStats::from_weights("layer 0", weights, &AttentionMask::causal(), None);
        let [uniform, first, same, previous] = &stats.heads[..] else {
            panic!("four heads");
        };
        let name = |h: &str, s: &str| format!("[{}] {h} head, {s}", be.name);
        let harmonic = (1.0 + 1.0 / 2.0 + 1.0 / 3.0 + 1.0 / 4.0) / 4.0;
        close(
            &name("uniform", "entropy"),
            uniform.entropy,
            (2f64.ln() + 3f64.ln() + 4f64.ln()) / 4.0,
        );
        // Row 0 sees one key and counts as 0; the others are exactly 1.
        close(
            &name("uniform", "normalised"),
            uniform.normalized_entropy,
            0.75,
        );
        close(
            &name("uniform", "distance"),
            uniform.distance,
            (0.0 + 0.5 + 1.0 + 1.5) / 4.0,
        );
        close(&name("uniform", "same"), uniform.same, harmonic);
        close(
            &name("uniform", "previous"),
            uniform.previous,
            (1.0 / 2.0 + 1.0 / 3.0 + 1.0 / 4.0) / 3.0,
        );
        close(&name("uniform", "first"), uniform.first, harmonic);
        // Row 0 sees one key and has no say; row 1 spreads over two keys.
        let link = uniform.strongest.expect("a link");
        assert_eq!(
            (link.query, link.key),
            (1, 0),
            "{}",
            name("uniform", "strongest")
        );
        close(&name("uniform", "strongest weight"), link.weight, 0.5);

        close(&name("first", "entropy"), first.entropy, 0.0);
        close(&name("first", "normalised"), first.normalized_entropy, 0.0);
        close(&name("first", "distance"), first.distance, 1.5);
        close(&name("first", "same"), first.same, 0.25);
        close(&name("first", "previous"), first.previous, 1.0 / 3.0);
        close(&name("first", "first"), first.first, 1.0);

        close(&name("same", "distance"), same.distance, 0.0);
        close(&name("same", "same"), same.same, 1.0);
        close(&name("same", "previous"), same.previous, 0.0);
        close(&name("same", "first"), same.first, 0.25);

        close(&name("previous", "distance"), previous.distance, 0.75);
        close(&name("previous", "same"), previous.same, 0.25);
        close(&name("previous", "previous"), previous.previous, 1.0);
        close(&name("previous", "first"), previous.first, 0.5);
        let link = previous.strongest.expect("a link");
        assert_eq!(
            (link.query, link.key),
            (1, 0),
            "{}",
            name("previous", "strongest")
        );
        close(&name("previous", "strongest weight"), link.weight, 1.0);
        let link = same.strongest.expect("a link");
        assert_eq!(
            (link.query, link.key),
            (1, 1),
            "{}",
            name("same", "strongest")
        );
        assert!(stats.heads.iter().all(|h| h.rows == 4));

        let report = HeadReport::new(vec![stats]);
        let table = report.to_string();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 5, "a header and a line per head:\n{table}");
        assert!(
            lines.iter().all(|l| l.len() == lines[0].len()),
            "aligned:\n{table}"
        );
        assert!(
            lines[2].contains("layer 0") && lines[2].contains("1.50"),
            "{table}"
        );
        let json = serde_json::to_string(&report).unwrap();
        assert_eq!(serde_json::from_str::<HeadReport>(&json).unwrap(), report);
    }
}

#[test]
fn padding_rows_and_fully_blocked_rows_are_left_out() {
    for be in backends() {
        // Two copies of the fixed weights; the second row's queries 2 and 3 are padding,
        // filled with weights that would change every statistic.
        let mut w = fixed_weights();
        let mut junk = fixed_weights();
        for h in 0..4 {
            for q in 2..4 {
                for k in 0..4 {
                    junk[h * 16 + q * 4 + k] = 0.25;
                }
            }
        }
        w.extend(junk);
        let weights = Tensor::<4>::from_data(TensorData::new(w.clone(), [2, 4, 4, 4]), &be.device);
        let stats = LayerStats::from_weights(
            "l",
            weights.clone(),
            &AttentionMask::causal(),
            Some(&[4, 2]),
        );
        let same = &stats.heads[2];
        assert_eq!(same.rows, 6, "[{}] rows counted", be.name);
        close(&format!("[{}] same head, same", be.name), same.same, 1.0);
        close(
            &format!("[{}] same head, entropy", be.name),
            same.entropy,
            0.0,
        );

        // Query row 3 of both batch rows blocked entirely: left out.
        let mut blocked = vec![false; 2 * 4 * 4];
        for b in 0..2 {
            for k in 0..4 {
                blocked[b * 16 + 3 * 4 + k] = true;
            }
        }
        let mask = AttentionMask::blocking(Tensor::<4, Bool>::from_data(
            TensorData::new(blocked, [2, 1, 4, 4]),
            &be.device,
        ));
        let stats = LayerStats::from_weights("l", weights, &mask, None);
        assert!(
            stats.heads.iter().all(|h| h.rows == 6),
            "[{}] {stats:?}",
            be.name
        );
    }
}

#[test]
fn statistics_gathered_batch_by_batch_are_those_of_all_rows_at_once() {
    for be in backends() {
        let w = fixed_weights();
        let full = Tensor::<4>::from_data(TensorData::new(w.clone(), [1, 4, 4, 4]), &be.device);
        // The same weights at 3 positions (a causal row gives the 4th key nothing).
        let short: Vec<f32> = (0..4)
            .flat_map(|h| (0..3).flat_map(move |q| (0..3).map(move |k| h * 16 + q * 4 + k)))
            .map(|i| w[i])
            .collect();
        let short = Tensor::<4>::from_data(TensorData::new(short, [1, 4, 3, 3]), &be.device);
        // All at once: the second row padded to 4, its last query left out.
        let joined = Tensor::<4>::from_data(
            TensorData::new([w.clone(), w].concat(), [2, 4, 4, 4]),
            &be.device,
        );
        let want = LayerStats::from_weights("l", joined, &AttentionMask::causal(), Some(&[4, 3]));
        // The shorter batch first: the links grow to the longer one's.
        let mut builder = LayerStatsBuilder::new("l");
        builder.add(short, &AttentionMask::causal(), None);
        builder.add(full, &AttentionMask::causal(), None);
        let got = builder.finish();
        assert_eq!(got.heads.len(), 4);
        for (g, w) in got.heads.iter().zip(&want.heads) {
            let what = |field: &str| format!("[{}] head {} {field}", be.name, w.head);
            assert_eq!(g.rows, w.rows, "{}", what("rows"));
            for (field, a, b) in [
                ("entropy", g.entropy, w.entropy),
                (
                    "normalized entropy",
                    g.normalized_entropy,
                    w.normalized_entropy,
                ),
                ("distance", g.distance, w.distance),
                ("same", g.same, w.same),
                ("previous", g.previous, w.previous),
                ("first", g.first, w.first),
            ] {
                close(&what(field), a, b);
            }
            let (gs, ws) = (g.strongest.unwrap(), w.strongest.unwrap());
            assert_eq!((gs.query, gs.key), (ws.query, ws.key), "{}", what("link"));
            close(&what("link weight"), gs.weight, ws.weight);
        }
    }
}

/// A key a row does not see is not one of its links: gathered batch by batch or padded
/// into one batch, the strongest link is the same (padding's blocked keys counted a weight
/// of 0 into the link's mean: 1 -> 2 fell from 0.8 to 0.4, behind 2 -> 2).
#[test]
fn a_blocked_key_is_not_a_link_of_the_row() {
    for be in backends() {
        let d = &be.device;
        let tensor =
            |values: Vec<f32>, dims| Tensor::<4>::from_data(TensorData::new(values, dims), d);
        let long = vec![0.4, 0.3, 0.3, 0.1, 0.1, 0.8, 0.1, 0.2, 0.7];
        let short = vec![0.5, 0.5, 0.1, 0.9];
        let none = AttentionMask::none();
        let mut builder = LayerStatsBuilder::new("l");
        builder.add(tensor(long.clone(), [1, 1, 3, 3]), &none, None);
        builder.add(tensor(short, [1, 1, 2, 2]), &none, None);
        let padded = vec![0.5, 0.5, 0.0, 0.1, 0.9, 0.0, 0.0, 0.0, 0.0];
        let joined = tensor([long, padded].concat(), [2, 1, 3, 3]);
        let padding = AttentionMask::key_lengths(&[3, 2], 3, d);
        let want = LayerStats::from_weights("l", joined, &padding, Some(&[3, 2]));
        let (got, want) = (builder.finish().heads[0].strongest, want.heads[0].strongest);
        assert_eq!(got, want, "[{}]", be.name);
        let want = want.unwrap();
        assert_eq!((want.query, want.key), (1, 2), "[{}] {want:?}", be.name);
        close(&format!("[{}] link weight", be.name), want.weight, 0.8);
    }
}

/// Positions are counted from each packed sequence's start: the first token is each
/// sequence's, the previous one never the sequence before's.
#[test]
fn statistics_count_positions_within_each_packed_sequence() {
    for be in backends() {
        let d = &be.device;
        let tensor =
            |values: Vec<f32>, dims| Tensor::<4>::from_data(TensorData::new(values, dims), d);
        // Two sequences of 2 in a row of 4; every row puts its weight on its sequence's
        // first token, which is the previous token of each second row.
        let first = [
            1., 0., 0., 0., 1., 0., 0., 0., 0., 0., 1., 0., 0., 0., 1., 0.,
        ];
        let packed = AttentionMask::packed(&[vec![0, 2, 4]]).and(AttentionMask::causal());
        let stats =
            LayerStats::from_weights("l", tensor(first.to_vec(), [1, 1, 4, 4]), &packed, None);
        let head = &stats.heads[0];
        close(&format!("[{}] first", be.name), head.first, 1.0);
        close(&format!("[{}] previous", be.name), head.previous, 1.0);
        close(&format!("[{}] distance", be.name), head.distance, 0.5);
        // The strongest link: each sequence's first token from its second, (1, 0).
        let strongest = head.strongest.unwrap();
        assert_eq!((strongest.query, strongest.key), (1, 0), "[{}]", be.name);
    }
}

/// A decoding step's weights (`Tq` queries, the last of `Tk` keys, under the causal
/// rule aligned bottom-right or at an offset) count each query at its own position among
/// the keys: their statistics are those of the same rows in the whole sequence's weights.
#[test]
fn a_decoding_steps_weights_count_positions_among_the_keys() {
    for be in backends() {
        let d = &be.device;
        let tensor =
            |values: Vec<f32>, dims| Tensor::<4>::from_data(TensorData::new(values, dims), d);
        // Row q of 4 causal positions: most weight on itself, some on the one before.
        let mut whole = vec![0.0f32; 16];
        for q in 0..4 {
            for k in 0..=q {
                whole[q * 4 + k] = 0.1 / q.max(1) as f32;
            }
            whole[q * 4 + q] = if q == 0 { 1.0 } else { 0.7 };
            if q > 0 {
                whole[q * 4 + q - 1] += 0.2;
            }
        }
        // The whole sequence's last row alone, then its last two rows.
        let causal = AttentionMask::causal();
        let cases = [
            (&whole[12..], 1, causal.clone()),
            (&whole[8..], 2, causal.clone()),
            (
                &whole[8..],
                2,
                causal.clone().aligned(mha::CausalAlignment::Offset(2)),
            ),
        ];
        for (rows, queries, mask) in cases {
            let what = format!("[{}] last {queries} rows, {mask:?}", be.name);
            let step = LayerStats::from_weights(
                "l",
                tensor(rows.to_vec(), [1, 1, queries, 4]),
                &mask,
                None,
            );
            let mut builder = LayerStatsBuilder::new("l");
            // The whole sequence's rows `4 - queries..`: the same rows, weights blocked
            // elsewhere by query lengths of the whole being unavailable, so built from
            // the full weights with the earlier rows blocked by a bias.
            let mut blocked = vec![0.0f32; 16];
            for v in blocked.iter_mut().take((4 - queries) * 4) {
                *v = f32::NEG_INFINITY;
            }
            let dead = AttentionMask::bias(tensor(blocked, [1, 1, 4, 4])).and(causal.clone());
            builder.add(tensor(whole.clone(), [1, 1, 4, 4]), &dead, None);
            let want = builder.finish();
            let (got, want) = (&step.heads[0], &want.heads[0]);
            assert_eq!(got.rows, want.rows, "{what}");
            close(&format!("{what} same"), got.same, want.same);
            close(&format!("{what} previous"), got.previous, want.previous);
            close(&format!("{what} distance"), got.distance, want.distance);
            close(&format!("{what} first"), got.first, want.first);
            close(&format!("{what} entropy"), got.entropy, want.entropy);
            assert_eq!(got.strongest, want.strongest, "{what}");
            close(&format!("{what} same, by hand"), got.same, 0.7);
        }
    }
}

/// A batch padded on the left (as for generation) counts positions from each sequence's
/// first token: its statistics, whole or a decoding step, are those of the same sequence
/// unpadded, its padding rows left out and its first token the first one seen.
#[test]
fn a_left_padded_batch_counts_positions_from_its_first_token() {
    for be in backends() {
        let d = &be.device;
        let tensor =
            |values: Vec<f32>, dims| Tensor::<4>::from_data(TensorData::new(values, dims), d);
        // Row q of 4 causal positions: 0.4 on the first token, 0.4 on itself (0.8 at
        // q = 1, all at q = 0), the rest spread over the others.
        let mut whole = [0.0f32; 16];
        for q in 0..4usize {
            let others = q.saturating_sub(1);
            for k in 1..q {
                whole[q * 4 + k] = 0.2 / others as f32;
            }
            whole[q * 4] += 0.4;
            whole[q * 4 + q] += if q == 0 { 0.6 } else { 0.4 };
            if q == 1 {
                whole[q * 4 + q] += 0.2;
            }
        }
        // The same rows behind 2 padding keys, the padding rows holding weights of their
        // own (a model writes something there) that must not count.
        let pad = 2;
        let keys = 4 + pad;
        let mut padded = vec![0.25f32; keys * keys];
        for q in 0..4 {
            for k in 0..keys {
                padded[(q + pad) * keys + k] = match k < pad {
                    true => 0.0,
                    false => whole[q * 4 + k - pad],
                };
            }
        }
        let padding = Tensor::<2, Bool>::from_data(
            TensorData::new((0..keys).map(|k| k < pad).collect::<Vec<_>>(), [1, keys]),
            d,
        );
        let masked = AttentionMask::key_padding(padding).and(AttentionMask::causal());
        let cases = [
            ("whole", &whole[..], 4, &padded[..], keys),
            (
                "a decoding step",
                &whole[12..],
                1,
                &padded[(keys - 1) * keys..],
                1,
            ),
        ];
        for (case, rows, queries, padded_rows, padded_queries) in cases {
            let what = format!("[{}] {case}", be.name);
            let want = LayerStats::from_weights(
                "l",
                tensor(rows.to_vec(), [1, 1, queries, 4]),
                &AttentionMask::causal(),
                None,
            );
            let got = LayerStats::from_weights(
                "l",
                tensor(padded_rows.to_vec(), [1, 1, padded_queries, keys]),
                &masked,
                None,
            );
            let (got, want) = (&got.heads[0], &want.heads[0]);
            assert_eq!(got.rows, want.rows, "{what}");
            close(&format!("{what} first"), got.first, want.first);
            close(&format!("{what} same"), got.same, want.same);
            close(&format!("{what} previous"), got.previous, want.previous);
            close(&format!("{what} distance"), got.distance, want.distance);
            close(&format!("{what} entropy"), got.entropy, want.entropy);
            assert_eq!(got.strongest, want.strongest, "{what}");
            close(
                &format!("{what} first, by hand"),
                got.first,
                match case {
                    "whole" => (1.0 + 0.4 * 3.0) / 4.0,
                    _ => 0.4,
                },
            );
        }
        // Without padding, a query the rule places before the first key still counts
        // where it sees one: 3 queries over 2 keys, a local window of 1 aligned
        // bottom-right (the first query at -1 sees key 0).
        let w = tensor(vec![1.0, 0.0, 0.5, 0.5, 0.5, 0.5], [1, 1, 3, 2]);
        let stats = LayerStats::from_weights("l", w, &AttentionMask::local(1), None);
        assert_eq!(stats.heads[0].rows, 3, "[{}] a local window", be.name);
    }
}

/// A module and a random input of width 16.
fn attention(
    heads: usize,
    kv_heads: usize,
    positions: Positions,
    device: &Device,
) -> MultiHeadAttention {
    let mut m = MultiHeadAttentionConfig::new(16, heads)
        .with_n_kv_heads(Some(kv_heads))
        .with_positions(positions)
        .init(device);
    if let Some(table) = &m.position_table {
        m.position_table = Some(Param::from_tensor(randn(table.dims(), 7, device)));
    }
    // Random biases, so that a slice taken from the wrong place shows.
    let out_bias = m
        .out_proj
        .bias
        .take()
        .map(|b| Param::from_tensor(randn(b.dims(), 8, device)));
    m.out_proj.bias = out_bias;
    m
}

/// `[(layer, head)]` of a plan.
fn dropped(plan: &PrunePlan) -> Vec<(usize, usize)> {
    plan.remove
        .iter()
        .enumerate()
        .flat_map(|(l, row)| row.iter().map(move |&h| (l, h)))
        .collect()
}

/// Forward values, the input's gradient and the query and output projections' gradients
/// of the kept heads: the masked module (asking for `weights`) against the pruned one.
fn assert_pruned_equals_masked(
    be: &Backend,
    m: &MultiHeadAttention,
    plan: &PrunePlan,
    mask: AttentionMask,
    what: &str,
    weights: AttentionWeights,
) {
    let device = be.autodiff();
    let pruned = m.prune(plan).unwrap_or_else(|e| panic!("{what}: {e}"));
    let head_mask = HeadMask::dropping(&m.head_counts(), &dropped(plan), &device);
    let x = randn([2, 6, 16], 3, &device).require_grad();
    let target = randn([2, 6, 16], 4, &device);
    let loss = |out: Tensor<3>| (out * target.clone()).sum();

    let masked_out = m
        .forward(
            MhaInput::self_attn(x.clone())
                .mask(mask.clone())
                .head_mask(head_mask.layer(0).clone())
                .weights(weights),
        )
        .context;
    let grads_masked = loss(masked_out.clone()).backward();
    let x2 = x.clone().detach().require_grad();
    let pruned_out = pruned
        .forward(MhaInput::self_attn(x2.clone()).mask(mask))
        .context;
    let grads_pruned = loss(pruned_out.clone()).backward();

    let tol = be.forward_tol();
    assert_close(&format!("{what}: output"), pruned_out, masked_out, tol);
    assert_close(
        &format!("{what}: input gradient"),
        x2.grad(&grads_pruned).unwrap(),
        x.grad(&grads_masked).unwrap(),
        be.grad_tol(),
    );
    let kept: Vec<usize> = (0..m.n_heads)
        .filter(|h| !plan.remove[0].contains(h))
        .collect();
    let dh = m.head_dim;
    let cols: Vec<i64> = kept
        .iter()
        .flat_map(|&h| (h * dh..(h + 1) * dh).map(|c| c as i64))
        .collect();
    let index = Tensor::<1, burn::tensor::Int>::from_data(
        TensorData::new(cols.clone(), [cols.len()]),
        &device,
    );
    let q_grad = |m: &MultiHeadAttention, grads| match &m.in_proj {
        mha::mha::InputProjection::Packed(p) => p.weight.val().grad(grads).unwrap(),
        mha::mha::InputProjection::Separate(p) => p.q_proj.weight.val().grad(grads).unwrap(),
    };
    let width = kept.len() * dh;
    assert_close(
        &format!("{what}: query projection gradient"),
        q_grad(&pruned, &grads_pruned).narrow(1, 0, width),
        q_grad(m, &grads_masked).select(1, index.clone()),
        be.grad_tol(),
    );
    assert_close(
        &format!("{what}: output projection gradient"),
        pruned.out_proj.weight.val().grad(&grads_pruned).unwrap(),
        m.out_proj
            .weight
            .val()
            .grad(&grads_masked)
            .unwrap()
            .select(0, index),
        be.grad_tol(),
    );
    if let (Some(pruned_sinks), Some(sinks)) = (&pruned.sinks, &m.sinks) {
        let kept = Tensor::<1, burn::tensor::Int>::from_data(
            TensorData::new(kept.iter().map(|&h| h as i64).collect(), [kept.len()]),
            &device,
        );
        assert_close(
            &format!("{what}: sinks' gradient"),
            pruned_sinks.val().grad(&grads_pruned).unwrap(),
            sinks.val().grad(&grads_masked).unwrap().select(0, kept),
            be.grad_tol(),
        );
    }
}

#[test]
fn a_pruned_attention_equals_the_masked_one_in_values_and_gradients() {
    let cases: Vec<(usize, usize, Positions, Vec<usize>)> = vec![
        (4, 4, Positions::None, vec![2]),
        // GQA 8:2: a head of a group (groups of 3 and 4 left: every key/value head
        // repeated per query head), a whole group, a head of each (3 and 3).
        (8, 2, Positions::None, vec![1]),
        (8, 2, Positions::None, vec![0, 1, 2, 3]),
        (8, 2, Positions::rope(), vec![0, 5]),
        // Biases per head follow their heads.
        (8, 4, Positions::Alibi, vec![1, 6]),
        (4, 2, Positions::Relative { max_distance: 3 }, vec![0]),
    ];
    for be in backends() {
        for (n, (heads, kv, positions, remove)) in cases.iter().enumerate() {
            let what = format!(
                "[{}] {heads}:{kv} {positions:?} without {remove:?}",
                be.name
            );
            let mut m = attention(*heads, *kv, positions.clone(), &be.autodiff());
            if n % 3 == 1 {
                // Attention sinks follow their heads.
                m.sinks = Some(Param::from_tensor(randn([*heads], 9, &be.autodiff())));
            }
            let plan = PrunePlan {
                remove: vec![remove.clone()],
            };
            let mask = match n % 2 {
                0 => AttentionMask::causal(),
                _ => AttentionMask::key_lengths(&[6, 4], 6, &be.autodiff()),
            };
            // Weights asked for take the explicit path, on the CPU too.
            for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
                let what = format!("{what}, weights {weights:?}");
                assert_pruned_equals_masked(&be, &m, &plan, mask.clone(), &what, weights);
            }
            let pruned = m.prune(&plan).unwrap();
            assert_eq!(pruned.n_heads, heads - remove.len(), "{what}");
        }
    }
}

/// Whether each float parameter of `module` tracks its gradient, in visiting order.
fn require_grads<M: Module>(module: &M) -> Vec<bool> {
    struct Visit(Vec<bool>);
    impl burn::module::ModuleVisitor for Visit {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().is_require_grad());
        }
    }
    let mut visit = Visit(Vec::new());
    module.visit(&mut visit);
    visit.0
}

/// A pruned module's parameters are trained or frozen as those they were cut from: a
/// frozen module stays frozen, the fixed sinks of Burn's quiet softmax stay fixed.
#[test]
fn pruning_keeps_each_parameter_trained_or_frozen_as_it_was() {
    let plan = PrunePlan {
        remove: vec![vec![1]],
    };
    for be in backends() {
        let d = &be.autodiff();
        let mut m = attention(4, 2, Positions::Relative { max_distance: 3 }, d);
        m.sinks = Some(Param::from_tensor(randn([4], 9, d)));
        for frozen in [false, true] {
            let what = format!("[{}] frozen {frozen}", be.name);
            let m = match frozen {
                true => m.clone().no_grad(),
                false => m.clone(),
            };
            let got = require_grads(&m.prune(&plan).unwrap());
            // The packed projection and its bias, the output's, the table, the sinks.
            assert_eq!(got.len(), 6, "{what}");
            assert!(got.iter().all(|&g| g != frozen), "{what}: {got:?}");
        }
        let burn = burn::nn::attention::MultiHeadAttentionConfig::new(16, 4)
            .with_quiet_softmax(true)
            .init(d);
        let pruned = MultiHeadAttention::from(burn).prune(&plan).unwrap();
        let what = format!("[{}] Burn's quiet softmax", be.name);
        assert!(!pruned.sinks.unwrap().val().is_require_grad(), "{what}");
        assert!(pruned.out_proj.weight.val().is_require_grad(), "{what}");
    }
}

#[test]
fn gqa_pruning_removes_a_key_value_head_only_with_its_whole_group() {
    let device = crate::util::first_device();
    let m = attention(8, 2, Positions::None, &device);
    let kv = |remove: Vec<usize>| {
        m.prune(&PrunePlan {
            remove: vec![remove],
        })
        .unwrap()
        .n_kv_heads
    };
    assert_eq!(
        kv(vec![0, 1, 2, 3]),
        1,
        "a whole group goes with its key/value head"
    );
    assert_eq!(
        kv(vec![0, 4]),
        2,
        "groups of 3 and 3 keep both key/value heads"
    );
    assert_eq!(kv(vec![0, 1, 4, 5]), 2);
    assert_eq!(
        kv(vec![1]),
        7,
        "groups of 3 and 4: one key/value head per query head"
    );
    assert_eq!(
        kv(vec![0, 1]),
        3,
        "groups of 2 and 4: heads of 2, the second repeated"
    );
}

#[test]
fn blocks_and_stacks_prune_to_their_masked_selves_and_save_and_load() {
    for be in backends() {
        let device = be.autodiff();
        let block = EncoderBlockConfig::new(16, 4)
            .with_n_kv_heads(Some(2))
            .with_dropout(0.0)
            .with_causal(true);
        let encoder = EncoderConfig::new(block, 2).init(&device);
        let decoder =
            DecoderConfig::new(DecoderBlockConfig::new(16, 4).with_dropout(0.0), 2).init(&device);
        let x = randn([2, 5, 16], 11, &device);
        let memory = randn([2, 7, 16], 12, &device);
        let padding = AttentionMask::key_lengths(&[7, 5], 7, &device);

        let plan = PrunePlan {
            remove: vec![vec![1], vec![0, 2, 3]],
        };
        let head_mask = HeadMask::dropping(&encoder.head_counts(), &dropped(&plan), &device);
        let inspect = Inspect::new().head_mask(head_mask);
        let masked = encoder
            .forward(StackInput::new(x.clone()).inspect(inspect))
            .unwrap()
            .output;
        let pruned = encoder.prune(&plan).unwrap();
        assert_eq!(pruned.head_counts(), vec![3, 1]);
        let got = pruned.forward(StackInput::new(x.clone())).unwrap().output;
        assert_close(
            &format!("[{}] encoder", be.name),
            got.clone(),
            masked,
            be.forward_tol(),
        );

        // Saved, then loaded into the full stack pruned with the same plan.
        let dir =
            std::env::temp_dir().join(format!("mha-prune-{}-{}", be.name, std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pruned");
        pruned.clone().save_file(&file).unwrap();
        let fresh = EncoderConfig::new(
            EncoderBlockConfig::new(16, 4)
                .with_n_kv_heads(Some(2))
                .with_dropout(0.0)
                .with_causal(true),
            2,
        )
        .init(&device)
        .prune(&plan)
        .unwrap()
        .try_load_file(&file)
        .unwrap();
        let loaded = fresh.forward(StackInput::new(x.clone())).unwrap().output;
        assert_close(&format!("[{}] encoder loaded", be.name), loaded, got, 0.0);
        std::fs::remove_dir_all(&dir).ok();

        // Decoder: attention layers self, cross, self, cross.
        let plan = PrunePlan {
            remove: vec![vec![0], vec![3], vec![], vec![1, 2]],
        };
        let head_mask = HeadMask::dropping(&decoder.head_counts(), &dropped(&plan), &device);
        let input = || {
            StackInput::new(x.clone())
                .memory(memory.clone())
                .memory_mask(padding.clone())
        };
        let masked = decoder
            .forward(input().head_mask(head_mask))
            .unwrap()
            .output;
        let pruned = decoder.prune(&plan).unwrap();
        assert_eq!(pruned.head_counts(), vec![3, 3, 4, 2]);
        let got = pruned.forward(input()).unwrap().output;
        assert_close(
            &format!("[{}] decoder", be.name),
            got,
            masked,
            be.forward_tol(),
        );
    }
}

#[test]
fn a_head_mask_that_keeps_every_head_changes_nothing() {
    for be in backends() {
        let device = &be.device;
        let m = attention(4, 2, Positions::None, device);
        let x = randn([2, 5, 16], 21, device);
        let keep = HeadMask::keep_all(&m.head_counts(), device);
        let plain = m.forward(MhaInput::causal(x.clone()));
        let masked = m.forward(MhaInput::causal(x.clone()).head_mask(keep.layer(0).clone()));
        assert_close(
            &format!("[{}] attention", be.name),
            masked.context,
            plain.context,
            0.0,
        );

        let encoder =
            EncoderConfig::new(EncoderBlockConfig::new(16, 4).with_causal(true), 3).init(device);
        let keep = HeadMask::keep_all(&encoder.head_counts(), device);
        let plain = encoder
            .forward(StackInput::new(x.clone()).weights())
            .unwrap();
        let inspected = encoder
            .forward(StackInput::new(x.clone()).head_mask(keep).weights())
            .unwrap();
        assert_close(
            &format!("[{}] encoder", be.name),
            inspected.output,
            plain.output,
            0.0,
        );
        assert_eq!(inspected.weights.len(), 3);
        for (got, want) in inspected.weights.into_iter().zip(plain.weights) {
            assert_close(&format!("[{}] encoder weights", be.name), got, want, 0.0);
        }

        let decoder = DecoderConfig::new(DecoderBlockConfig::new(16, 4), 2).init(device);
        let memory = randn([2, 3, 16], 22, device);
        let keep = HeadMask::keep_all(&decoder.head_counts(), device);
        let input = || StackInput::new(x.clone()).memory(memory.clone());
        // Weights asked for change the path attention takes: compare like with like.
        let plain = decoder.forward(input()).unwrap().output;
        let masked = decoder.forward(input().head_mask(keep.clone())).unwrap();
        assert_close(&format!("[{}] decoder", be.name), masked.output, plain, 0.0);
        let cross: Vec<_> = decoder.forward(input().weights()).unwrap().weights;
        let cross = [cross[1].clone(), cross[3].clone()];
        let inspected = decoder.forward(input().head_mask(keep).weights()).unwrap();
        // Self, cross, self, cross: the cross-attentions are the plain call's.
        assert_eq!(inspected.weights.len(), 4);
        for (got, want) in [&inspected.weights[1], &inspected.weights[3]]
            .into_iter()
            .zip(cross)
        {
            assert_close(
                &format!("[{}] decoder cross weights", be.name),
                got.clone(),
                want,
                be.forward_tol(),
            );
        }
        // Every layer's weights, self-attentions included, are those of its attention
        // module over its branch's input, the blocks walked by hand (pre-norm).
        let want = decoder_weights_by_hand(&decoder, x.clone(), memory.clone());
        for (layer, (got, want)) in inspected.weights.into_iter().zip(want).enumerate() {
            assert_close(
                &format!("[{}] decoder weights of attention layer {layer}", be.name),
                got,
                want,
                be.forward_tol(),
            );
        }
    }
}

/// The weights of every attention layer of a pre-norm decoder without absolute positions
/// over `x` and `memory`: each block's self-attention over `norm1(x)` (causal), its
/// cross-attention over `norm2(x + self)`, its feed-forward over `norm3(..)`.
fn decoder_weights_by_hand(decoder: &Decoder, x: Tensor<3>, memory: Tensor<3>) -> Vec<Tensor<4>> {
    let per_head = AttentionWeights::PerHead;
    let mut weights = Vec::new();
    let x = decoder.layers.iter().fold(x, |x, block| {
        let input = MhaInput::causal(block.norm1.forward(x.clone())).weights(per_head);
        let out = block.self_attn.forward(input);
        weights.push(out.weights.expect("asked for"));
        let x = x + out.context;
        let input = MhaInput::cross(block.norm2.forward(x.clone()), memory.clone());
        let out = block.cross_attn.forward(input.weights(per_head));
        weights.push(out.weights.expect("asked for"));
        let x = x + out.context;
        x.clone() + block.feed_forward.forward(block.norm3.forward(x))
    });
    assert_eq!(weights[0].dims(), [x.dims()[0], 4, 5, 5]);
    weights
}

/// Attention in which only head 2 reaches the output: the output projection reads
/// nothing from the other heads.
fn one_decisive_head(device: &Device) -> MultiHeadAttention {
    let mut m = attention(4, 4, Positions::None, device);
    let weight = m.out_proj.weight.val();
    let keep = Tensor::<1>::from_data(
        TensorData::new(
            (0..16)
                .map(|r| if r / 4 == 2 { 1.0f32 } else { 0.0 })
                .collect::<Vec<_>>(),
            [16],
        ),
        device,
    );
    m.out_proj.weight = Param::from_tensor((weight * keep.reshape([16, 1])).detach());
    m
}

#[test]
fn importance_ranks_first_the_head_that_decides_the_loss() {
    for be in backends() {
        let device = be.autodiff();
        let m = one_decisive_head(&device);
        let counts = m.head_counts();
        let xs: Vec<Tensor<3>> = (0..2).map(|i| randn([2, 5, 16], 30 + i, &device)).collect();
        let forward = |i: usize, mask: Tensor<1>| {
            m.forward(MhaInput::causal(xs[i].clone()).head_mask(mask))
                .context
        };
        // The targets need head 2 twice as strong: dropping it moves the output away.
        let stronger =
            Tensor::<1>::from_data(TensorData::new(vec![1.0f32, 1.0, 2.0, 1.0], [4]), &device);
        let targets: Vec<Tensor<3>> = (0..2)
            .map(|i| forward(i, stronger.clone()).detach())
            .collect();
        let loss = |mask: &HeadMask, i: usize| {
            (forward(i, mask.layer(0).clone()) - targets[i].clone())
                .powi_scalar(2)
                .mean()
        };
        let ablation = HeadImportance::by_ablation(&counts, &device, 2, |mask, i| {
            loss(mask, i).into_scalar::<f64>()
        });
        let gradient = HeadImportance::by_gradient(&counts, &device, 2, loss);
        // Means over the batches, not sums: the same two batches twice score the same, and
        // the baseline is the mean of the batches' losses.
        let twice = HeadImportance::by_ablation(&counts, &device, 4, |mask, i| {
            loss(mask, i % 2).into_scalar::<f64>()
        });
        let kept = HeadMask::keep_all(&counts, &device);
        let mean = (0..2)
            .map(|i| loss(&kept, i).into_scalar::<f64>())
            .sum::<f64>()
            / 2.0;
        for (name, got, want) in [
            ("ablation baseline", ablation.baseline_loss, mean),
            ("gradient baseline", gradient.baseline_loss, mean),
            ("baseline of 4 batches", twice.baseline_loss, mean),
            (
                "head 2 over 4 batches",
                twice.scores[0][2],
                ablation.scores[0][2],
            ),
        ] {
            close(&format!("[{}] {name}", be.name), got, want);
        }
        for importance in [&ablation, &gradient] {
            let ranking = importance.ranking();
            assert_eq!(
                (ranking[0].0, ranking[0].1),
                (0, 2),
                "[{}] {importance:?}",
                be.name
            );
            for &(_, h, score) in &ranking[1..] {
                assert!(
                    score.abs() < 1e-6,
                    "[{}] head {h} cannot matter: {importance:?}",
                    be.name
                );
            }
        }
        // Head 2's ablation score: the mean loss without it less the baseline.
        let without = HeadMask::dropping(&counts, &[(0, 2)], &device);
        let dropped = (0..2)
            .map(|i| loss(&without, i).into_scalar::<f64>())
            .sum::<f64>()
            / 2.0;
        assert!(dropped > mean, "[{}] dropping head 2 costs", be.name);
        close(
            &format!("[{}] head 2's ablation score", be.name),
            ablation.scores[0][2],
            dropped - mean,
        );
        close(
            &format!("[{}] normalised gradient score", be.name),
            gradient.scores[0][2],
            1.0,
        );
        // The plan keeps the decisive head.
        assert_eq!(gradient.prune_least(3).remove, vec![vec![0, 1, 3]]);
    }
}

#[test]
fn the_head_mask_gradient_is_the_loss_slope() {
    // The loss is quadratic in each mask weight, so a central difference is exact up to
    // rounding.
    for be in backends() {
        let device = be.autodiff();
        let m = attention(4, 2, Positions::None, &device);
        let x = randn([2, 5, 16], 50, &device);
        let target = randn([2, 5, 16], 51, &device);
        let loss = |mask: Tensor<1>| {
            let out = m
                .forward(MhaInput::causal(x.clone()).head_mask(mask))
                .context;
            (out - target.clone()).powi_scalar(2).sum()
        };
        let mask = HeadMask::keep_all(&[4], &device).with_gradient();
        let grads = loss(mask.layer(0).clone()).backward();
        let got = mask.grads(&grads).remove(0);
        for h in 0..4 {
            let at = |w: f32| {
                let mut row = vec![1.0f32; 4];
                row[h] = w;
                let mask = Tensor::<1>::from_data(TensorData::new(row, [4]), &device);
                loss(mask).into_scalar::<f64>()
            };
            let slope = (at(1.5) - at(0.5)) as f32;
            assert!(
                (got[h] - slope).abs() <= 1e-3 * slope.abs().max(1.0),
                "[{}] head {h}: gradient {} against slope {slope}",
                be.name,
                got[h]
            );
        }
    }
}

#[test]
fn bad_plans_and_masks_are_refused_by_name() {
    let device = crate::util::first_device();
    let m = attention(4, 2, Positions::None, &device);
    let err = m
        .prune(&PrunePlan {
            remove: vec![vec![4]],
        })
        .unwrap_err();
    assert_eq!(
        err,
        PruneError::Head {
            layer: 0,
            head: 4,
            heads: 4
        }
    );
    assert_eq!(
        err.to_string(),
        "prune: attention layer 0 has heads 0..4, the plan removes head 4"
    );
    let err = m
        .prune(&PrunePlan {
            remove: vec![vec![0, 1, 2, 3]],
        })
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("removes all 4 heads of attention layer 0"),
        "{err}"
    );
    let encoder = EncoderConfig::new(EncoderBlockConfig::new(16, 4), 2).init(&device);
    let err = encoder.prune(&PrunePlan::keep_all(3)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "prune: the plan has 3 attention layers, the Encoder 2"
    );
    let err = encoder
        .prune(&PrunePlan {
            remove: vec![vec![], vec![9]],
        })
        .unwrap_err();
    assert_eq!(
        err,
        PruneError::Head {
            layer: 1,
            head: 9,
            heads: 4
        }
    );

    let x = randn([1, 3, 16], 1, &device);
    let wrong = HeadMask::keep_all(&[4, 4, 4], &device);
    let message = panic_message(|| {
        let _ = encoder.forward(StackInput::new(x.clone()).head_mask(wrong));
    });
    assert_eq!(
        message,
        "Encoder: the head mask has [4, 4, 4] heads per attention layer, the module [4, 4]"
    );
    let message = panic_message(|| {
        m.forward(MhaInput::causal(x.clone()).head_mask(Tensor::ones([3], &device)));
    });
    assert!(
        message.contains("the head mask has 3 weights for 4 heads"),
        "{message}"
    );
    let plan = PrunePlan {
        remove: vec![vec![], vec![1]],
    };
    assert_eq!(plan.slice(1, 1).remove, vec![vec![1]]);
    let message = panic_message(|| {
        plan.slice(1, 2);
    });
    assert_eq!(
        message,
        "PrunePlan::slice: layers 1..1+2 pass the plan's 2 layers"
    );
    let message = panic_message(|| {
        PrunePlan::removing(2, &[(1, 0), (usize::MAX, 3)]);
    });
    assert_eq!(
        message,
        format!(
            "PrunePlan::removing: head 3 of layer {}, past the 2 layers",
            usize::MAX
        )
    );
    let message = panic_message(|| {
        HeadImportance::by_ablation(&[4], &device, 0, |_, _| 1.0);
    });
    assert_eq!(
        message,
        "HeadImportance::by_ablation: batches must be at least 1, got 0"
    );
    // A loss per example, not one value: refused before its gradient is read.
    let autodiff = device.clone().autodiff();
    let m = attention(4, 2, Positions::None, &autodiff);
    let x = randn([2, 3, 16], 2, &autodiff);
    let message = panic_message(|| {
        HeadImportance::by_gradient(&m.head_counts(), &autodiff, 1, |mask, _| {
            let out = m.forward(MhaInput::causal(x.clone()).head_mask(mask.layer(0).clone()));
            out.context.sum_dim(2).sum_dim(1).reshape([2])
        });
    });
    assert_eq!(
        message,
        "HeadImportance::by_gradient: the loss of batch 0 must be one value [1] (a mean, say), \
         got [2]"
    );
}

#[cfg(feature = "plot")]
mod maps {
    use burn::tensor::{Tensor, TensorData};
    use mha::analysis::maps::{AttentionMap, MapError};

    fn labels(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("t{i}")).collect()
    }

    fn map(values: Vec<f32>) -> AttentionMap {
        let device = crate::util::first_device();
        let weights = Tensor::<3>::from_data(TensorData::new(values, [2, 3, 4]), &device);
        AttentionMap::layer(weights, &labels(3), &labels(4)).titled("two heads")
    }

    #[test]
    fn a_map_draws_its_weights_at_its_size_in_png_and_svg() {
        let a = map((0..24).map(|i| (i % 4) as f32 / 3.0).collect());
        let (w, h) = a.size();
        let pixels = a.to_rgb().unwrap();
        assert_eq!(pixels.len(), 3 * w as usize * h as usize);
        // Not blank: the cells of weight 1 are dark blue.
        let dark = pixels.chunks(3).filter(|p| p == &[8, 48, 107]).count();
        assert!(dark > 2 * 3 * 10 * 10, "{dark} dark-blue pixels");
        // Other weights, other pixels.
        let b = map((0..24).map(|i| (3 - i % 4) as f32 / 3.0).collect());
        let changed = pixels
            .iter()
            .zip(b.to_rgb().unwrap())
            .filter(|(x, y)| **x != *y)
            .count();
        assert!(changed > 1000, "{changed} bytes changed");

        let dir = std::env::temp_dir().join(format!("mha-maps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        a.save(dir.join("map.png")).unwrap();
        let png = std::fs::read(dir.join("map.png")).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        let be32 = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
        assert_eq!(
            (u64::from(be32(16)), u64::from(be32(20))),
            (w, h),
            "the PNG header's width and height"
        );
        a.save(dir.join("map.svg")).unwrap();
        let svg = std::fs::read_to_string(dir.join("map.svg")).unwrap();
        assert_eq!(svg, a.to_svg().unwrap());
        for text in ["two heads", "head 0", "head 1", "t3", "weight"] {
            assert!(svg.contains(text), "the SVG has no {text:?}");
        }
        assert!(matches!(
            a.save(dir.join("map.bmp")),
            Err(MapError::Format(_))
        ));
        // Saving over a map replaces it whole, through a temporary file that is gone after.
        b.save(dir.join("map.png")).unwrap();
        assert_ne!(std::fs::read(dir.join("map.png")).unwrap(), png);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["map.png", "map.svg"]);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A bitmap of more than `i32::MAX` pixels (a head over 2,000,000 keys, or one of
    /// 4,620 x 4,620 weights) is refused before its buffer is allocated, naming its size,
    /// and nothing is written; it panicked inside the drawing library (its offsets
    /// overflow there). SVG has no such limit.
    #[test]
    fn a_bitmap_too_large_to_draw_is_refused_by_its_size() {
        let keys = 2_000_000;
        let weights = Tensor::<2>::zeros([1, keys], &crate::util::first_device());
        let a = AttentionMap::head(weights, &labels(1), &labels(keys));
        let (width, height) = a.size();
        assert!(width * height > i32::MAX as u64 && width.max(height) < i32::MAX as u64);
        let too_large = MapError::TooLarge {
            width,
            height,
            bitmap: true,
        };
        assert_eq!(
            too_large.to_string(),
            format!(
                "attention map: {width} x {height} pixels is too large: a bitmap holds \
                 2147483647 pixels (PNG, to_rgb); save it as .svg, or draw fewer tokens or heads"
            )
        );
        assert_eq!(a.to_rgb().unwrap_err(), too_large);
        let dir = std::env::temp_dir().join(format!("mha-large-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(a.save(dir.join("map.png")).unwrap_err(), too_large);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "nothing written"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
