//! [`on_cpu_workers`]: running a training step, or any run of many tensor operations, on
//! a thread of the pool the CPU backends split their work over.

use burn::tensor::Device;

/// On a flex or ndarray `device` (with autodiff or not), runs `f` on a worker thread of
/// rayon's pool, the pool over which the CPU backends' kernels (`mha`'s, and flex's and
/// ndarray's own) split their work, with the pool's other workers spinning for its work
/// while it runs (each until it finds none for 2 ms, then asleep as usual for the rest of
/// the call), and returns what it returns; called on a worker already, it runs `f`
/// there. On any other device it only calls `f`.
///
/// Each parallel operation called from outside the pool hands its work to the pool and
/// sleeps until a worker has done it: a wake-up on each side, tens of microseconds, paid
/// once per operation, and a step of a small model runs hundreds of them. Called from a
/// worker, an operation starts on that worker at once and the others join in. And a
/// worker with nothing to do goes to sleep, to be woken by the next operation's work,
/// again a system call on each side, where a step's operations come microseconds apart:
/// inside `f` the other workers instead wait for work by spinning, as OpenMP's threads
/// (PyTorch's on the CPU) do. Each shortened the trainer's text steps on 2 cores, with the
/// same numbers to the last digit (the project's `docs/benchmarks.md` has the
/// measurements): an operation gives the same numbers inside `f` and outside it (the CPU
/// kernels cut their work for the pool's size either way; a pool of another size may sum
/// some gradients in another order, as PyTorch's threads do). Wrap a whole step
/// (forward, backward, optimizer), not each call: the hand-over is then paid once; and
/// not a loop that waits on something else: the spinning workers keep their cores busy
/// for as long as `f` gives them work. One call spins at a time.
///
/// Calls made at once from several threads (one per CPU device, say) share the workers:
/// a worker that waits inside one call's operations runs whatever work is queued,
/// another thread's whole call included, on top of the one it waits in, and a call
/// returns only once the workers spinning for it have stopped, which may be once they
/// have finished another thread's call. So a call can wait for the end of another, and
/// inside `f` nothing may wait for another thread: not a barrier or a collective
/// operation (an all-reduce of gradients between the devices' steps), not a channel's
/// receive, not a lock another thread holds across tensor operations, not a data loader
/// running tensor operations of its own. Whatever the number of workers, such a wait can
/// end up waiting for itself, and never ends. Threads whose steps must meet each install
/// a pool of their own, where their operations then run:
/// `rayon::ThreadPoolBuilder::new().num_threads(n).build()?.install(|| mha::on_cpu_workers(&device, step))`.
///
/// ```
/// use burn::tensor::{Device, Tensor};
///
/// let device = Device::default();
/// let x = Tensor::<2>::ones([64, 64], &device);
/// let y = mha::on_cpu_workers(&device, || x.clone().matmul(x).sum());
/// assert_eq!(y.into_scalar::<f32>(), 64.0 * 64.0 * 64.0);
/// ```
#[cfg_attr(not(feature = "cpu-kernels"), allow(unused_variables))]
pub fn on_cpu_workers<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    #[cfg(feature = "cpu-kernels")]
    if crate::dispatch::cpu_pool(device) {
        return pool::run(f);
    }
    f()
}

#[cfg(feature = "cpu-kernels")]
mod pool {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    /// Whether a call keeps the pool's other workers looking for work (one at a time:
    /// several devices' steps may run at once on the CPU).
    static SPINNING: AtomicBool = AtomicBool::new(false);

