// CPU emulator runtime: runs one dispatch, one threadgroup at a time, every GPU thread a fiber.
//
// Included once, after the kernel source, by the glue the Python driver generates; the glue adds one
// `moepack_launch_<kernel>` C entry per kernel. Rules (see shared/design/metal-kernels.md):
// - A simd collective is released once every live lane of its simdgroup is blocked (at a collective or a
//   barrier); the lanes blocked at the same call site form the active set; values are snapshotted at
//   release so a fast lane cannot overwrite its slot before slow lanes read it.
// - A threadgroup barrier is released only when every live thread waits at the same barrier; a thread
//   that returned while others wait, or threads waiting at different barriers, is an error.
// - Threads are resumed forward, in reverse, or in a seeded random order (groups too), so a missing
//   barrier shows up as a wrong result under some order.
// - Threadgroup arrays get one instance per group run, filled with a garbage byte pattern at first use.
#ifndef MOEPACK_EMU_RUNTIME_H
#define MOEPACK_EMU_RUNTIME_H

#include <setjmp.h>
#include <stdarg.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__) || defined(MOEPACK_EMU_UCONTEXT)
#include <ucontext.h>
#endif

// float -> bfloat conversion helpers clang calls on x86 (compiler-rt has them; libgcc may not):
// round to nearest even, NaN stays NaN.
extern "C" __attribute__((weak, visibility("hidden"))) __bf16 __truncsfbf2(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  unsigned short h = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                                     : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  __bf16 r;
  memcpy(&r, &h, 2);
  return r;
}
extern "C" __attribute__((weak, visibility("hidden"))) __bf16 __truncdfbf2(double d) { return __truncsfbf2((float)d); }

namespace moepack_emu {

struct ThreadInfo {
  uint3 tpig, tpitg, tgpig, tptg, tgpg, tpg;  // position in grid / in group, group position, sizes
  uint tiitg, tiisg, sgitg, sgptg;            // linear index, lane, simdgroup index, simdgroups/group
};

enum { MAX_THREADS = 1024, STACK_BYTES = 256 * 1024, TG_LIMIT = 32 * 1024, TG_ARENA = 1 << 20, MAX_TG_DECLS = 256 };
enum State { RUNNABLE = 0, AT_COLLECTIVE = 1, AT_BARRIER = 2, DONE = 3 };
enum Schedule { FORWARD = 0, REVERSE = 1, RANDOM = 2 };

struct Fiber {
  void* sp;
#if !defined(__x86_64__) || defined(MOEPACK_EMU_UCONTEXT)
  ucontext_t uc;
#endif
  int state, line, site, op;
  unsigned size;
  ThreadInfo info;
};

typedef void (*Thunk)(void** bufs, const ThreadInfo* t);

struct Run {
  const char* kname;
  Thunk thunk;
  void** bufs;
  Fiber fibers[MAX_THREADS];
  unsigned char slots[MAX_THREADS][SLOT];    // each lane's value at its pending collective
  unsigned char snaps[MAX_THREADS / LANES][LANES * SLOT];
  unsigned snap_mask[MAX_THREADS / LANES];
  int order[MAX_THREADS];
  int nthreads, nsg, cur;
  void* sched_sp;
#if !defined(__x86_64__) || defined(MOEPACK_EMU_UCONTEXT)
  ucontext_t sched_uc;
#endif
  int strict_simd, schedule;
  unsigned long long rng;
  unsigned char garbage;
  unsigned char* arena;
  unsigned long arena_used;
  int tg_n, tg_id[MAX_TG_DECLS];
  unsigned long tg_off[MAX_TG_DECLS];
  int failed;
  char msg[1024];
  char* stacks;
  sigjmp_buf crash_jmp;
  volatile sig_atomic_t crash_sig;
  void* crash_addr;
};
static Run R;

// ---------------------------------------------------------------- context switch
#if defined(__x86_64__) && !defined(MOEPACK_EMU_UCONTEXT)
// switch(save, to): push callee-saved registers and the FP control words, store rsp in *save, load
// `to`, pop, return into the other context. ~20 instructions; ucontext's swapcontext makes a syscall.
extern "C" void moepack_emu_switch(void** save, void* to);
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".type moepack_emu_switch,@function\n"
    "moepack_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size moepack_emu_switch, .-moepack_emu_switch\n");
#endif

static void fiber_main();

static char* stack_of(int i) { return R.stacks + (unsigned long)i * STACK_BYTES; }

