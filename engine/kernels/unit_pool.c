/*
 * The pool of unit_pool.h. `next` holds (generation << 32 | next unit): a thread claims units
 * only while the generation is the one whose call it read, so a late worker never runs a
 * finished call's units; between calls the unit field is 0xFFFFFFFF (none left). `done` counts
 * finished units of the current call.
 */
#include "unit_pool.h"

#include <pthread.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    unit_fn fn;
    const void *ctx;
    int64_t num_units;
    int64_t max_take; /* units per claim at most */
    int64_t threads;
} call_t;

static struct {
    pthread_mutex_t call_mu; /* one call at a time */
    pthread_mutex_t mu;      /* with cv: sleeping workers */
    pthread_cond_t cv;
    uint32_t gen;            /* atomic: the published call's generation */
    uint64_t next;           /* atomic */
    int64_t done;            /* atomic */
    int sleepers;            /* atomic */
    int started;             /* workers running (call_mu) */
    int threads;             /* atomic: threads per call, the caller included */
    int64_t spin_ns;         /* atomic */
    call_t call;             /* written by the caller before it publishes `gen` */
    const char *ahead;       /* atomic: memory for a spinning worker to read (NULL: none) */
    int64_t ahead_bytes;     /* atomic: its length, written before `ahead` */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          0, 0xFFFFFFFFu, 0, 0, 0, 1, 500000, {0}, 0, 0};

#define LOAD(p) __atomic_load_n(&(p), __ATOMIC_ACQUIRE)
#define RELAXED(p) __atomic_load_n(&(p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n(&(p), (v), __ATOMIC_RELAXED)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Units per claim when `left` are unclaimed: a share of them that shrinks as they run out
 * (guided scheduling), so that the threads finish together, from max_take down to one. */
static inline int64_t claim_size(const call_t *call, int64_t left) {
    const int64_t take = left / (2 * call->threads);
    return take < 1 ? 1 : take > call->max_take ? call->max_take : take;
}

