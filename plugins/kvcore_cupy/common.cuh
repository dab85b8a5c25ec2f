// kvcore_cupy/common.cuh -- types, 16-byte vector loads, dtype conversion, fast
// integer division, and what decode.cu and prefill.cu share: the load of a query
// row's group of heads, the paged view of a sequence and the warp-level attention loop.
//
// Valid for both NVRTC (what CuPy's RawModule uses) and nvcc: no header is
// included at all. bf16 and fp16 travel as raw 16-bit words (kv_bf16 / kv_f16
// below) and are converted to fp32 in registers with shifts (bf16) or one PTX
// cvt (fp16), so neither <cuda_bf16.h> nor <cuda_fp16.h> is needed.
//
// Layout of one layer's cache (strides in elements, int64; only the last dim is
// contiguous):
//
//   cache[page, kv, token_in_page, kv_head, d]     kv = 0 (K) or 1 (V)
//
// Vector loads: a row of D elements is read as D * sizeof(T) / 16 chunks of 16
// bytes (WIDE = true) when the host finds the base pointer and every stride
// 16-byte aligned (any pool kvcore allocates, for every head dim this backend
// declares); otherwise the WIDE = false instantiations read one element per chunk.
#pragma once

typedef long long i64;
typedef int i32;
typedef unsigned int u32;
typedef unsigned short u16;

// Raw 16-bit storage types: the kernels never do arithmetic on them.
struct kv_bf16 { u16 bits; };
struct kv_f16 { u16 bits; };

// 16 bytes, loaded and stored as one ld/st.global.v4.u32.
struct __align__(16) Vec16 { u32 x, y, z, w; };

__host__ __device__ constexpr int kv_pow2_ceil(int n) { return n <= 1 ? 1 : 2 * kv_pow2_ceil((n + 1) / 2); }
__host__ __device__ constexpr int kv_min(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float kv_neg_inf() { return __int_as_float(0xff800000); }

// 2^x by the SFU (ex2.approx: ~2 ulp; 2^-inf = +0). All softmax math is in base 2:
// the host folds log2(e) into the scale. fp16 <-> fp32 by one PTX cvt each.
// (KVCORE_HOST_EMULATION: the CPU emulation in tests/cupy_emulation/host_emu.h supplies these.)
#ifndef KVCORE_HOST_EMULATION
__device__ __forceinline__ float kv_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float kv_h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 kv_f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif
// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ u32 kv_f2bf(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Elem<T>: elements per 16-byte chunk, unpack a chunk to fp32, pack fp32 to a chunk,
// store one element.
template <class T> struct Elem;

template <> struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ static void unpack(const Vec16& r, float* f) {
    f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
  }
  __device__ static Vec16 pack(const float* f) {
    Vec16 r;
    r.x = __float_as_uint(f[0]); r.y = __float_as_uint(f[1]);
    r.z = __float_as_uint(f[2]); r.w = __float_as_uint(f[3]);
    return r;
  }
  __device__ static void store(float* p, float f) { *p = f; }
  __device__ static float to_float(u32 raw) { return __uint_as_float(raw); }
};

