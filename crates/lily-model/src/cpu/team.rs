//! A team of the thread pool's threads that runs one decode step together: every thread of the pool executes the
//! same list of steps, taking tasks of each parallel step from a shared counter and waiting for the others at a
//! barrier before the next step. A step of one thread ([`Team::single`]) runs while the others wait.
//!
//! A decode step has a few dozen dependent steps per layer, each too short for a fork-join region of the pool (the
//! wake-ups and the splitting of each region cost about as much as its work); the team pays one wake-up per token
//! and a barrier per step. A thread waiting at a barrier spins briefly, then yields its core in a loop for a bounded
//! time ([`yield_time`]), then sleeps until the last thread arrives. The spins cover the waits of a step when every
//! thread has a core; yielding keeps the thread ready to go on at once while letting other threads of the core run;
//! a wait longer than that (the thread waited for was descheduled on a busy machine, or a step of one thread is
//! long) costs no CPU time. Between decode steps the pool's threads sleep as the pool's own idle threads do.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// The environment variable that sets how many microseconds a thread waiting at a barrier yields its core in a loop
/// before it sleeps (default [`DEFAULT_YIELD_MICROS`]; 0 sleeps right after the spins).
pub const YIELD_ENV: &str = "LILY_CPU_YIELD_US";

/// Microseconds of yielding before a waiting thread sleeps: well beyond the waits of a decode step whose threads all
/// have a core (so that such a team never pays a wake-up from sleep), and short beside a scheduler's time slice.
const DEFAULT_YIELD_MICROS: u64 = 1000;

/// Spins before a waiting thread starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 2_000;

/// How long a thread waiting at a barrier yields before it sleeps: [`YIELD_ENV`] if set to a number of
/// microseconds, else [`DEFAULT_YIELD_MICROS`].
pub fn yield_time() -> Duration {
    static YIELD: OnceLock<Duration> = OnceLock::new();
    *YIELD.get_or_init(|| {
        let micros = std::env::var(YIELD_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_YIELD_MICROS);
        Duration::from_micros(micros)
    })
}

#[derive(Default)]
struct TeamState {
    /// Threads arrived at the current barrier.
    arrived: AtomicUsize,
    /// Barriers passed so far.
    generation: AtomicUsize,
    /// Tasks taken so far, over every parallel step (see [`Team::tasks`]).
    taken: AtomicUsize,
    /// Set when a thread panicked, so that the others stop waiting for it.
    poisoned: AtomicBool,
    /// Threads asleep at the current barrier (or about to sleep: counted before they check `generation` under
    /// `lock`), so that the last thread to arrive knows whether to wake anyone.
    sleepers: AtomicUsize,
    /// Held by a thread between its last look at `generation` (or `poisoned`) and its sleep on `wake`, and by a
    /// thread that wakes the sleepers, so that no wake-up falls between the look and the sleep.
    lock: Mutex<()>,
    /// Where threads sleep at a barrier.
    wake: Condvar,
}

impl TeamState {
    /// Wakes the threads asleep at the barrier, after `generation` or `poisoned` changed.
    fn wake_sleepers(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.wake.notify_all();
        }
    }
}

/// One thread's handle on the team.
pub struct Team<'a> {
    shared: &'a TeamState,
    index: usize,
    count: usize,
    /// Tasks taken before the current parallel step, as every thread counts them.
    base: Cell<usize>,
    generation: Cell<usize>,
}

/// Whether a team is running in this process. Teams run one at a time: two teams on one pool, each holding
/// threads that wait at its barrier for threads the other holds, would wait forever.
static RUNNING: AtomicBool = AtomicBool::new(false);

/// Runs `step` on every thread of the current pool at once, each with its [`Team`] handle, and returns true when
/// all are done; returns false at once, running nothing, when another team is running (the caller then computes
/// its step another way). A panic in one thread is re-raised after every thread has stopped.
pub fn try_run(step: impl Fn(&Team) + Sync) -> bool {
    if RUNNING
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return false;
    }
    struct Done;
    impl Drop for Done {
        fn drop(&mut self) {
            RUNNING.store(false, Ordering::Release);
        }
    }
    let _done = Done;
    let shared = TeamState::default();
    rayon::broadcast(|context| {
        let team = Team {
            shared: &shared,
            index: context.index(),
            count: context.num_threads(),
            base: Cell::new(0),
            generation: Cell::new(0),
        };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(&team)));
        if let Err(panic) = result {
            shared.poisoned.store(true, Ordering::SeqCst);
            shared.wake_sleepers();
            std::panic::resume_unwind(panic);
        }
    });
    true
}

