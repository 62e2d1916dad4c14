/* Work sharing for the kernels' parallel loops that survives a team mate losing its core.
 *
 * Why: with `schedule(static)` each thread owns a fixed share, so when the OS runs something
 * else on one core (the front-end, an HTTP server, a client on the same machine) for a slice of
 * the region, the whole team waits for that thread at the region's end: on this 2-core machine a
 * process busy 13% of one core slowed the offline run by 13%, twice its share of the machine.
 * `schedule(dynamic)` absorbs that but hands neighbouring tasks to different threads, which
 * undoes the GEMM's prefetch of the panel a thread runs next.
 *
 * So: task ids [0, tasks) are cut into one contiguous span per thread, the same shares as
 * `schedule(static)`. A thread runs its own span front to back (its order, so its prefetches stay
 * right); once it is empty, it takes tasks one at a time from the back of the others' spans.
 * Each span is one 64-bit word, (end << 32) | next, changed only by compare-and-swap, so a task
 * is handed out exactly once whoever asks. Spans are filled before the parallel region for every
 * thread the region may have: spans of threads the team did not get are simply all stolen.
 * The order a task's own work runs in does not change, so results do not depend on who ran it.
 */
#ifndef TIDAL_WORK_SHARE_H
#define TIDAL_WORK_SHARE_H

#include <stdatomic.h>
#include <stdint.h>

typedef struct {
    _Alignas(64) _Atomic uint64_t span; /* (end << 32) | next; empty when next >= end */
} OwnedSpan;

/* tasks < 2^32 (the halves of a span). */
static inline void work_share_init(OwnedSpan *spans, int64_t threads, int64_t tasks) {
    for (int64_t t = 0; t < threads; ++t) {
        const uint64_t lo = (uint64_t)(tasks * t / threads), hi = (uint64_t)(tasks * (t + 1) / threads);
        atomic_init(&spans[t].span, (hi << 32) | lo);
    }
}

/* The next task of span s from the front (own == 1) or the back (own == 0); -1 when empty. */
static inline int64_t work_share_take(OwnedSpan *s, int own) {
    uint64_t v = atomic_load_explicit(&s->span, memory_order_relaxed);
    for (;;) {
        const uint64_t lo = v & 0xFFFFFFFFu, hi = v >> 32;
        if (lo >= hi) return -1;
        const uint64_t taken = own ? v + 1 : ((hi - 1) << 32) | lo;
        /* Relaxed is enough: the task id is all that passes here, and the region's closing
         * barrier orders every task's writes before the caller reads them. */
        if (atomic_compare_exchange_weak_explicit(&s->span, &v, taken, memory_order_relaxed, memory_order_relaxed))
            return (int64_t)(own ? lo : hi - 1);
    }
}

/* The next task for thread `me` of `threads` spans: its own, else the others' (nearest first);
 * -1 when every span is empty (and stays so: spans only shrink). */
static inline int64_t work_share_next(OwnedSpan *spans, int64_t threads, int64_t me) {
    const int64_t task = me < threads ? work_share_take(&spans[me], 1) : -1;
    if (task >= 0) return task;
    for (int64_t d = 1; d <= threads; ++d) {
        const int64_t stolen = work_share_take(&spans[(me + d) % threads], 0);
        if (stolen >= 0) return stolen;
    }
    return -1;
}

#endif