static int ensure_stacks() {
  if (R.stacks) return 1;
  // lazily committed: the kernel touches a page or two of each 256 KiB stack; the lowest page of each
  // stack is a guard so an overflow faults instead of corrupting the neighbour.
  void* p = mmap(0, (unsigned long)MAX_THREADS * STACK_BYTES, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 0;
  R.stacks = (char*)p;
  long page = sysconf(_SC_PAGESIZE);
  for (int i = 0; i < MAX_THREADS; ++i) mprotect(stack_of(i), (unsigned long)page, PROT_NONE);
  R.arena = (unsigned char*)malloc(TG_ARENA);
  return R.arena != 0;
}

static void fiber_init(int i) {
  Fiber* f = &R.fibers[i];
#if defined(__x86_64__) && !defined(MOEPACK_EMU_UCONTEXT)
  unsigned long top = ((unsigned long)(stack_of(i) + STACK_BYTES)) & ~15ul;
  unsigned long* sp = (unsigned long*)(top - 8);  // rsp after `ret` into fiber_main: 8 mod 16
  *sp = 0;                                        // fiber_main never returns
  *--sp = (unsigned long)&fiber_main;
  for (int k = 0; k < 6; ++k) *--sp = 0;          // rbp rbx r12 r13 r14 r15
  --sp;
  unsigned mx;
  unsigned short cw;
  __asm__ volatile("stmxcsr %0" : "=m"(mx));
  __asm__ volatile("fnstcw %0" : "=m"(cw));
  memcpy((char*)sp, &mx, 4);
  memcpy((char*)sp + 4, &cw, 2);
  f->sp = sp;
#else
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = stack_of(i) + 4096;
  f->uc.uc_stack.ss_size = STACK_BYTES - 4096;
  f->uc.uc_link = 0;
  makecontext(&f->uc, (void (*)())fiber_main, 0);
#endif
}

static void to_scheduler(Fiber* f) {
#if defined(__x86_64__) && !defined(MOEPACK_EMU_UCONTEXT)
  moepack_emu_switch(&f->sp, R.sched_sp);
#else
  swapcontext(&f->uc, &R.sched_uc);
#endif
}

static void to_fiber(int i) {
  R.cur = i;
#if defined(__x86_64__) && !defined(MOEPACK_EMU_UCONTEXT)
  moepack_emu_switch(&R.sched_sp, R.fibers[i].sp);
#else
  swapcontext(&R.sched_uc, &R.fibers[i].uc);
#endif
}

static void fiber_main() {
  Fiber* f = &R.fibers[R.cur];
  R.thunk(R.bufs, &f->info);
  f = &R.fibers[R.cur];
  f->state = DONE;
  to_scheduler(f);
  __builtin_trap();  // a finished fiber is never resumed
}

// ---------------------------------------------------------------- errors
static const char* thread_name(int i, char* buf, unsigned n) {
  const ThreadInfo& t = R.fibers[i].info;
  snprintf(buf, n, "thread (%u,%u,%u) of threadgroup (%u,%u,%u)", t.tpitg.x, t.tpitg.y, t.tpitg.z,
           t.tgpig.x, t.tgpig.y, t.tgpig.z);
  return buf;
}

static const char* op_name(int op) {
  static const char* names[] = {"?", "simd_sum", "simd_product", "simd_max", "simd_min", "simd_and",
                                "simd_or", "simd_xor", "simd_all", "simd_any", "simd_shuffle",
                                "simd_shuffle_xor", "simd_shuffle_down", "simd_shuffle_up",
                                "simd_broadcast", "simd_broadcast_first", "simd_prefix_exclusive_sum",
                                "simd_prefix_inclusive_sum", "simdgroup_barrier"};
  return op > 0 && op <= OP_SIMD_BARRIER ? names[op] : "?";
}

static void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char* fmt, ...) {
  if (R.failed) return;
  R.failed = 1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(R.msg, sizeof R.msg, fmt, ap);
  va_end(ap);
}

// called from inside a fiber: record the error and never come back
static void fail_in_fiber() {
  Fiber* f = &R.fibers[R.cur];
  f->state = DONE;
  to_scheduler(f);
  __builtin_trap();
}

// ---------------------------------------------------------------- what kernels call
static Snapshot collective(int line, int site, int op, const void* value, unsigned size) {
  int i = R.cur;
  Fiber* f = &R.fibers[i];
  if (size) memcpy(R.slots[i], value, size);
  f->state = AT_COLLECTIVE;
  f->line = line;
  f->site = site;
  f->op = op;
  f->size = size;
  to_scheduler(f);
  unsigned sg = (unsigned)i / LANES;
  Snapshot s = {R.snaps[sg], R.snap_mask[sg], (unsigned)i % LANES};
  return s;
}

static void barrier(int line, int site, unsigned flags) {
  (void)flags;
  Fiber* f = &R.fibers[R.cur];
  f->state = AT_BARRIER;
  f->line = line;
  f->site = site;
  f->op = 0;
  to_scheduler(f);
}

