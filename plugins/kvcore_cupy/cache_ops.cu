// kvcore_cupy/cache_ops.cu -- write_kv (scatter new K/V into slots) and copy_pages
// (copy-on-write). Both move bytes, so they are templated on the chunk size CB
// (16, 8, 4, 2 or 1 bytes), not on the dtype: a row of D elements is row_chunks chunks
// of CB bytes, CB being the largest size that divides the row size, the base
// pointer and every stride (16 for any pool kvcore allocates). Strides are in
// bytes, int64. One thread moves one chunk (grid-stride loop).
//
// write_kv_fp8<T> (T = kv_e4m3 / kv_e5m2) quantizes instead of copying: fp32 key/value
// x -> x / scale, saturated to the format's largest finite value (448 / 57344, as
// vLLM does), rounded to nearest even (kv_f32_to_fp8 in common.cuh); NaN stays NaN.
#include "common.cuh"

template <int CB> struct Word;
template <> struct Word<16> { typedef Vec16 type; };
template <> struct Word<8> { typedef unsigned long long type; };
template <> struct Word<4> { typedef u32 type; };
template <> struct Word<2> { typedef u16 type; };
template <> struct Word<1> { typedef u8 type; };

template <int CB> __device__ __forceinline__ void kv_move(char* dst, const char* src) {
  typedef typename Word<CB>::type W;
  *reinterpret_cast<W*>(dst) = *reinterpret_cast<const W*>(src);
}

// key/value [T, Hkv, row] contiguous; slots [T] int64, slot = page * page_size +
// offset; a negative slot is skipped. Non-negative slots are distinct (checked by
// the caller), so no two threads write the same bytes.
template <int CB>
__global__ void __launch_bounds__(256) write_kv(
    const char* __restrict__ key, const char* __restrict__ value,
    const i64* __restrict__ slots, i64 num_tokens, int num_heads, int row_chunks,
    char* __restrict__ cache,
    i64 stride_page, i64 stride_kv, i64 stride_tok, i64 stride_head,  // bytes
    i64 page_size) {
  const i64 per_token = (i64)num_heads * row_chunks;
  const i64 total = num_tokens * per_token;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const i64 t = i / per_token;
    const i64 slot = slots[t];
    if (slot < 0) continue;
    const i64 rem = i - t * per_token;
    const i64 head = rem / row_chunks, ch = rem - head * row_chunks;
    const i64 dst = (slot / page_size) * stride_page + (slot % page_size) * stride_tok +
                    head * stride_head + ch * CB;
    const i64 src = i * CB;  // key/value are contiguous: chunk i is at byte CB * i
    kv_move<CB>(cache + dst, key + src);
    kv_move<CB>(cache + dst + stride_kv, value + src);
  }
}

// key/value [T, Hkv, D] fp32, contiguous; cache strides in bytes (= elements); one
// thread per element (grid-stride loop); slots as in write_kv.
template <class T>
__global__ void __launch_bounds__(256) write_kv_fp8(
    const float* __restrict__ key, const float* __restrict__ value,
    const i64* __restrict__ slots, i64 num_tokens, int num_heads, int head_dim,
    T* __restrict__ cache,
    i64 stride_page, i64 stride_kv, i64 stride_tok, i64 stride_head,  // bytes
    i64 page_size, float k_scale, float v_scale) {
  const float mx = Elem<T>::kMax;
  const i64 per_token = (i64)num_heads * head_dim;
  const i64 total = num_tokens * per_token;
  u8* bytes = reinterpret_cast<u8*>(cache);
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const i64 t = i / per_token;
    const i64 slot = slots[t];
    if (slot < 0) continue;
    const i64 rem = i - t * per_token;
    const i64 head = rem / head_dim, d = rem - head * head_dim;
    const i64 dst = (slot / page_size) * stride_page + (slot % page_size) * stride_tok +
                    head * stride_head + d;
    // fminf/fmaxf would turn NaN into the bound: keep it (NaN compares false)
    float k = key[i] / k_scale, v = value[i] / v_scale;
    k = k > mx ? mx : (k < -mx ? -mx : k);
    v = v > mx ? mx : (v < -mx ? -mx : v);
    bytes[dst] = (u8)Elem<T>::from_float(k);
    bytes[dst + stride_kv] = (u8)Elem<T>::from_float(v);
  }
}

// Copy page src[j] to page dst[j] (K and V, every token slot and head). dst holds no
// duplicate and no page of src (checked by the caller), so the copies never race.
// Grid (x: chunks of a page, y: pair j).
template <int CB>
__global__ void __launch_bounds__(256) copy_pages(
    char* __restrict__ cache,
    i64 stride_page, i64 stride_kv, i64 stride_tok, i64 stride_head,  // bytes
    const i64* __restrict__ src, const i64* __restrict__ dst,
    int page_size, int num_heads, int row_chunks) {
  const i64 per_tok = (i64)num_heads * row_chunks;
  const i64 per_kv = (i64)page_size * per_tok;
  const i64 total = 2 * per_kv;  // chunks per page
  const i64 from = src[blockIdx.y] * stride_page, to = dst[blockIdx.y] * stride_page;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const i64 kv = i / per_kv;
    i64 rem = i - kv * per_kv;
    const i64 tok = rem / per_tok;
    rem -= tok * per_tok;
    const i64 head = rem / row_chunks, ch = rem - head * row_chunks;
    const i64 off = kv * stride_kv + tok * stride_tok + head * stride_head + ch * CB;
    kv_move<CB>(cache + to + off, cache + from + off);
  }
}