template <> struct Elem<kv_bf16> {
  static constexpr int kVec = 8;
  // little endian: element 2i is the low half of word i; bf16 -> fp32 is a 16-bit shift.
  __device__ static void unpack_word(u32 w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  __device__ static void unpack(const Vec16& r, float* f) {
    unpack_word(r.x, f); unpack_word(r.y, f + 2); unpack_word(r.z, f + 4); unpack_word(r.w, f + 6);
  }
  __device__ static u32 pack_word(const float* f) { return kv_f2bf(f[0]) | (kv_f2bf(f[1]) << 16); }
  __device__ static Vec16 pack(const float* f) {
    Vec16 r;
    r.x = pack_word(f); r.y = pack_word(f + 2); r.z = pack_word(f + 4); r.w = pack_word(f + 6);
    return r;
  }
  __device__ static void store(kv_bf16* p, float f) { p->bits = (u16)kv_f2bf(f); }
  __device__ static float to_float(u32 raw) { return __uint_as_float(raw << 16); }
};

template <> struct Elem<kv_f16> {
  static constexpr int kVec = 8;
  __device__ static void unpack_word(u32 w, float* f) {
    f[0] = kv_h2f((u16)(w & 0xffffu));
    f[1] = kv_h2f((u16)(w >> 16));
  }
  __device__ static void unpack(const Vec16& r, float* f) {
    unpack_word(r.x, f); unpack_word(r.y, f + 2); unpack_word(r.z, f + 4); unpack_word(r.w, f + 6);
  }
  __device__ static u32 pack_word(const float* f) { return (u32)kv_f2h(f[0]) | ((u32)kv_f2h(f[1]) << 16); }
  __device__ static Vec16 pack(const float* f) {
    Vec16 r;
    r.x = pack_word(f); r.y = pack_word(f + 2); r.z = pack_word(f + 4); r.w = pack_word(f + 6);
    return r;
  }
  __device__ static void store(kv_f16* p, float f) { p->bits = kv_f2h(f); }
  __device__ static float to_float(u32 raw) { return kv_h2f((u16)raw); }
};

// Chunk<T, WIDE>: the unit a lane loads. WIDE: 16 bytes (kVec = 16 / sizeof(T)
// elements, one vector load) -- needs 16-byte aligned rows. Not WIDE: one element,
// for cache views whose base or strides are not multiples of 16 bytes (e.g. a slice
// of a padded pool); lanes then read consecutive elements, still coalesced.
template <class T, bool WIDE> struct Chunk;

template <class T> struct Chunk<T, true> {
  static constexpr int kVec = Elem<T>::kVec;
  Vec16 raw;
  __device__ __forceinline__ void zero() { raw = Vec16{0u, 0u, 0u, 0u}; }
  __device__ __forceinline__ void load(const T* p) { raw = *reinterpret_cast<const Vec16*>(p); }
  __device__ __forceinline__ void unpack(float* f) const { Elem<T>::unpack(raw, f); }
  __device__ __forceinline__ static void store(T* p, const float* f) {
    *reinterpret_cast<Vec16*>(p) = Elem<T>::pack(f);
  }
};

template <class T> struct Chunk<T, false> {
  static constexpr int kVec = 1;
  u32 raw;  // the element's bits, zero-extended
  __device__ __forceinline__ void zero() { raw = 0u; }
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (sizeof(T) == 4) {
      raw = *reinterpret_cast<const u32*>(p);
    } else {
      raw = *reinterpret_cast<const u16*>(p);
    }
  }
  __device__ __forceinline__ void unpack(float* f) const { f[0] = Elem<T>::to_float(raw); }
  __device__ __forceinline__ static void store(T* p, const float* f) { Elem<T>::store(p, f[0]); }
};

// Division by the page size (a runtime value, 1..128) without a hardware divide:
// n / d == (umulhi(n, mul) + n) >> shift for 0 <= n < 2^31, with shift = ceil(log2 d)
// and mul = floor(2^32 * (2^shift - d) / d) + 1 (computed on the host; see
// kvcore_cupy.plan.fast_divisor). Token indices are < 2^31.
struct FastDiv {
  u32 d, mul, shift;
  __device__ __forceinline__ u32 div(u32 n) const { return (__umulhi(n, mul) + n) >> shift; }
};

// Geometry of a lane's share of one K/V row. A row (D elements) is kChunks chunks
// (Chunk<T, WIDE>); kLanes lanes (a power of two <= 32) share a row, lane c holding chunks
// c, c + kLanes, ... (kCpl of them, kE elements); a warp covers kRows rows (tokens)
// at once, and each loop step loads kUnroll tokens per row group so that
// 2 * kUnroll * kCpl independent loads are in flight per lane.
template <class T, int D, bool WIDE> struct Geo {
  typedef Chunk<T, WIDE> Ch;
  static constexpr int kVec = Ch::kVec;
  static_assert(D % kVec == 0, "a row must be a whole number of chunks");
  static constexpr int kChunks = D / kVec;
  static constexpr int kLanes = kv_pow2_ceil(kv_min(kChunks, 32));
  static constexpr int kCpl = (kChunks + kLanes - 1) / kLanes;
  static constexpr int kE = kCpl * kVec;
  static constexpr int kRows = 32 / kLanes;
  static constexpr int kUnroll = kCpl >= 2 ? 2 : 4;
  static constexpr int kBlock = kRows * kUnroll;  // tokens per warp per loop step
};

