//! Pruned attention against the full module: causal self-attention at the base shape
//! (B 8, T 512, D 512, H 8) with 8, 6, 4 and 2 heads kept (mha's `Heads::prune`), forward
//! and forward+backward. The projections and the attention core both shrink with the
//! heads, all but the output projection's output width.

use burn::tensor::Device;
use mha::analysis::{Heads, PrunePlan};
use mha::{MhaInput, MultiHeadAttentionConfig};
use train::backend::Backend;

use crate::{Record, Timed, backward_of, randn, time};

const BATCH: usize = 8;
const SEQ: usize = 512;
const D_MODEL: usize = 512;
const HEADS: usize = 8;
/// Heads kept.
pub const KEPT: [usize; 4] = [8, 6, 4, 2];

/// Times the module with each count of [`KEPT`] heads (the last heads removed).
pub fn bench_prune(
    runs: usize,
    backend: Backend,
    device: &Device,
    out: &mut Vec<Record>,
) -> anyhow::Result<()> {
    let ad = device.clone().autodiff();
    let config = MultiHeadAttentionConfig::new(D_MODEL, HEADS);
    for kept in KEPT {
        eprintln!("{backend}: attention with {kept} of {HEADS} heads ...");
        let plan = PrunePlan {
            remove: vec![(kept..HEADS).collect()],
        };
        let mut record = |pass, timed: Timed| {
            out.push(Record {
                tokens_per_second: Some((BATCH * SEQ) as f64 / timed.ms * 1e3),
                batch: Some(BATCH),
                context: Some(SEQ),
                heads: Some(kept),
                ..Record::new(backend.name(), "mha-pruned", pass, timed)
            });
        };
        let module = config.init(device).prune(&plan)?;
        let x = randn([BATCH, SEQ, D_MODEL], device);
        let ms = time(runs, device, || {
            module.forward(MhaInput::causal(x.clone())).context
        })?;
        record("forward", ms);
        let module = config.init(&ad).prune(&plan)?;
        let x = randn([BATCH, SEQ, D_MODEL], &ad).require_grad();
        let ms = time(runs, device, || {
            let out = module.forward(MhaInput::causal(x.clone())).context;
            backward_of(&x, out.sum())
        })?;
        record("forward+backward", ms);
    }
    Ok(())
}

/// Prints the pruning table as Markdown: time per head count, and the speed-up against
/// the share of heads removed.
pub fn print_prune(backend: Backend, records: &[Record]) {
    let find = |pass: &str, kept: usize| {
        records
            .iter()
            .find(|r| r.subject == "mha-pruned" && r.pass == pass && r.heads == Some(kept))
    };
    println!(
        "\n## {backend}: pruned attention (B {BATCH}, T {SEQ}, D {D_MODEL}, causal), median ms\n"
    );
    println!("| heads kept | forward | speed-up | forward+backward | speed-up | heads ratio |");
    println!("|---|---|---|---|---|---|");
    let (Some(full_f), Some(full_b)) = (find("forward", HEADS), find("forward+backward", HEADS))
    else {
        return;
    };
    for kept in KEPT {
        let (Some(f), Some(b)) = (find("forward", kept), find("forward+backward", kept)) else {
            continue;
        };
        println!(
            "| {kept} of {HEADS} | {:.2} | {:.2}x | {:.2} | {:.2}x | {:.2}x |",
            f.median_ms,
            full_f.median_ms / f.median_ms,
            b.median_ms,
            full_b.median_ms / b.median_ms,
            HEADS as f64 / kept as f64
        );
    }
}