impl Team<'_> {
    /// This thread's place in the team, `0..count()`.
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// Waits until every thread of the team has arrived; what each wrote before is then visible to all. A waiting
    /// thread spins, yields for [`yield_time`], then sleeps until the last thread arrives.
    pub fn barrier(&self) {
        let generation = self.generation.get() + 1;
        self.generation.set(generation);
        let shared = self.shared;
        if shared.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.count {
            shared.arrived.store(0, Ordering::Relaxed);
            shared.generation.store(generation, Ordering::SeqCst);
            shared.wake_sleepers();
            return;
        }
        let mut spins = 0u32;
        let mut start = None;
        while shared.generation.load(Ordering::Acquire) != generation {
            if shared.poisoned.load(Ordering::Relaxed) {
                panic!("another thread of the team panicked");
            }
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else if start.get_or_insert_with(Instant::now).elapsed() < yield_time() {
                std::thread::yield_now();
            } else {
                self.sleep_until(generation);
                return;
            }
        }
    }

    /// Sleeps until the barrier's generation reaches `generation`.
    #[cold]
    fn sleep_until(&self, generation: usize) {
        let shared = self.shared;
        let mut guard = shared.lock.lock().unwrap_or_else(PoisonError::into_inner);
        // Counted before the look at `generation` below; the last thread to arrive stores `generation` before it
        // reads `sleepers` (both sequentially consistent), so either this thread sees the new generation or that
        // thread sees it counted and wakes it under the lock.
        shared.sleepers.fetch_add(1, Ordering::SeqCst);
        while shared.generation.load(Ordering::SeqCst) != generation && !shared.poisoned.load(Ordering::SeqCst) {
            guard = shared.wake.wait(guard).unwrap_or_else(PoisonError::into_inner);
        }
        shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(guard);
        if shared.generation.load(Ordering::Acquire) != generation {
            panic!("another thread of the team panicked");
        }
    }

    /// Runs `task(i)` for every `i` in `0..tasks`, each once on some thread (threads take the next task as they
    /// finish one), then waits at a barrier. Every thread of the team must call it with the same `tasks`.
    pub fn tasks(&self, tasks: usize, mut task: impl FnMut(usize)) {
        // The counter only grows: each thread takes tasks until it draws one past the end, so a step draws exactly
        // `tasks + count` numbers and every thread knows where the next step's numbers begin.
        let base = self.base.get();
        loop {
            let i = self.shared.taken.fetch_add(1, Ordering::Relaxed) - base;
            if i >= tasks {
                break;
            }
            task(i);
        }
        self.base.set(base + tasks + self.count);
        self.barrier();
    }

    /// Runs `step` on the first thread while the others wait, then a barrier.
    pub fn single(&self, step: impl FnOnce()) {
        if self.index == 0 {
            step();
        }
        self.barrier();
    }
}

/// A mutable buffer that the team's threads share: each step writes disjoint parts of it, or one thread writes it
/// while the others wait ([`Team::single`]); a barrier separates writes from the reads of later steps.
pub struct Shared<'a, T: ?Sized> {
    ptr: *mut T,
    _life: std::marker::PhantomData<&'a mut T>,
}

impl<T: ?Sized> Clone for Shared<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: ?Sized> Copy for Shared<'_, T> {}

// SAFETY: the team's threads access the value through `get`, whose callers promise disjoint or ordered access.
unsafe impl<T: ?Sized + Send> Send for Shared<'_, T> {}
unsafe impl<T: ?Sized + Send> Sync for Shared<'_, T> {}

impl<'a, T: ?Sized> Shared<'a, T> {
    pub fn new(value: &'a mut T) -> Self {
        Shared {
            ptr: value,
            _life: std::marker::PhantomData,
        }
    }

    /// # Safety
    /// No other thread accesses the value until the next barrier (for a slice, see [`Shared::part`]).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn get(&self) -> &'a mut T {
        unsafe { &mut *self.ptr }
    }
}

impl<'a, T> Shared<'a, [T]> {
    pub fn len(&self) -> usize {
        self.ptr.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements `start..start + len`, shared as a buffer of their own.
    pub fn sub(&self, start: usize, len: usize) -> Shared<'a, [T]> {
        assert!(start + len <= self.len(), "part {start}+{len} of {}", self.len());
        Shared {
            ptr: std::ptr::slice_from_raw_parts_mut(self.ptr.cast::<T>().wrapping_add(start), len),
            _life: std::marker::PhantomData,
        }
    }

