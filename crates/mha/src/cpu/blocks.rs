//! [`for_each_block`]: a parallel loop over a few large blocks of work whose calling
//! thread waits for the others by spinning.
//!
//! A `join` of rayon's (and so its parallel iterators) lets a thread that waits for a
//! stolen half spin for a few dozen `yield`s and then sleep until the thief wakes it: a
//! system call on each side. The thread running a training step waits so at the end of
//! each split operation whenever its part was done first, and its wake-up came 30 to 80
//! microseconds after the other's end in the text task's linear layers, several times a
//! step. Here it spins until every block is done, as OpenMP's threads wait at a barrier.

use std::marker::PhantomData;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Runs `f(i)` for every `i < blocks` on the threads of the pool, each block once. The
/// blocks are dealt in contiguous runs, the first to the calling thread and the others
/// to the threads in the order they join (on two threads, each takes the same rows from
/// one operation to the next); a thread done with its run takes the next blocks of the
/// others'. The calling thread, a worker of the pool (as inside
/// [`on_cpu_workers`](crate::on_cpu_workers)), waits for the last block by spinning,
/// yielding its core now and then; called from outside the pool, it waits as rayon's
/// `scope` does. A panic in `f` reaches the caller once every block that started has
/// ended.
pub(crate) fn for_each_block(blocks: usize, f: impl Fn(usize) + Sync) {
    for_each_block_on(rayon::current_num_threads(), blocks, f)
}

/// [`for_each_block`] on at most `threads` threads (one: every block on the calling
/// thread, in order).
pub(crate) fn for_each_block_on(threads: usize, blocks: usize, f: impl Fn(usize) + Sync) {
    let threads = rayon::current_num_threads().min(threads).min(blocks);
    if threads <= 1 {
        (0..blocks).for_each(f);
        return;
    }
    let end = |run: usize| (run + 1) * blocks / threads;
    // The next block of each thread's run.
    let next: Vec<AtomicUsize> = (0..threads)
        .map(|run| AtomicUsize::new(run * blocks / threads))
        .collect();
    let done = AtomicUsize::new(0);
    let joined = AtomicUsize::new(1);
    let work = |me: usize| {
        for k in 0..threads {
            let run = (me + k) % threads;
            loop {
                let block = next[run].fetch_add(1, Ordering::Relaxed);
                if block >= end(run) {
                    break;
                }
                // Counted when `f` returns or unwinds.
                let _count = Count(&done);
                f(block);
            }
        }
    };
    rayon::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|_| {
                let me = joined.fetch_add(1, Ordering::Relaxed);
                if me < threads {
                    work(me);
                }
            });
        }
        work(0);
        let mut spins = 0u32;
        while done.load(Ordering::Acquire) < blocks {
            // With more threads than free cores, the thread waited for may need this one.
            spins = spins.wrapping_add(1);
            match spins % YIELD_EVERY {
                0 => std::thread::yield_now(),
                _ => std::hint::spin_loop(),
            }
        }
    });
}

/// Spins between two yields of the waiting thread's core (tens of microseconds).
const YIELD_EVERY: u32 = 1 << 14;

/// Multiply-adds below which an operation called from outside the pool runs on the
/// calling thread: handing work to the pool costs a wake-up on each side, tens of
/// microseconds, more than such work takes on one core (flex's threshold for its matrix
/// product, 192³).
pub(crate) const SERIAL_BELOW: usize = 192 * 192 * 192;

/// The threads an operation of `work` multiply-adds is split over: one where it is
/// called from outside the pool with under [`SERIAL_BELOW`], else the pool's. On a
/// worker (inside [`on_cpu_workers`](crate::on_cpu_workers), where the other workers
/// spin for work) a split costs little, and the trainer's small attention calls gain
/// from it.
pub(crate) fn threads_for(work: usize) -> usize {
    let outside = rayon::current_thread_index().is_none();
    match outside && work < SERIAL_BELOW {
        true => 1,
        false => rayon::current_num_threads(),
    }
}

/// `f(i)` for every `i < blocks`, run as [`for_each_block`] runs them, the results in
/// the order of the blocks.
pub(crate) fn map_blocks<R: Send + Sync>(blocks: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    map_blocks_on(usize::MAX, blocks, f)
}

/// [`map_blocks`] on at most `threads` threads.
pub(crate) fn map_blocks_on<R: Send + Sync>(
    threads: usize,
    blocks: usize,
    f: impl Fn(usize) -> R + Sync,
) -> Vec<R> {
    let slots: Vec<OnceLock<R>> = (0..blocks).map(|_| OnceLock::new()).collect();
    for_each_block_on(threads, blocks, |b| {
        let _ = slots[b].set(f(b));
    });
    slots
        .into_iter()
        .map(|slot| slot.into_inner().expect("every block ran"))
        .collect()
}

/// A mutable slice cut into chunks of `chunk` elements (the last one shorter), chunk
/// `c` for block `c` of a [`for_each_block`], which runs each block once.
pub(crate) struct Chunks<'a, T> {
    ptr: *mut T,
    len: usize,
    chunk: usize,
    slice: PhantomData<&'a mut [T]>,
}

// SAFETY: the chunks are disjoint, each handed out once (`take`'s contract): as `&mut
// [T]` split into parts, sent to other threads.
unsafe impl<T: Send> Send for Chunks<'_, T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Send> Sync for Chunks<'_, T> {}

impl<'a, T> Chunks<'a, T> {
    pub(crate) fn new(slice: &'a mut [T], chunk: usize) -> Self {
        Self {
            ptr: slice.as_mut_ptr(),
            len: slice.len(),
            chunk: chunk.max(1),
            slice: PhantomData,
        }
    }

    /// How many chunks.
    pub(crate) fn count(&self) -> usize {
        self.len.div_ceil(self.chunk)
    }

    /// Chunk `c`.
    ///
    /// # Safety
    /// No other `take` of `c` while the chunk is in use.
    ///
    /// # Panics
    /// If `c` is past the last chunk.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn take(&self, c: usize) -> &'a mut [T] {
        assert!(c < self.count(), "chunk {c} of {}", self.count());
        let start = c * self.chunk;
        // SAFETY: within the slice; disjoint from every other chunk, and taken once (the
        // caller's contract).
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(start), self.chunk.min(self.len - start))
        }
    }
}

/// Counts one block done when dropped.
struct Count<'a>(&'a AtomicUsize);

impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::for_each_block;

    #[test]
    fn every_block_runs_once_on_any_pool() {
        for threads in [1, 2, 3, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for blocks in [0, 1, 2, 5, 16] {
                let runs: Vec<AtomicUsize> = (0..blocks).map(|_| AtomicUsize::new(0)).collect();
                pool.install(|| {
                    for_each_block(blocks, |b| {
                        runs[b].fetch_add(1, Ordering::Relaxed);
                    })
                });
                let counts: Vec<usize> = runs.iter().map(|r| r.load(Ordering::Relaxed)).collect();
                assert_eq!(
                    counts,
                    vec![1; blocks],
                    "{threads} threads, {blocks} blocks"
                );
            }
        }
    }

    #[test]
    fn a_panic_in_a_block_reaches_the_caller_after_the_others() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let ran = AtomicUsize::new(0);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                for_each_block(6, |b| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    assert!(b != 4, "block 4 fails");
                })
            })
        }));
        assert!(result.is_err());
        assert_eq!(ran.load(Ordering::Relaxed), 6);
        // The pool goes on.
        pool.install(|| for_each_block(3, |_| {}));
    }
}