static void* tg_alloc(unsigned long size, unsigned long align, int id) {
  for (int k = 0; k < R.tg_n; ++k)
    if (R.tg_id[k] == id) return R.arena + R.tg_off[k];
  unsigned long off = (R.arena_used + align - 1) & ~(align - 1);
  if (R.tg_n == MAX_TG_DECLS || off + size > TG_LIMIT) {
    fail("kernel %s: threadgroup memory exceeds Metal's 32 KiB limit (%lu bytes requested)", R.kname,
         off + size);
    fail_in_fiber();
  }
  memset(R.arena + off, R.garbage, size);
  R.tg_id[R.tg_n] = id;
  R.tg_off[R.tg_n++] = off;
  R.arena_used = off + size;
  return R.arena + off;
}

// ---------------------------------------------------------------- scheduler
static unsigned long long next_rand() {
  unsigned long long x = R.rng;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return R.rng = x;
}

static void make_order(int* order, int n) {
  for (int k = 0; k < n; ++k) order[k] = R.schedule == REVERSE ? n - 1 - k : k;
  if (R.schedule == RANDOM)
    for (int k = n - 1; k > 0; --k) {
      int j = (int)(next_rand() % (unsigned long long)(k + 1));
      int t = order[k];
      order[k] = order[j];
      order[j] = t;
    }
}

// release the collective of one simdgroup whose live lanes are all blocked; returns 1 if released
static int release_simdgroup(unsigned sg) {
  int lo = (int)sg * LANES, hi = lo + LANES < R.nthreads ? lo + LANES : R.nthreads;
  int pick = -1;
  for (int i = lo; i < hi; ++i) {
    int st = R.fibers[i].state;
    if (st == RUNNABLE) return 0;
    if (st == AT_COLLECTIVE && pick < 0) pick = i;
  }
  if (pick < 0) return 0;
  const Fiber& p = R.fibers[pick];
  unsigned mask = 0;
  int n = 0;
  char tn[96];
  for (int i = lo; i < hi; ++i) {
    const Fiber& f = R.fibers[i];
    if (f.state != AT_COLLECTIVE || f.site != p.site) continue;
    if (f.op != p.op || f.size != p.size) {
      fail("kernel %s: lanes of one simdgroup meet at line %d with different collectives (%s and %s)",
           R.kname, p.line, op_name(p.op), op_name(f.op));
      return 0;
    }
    mask |= 1u << (i - lo);
    memcpy(R.snaps[sg] + (i - lo) * SLOT, R.slots[i], p.size);
    ++n;
  }
  if (R.strict_simd && n != LANES) {
    fail("kernel %s: %s at line %d ran with %d of 32 lanes active in simdgroup %u (%s); strict_simd "
         "demands all 32 lanes (CUDA warps use a full mask)",
         R.kname, op_name(p.op), p.line, n, sg, thread_name(pick, tn, sizeof tn));
    return 0;
  }
  R.snap_mask[sg] = mask;
  for (int i = lo; i < hi; ++i)
    if (mask >> (i - lo) & 1u) R.fibers[i].state = RUNNABLE;
  return 1;
}

static int release_barrier() {
  int first = -1, done = -1;
  char a[96], b[96];
  for (int i = 0; i < R.nthreads; ++i) {
    const Fiber& f = R.fibers[i];
    if (f.state == DONE) { if (done < 0) done = i; continue; }
    if (first < 0) { first = i; continue; }
    const Fiber& p = R.fibers[first];
    if (f.site != p.site) {
      fail("kernel %s: threads wait at different barriers (line %d: %s; line %d: %s): a barrier in "
           "divergent code",
           R.kname, p.line, thread_name(first, a, sizeof a), f.line, thread_name(i, b, sizeof b));
      return 0;
    }
  }
  if (first < 0) return 0;  // every thread finished
  if (done >= 0) {
    fail("kernel %s: %s returned while other threads wait at the threadgroup_barrier at line %d "
         "(early return before a barrier; guard the work with `if` instead)",
         R.kname, thread_name(done, a, sizeof a), R.fibers[first].line);
    return 0;
  }
  for (int i = 0; i < R.nthreads; ++i)
    if (R.fibers[i].state == AT_BARRIER) R.fibers[i].state = RUNNABLE;
  return 1;
}