// Load the lane's share of a [*, D] row of fp32-converted values, times `mult`;
// chunks past D are zero.
template <class T, int D, bool WIDE>
__device__ __forceinline__ void kv_load_row(const T* row, int c, float mult, float* out) {
  typedef Geo<T, D, WIDE> G_;
#pragma unroll
  for (int k = 0; k < G_::kCpl; ++k) {
    const int ch = c + k * G_::kLanes;
    float f[G_::kVec];
    if (ch < G_::kChunks) {
      typename G_::Ch chunk;
      chunk.load(row + ch * G_::kVec);
      chunk.unpack(f);
    } else {
#pragma unroll
      for (int e = 0; e < G_::kVec; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < G_::kVec; ++e) out[k * G_::kVec + e] = f[e] * mult;
  }
}

// Store the lane's share of a row: acc * inv (rounded to T).
template <class T, int D, bool WIDE>
__device__ __forceinline__ void kv_store_row(T* row, int c, const float* acc, float inv) {
  typedef Geo<T, D, WIDE> G_;
#pragma unroll
  for (int k = 0; k < G_::kCpl; ++k) {
    const int ch = c + k * G_::kLanes;
    if (ch < G_::kChunks) {
      float f[G_::kVec];
#pragma unroll
      for (int e = 0; e < G_::kVec; ++e) f[e] = acc[k * G_::kVec + e] * inv;
      G_::Ch::store(row + ch * G_::kVec, f);
    }
  }
}

// The lane's share of one query row's NG heads kv_head * group + h0 + [0, NG) (those
// < group; the rest are zero), times `mult` (scale * log2(e)). `q_row` points at the
// row's first head ([Hq, D], contiguous). One helper for both kernels: measured with
// nvcc for sm_90, no instantiation takes more registers than with a loop of its own
// in each kernel (21 decode variants take fewer), and none spills.
template <class T, int D, int NG, bool WIDE>
__device__ __forceinline__ void kv_load_group(const T* q_row, int kv_head, int group, int h0,
                                              int c, float mult,
                                              float (&q)[NG][Geo<T, D, WIDE>::kE]) {
#pragma unroll
  for (int h = 0; h < NG; ++h) {
    if (h0 + h < group) {
      kv_load_row<T, D, WIDE>(q_row + (i64)(kv_head * group + h0 + h) * D, c, mult, q[h]);
    } else {
#pragma unroll
      for (int e = 0; e < Geo<T, D, WIDE>::kE; ++e) q[h][e] = 0.f;
    }
  }
}

// Online-softmax state of one lane for the NG query heads of its CTA/warp: running
// max m (log2 units, starts at a finite -1e30 so that exp2(m_old - m_new) is never
// NaN), running denominator l, and the un-normalised output acc over the lane's kE
// elements of D.
template <int NG, int E> struct Softmax {
  float m[NG], l[NG], acc[NG][E];
  __device__ void init() {
#pragma unroll
    for (int h = 0; h < NG; ++h) {
      m[h] = -1e30f;
      l[h] = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[h][e] = 0.f;
    }
  }
  // Merge the state held by the lane `lane ^ offset` (same elements of D) into ours.
  __device__ void merge_xor(int offset) {
#pragma unroll
    for (int h = 0; h < NG; ++h) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[h], offset);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[h], offset);
      const float mn = fmaxf(m[h], m2);
      const float a = kv_exp2(m[h] - mn), b = kv_exp2(m2 - mn);
      m[h] = mn;
      l[h] = l[h] * a + l2 * b;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float x2 = __shfl_xor_sync(0xffffffffu, acc[h][e], offset);
        acc[h][e] = acc[h][e] * a + x2 * b;
      }
    }
  }
};

// Paging of one sequence: token t lives in page pages[t / page_size] at offset
// t % page_size. `kv` points at (page 0, K, token 0, this kv head, d 0).
template <class T> struct PagedSeq {
  const T* kv;
  const i32* pages;
  i64 stride_page, stride_kv, stride_tok;
  FastDiv ps;
  // Sequence b at kv head `kv_head`, from the kernels' cache arguments (same names,
  // same order): cache [num_pages, 2, page_size, Hkv, D] with strides in elements,
  // block_table [B, max_pages] with row stride table_stride, and the page size's
  // FastDiv constants.
  __device__ __forceinline__ static PagedSeq at(
      const T* cache, i64 stride_page, i64 stride_kv, i64 stride_tok, i64 stride_head,
      const i32* block_table, i64 table_stride, u32 page_size, u32 ps_mul, u32 ps_shift,
      int b, int kv_head) {
    return PagedSeq{cache + (i64)kv_head * stride_head, block_table + (i64)b * table_stride,
                    stride_page, stride_kv, stride_tok, FastDiv{page_size, ps_mul, ps_shift}};
  }
  // The page id of token t (a block-table read: issue it early, see attend_tokens).
  __device__ __forceinline__ i32 page_of(int t) const { return pages[ps.div((u32)t)]; }
  // Element offset of token t's row, given its page id.
  __device__ __forceinline__ i64 row_offset(int t, i32 page) const {
    const u32 off = (u32)t - ps.div((u32)t) * ps.d;
    return (i64)page * stride_page + (i64)off * stride_tok;
  }
};

