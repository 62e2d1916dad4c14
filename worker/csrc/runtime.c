/* Threads for the kernels: the OpenMP thread count, and the team of thread_pool.h.
 *
 * OpenMP: when this library binds to the libgomp torch already loaded (the usual case: same
 * soname), torch.set_num_threads has set it already; tidal_set_num_threads keeps the share
 * right if the kernels ever get an OpenMP runtime of their own. The team's callers pass
omp_get_max_threads() as their thread count, so both follow torch.set_num_threads.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "thread_pool.h"

#define MAX_TEAM 256
#define SPIN_NS 50000 /* a team thread spins this long for the next job before it sleeps: the
                       * gap between one layer's GEMVs and the next is a few us of Python */

typedef struct {
    tidal_task_fn fn;
    const void *ctx;
    OwnedSpan *spans;
    int64_t threads;
} Job;

static struct {
    _Atomic uint32_t gen;     /* job generation; the futex word sleepers wait on */
    _Atomic int closed;       /* the current job hands out no more joins */
    _Atomic int active;       /* team threads inside the current job */
    _Atomic int sleepers;     /* team threads in futex_wait (the caller wakes only if any) */
    _Atomic int busy;         /* a caller owns the team */
    _Atomic int started;      /* team threads created (1..started are their ids) */
    _Atomic int enabled;      /* 0: the kernels use OpenMP regions instead */
    Job job;
    pthread_mutex_t grow;
} team = {.closed = 1, .enabled = 1, .grow = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Returns the generation once it differs from `seen`: spinning first, then asleep. */
static uint32_t wait_for_job(uint32_t seen) {
    const int64_t deadline = now_ns() + SPIN_NS;
    for (int i = 1;; ++i) {
        const uint32_t g = atomic_load(&team.gen);
        if (g != seen) return g;
        if ((i & 63) == 0) {
            if (now_ns() > deadline) break;
            /* A thread waiting to run here (the caller, OpenMP's threads for torch's ops, the
             * front-end) goes first: this spin only bridges gaps, it must not lengthen them. */
            sched_yield();
        }
        cpu_relax();
    }
    for (;;) {
        atomic_fetch_add(&team.sleepers, 1);
        /* The kernel sleeps only while gen still equals seen: a job published in between wakes
         * nothing and is seen at once. */
        syscall(SYS_futex, &team.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&team.sleepers, 1);
        const uint32_t g = atomic_load(&team.gen);
        if (g != seen) return g;
    }
}

static void *team_main(void *arg) {
    const int64_t me = (int64_t)(intptr_t)arg;
    uint32_t seen = atomic_load(&team.gen);
    for (;;) {
        seen = wait_for_job(seen);
        atomic_fetch_add(&team.active, 1);
        if (!atomic_load(&team.closed) && atomic_load(&team.gen) == seen && me < team.job.threads) {
            const Job job = team.job;
            for (int64_t task; (task = work_share_next(job.spans, job.threads, me)) >= 0;) job.fn(job.ctx, task);
        }
        atomic_fetch_sub(&team.active, 1);
    }
    return NULL;
}

/* Team threads 1..size-1 exist (created on first need; never destroyed: a job of fewer
 * threads leaves the extra ones out). */
static void grow_team(int size) {
    if (atomic_load(&team.started) >= size - 1) return;
    pthread_mutex_lock(&team.grow);
    for (int id = atomic_load(&team.started) + 1; id < size; ++id) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&tid, &attr, team_main, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer threads: the caller takes their share */
        atomic_store(&team.started, id);
    }
    pthread_mutex_unlock(&team.grow);
}

static void team_run_tasks(tidal_task_fn fn, const void *ctx, int64_t tasks, int64_t threads) {
    if (threads > MAX_TEAM) threads = MAX_TEAM;
    if (threads < 1) threads = 1;
    OwnedSpan spans[threads];
    work_share_init(spans, threads, tasks);
    if (threads == 1 || atomic_exchange(&team.busy, 1)) { /* alone, or the team is taken */
        for (int64_t task; (task = work_share_next(spans, threads, 0)) >= 0;) fn(ctx, task);
        return;
    }
    grow_team((int)threads);
    team.job = (Job){fn, ctx, spans, threads};
    atomic_fetch_add(&team.gen, 1);
    atomic_store(&team.closed, 0);
    if (atomic_load(&team.sleepers))
        syscall(SYS_futex, &team.gen, FUTEX_WAKE_PRIVATE, (int)threads - 1, NULL, NULL, 0);
    for (int64_t task; (task = work_share_next(spans, threads, 0)) >= 0;) fn(ctx, task);
    atomic_store(&team.closed, 1);
    while (atomic_load(&team.active)) cpu_relax(); /* only threads that joined: they are running */
    atomic_store(&team.busy, 0);
}

void tidal_run_tasks(tidal_task_fn fn, const void *ctx, int64_t tasks, int64_t threads) {
    if (atomic_load(&team.enabled)) {
        team_run_tasks(fn, ctx, tasks, threads);
        return;
    }
    OwnedSpan spans[threads];
    work_share_init(spans, threads, tasks);
#pragma omp parallel if (threads > 1)
    for (int64_t task; (task = work_share_next(spans, threads, omp_get_thread_num())) >= 0;) fn(ctx, task);
}

void tidal_set_num_threads(int num_threads) {
    if (num_threads <= 0) return;
    omp_set_num_threads(num_threads);
}

void tidal_set_thread_pool(int enabled) { atomic_store(&team.enabled, enabled != 0); }
