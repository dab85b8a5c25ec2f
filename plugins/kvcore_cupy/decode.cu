// kvcore_cupy/decode.cu -- paged decode attention with split-KV (flash-decoding).
//
// One query token per sequence. Grid (B, Hkv * n_chunks, num_splits); a CTA of
// 4 warps handles
//
//   sequence b = blockIdx.x,
//   kv head    = blockIdx.y / n_chunks, and the query heads
//                kv_head * group + (blockIdx.y % n_chunks) * NG + [0, NG)  (those < group),
//   tokens     [lo + split * split_len, min(lo + (split + 1) * split_len, seq_len)),
//
// lo = max(0, seq_len - 1 - window_left) with a sliding window (window_left >= 0),
// else 0: the query (position seq_len - 1) attends its last window_left + 1 tokens,
// and the pages before `lo` are never touched -- not even their block-table entries,
// which a hybrid engine may have released (-1 or anything). The host plans the splits
// over min(max_seq_len, window_left + 1) tokens.
//
// fp8 caches (T = kv_e4m3 / kv_e5m2): query and output are fp32 (Io<T>); the host folds
// k_scale into scale_log2 and passes v_scale as out_mult (dequantize-then-attend,
// reordered: both scales are per layer). Soft-capping (cap_log2) is applied to each
// score in attend_tokens (common.cuh); sinks (one logit per query head, natural
// units, or null) join the denominator where the final output is normalised: here
// with one split, in decode_merge with several.
//
// GQA: the NG query heads of one kv head sit in the same CTA, so each K/V row is
// loaded once (16-byte vector loads along D when WIDE, see common.cuh) and used NG
// times from registers. The host picks NG in {1, 2, 4} >= the group when it can,
// else 4 and several chunks (a group of 8 reads K/V twice, MQA with 32 query heads
// 8 times; the chunks of one kv head are neighbours in the grid, so the repeats
// mostly hit L2). Page ids are read one block ahead (common.cuh attend_tokens).
//
// Splits: the host chooses num_splits so that B * Hkv * n_chunks * num_splits fills
// the SMs with KV_DECODE_MIN_CTAS resident CTAs each; a CTA's tokens are dealt to its
// 4 warps in blocks of Geo::kBlock consecutive tokens. Each warp keeps an online
// softmax (m, l, acc) per head; the warps are merged through shared memory. With one split the CTA
// writes the normalised output in the cache dtype; otherwise it writes
//
//   part_out[b, h, split, :] = acc / l           (fp32)
//   part_lse[b, h, split]    = m + log2(l)       (log2 units; -inf when the split is empty)
//
// and decode_merge combines the splits: out = sum_s 2^(lse_s - M) part_s / sum_s 2^(lse_s - M).
#include "common.cuh"

#define KV_DECODE_WARPS 4

// Registers: a lane holds q and acc for its NG heads (2 * NG * kE fp32) besides
// 2 * kUnroll K/V chunks in flight, so the group tile is capped at 4 (kernels.py
// GROUP_TILES; a group of 8 runs as two chunks) and the bound below makes ptxas fit
// KV_DECODE_MIN_CTAS CTAs per SM (<= 128 registers). Before, NG=8 took up to 255
// registers (2 CTAs per SM). tests/test_cuda_compile.py holds every instantiation to
// the bound with no spills.
#define KV_DECODE_MIN_CTAS 4