    /// `f` on a worker; while it runs, the pool's other workers look for its work without
    /// going to sleep between two operations.
    pub(super) fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        let done = AtomicBool::new(false);
        rayon::scope(|scope| {
            let spins = SPINNING
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok();
            let step_thread = rayon::current_thread_index();
            if spins {
                // One spinner on each worker's own queue (a spinner stolen by a worker
                // that spins already would leave a third one asleep).
                let done = &done;
                scope.spawn_broadcast(move |_, _| spin(done, step_thread));
            }
            // Set when `f` returns or unwinds: the scope waits for the spinners.
            let _stop = Stop { done: &done, spins };
            f()
        })
    }

    /// Ends the spinning of a [`run`] when dropped.
    struct Stop<'a> {
        done: &'a AtomicBool,
        spins: bool,
    }

    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.done.store(true, Ordering::Release);
            if self.spins {
                SPINNING.store(false, Ordering::Release);
            }
        }
    }

    /// Runs the pool's pending work until `done`, waiting for it by spinning: a sleeping
    /// worker is woken by each new operation, a system call on each side (tens of
    /// microseconds), where a step's operations come a few microseconds apart. OpenMP's
    /// threads, PyTorch's on the CPU, wait the same way. A spinner taken up by the thread
    /// that runs the step itself (when it waits inside a `join` of its own, or at the
    /// scope's end) returns at once: it would spin on what it stops.
    ///
    /// A spinner also returns after [`IDLE`] without work. Another worker may take it up
    /// while it waits inside a piece of the step's own work (a `join` whose other half
    /// was stolen): the piece cannot finish beneath a spinner that waits for the step,
    /// and the step cannot finish without the piece. Returning when idle ends that wait
    /// after `IDLE`, where it had been a hang.
    fn spin(done: &AtomicBool, step_thread: Option<usize>) {
        if rayon::current_thread_index() == step_thread {
            return;
        }
        let mut idle_since = None;
        while !done.load(Ordering::Acquire) {
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                idle_since = None;
                continue;
            }
            if idle_since.get_or_insert_with(Instant::now).elapsed() > IDLE {
                return;
            }
            std::hint::spin_loop();
        }
    }

    /// How long a spinner waits for work before it returns: far longer than the gaps
    /// between a step's operations (microseconds).
    const IDLE: Duration = Duration::from_millis(2);
}

#[cfg(all(test, feature = "cpu-kernels"))]
mod tests {
    use std::panic::AssertUnwindSafe;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc::{self, RecvTimeoutError};
    use std::time::{Duration, Instant};

    use burn::tensor::Tensor;
    use rayon::prelude::*;

    use super::on_cpu_workers;

