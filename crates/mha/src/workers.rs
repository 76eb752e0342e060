//! [`on_cpu_workers`]: running a training step, or any run of many tensor operations, on
//! a thread of the pool the CPU backends split their work over.

use burn::tensor::Device;

/// On a flex or ndarray `device` (with autodiff or not), runs `f` on a worker thread of
/// rayon's pool, the pool over which the CPU backends' kernels (`mha`'s, and flex's and
/// ndarray's own) split their work, and returns what it returns; called on a worker
/// already, it runs `f` there. On any other device it only calls `f`.
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
/// Inside `f`, do not wait for another thread that itself needs the pool (a data loader
/// running tensor operations, say): with one worker (`RAYON_NUM_THREADS=1`) that wait
/// never ends.
///
/// ```
/// use burn::tensor::{Device, Tensor};
///
/// let device = Device::default();
/// let x = Tensor::<2>::ones([64, 64], &device);
/// let y = mha::on_cpu_workers(&device, || x.clone().matmul(x).sum());
/// assert_eq!(y.into_scalar::<f32>(), 64.0 * 64.0 * 64.0);
/// ```
#[cfg_attr(
    not(any(feature = "flex", feature = "ndarray")),
    allow(unused_variables)
)]
pub fn on_cpu_workers<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    if crate::dispatch::Backend::of(device).has_cpu_kernels() {
        return rayon::scope(|_| f());
    }
    f()
}

#[cfg(all(test, any(feature = "flex", feature = "ndarray")))]
mod tests {
    use super::on_cpu_workers;

    #[test]
    fn runs_on_a_worker_on_cpu_devices_only() {
        assert_eq!(rayon::current_thread_index(), None);
        for device in crate::testing::devices() {
            let index = on_cpu_workers(&device, rayon::current_thread_index);
            let cpu = crate::dispatch::Backend::of(&device).has_cpu_kernels();
            assert_eq!(index.is_some(), cpu, "{device:?}");
        }
        // The first device is flex's or ndarray's. Nested: stays on the worker it was
        // called on.
        let device = crate::testing::devices().remove(0);
        let (outer, inner) = on_cpu_workers(&device, || {
            let outer = rayon::current_thread_index();
            (outer, on_cpu_workers(&device, rayon::current_thread_index))
        });
        assert!(outer.is_some());
        assert_eq!(outer, inner);
        assert_eq!(on_cpu_workers(&device, || 7), 7);
    }
}
