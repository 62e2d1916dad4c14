/* A team for the GEMM/GEMV loops whose caller never waits for a thread that has not started.
 *
 * Why not an OpenMP region: its closing barrier waits for every team member, also one the OS
 * has not run yet (descheduled for the front-end, or asleep after its spin and still waking).
 * At batch 1 a decode step is ~100 such regions of 10-100 us each, and on a 2-core machine with
 * the front-end and the engine core beside the worker those waits, not the GEMVs, were most of
 * the step. Here the caller publishes the job, runs tasks itself (work_share.h: its own span,
 * then the others'), closes the job once every task is taken, and waits only for the threads
 * that joined it while it was open. A late thread sees the job closed and goes back to waiting.
 *
 * Protocol (every access seq_cst unless noted; `gen` is also the futex word):
 *   caller:  job = ...; gen += 1; closed = 0; wake sleepers; run tasks; closed = 1;
 *            wait until active == 0
 *   thread:  wait until gen != seen; seen = gen; active += 1;
 *            if (!closed && gen == seen) run the job's tasks; active -= 1
 * A thread that counted itself in before the caller's `closed = 1` is seen by the caller's wait;
 * one that counted itself in after it reads closed == 1 (or a newer gen) and touches nothing.
 * The job (and the spans on the caller's stack) is read only between those two points.
 * One caller at a time: a second concurrent caller (two engines in threads of one process) runs
 * its tasks alone rather than wait. After fork() the child has no team threads: nothing joins,
 * the caller runs every task, nothing waits.
 */
#ifndef TIDAL_THREAD_POOL_H
#define TIDAL_THREAD_POOL_H

#include <stdint.h>

#include "work_share.h"

typedef void (*tidal_task_fn)(const void *ctx, int64_t task);

/* Run tasks [0, tasks) of fn over `threads` spans (threads <= 1: all here, in order): on the
 * team, or in an OpenMP region over the same spans after tidal_set_thread_pool(0)
 * (TIDAL_CPU_THREAD_POOL=0). Each task's work is the same either way, so are the results. */
void tidal_run_tasks(tidal_task_fn fn, const void *ctx, int64_t tasks, int64_t threads);

/* One linear-layer kernel call (gemm_panels.c, gemv.c) as its tasks read it. */
typedef struct {
    const float *x;
    int64_t xs;
    const void *w;
    const float *bias;
    float *out;
    int64_t os, m, n, k;
    int kind;
    int64_t groups, mblocks; /* gemm's task grid (gemv: unused) */
} LinearCall;

#endif