    #[test]
    fn runs_on_a_worker_on_cpu_devices_only() {
        assert_eq!(rayon::current_thread_index(), None);
        for device in crate::testing::devices() {
            let index = on_cpu_workers(&device, rayon::current_thread_index);
            let cpu = crate::dispatch::cpu_pool(&device);
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

    #[test]
    fn attention_gives_the_same_gradients_inside_and_outside_the_workers() {
        // Two heads, 100 keys: small enough to run on the caller's thread outside the pool,
        // whose threads cut each head's keys in parts (more threads than heads); the parts
        // are cut alike either way, and so summed in one order.
        use burn::tensor::Distribution;
        let devices = crate::testing::devices();
        for device in devices.iter().filter(|d| crate::dispatch::cpu_pool(d)) {
            device.seed(7);
            let [q, k, v] = [0, 1, 2]
                .map(|_| Tensor::<4>::random([1, 2, 100, 64], Distribution::Default, device));
            let run = |[q, k, v]: [Tensor<4>; 3]| {
                let [q, k, v] = [q, k, v].map(|x| x.require_grad());
                let mask = crate::AttentionMask::causal();
                let out = crate::scaled_dot_product_attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    &mask,
                    crate::SdpaOptions::default(),
                );
                let grads = (out.context.clone() * out.context).sum().backward();
                [q, k, v].map(|x| x.grad(&grads).unwrap().into_data())
            };
            let outside = run([q.clone(), k.clone(), v.clone()]);
            let inside = on_cpu_workers(device, || run([q, k, v]));
            for (name, (a, b)) in ["dq", "dk", "dv"]
                .into_iter()
                .zip(outside.iter().zip(&inside))
            {
                assert_eq!(a, b, "{device:?}: {name} differs inside the workers");
            }
        }
    }

    #[test]
    fn the_other_workers_take_the_steps_work() {
        if rayon::current_num_threads() < 2 {
            eprintln!("one worker in the pool: nothing to take the step's work");
            return;
        }
        let device = crate::testing::devices().remove(0);
        let taken = within_a_minute("a join in a step", move || {
            on_cpu_workers(&device, || {
                let other = AtomicBool::new(false);
                // The first half waits (10 s at most) for another worker to take up the
                // second: workers that only spun, taking no work, would leave it queued.
                rayon::join(
                    || {
                        let start = Instant::now();
                        while !other.load(Ordering::Acquire) {
                            if start.elapsed() > Duration::from_secs(10) {
                                return false;
                            }
                            std::hint::spin_loop();
                        }
                        true
                    },
                    || other.store(true, Ordering::Release),
                )
                .0
            })
        });
        assert!(taken, "no other worker took up half of a join within 10 s");
    }

    #[test]
    fn a_panic_inside_reaches_the_caller_and_the_pool_goes_on() {
        let device = crate::testing::devices().remove(0);
        within_a_minute("a step that panics", move || {
            let caught = std::panic::catch_unwind(AssertUnwindSafe(|| {
                on_cpu_workers(&device, || {
                    let x = Tensor::<2>::ones([128, 128], &device);
                    let _ = x.clone().matmul(x).into_data();
                    panic!("a step that fails");
                })
            }));
            assert!(caught.is_err(), "the panic did not reach the caller");
            // The next call spins and runs as before.
            let x = Tensor::<2>::ones([128, 128], &device);
            let sum = on_cpu_workers(&device, || x.clone().matmul(x).sum());
            assert_eq!(sum.into_scalar::<f32>(), 128.0f32.powi(3));
        });
    }

    #[test]
    fn steps_from_several_threads_at_once_all_finish() {
        let device = crate::testing::devices().remove(0);
        within_a_minute("steps on four threads", move || {
            let threads: Vec<_> = (0..4)
                .map(|t| {
                    let device = device.clone();
                    std::thread::spawn(move || {
                        for i in 0..20 {
                            let n = 1000 * (t + 1) + i;
                            let sum = on_cpu_workers(&device, || {
                                (0..n).into_par_iter().with_max_len(64).sum::<usize>()
                            });
                            assert_eq!(sum, n * (n - 1) / 2);
                        }
                    })
                })
                .collect();
            for thread in threads {
                thread.join().expect("a step's thread panicked");
            }
        });
    }

    /// Steps that meet inside (at a barrier, as data-parallel steps at an all-reduce),
    /// each in a pool of its own as the documentation says, all finish: each waits in its
    /// own pool, where no other thread's step can run on top of it.
    #[test]
    fn steps_that_meet_inside_finish_in_pools_of_their_own() {
        let device = crate::testing::devices().remove(0);
        within_a_minute("steps meeting at a barrier", move || {
            let threads = 2;
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads));
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (device, barrier) = (device.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let pool = rayon::ThreadPoolBuilder::new()
                            .num_threads(2)
                            .build()
                            .expect("a pool");
                        for i in 0..20 {
                            let n = 1000 * (t + 1) + i;
                            let sums = pool.install(|| {
                                on_cpu_workers(&device, || {
                                    let sum =
                                        || (0..n).into_par_iter().with_max_len(64).sum::<usize>();
                                    let before = sum();
                                    barrier.wait();
                                    let x = Tensor::<2>::ones([32, 32], &device);
                                    let product = x.clone().matmul(x).sum().into_scalar::<f32>();
                                    (before, sum(), product)
                                })
                            });
                            assert_eq!(
                                sums,
                                (n * (n - 1) / 2, n * (n - 1) / 2, 32.0 * 32.0 * 32.0)
                            );
                        }
                    })
                })
                .collect();
            for handle in handles {
                handle.join().expect("a step's thread panicked");
            }
        });
    }

    /// `f` on a thread of its own, failing if it takes more than a minute: spinners that
    /// never stop would otherwise hang the suite instead of failing it.
    fn within_a_minute<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (send, receive) = mpsc::channel();
        std::thread::spawn(move || send.send(f()));
        match receive.recv_timeout(Duration::from_secs(60)) {
            Ok(value) => value,
            Err(RecvTimeoutError::Timeout) => panic!("{what}: still running after a minute"),
            Err(RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
        }
    }
}