    /// Elements `start..start + len`.
    ///
    /// # Safety
    /// No other thread accesses these elements until the next barrier.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, start: usize, len: usize) -> &'a mut [T] {
        assert!(start + len <= self.len(), "part {start}+{len} of {}", self.len());
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<T>().add(start), len) }
    }

    /// The whole slice, to read.
    ///
    /// # Safety
    /// No thread writes it until the next barrier.
    pub unsafe fn read(&self) -> &'a [T] {
        unsafe { &*self.ptr }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `step` as a team as soon as no other team (of another test running at the same time) runs.
    pub fn run_when_free(step: impl Fn(&Team) + Sync) {
        let start = std::time::Instant::now();
        while !try_run(&step) {
            assert!(start.elapsed().as_secs() < 60, "another team ran for a minute");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Every task of every step runs once, and each step sees all writes of the steps before it.
    #[test]
    fn steps_run_every_task_once_in_order() {
        for threads in [1, 3, 4] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut values = vec![0usize; 38];
            let shared = Shared::new(&mut values[..]);
            let sum = AtomicUsize::new(0);
            pool.install(|| {
                run_when_free(|team| {
                    for step in 1..=20usize {
                        team.tasks(37 + step, |i| {
                            if i < 38 {
                                // SAFETY: task i alone touches element i in this step.
                                let v = unsafe { shared.part(i, 1) };
                                assert_eq!(v[0], (step - 1) * (step - 1));
                                v[0] += 2 * step - 1;
                            }
                        });
                        team.single(|| {
                            // SAFETY: the others wait at the barrier.
                            let all = unsafe { shared.read() };
                            sum.fetch_add(all.iter().sum::<usize>(), Ordering::Relaxed);
                            // A second team cannot start while this one runs.
                            assert!(!try_run(|_| unreachable!()));
                        });
                    }
                });
            });
            let expected: usize = (1..=20usize).map(|s| s * s * 38).sum();
            assert_eq!(sum.load(Ordering::Relaxed), expected, "{threads} threads");
        }
    }

    /// CPU time the calling thread has used.
    fn thread_cpu_time() -> std::time::Duration {
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `t` is a valid timespec to write.
        assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) }, 0);
        std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }

    /// A thread that waits long at a barrier sleeps there instead of keeping its core busy: while the first thread
    /// of a team of two works for 400 ms in a step of its own, the second uses far less CPU time than that (a
    /// waiter that spins or yields all along uses its core's share of the whole wait: a third of it when three
    /// threads share its core).
    #[test]
    fn a_long_wait_at_a_barrier_sleeps() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let waited = std::sync::Mutex::new(None);
        pool.install(|| {
            run_when_free(|team| {
                let before = thread_cpu_time();
                team.single(|| std::thread::sleep(std::time::Duration::from_millis(400)));
                if team.index() == 1 {
                    *waited.lock().unwrap() = Some(thread_cpu_time() - before);
                }
            });
        });
        let waited = waited.into_inner().unwrap().expect("the second thread waited");
        assert!(
            waited < std::time::Duration::from_millis(40),
            "the waiting thread used {waited:?} of CPU time over a 400 ms wait"
        );
    }

    /// A panic in one thread wakes a thread asleep at a barrier, and the team's run re-raises it instead of
    /// waiting forever.
    #[test]
    fn a_panic_wakes_a_sleeping_thread() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let start = std::time::Instant::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                run_when_free(|team| {
                    team.single(|| {
                        std::thread::sleep(std::time::Duration::from_millis(100));
                        panic!("a failing step");
                    });
                });
            })
        }));
        assert!(result.is_err(), "the panic was re-raised");
        assert!(start.elapsed().as_secs() < 30, "the team stopped");
    }

    /// Once a team is done, the pool's threads use no CPU time while the pool has no work.
    #[test]
    fn the_pool_is_idle_after_a_team() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| {
            run_when_free(|team| {
                for _ in 0..100 {
                    team.tasks(50, |_| std::hint::black_box(()));
                    team.single(|| ());
                }
            })
        });
        let before = pool.broadcast(|_| thread_cpu_time());
        std::thread::sleep(std::time::Duration::from_millis(200));
        let after = pool.broadcast(|_| thread_cpu_time());
        for (thread, (a, b)) in after.iter().zip(&before).enumerate() {
            let used = *a - *b;
            assert!(
                used < std::time::Duration::from_millis(20),
                "thread {thread} of the idle pool used {used:?} of CPU time in 200 ms"
            );
        }
    }
}
