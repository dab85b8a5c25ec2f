// kvcore_cupy/common.cuh -- types, 16-byte vector loads, dtype conversion, fast
// integer division, and what decode.cu and prefill.cu share: the load of a query
// row's group of heads, the paged view of a sequence and the warp-level attention loop.
//
// Valid for both NVRTC (what CuPy's RawModule uses) and nvcc: no header is
// included at all. bf16 and fp16 travel as raw 16-bit words (kv_bf16 / kv_f16
// below) and are converted to fp32 in registers with shifts (bf16) or one PTX
// cvt (fp16), so neither <cuda_bf16.h> nor <cuda_fp16.h> is needed. fp8 pages
// (kv_e4m3: float8_e4m3fn, kv_e5m2: float8_e5m2) travel as raw bytes and are
// converted by integer bit manipulation (kv_fp8_to_f32 / kv_f32_to_fp8 below,
// exact both ways for finite values), so <cuda_fp8.h> is not needed either. An
// fp8 cache's queries and outputs are fp32 (Io<T>): the host converts them.
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
typedef unsigned char u8;

// Raw 16-bit and 8-bit storage types: the kernels never do arithmetic on them.
struct kv_bf16 { u16 bits; };
struct kv_f16 { u16 bits; };
struct kv_e4m3 { u8 bits; };  // float8_e4m3fn: bias 7, no inf, NaN = S.1111.111, max 448
struct kv_e5m2 { u8 bits; };  // float8_e5m2: bias 15, IEEE-like inf/NaN, max 57344

// 16 bytes, loaded and stored as one ld/st.global.v4.u32; 8 bytes as one .v2.u32.
struct __align__(16) Vec16 { u32 x, y, z, w; };
struct __align__(8) Vec8 { u32 x, y; };

template <class A, class B> struct kv_same { static constexpr bool value = false; };
template <class A> struct kv_same<A, A> { static constexpr bool value = true; };

// Io<T>::type: the dtype of queries and outputs of a cache of storage type T (fp32 for fp8).
template <class T> struct Io { typedef T type; };
template <> struct Io<kv_e4m3> { typedef float type; };
template <> struct Io<kv_e5m2> { typedef float type; };

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

// fp8 <-> fp32, by bit manipulation (no float denormal is ever formed, so FTZ
// settings cannot change a result). Format: M mantissa bits, exponent bias B.
//
// Decode: placing the byte's exponent and mantissa fields under the fp32 ones and
// adding 127 - B to the exponent gives (1 + m / 2^M) * 2^(e - B) for e >= 1. A
// subnormal (e = 0) is m / 2^M * 2^(1 - B): read as e = 1, that is 2^(1 - B) too
// much, subtracted exactly. The all-ones patterns are NaN (e4m3fn: S.1111.111;
// e5m2: exponent 31, m != 0) or inf (e5m2, m = 0).
template <int M, int B, bool IEEE>
__device__ __forceinline__ float kv_fp8_to_f32(u32 byte) {
  const u32 mag = byte & 0x7fu, e = mag >> M;
  const u32 normal = (mag << (23 - M)) + ((u32)(127 - B) << 23);
  const float f = e != 0u ? __uint_as_float(normal)
                          : __uint_as_float(normal + (1u << 23)) -
                                __uint_as_float((u32)(128 - B) << 23);  // - 2^(1 - B)
  u32 bits = __float_as_uint(f);
  if (IEEE ? e == (1u << (8 - 1 - M)) - 1u : mag == 0x7fu) {
    bits = (IEEE && (mag & ((1u << M) - 1u)) == 0u) ? 0x7f800000u : 0x7fc00000u;
  }
  return __uint_as_float(bits | ((byte & 0x80u) << 24));
}

// Encode, round to nearest even; the caller has saturated |f| to the format's largest
// finite value (so nothing overflows); NaN -> 0x7f | sign. Below the smallest normal
// 2^(1 - B), adding 2^(1 - B - M + 23) (whose fp32 ulp is the fp8 subnormal step)
// lets the fp32 adder round; above it, the mantissa is rounded by integer arithmetic
// (the carry may move into the exponent: 1.111b rounds up to 10.00b).
template <int M, int B>
__device__ __forceinline__ u32 kv_f32_to_fp8(float f) {
  u32 u = __float_as_uint(f);
  const u32 sign = (u >> 24) & 0x80u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7fu;
  u32 r;
  if (u < ((u32)(128 - B) << 23)) {
    const u32 magic = (u32)(128 - B - M + 23) << 23;
    r = __float_as_uint(__uint_as_float(u) + __uint_as_float(magic)) - magic;
  } else {
    const u32 odd = (u >> (23 - M)) & 1u;
    u += ((u32)(B - 127) << 23) + ((1u << (22 - M)) - 1u) + odd;
    r = u >> (23 - M);
  }
  return sign | r;
}