template <class T, int D, int NG, bool WIDE>
__global__ void __launch_bounds__(KV_DECODE_WARPS * 32, KV_DECODE_MIN_CTAS) decode_partial(
    const typename Io<T>::type* __restrict__ query,  // [B, Hq, D], contiguous
    const T* __restrict__ cache,        // [num_pages, 2, page_size, Hkv, D], strided
    i64 stride_page, i64 stride_kv, i64 stride_tok, i64 stride_head,  // elements
    const i32* __restrict__ block_table, i64 table_stride,            // [B, max_pages]
    const i32* __restrict__ seq_lens,   // [B], tokens, >= 1
    int num_q_heads, int group, int n_chunks,
    float scale_log2,                   // scale * log2(e)
    u32 page_size, u32 ps_mul, u32 ps_shift,
    int split_len, int num_splits,      // split_len: tokens per split
    int window_left,                    // tokens; -1: no window
    float cap_log2,                     // soft cap * log2(e); 0: off
    const float* __restrict__ sinks,    // [Hq] sink logits, or null
    float out_mult,                     // v_scale (1 unless fp8)
    typename Io<T>::type* __restrict__ out,  // [B, Hq, D] (num_splits == 1)
    float* __restrict__ part_out,       // [B, Hq, num_splits, D] (num_splits > 1)
    float* __restrict__ part_lse) {     // [B, Hq, num_splits]
  typedef Geo<T, D, WIDE> G_;
  constexpr int E = G_::kE;
  const int b = blockIdx.x;
  const int kv_head = blockIdx.y / n_chunks;
  const int h0 = (blockIdx.y % n_chunks) * NG;  // first head of this CTA within the group
  const int split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c = lane % G_::kLanes;

  const int seq_len = seq_lens[b];
  const int lo = window_left >= 0 ? max(0, seq_len - 1 - window_left) : 0;
  const int t0 = lo + split * split_len;
  const int t_end = min(t0 + split_len, seq_len);

  float q[NG][E];
  kv_load_group<T, D, NG, WIDE>(query + (i64)b * num_q_heads * D, kv_head, group, h0, c,
                                scale_log2, q);

  const PagedSeq<T> seq = PagedSeq<T>::at(cache, stride_page, stride_kv, stride_tok, stride_head,
                                          block_table, table_stride, page_size, ps_mul, ps_shift,
                                          b, kv_head);

  Softmax<NG, E> st;
  st.init();
  attend_tokens<T, D, NG, WIDE>(seq, t0, t_end, warp * G_::kBlock, KV_DECODE_WARPS * G_::kBlock,
                                cap_log2, q, st);
  merge_rows<T, D, NG, WIDE>(st);

  // merge the warps: each writes its state, then the CTA combines element-wise
  __shared__ float sm_m[KV_DECODE_WARPS][NG], sm_l[KV_DECODE_WARPS][NG];
  __shared__ float sm_acc[KV_DECODE_WARPS][NG][D];
  if (lane < G_::kLanes) {  // row group 0 holds the merged state
#pragma unroll
    for (int h = 0; h < NG; ++h) {
#pragma unroll
      for (int k = 0; k < G_::kCpl; ++k) {
        const int ch = c + k * G_::kLanes;
        if (ch < G_::kChunks) {
#pragma unroll
          for (int e = 0; e < G_::kVec; ++e) sm_acc[warp][h][ch * G_::kVec + e] = st.acc[h][k * G_::kVec + e];
        }
      }
      if (lane == 0) {
        sm_m[warp][h] = st.m[h];
        sm_l[warp][h] = st.l[h];
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NG * D; i += KV_DECODE_WARPS * 32) {
    const int h = i / D, d = i % D;
    if (h0 + h >= group) continue;
    float mx = sm_m[0][h];
#pragma unroll
    for (int w = 1; w < KV_DECODE_WARPS; ++w) mx = fmaxf(mx, sm_m[w][h]);
    float l = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < KV_DECODE_WARPS; ++w) {
      const float f = kv_exp2(sm_m[w][h] - mx);
      l += sm_l[w][h] * f;
      a += sm_acc[w][h][d] * f;
    }
    const int qh = kv_head * group + h0 + h;
    const i64 row = (i64)b * num_q_heads + qh;  // [B, Hq] row
    if (num_splits == 1) {
      const float sink = sinks != nullptr ? sinks[qh] * KV_LOG2E : 0.f;
      const float o = a * kv_norm_with_sink(mx, l, sinks != nullptr, sink) * out_mult;
      Elem<typename Io<T>::type>::store(out + row * D + d, o);
    } else {
      part_out[(row * num_splits + split) * D + d] = l > 0.f ? a / l * out_mult : 0.f;
      if (d == 0) part_lse[row * num_splits + split] = l > 0.f ? mx + log2f(l) : kv_neg_inf();
    }
  }
}

// Combine the splits of one (b, h) row per CTA: out[row, d] in the output dtype T
// (Io of the cache's). A sink (log-sum-exp sinks[h] * log2(e), no value row) joins
// as one more term of the denominator. A row whose splits are all empty and that has
// no sink (cannot happen for seq_len >= 1) gets zeros.
template <class T>
__global__ void __launch_bounds__(128) decode_merge(
    const float* __restrict__ part_out,  // [rows, num_splits, D]
    const float* __restrict__ part_lse,  // [rows, num_splits]
    int num_splits, int head_dim,
    const float* __restrict__ sinks,     // [Hq], or null
    int num_q_heads,
    T* __restrict__ out) {               // [rows, D], contiguous
  const i64 row = blockIdx.x;
  const float* lse = part_lse + row * num_splits;
  const float sink = sinks != nullptr ? sinks[row % num_q_heads] * KV_LOG2E : kv_neg_inf();
  float mx = sink;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, lse[s]);
  const bool empty = mx == kv_neg_inf();
  float den = empty || sinks == nullptr ? 0.f : kv_exp2(sink - mx);
  for (int s = 0; s < num_splits; ++s) den += empty ? 0.f : kv_exp2(lse[s] - mx);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float num = 0.f;
    if (!empty) {
      for (int s = 0; s < num_splits; ++s) {
        num += part_out[(row * num_splits + s) * head_dim + d] * kv_exp2(lse[s] - mx);
      }
    }
    Elem<T>::store(out + row * head_dim + d, empty ? 0.f : num / den);
  }
}