static void run_group(const unsigned* grid, const unsigned* tg, unsigned gx, unsigned gy, unsigned gz) {
  int n = R.nthreads;
  unsigned nsg = (unsigned)(n + LANES - 1) / LANES;
  for (int i = 0; i < n; ++i) {
    Fiber* f = &R.fibers[i];
    unsigned x = (unsigned)i % tg[0], y = (unsigned)i / tg[0] % tg[1], z = (unsigned)i / (tg[0] * tg[1]);
    ThreadInfo& t = f->info;
    t.tpitg = uint3{x, y, z};
    t.tgpig = uint3{gx, gy, gz};
    t.tptg = uint3{tg[0], tg[1], tg[2]};
    t.tgpg = uint3{grid[0], grid[1], grid[2]};
    t.tpg = t.tptg * t.tgpg;
    t.tpig = t.tgpig * t.tptg + t.tpitg;
    t.tiitg = (unsigned)i;
    t.tiisg = (unsigned)i % LANES;
    t.sgitg = (unsigned)i / LANES;
    t.sgptg = nsg;
    f->state = RUNNABLE;
    fiber_init(i);
  }
  R.tg_n = 0;
  R.arena_used = 0;
  for (;;) {
    if (R.schedule == RANDOM) make_order(R.order, n);
    for (int k = 0; k < n; ++k) {
      int i = R.order[k];
      if (R.fibers[i].state != RUNNABLE) continue;
      to_fiber(i);
      if (R.failed) return;
    }
    int released = 0;
    for (unsigned sg = 0; sg < nsg; ++sg) released |= release_simdgroup(sg);
    if (R.failed) return;
    if (released) continue;
    if (!release_barrier()) return;
  }
}

static void on_crash(int sig, siginfo_t* info, void*) {
  R.crash_sig = sig;
  R.crash_addr = info ? info->si_addr : 0;
  siglongjmp(R.crash_jmp, 1);
}

// geom: grid xyz, threadgroup xyz. opts: schedule, seed, strict_simd, garbage byte.
static int launch(const char* kname, Thunk thunk, void** bufs, const unsigned* geom, const long long* opts,
                  char* err, int errlen) {
  const unsigned* grid = geom;
  const unsigned* tg = geom + 3;
  unsigned long n = (unsigned long)tg[0] * tg[1] * tg[2];
  R.failed = 0;
  R.msg[0] = 0;
  if (n == 0 || n > MAX_THREADS) {
    snprintf(err, (unsigned long)errlen, "kernel %s: threadgroup of %lu threads (must be 1..1024)", kname, n);
    return 1;
  }
  if (!ensure_stacks()) {
    snprintf(err, (unsigned long)errlen, "kernel %s: cannot allocate fiber stacks", kname);
    return 1;
  }
  R.kname = kname;
  R.thunk = thunk;
  R.bufs = bufs;
  R.nthreads = (int)n;
  R.schedule = (int)opts[0];
  R.rng = (unsigned long long)opts[1] * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  R.strict_simd = (int)opts[2];
  R.garbage = (unsigned char)opts[3];
  make_order(R.order, (int)n);

  // a wild pointer in a kernel becomes an error naming the kernel instead of killing Python
  static char altstack[64 * 1024];
  stack_t ss, old_ss;
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  struct sigaction sa, old_segv, old_bus, old_fpe;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_crash;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  sigaction(SIGFPE, &sa, &old_fpe);
  R.crash_sig = 0;
  int fiber_at_crash = -1;
  if (sigsetjmp(R.crash_jmp, 1) == 0) {
    unsigned long groups = (unsigned long)grid[0] * grid[1] * grid[2];
    // random: visit groups as k * stride + offset mod groups, with stride coprime to groups
    unsigned long stride = 1, offset = 0;
    if (R.schedule == RANDOM && groups > 1) {
      stride = (unsigned long)(next_rand() % groups) | 1ul;
      for (;;) {
        unsigned long a = stride, b = groups;
        while (b) { unsigned long t = a % b; a = b; b = t; }
        if (a == 1) break;
        stride += 2;
      }
      offset = (unsigned long)(next_rand() % groups);
    }
    for (unsigned long k = 0; k < groups && !R.failed; ++k) {
      unsigned long g = R.schedule == REVERSE ? groups - 1 - k : (k * stride + offset) % groups;
      unsigned gx = (unsigned)(g % grid[0]), gy = (unsigned)(g / grid[0] % grid[1]),
               gz = (unsigned)(g / ((unsigned long)grid[0] * grid[1]));
      run_group(grid, tg, gx, gy, gz);
    }
  } else {
    fiber_at_crash = R.cur;
  }
  sigaction(SIGSEGV, &old_segv, 0);
  sigaction(SIGBUS, &old_bus, 0);
  sigaction(SIGFPE, &old_fpe, 0);
  sigaltstack(&old_ss, 0);
  if (fiber_at_crash >= 0) {
    char tn[96];
    snprintf(err, (unsigned long)errlen,
             "kernel %s: %s at address %p in %s (out-of-bounds access, a bad offset, or a stack overflow)",
             kname, R.crash_sig == SIGFPE ? "arithmetic fault (integer division by zero?)" : "invalid memory access",
             R.crash_addr, thread_name(fiber_at_crash, tn, sizeof tn));
    return 2;
  }
  if (R.failed) {
    snprintf(err, (unsigned long)errlen, "%s", R.msg);
    return 1;
  }
  return 0;
}

}  // namespace moepack_emu

#endif