/* Claim and run units of generation `gen` until none is left. */
static void work(const call_t *call, uint32_t gen) {
    uint64_t v = LOAD(pool.next);
    for (;;) {
        const int64_t u0 = (int64_t)(v & 0xFFFFFFFFu);
        if ((uint32_t)(v >> 32) != gen || u0 >= call->num_units) return;
        const int64_t take = claim_size(call, call->num_units - u0);
        if (__atomic_compare_exchange_n(&pool.next, &v, v + (uint64_t)take, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            const int64_t u1 = u0 + take < call->num_units ? u0 + take : call->num_units;
            call->fn(call->ctx, u0, u1);
            __atomic_fetch_add(&pool.done, u1 - u0, __ATOMIC_RELEASE);
            v = LOAD(pool.next);
        }
    }
}

/* Read the memory a caller asked for (`unit_pool_read_ahead`) a line at a time, so that its
 * next call finds it in cache; stop when a call after `seen` is published. */
static void read_ahead(uint32_t seen) {
    const char *p = __atomic_exchange_n(&pool.ahead, (const char *)0, __ATOMIC_ACQ_REL);
    if (p == 0) return;
    const int64_t bytes = RELAXED(pool.ahead_bytes);
    uint64_t sink = 0;
    for (int64_t off = 0; off < bytes; off += 64) {
        sink += *(const volatile uint8_t *)(p + off);
        if (off % 4096 == 0 && RELAXED(pool.gen) != seen) break;
    }
    __asm__ volatile("" : : "r"(sink));
}

/* Spin, then sleep, until a generation after `seen` is published; returns it. */
static uint32_t wait_for_call(uint32_t seen) {
    uint32_t g = LOAD(pool.gen);
    if (g != seen) return g;
    const int64_t deadline = now_ns() + RELAXED(pool.spin_ns);
    int spins = 0;
    while ((g = LOAD(pool.gen)) == seen) {
        if (RELAXED(pool.ahead)) read_ahead(seen);
        cpu_relax();
        if (++spins % 64 == 0 && now_ns() > deadline) break;
    }
    if (g != seen) return g;
    pthread_mutex_lock(&pool.mu);
    __atomic_fetch_add(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    while ((g = __atomic_load_n(&pool.gen, __ATOMIC_SEQ_CST)) == seen) {
        pthread_cond_wait(&pool.cv, &pool.mu);
    }
    __atomic_fetch_sub(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&pool.mu);
    return g;
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1 .. threads - 1 */
    uint32_t seen = LOAD(pool.gen);
    for (;;) {
        const uint32_t g = wait_for_call(seen);
        seen = g;
        if (index >= RELAXED(pool.threads)) continue; /* not a participant at this setting */
        call_t call;
        call.fn = __atomic_load_n(&pool.call.fn, __ATOMIC_RELAXED);
        call.ctx = __atomic_load_n(&pool.call.ctx, __ATOMIC_RELAXED);
        call.num_units = RELAXED(pool.call.num_units);
        call.max_take = RELAXED(pool.call.max_take);
        call.threads = RELAXED(pool.call.threads);
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* pairs with the caller's release fence */
        work(&call, g); /* uses the copy only if generation g's units are still unclaimed */
    }
    return 0;
}

static void after_fork_in_child(void) {
    pthread_mutex_init(&pool.call_mu, 0);
    pthread_mutex_init(&pool.mu, 0);
    pthread_cond_init(&pool.cv, 0);
    pool.sleepers = 0;
    pool.started = 0;
}

/* Start workers up to threads - 1 (call_mu held); returns how many run. */
static int ensure_workers(int threads) {
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(0, 0, after_fork_in_child);
        atfork = 1;
    }
    while (pool.started < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.started++;
    }
    return pool.started;
}

static void run_alone(const call_t *call) {
    for (int64_t u = 0; u < call->num_units; u += call->max_take) {
        const int64_t u1 = u + call->max_take;
        call->fn(call->ctx, u, u1 < call->num_units ? u1 : call->num_units);
    }
}

void unit_pool_run(unit_fn fn, const void *ctx, int64_t num_units, int64_t max_take) {
    const int threads = RELAXED(pool.threads);
    const call_t call = {fn, ctx, num_units, max_take > 1 ? max_take : 1, threads};
    if (threads <= 1 || num_units <= 1) {
        run_alone(&call);
        return;
    }
    pthread_mutex_lock(&pool.call_mu);
    if (ensure_workers(threads) == 0) {
        pthread_mutex_unlock(&pool.call_mu);
        run_alone(&call);
        return;
    }
    /* `next` holds the finished generation with no unit left (set at the end of each call);
     * a worker that reads any field below written sees that, so it never runs a torn call. */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    STORE(pool.call.fn, call.fn);
    STORE(pool.call.ctx, call.ctx);
    STORE(pool.call.num_units, call.num_units);
    STORE(pool.call.max_take, call.max_take);
    STORE(pool.call.threads, call.threads);
    const uint32_t gen = RELAXED(pool.gen) + 1;
    STORE(pool.done, 0);
    __atomic_store_n(&pool.next, (uint64_t)gen << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.gen, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    work(&call, gen);
    while (LOAD(pool.done) < call.num_units) cpu_relax();
    STORE(pool.next, (uint64_t)gen << 32 | 0xFFFFFFFFu);
    pthread_mutex_unlock(&pool.call_mu);
}

void unit_pool_set_threads(int threads) {
    threads = threads < 1                       ? 1
              : threads > UNIT_POOL_MAX_THREADS ? UNIT_POOL_MAX_THREADS
                                                : threads;
    STORE(pool.threads, threads);
}

int unit_pool_get_threads(void) { return RELAXED(pool.threads); }

void unit_pool_set_spin_us(int64_t us) { STORE(pool.spin_ns, us < 0 ? 0 : us * 1000); }

void unit_pool_read_ahead(const void *ptr, int64_t bytes) {
    if (RELAXED(pool.threads) <= 1 || RELAXED(pool.started) == 0) return;
    STORE(pool.ahead_bytes, bytes);
    __atomic_store_n(&pool.ahead, (const char *)ptr, __ATOMIC_RELEASE);
}
