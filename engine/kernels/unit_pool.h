/*
 * A process-wide pool of threads that runs a call's units of work (no OpenMP runtime).
 *
 * `unit_pool_run(fn, ctx, num_units, max_take)` runs fn(ctx, u0, u1) over runs [u0, u1) that
 * cover [0, num_units) once, on the calling thread and `threads - 1` persistent workers, and
 * returns when every run is done. The threads claim runs from one atomic counter, each run a
 * share of the units left (guided scheduling: up to `max_take` units, down to one as the call
 * ends, so that the threads finish together). Between calls a worker spins for `spin_us`
 * microseconds (default 500: longer than the other work between a step's products, and than
 * most gaps between one client's steps, so that a worker is rarely woken from sleep within a
 * step), then sleeps on a condition variable. Concurrent calls from several threads are
 * serialised by a mutex. Workers are not inherited by a forked child; the child starts its own
 * on its first call.
 */
#ifndef SPECSERVE_UNIT_POOL_H
#define SPECSERVE_UNIT_POOL_H

#include <stdint.h>

#define UNIT_POOL_MAX_THREADS 256

/* Runs units [u0, u1) of the call whose context is `ctx`. */
typedef void (*unit_fn)(const void *ctx, int64_t u0, int64_t u1);

/* Runs fn over [0, num_units) as above; `ctx` must stay valid until the call returns. One
 * thread, or one unit, runs on the caller alone in runs of max_take. */
void unit_pool_run(unit_fn fn, const void *ctx, int64_t num_units, int64_t max_take);

/* Threads per call, the caller included (clamped to 1 .. UNIT_POOL_MAX_THREADS). */
void unit_pool_set_threads(int threads);
int unit_pool_get_threads(void);

/* Ask a worker spinning between calls to read [ptr, ptr + bytes) a cache line at a time (the
 * weights of the caller's next call, while it does other work), stopping at the next call. The
 * latest request replaces any not yet taken; nothing with one thread or no worker started. */
void unit_pool_read_ahead(const void *ptr, int64_t bytes);

/* How long an idle worker spins before it sleeps, in microseconds (0: sleep at once). */
void unit_pool_set_spin_us(int64_t us);

#endif
