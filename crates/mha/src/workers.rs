//! [`on_cpu_workers`]: running a training step, or any run of many tensor operations, on
//! a thread of the pool the CPU backends split their work over.

/// Runs `f` on a worker thread of rayon's pool, the pool over which the CPU backends'
/// kernels (`mha`'s, and flex's and ndarray's own) split their work, and returns what it
/// returns; called on a worker already, it runs `f` there.
///
/// Each parallel operation called from outside the pool hands its work to the pool and
/// sleeps until a worker has done it: a wake-up on each side, tens of microseconds, paid
/// once per operation, and a step of a small model runs hundreds of them. Called from a
/// worker, an operation starts on that worker at once and the others join in. The
/// character-level model of the trainer's text task (4 layers of width 128, batch 12 of
/// 64) took 46 ms a step called from the main thread and 32 ms inside this, with the same
/// numbers (2 cores, flex). Wrap a whole step (forward, backward, optimizer), not each
/// call: the hand-over is then paid once.
///
/// On GPU backends it changes nothing; without a CPU backend compiled in (features
/// `flex`, `ndarray`) it only calls `f`. Inside `f`, do not wait for another thread that
/// itself needs the pool (a data loader running tensor operations, say): with one worker
/// (`RAYON_NUM_THREADS=1`) that wait never ends.
///
/// ```
/// use burn::tensor::{Device, Tensor};
///
/// let device = Device::default();
/// let x = Tensor::<2>::ones([64, 64], &device);
/// let y = mha::on_cpu_workers(|| x.clone().matmul(x).sum());
/// assert_eq!(y.into_scalar::<f32>(), 64.0 * 64.0 * 64.0);
/// ```
pub fn on_cpu_workers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    return rayon::scope(|_| f());
    #[cfg(not(any(feature = "flex", feature = "ndarray")))]
    f()
}

#[cfg(all(test, any(feature = "flex", feature = "ndarray")))]
mod tests {
    use super::on_cpu_workers;

    #[test]
    fn runs_on_a_worker_and_returns_its_result() {
        assert_eq!(rayon::current_thread_index(), None);
        let (index, value) = on_cpu_workers(|| (rayon::current_thread_index(), 7));
        assert!(index.is_some(), "f ran outside the pool");
        assert_eq!(value, 7);
        // Nested: stays on the worker it was called on.
        let (outer, inner) = on_cpu_workers(|| {
            let outer = rayon::current_thread_index();
            (outer, on_cpu_workers(rayon::current_thread_index))
        });
        assert_eq!(outer, inner);
    }
}