// The attention loop of one warp: for its NG query heads (q already scaled by
// scale * log2(e), lane share only), fold the tokens
//
//   t = t0 + first + i * step + u * kRows + row      (i = 0, 1, ...; u < kUnroll)
//
// that are < t_end into the lane's Softmax state. Tokens are visited in blocks of
// kBlock = kRows * kUnroll consecutive tokens; `first`/`step` let several warps of a
// CTA interleave blocks (decode) or one warp walk all of them (prefill). The loop
// bound is warp-uniform, so every shuffle runs with the full warp; tokens >= t_end
// are neither loaded nor counted (their slots may hold NaN).
//
// Per block: issue all K and V loads (2 * kUnroll * kCpl chunks per lane), then the
// next block's page ids (so that its K/V loads never wait on a block-table read),
// then scores s = q.k reduced over the row's kLanes lanes with xor shuffles, then
// one max/rescale per head for the whole block and the p * V accumulation.
template <class T, int D, int NG, bool WIDE>
__device__ __forceinline__ void attend_tokens(
    const PagedSeq<T>& seq, int t0, int t_end, int first, int step,
    const float (&q)[NG][Geo<T, D, WIDE>::kE], Softmax<NG, Geo<T, D, WIDE>::kE>& st) {
  typedef Geo<T, D, WIDE> G_;
  constexpr int U = G_::kUnroll, C = G_::kCpl, E = G_::kE, V = G_::kVec;
  const int lane = threadIdx.x & 31;
  const int row = lane / G_::kLanes, c = lane % G_::kLanes;
  static_assert(G_::kBlock <= 32, "one lane per token of a block holds its page id");
  // Page ids run one block ahead, one register per lane: lane j < kBlock holds the id
  // of token j of the block to come (0 past t_end); a row gets its id by shuffle.
  int ahead_t = t0 + first + lane;
  i32 ahead = lane < G_::kBlock && ahead_t < t_end ? seq.page_of(ahead_t) : 0;
  for (int blk = t0 + first; blk < t_end; blk += step) {
    const i32 pages_held = ahead;
    typename G_::Ch kr[U][C], vr[U][C];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = blk + u * G_::kRows + row;
      valid[u] = t < t_end;
      const i32 page = __shfl_sync(0xffffffffu, pages_held, u * G_::kRows + row);
#pragma unroll
      for (int k = 0; k < C; ++k) {
        kr[u][k].zero();
        vr[u][k].zero();
      }
      if (valid[u]) {
        const T* base = seq.kv + seq.row_offset(t, page);
#pragma unroll
        for (int k = 0; k < C; ++k) {
          const int ch = c + k * G_::kLanes;
          if (ch < G_::kChunks) {
            kr[u][k].load(base + ch * V);
            vr[u][k].load(base + seq.stride_kv + ch * V);
          }
        }
      }
    }
    ahead_t = blk + step + lane;  // the next block's ids, in flight with this block's K/V
    ahead = lane < G_::kBlock && ahead_t < t_end ? seq.page_of(ahead_t) : 0;
    // scores, in log2 units
    float s[U][NG];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[E];
#pragma unroll
      for (int k = 0; k < C; ++k) kr[u][k].unpack(kf + k * V);
#pragma unroll
      for (int h = 0; h < NG; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot = fmaf(q[h][e], kf[e], dot);
#pragma unroll
        for (int o = G_::kLanes / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        s[u][h] = valid[u] ? dot : kv_neg_inf();
      }
    }
    // one rescale per head per block: m_new = max(m, s), acc *= 2^(m - m_new)
#pragma unroll
    for (int h = 0; h < NG; ++h) {
      float mx = st.m[h];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][h]);
      const float corr = kv_exp2(st.m[h] - mx);
      st.m[h] = mx;
      st.l[h] *= corr;
#pragma unroll
      for (int e = 0; e < E; ++e) st.acc[h][e] *= corr;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[E];
#pragma unroll
      for (int k = 0; k < C; ++k) vr[u][k].unpack(vf + k * V);
#pragma unroll
      for (int h = 0; h < NG; ++h) {
        const float p = kv_exp2(s[u][h] - st.m[h]);  // 0 for an invalid token
        st.l[h] += p;
#pragma unroll
        for (int e = 0; e < E; ++e) st.acc[h][e] = fmaf(p, vf[e], st.acc[h][e]);
      }
    }
  }
}

// Fold the row groups of a warp (lanes that hold the same elements of D for
// different tokens) into one state, held by every lane.
template <class T, int D, int NG, bool WIDE>
__device__ __forceinline__ void merge_rows(Softmax<NG, Geo<T, D, WIDE>::kE>& st) {
#pragma unroll
  for (int o = Geo<T, D, WIDE>::kLanes; o < 32; o <<= 1) st.merge_xor(o);
}