// Elem<T>: elements per wide chunk (Wide: 16 bytes, 8 for fp8), unpack a chunk to fp32,
// pack fp32 to a chunk, store one element, convert one raw element.
template <class T> struct Elem;

template <> struct Elem<float> {
  typedef Vec16 Wide;
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
  typedef Vec16 Wide;
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
  typedef Vec16 Wide;
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

// fp8 pages are read, never written, by the attention kernels (write_kv_fp8 in
// cache_ops.cu quantizes). A wide chunk is 8 bytes, so that a lane holds as many
// elements of a row (kE) as with 16-byte chunks of a 16-bit dtype: the same registers.
template <int M, int B, bool IEEE> struct Fp8Elem {
  typedef Vec8 Wide;
  static constexpr int kVec = 8;
  __device__ static void unpack_word(u32 w, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = kv_fp8_to_f32<M, B, IEEE>((w >> (8 * i)) & 0xffu);
  }
  __device__ static void unpack(const Vec8& r, float* f) { unpack_word(r.x, f); unpack_word(r.y, f + 4); }
  __device__ static float to_float(u32 raw) { return kv_fp8_to_f32<M, B, IEEE>(raw); }
  __device__ static u32 from_float(float f) { return kv_f32_to_fp8<M, B>(f); }
};
template <> struct Elem<kv_e4m3> : Fp8Elem<3, 7, false> {
  static constexpr float kMax = 448.f;
};
template <> struct Elem<kv_e5m2> : Fp8Elem<2, 15, true> {
  static constexpr float kMax = 57344.f;
};

// Chunk<T, WIDE>: the unit a lane loads. WIDE: 16 bytes (kVec = 16 / sizeof(T)
// elements, one vector load) -- needs 16-byte aligned rows. Not WIDE: one element,
// for cache views whose base or strides are not multiples of 16 bytes (e.g. a slice
// of a padded pool); lanes then read consecutive elements, still coalesced.
template <class T, bool WIDE> struct Chunk;

template <class T> struct Chunk<T, true> {
  typedef typename Elem<T>::Wide W;
  static constexpr int kVec = Elem<T>::kVec;
  W raw;
  __device__ __forceinline__ void zero() { raw = W{}; }
  __device__ __forceinline__ void load(const T* p) { raw = *reinterpret_cast<const W*>(p); }
  __device__ __forceinline__ void unpack(float* f) const { Elem<T>::unpack(raw, f); }
  __device__ __forceinline__ static void store(T* p, const float* f) {
    *reinterpret_cast<W*>(p) = Elem<T>::pack(f);
  }
};

template <class T> struct Chunk<T, false> {
  static constexpr int kVec = 1;
  u32 raw;  // the element's bits, zero-extended
  __device__ __forceinline__ void zero() { raw = 0u; }
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (sizeof(T) == 4) {
      raw = *reinterpret_cast<const u32*>(p);
    } else if constexpr (sizeof(T) == 2) {
      raw = *reinterpret_cast<const u16*>(p);
    } else {
      raw = *reinterpret_cast<const u8*>(p);
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

// Load the lane's share (in the geometry of a T row) of a [*, D] row of Q = T or, for
// fp8 caches, Q = float (Io<T>), as fp32 values times `mult`; chunks past D are zero.
template <class T, int D, bool WIDE, class Q>
__device__ __forceinline__ void kv_load_row(const Q* row, int c, float mult, float* out) {
  typedef Geo<T, D, WIDE> G_;
#pragma unroll
  for (int k = 0; k < G_::kCpl; ++k) {
    const int ch = c + k * G_::kLanes;
    float f[G_::kVec];
    if (ch < G_::kChunks) {
      if constexpr (kv_same<Q, T>::value) {
        typename G_::Ch chunk;
        chunk.load(row + ch * G_::kVec);
        chunk.unpack(f);
      } else {
        static_assert(kv_same<Q, float>::value, "a query is T or fp32");
#pragma unroll
        for (int e = 0; e < G_::kVec; ++e) f[e] = row[ch * G_::kVec + e];
      }
    } else {
#pragma unroll
      for (int e = 0; e < G_::kVec; ++e) f[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < G_::kVec; ++e) out[k * G_::kVec + e] = f[e] * mult;
  }
}

// Store the lane's share (geometry of a T row) of an output row of O = Io<T>:
// acc * inv (rounded to O).
template <class T, int D, bool WIDE, class O>
__device__ __forceinline__ void kv_store_row(O* row, int c, const float* acc, float inv) {
  typedef Geo<T, D, WIDE> G_;
#pragma unroll
  for (int k = 0; k < G_::kCpl; ++k) {
    const int ch = c + k * G_::kLanes;
    if (ch < G_::kChunks) {
      float f[G_::kVec];
#pragma unroll
      for (int e = 0; e < G_::kVec; ++e) f[e] = acc[k * G_::kVec + e] * inv;
      if constexpr (kv_same<O, T>::value) {
        G_::Ch::store(row + ch * G_::kVec, f);
      } else {
#pragma unroll
        for (int e = 0; e < G_::kVec; ++e) row[ch * G_::kVec + e] = f[e];
      }
    }
  }
}

// The lane's share of one query row's NG heads kv_head * group + h0 + [0, NG) (those
// < group; the rest are zero), times `mult` (scale * log2(e)). `q_row` points at the
// row's first head ([Hq, D], contiguous). One helper for both kernels: measured with
// nvcc for sm_90, no instantiation takes more registers than with a loop of its own
// in each kernel (21 decode variants take fewer), and none spills.
template <class T, int D, int NG, bool WIDE, class Q>
__device__ __forceinline__ void kv_load_group(const Q* q_row, int kv_head, int group, int h0,
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
// scale * k_scale * log2(e), lane share only), fold the tokens
//
//   t = t0 + first + i * step + u * kRows + row      (i = 0, 1, ...; u < kUnroll)
//
// that are < t_end into the lane's Softmax state. Tokens are visited in blocks of
// kBlock = kRows * kUnroll consecutive tokens; `first`/`step` let several warps of a
// CTA interleave blocks (decode) or one warp walk all of them (prefill). The loop
// bound is warp-uniform, so every shuffle runs with the full warp; tokens >= t_end
// are neither loaded nor counted (their slots may hold NaN), nor are their pages'
// block-table entries read (a window's released pages, see decode.cu).
//
// Soft-capping (cap_log2 = cap * log2(e) > 0; 0 = off): a score s (log2 units) becomes
// cap_log2 * tanh(s / cap_log2), i.e. cap * tanh(logit / cap) in natural units.
//
// Per block: issue all K and V loads (2 * kUnroll * kCpl chunks per lane), then the
// next block's page ids (so that its K/V loads never wait on a block-table read),
// then scores s = q.k reduced over the row's kLanes lanes with xor shuffles, then
// one max/rescale per head for the whole block and the p * V accumulation.
template <class T, int D, int NG, bool WIDE>
__device__ __forceinline__ void attend_tokens(
    const PagedSeq<T>& seq, int t0, int t_end, int first, int step, float cap_log2,
    const float (&q)[NG][Geo<T, D, WIDE>::kE], Softmax<NG, Geo<T, D, WIDE>::kE>& st) {
  typedef Geo<T, D, WIDE> G_;
  constexpr int U = G_::kUnroll, C = G_::kCpl, E = G_::kE, V = G_::kVec;
  const int lane = threadIdx.x & 31;
  const int row = lane / G_::kLanes, c = lane % G_::kLanes;
  static_assert(G_::kBlock <= 32, "one lane per token of a block holds its page id");
  const float inv_cap = cap_log2 > 0.f ? 1.f / cap_log2 : 0.f;
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
        if (cap_log2 > 0.f) dot = cap_log2 * tanhf(dot * inv_cap);
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

// A sink (gpt-oss): one logit per query head, `sink_log2` (log2 units), that joins the
// softmax denominator only. Given a state (m, l) over the tokens, returns the factor f
// with out = acc * f: 2^(m - m') / (l * 2^(m - m') + 2^(sink_log2 - m')), m' = max(m, sink).
// Without a sink (sinks == nullptr at the call) the factor is 1 / l (0 for l = 0).
__device__ __forceinline__ float kv_norm_with_sink(float m, float l, bool has_sink, float sink_log2) {
  if (!has_sink) return l > 0.f ? 1.f / l : 0.f;
  const float mn = fmaxf(m, sink_log2);
  const float f = kv_exp2(m - mn);
  return f / (l * f + kv_exp2(sink_log2 - mn));
}

#define KV_LOG2E 1.4426950408889634f
