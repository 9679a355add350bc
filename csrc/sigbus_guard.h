/* A SIGBUS guard for reads of file mappings, for the library that includes it (its state is static:
 * each library has its own handler and thread-local jump target).
 *
 * A page of a mapped file that cannot be read (the file was truncated under the mapping, or the disk
 * returned an I/O error) raises SIGBUS in the thread that touches it, which kills the process by
 * default. A thread reads inside a guard: sigsetjmp(jb, 0), then guard_arm(&jb), the reads, then
 * guard_disarm(). The handler (guard_install, once per library) jumps out of the reads of an armed
 * thread, guard_fault_addr() telling where they failed. A SIGBUS anywhere else goes to the handler that
 * was there before: another library's guard (mo_native's copy pool and mo_host's kernel each install
 * one, in either order, and each passes the other's faults on), Python's faulthandler, or the default
 * (the process dies as it would have without this). */
#ifndef MO_SIGBUS_GUARD_H
#define MO_SIGBUS_GUARD_H

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>

/* initial-exec: the handler may run in any thread (a fault elsewhere), where a lazily allocated
 * general-dynamic TLS block would be allocated inside the handler (not async-signal-safe) */
#define GUARD_TLS __thread __attribute__((tls_model("initial-exec")))
/* volatile, and a compiler barrier around arming: the compiler must neither drop the store that arms the
 * guard (a store overwritten by the disarm with no read between looks dead to it) nor move the guarded
 * reads outside it */
static GUARD_TLS sigjmp_buf *volatile guard_jmp;
static GUARD_TLS void *volatile guard_addr;
static struct sigaction guard_prev;
static pthread_once_t guard_once = PTHREAD_ONCE_INIT;

static void guard_on_sigbus(int sig, siginfo_t *si, void *uc) {
    sigjmp_buf *jb = guard_jmp;
    if (jb) {
        guard_jmp = NULL;
        /* si_addr is the faulting address only for a kernel-sent SIGBUS (si_code > 0), not for
         * one re-raised by a handler installed after this one (faulthandler) */
        guard_addr = si && si->si_code > 0 ? si->si_addr : NULL;
        siglongjmp(*jb, 1);
    }
    if (guard_prev.sa_flags & SA_SIGINFO) {
        if (guard_prev.sa_sigaction) { guard_prev.sa_sigaction(sig, si, uc); return; }
    } else if (guard_prev.sa_handler != SIG_DFL && guard_prev.sa_handler != SIG_IGN) {
        guard_prev.sa_handler(sig);
        return;
    }
    /* default (or ignored, which for a fault would loop): die of it, as without this handler;
     * returning re-runs the faulting access, which raises SIGBUS again, now with the default */
    signal(SIGBUS, SIG_DFL);
}

static void guard_install_once(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = guard_on_sigbus;
    /* NODEFER: SIGBUS is not blocked while the handler runs, so the jump out of it leaves the
     * thread's mask as it was and sigsetjmp need not save the mask (a syscall per guard) */
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &guard_prev);
}

static inline void guard_install(void) { pthread_once(&guard_once, guard_install_once); }
static inline void guard_arm(sigjmp_buf *jb) {
    guard_jmp = jb;
    __asm__ __volatile__("" ::: "memory");
}
static inline void guard_disarm(void) {
    __asm__ __volatile__("" ::: "memory");
    guard_jmp = NULL;
}
static inline void *guard_fault_addr(void) { return guard_addr; }
/* this thread's guard state touched outside the handler (a worker's start) */
static inline void guard_thread_init(void) { guard_jmp = NULL; guard_addr = NULL; }

/* 1 while the process's SIGBUS handler is this library's. A handler installed later that does not pass
 * faults on disarms the guard (faulthandler dumps and re-raises: still caught). */
static inline int guard_is_current(void) {
    struct sigaction cur;
    return sigaction(SIGBUS, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == guard_on_sigbus;
}

/* This library's handler, and the one it passes other faults on to (NULL: the default or a plain one). */
static inline void *guard_handler(void) { return (void *)guard_on_sigbus; }
static inline void *guard_prev_handler(void) {
    guard_install();
    return (guard_prev.sa_flags & SA_SIGINFO) ? (void *)guard_prev.sa_sigaction : NULL;
}

#endif
