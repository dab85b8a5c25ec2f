// kvcore_cupy/emulation/host_emu.h -- run the CUDA kernels of this backend on the CPU.
//
// For tests on machines without a GPU: the .cu files are compiled as plain C++ by
// g++ after this header, and a launch runs every CTA of the grid in turn, each of
// its threads as a cooperative fiber (ucontext) on one OS thread. Threads switch
// only at synchronisation points:
//
//   __shfl_[xor_]sync write my value, yield once (every fiber runs one segment per
//                     round, so all lanes of my warp have written), read my partner's.
//                     Two buffers alternate, so a fast lane's next write never
//                     clobbers a value still to be read.
//   __syncthreads     wait until every live thread of the CTA has arrived.
//
// This is exact for kernels whose shuffles sit in warp-uniform control flow (all
// of ours). __shared__ becomes a function-local static: one CTA runs at a time.
// It checks the kernels' logic (indexing, paging, softmax, splits), not timing,
// memory-model or coalescing questions. Device intrinsics are emulated below with
// the same semantics (exp2 exactly, fp16 via _Float16, round to nearest even).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <csetjmp>
#include <cstring>
#include <ucontext.h>
#include <utility>
#include <vector>

#define KVCORE_HOST_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace emu {
inline dim3 g_thread, g_block, g_block_dim, g_grid_dim;  // of the running fiber
}  // namespace emu
#define threadIdx (::emu::g_thread)
#define blockIdx (::emu::g_block)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int min(int a, int b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
using std::fmaf;
using std::fmaxf;
using std::log2f;
using ::tanhf;

inline float kv_exp2(float x) { return std::exp2(x); }
inline float kv_h2f(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline unsigned short kv_f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h; }

namespace emu {

struct Fiber {
  ucontext_t ctx;  // first entry only
  jmp_buf jb;      // where the fiber resumes after a yield
  char* stack = nullptr;
  bool started = false;
  dim3 tid;
  unsigned shuffles = 0;  // parity selects the shuffle buffer
  bool done = false;
};

struct Cta {
  ucontext_t sched;  // unused after a fiber's first entry
  jmp_buf sched_jb;
  std::vector<Fiber> fibers;
  int current = 0;
  int alive = 0;
  int sync_arrived = 0;
  unsigned sync_generation = 0;
  std::vector<unsigned> buf[2];  // shuffle buffers, one word per thread
};

inline Cta* g_cta = nullptr;
inline void (*g_body)(void*) = nullptr;
inline void* g_body_arg = nullptr;

inline void yield() {
  Fiber& f = g_cta->fibers[g_cta->current];
  if (!_setjmp(f.jb)) _longjmp(g_cta->sched_jb, 1);
}

inline void fiber_main() {
  g_body(g_body_arg);
  g_cta->fibers[g_cta->current].done = true;
  g_cta->alive -= 1;
  // a thread that exits no longer counts for __syncthreads
  if (g_cta->sync_arrived > 0 && g_cta->sync_arrived >= g_cta->alive) {
    g_cta->sync_arrived = 0;
    g_cta->sync_generation += 1;
  }
  _longjmp(g_cta->sched_jb, 1);  // never return: uc_link would resume a stale context
}

constexpr std::size_t kStackBytes = 1 << 17;
inline std::vector<char*> g_stacks;  // reused by every CTA of every launch

inline char* stack_for(unsigned t) {
  while (g_stacks.size() <= t) g_stacks.push_back(static_cast<char*>(std::malloc(kStackBytes)));
  return g_stacks[t];
}

inline void run_cta(unsigned threads) {
  Cta cta;
  g_cta = &cta;
  cta.fibers.resize(threads);
  cta.buf[0].assign(threads, 0u);
  cta.buf[1].assign(threads, 0u);
  cta.alive = (int)threads;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = cta.fibers[t];
    f.stack = stack_for(t);
    f.tid.x = t;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &cta.sched;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (bool any = true; any;) {
    any = false;
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = cta.fibers[t];
      if (f.done) continue;
      any = true;
      cta.current = (int)t;
      g_thread = f.tid;
      if (!_setjmp(cta.sched_jb)) {
        if (!f.started) {
          f.started = true;
          swapcontext(&cta.sched, &f.ctx);
        } else {
          _longjmp(f.jb, 1);
        }
      }
    }
  }
  g_cta = nullptr;
}

template <class F>
void launch(dim3 grid, dim3 block, F&& body) {
  g_grid_dim = grid;
  g_block_dim = block;
  g_body = [](void* p) { (*static_cast<F*>(p))(); };
  g_body_arg = &body;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        g_block = dim3{x, y, z};
        run_cta(block.x);
      }
}

// cuLaunchKernel-style: args[i] points at the i-th argument's value.
template <class... A, std::size_t... I>
void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A>
void launch_kernel(void (*kernel)(A...), dim3 grid, dim3 block, void** args) {
  launch(grid, block, [&] { call_with(kernel, args, std::index_sequence_for<A...>{}); });
}

}  // namespace emu

inline void __syncthreads() {
  emu::Cta& c = *emu::g_cta;
  const unsigned gen = c.sync_generation;
  if (++c.sync_arrived >= c.alive) {
    c.sync_arrived = 0;
    c.sync_generation += 1;
    return;
  }
  while (c.sync_generation == gen) emu::yield();
}

// Lane `me` reads lane `source`'s value (the same two-buffer round as the xor form).
template <class T>
inline T __shfl_sync(unsigned, T value, int source) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  emu::Cta& c = *emu::g_cta;
  const unsigned me = (unsigned)c.current;
  emu::Fiber& f = c.fibers[me];
  std::vector<unsigned>& buf = c.buf[f.shuffles++ & 1u];
  std::memcpy(&buf[me], &value, 4);
  emu::yield();
  const unsigned partner = (me & ~31u) | ((unsigned)source & 31u);
  T out;
  std::memcpy(&out, &buf[partner], 4);
  return out;
}

template <class T>
inline T __shfl_xor_sync(unsigned, T value, int offset) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  emu::Cta& c = *emu::g_cta;
  const unsigned me = (unsigned)c.current;
  emu::Fiber& f = c.fibers[me];
  std::vector<unsigned>& buf = c.buf[f.shuffles++ & 1u];
  std::memcpy(&buf[me], &value, 4);
  emu::yield();
  const unsigned partner = (me & ~31u) | ((me & 31u) ^ (unsigned)offset);
  T out;
  std::memcpy(&out, &buf[partner], 4);
  return out;
}
