// kvcore_cupy/prefill.cu -- varlen causal attention over a paged, cached prefix.
//
// The queries of sequence b are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 of
// the packed query array and are its *last* q_len tokens (bottom-right aligned):
//
//   tokens     0 1 2 3 4 5        (seq_len = 6, q_len = 2: 4 cached, 2 new)
//   query 0    x x x x x .        attends 0 .. seq_len - q_len + 0
//   query 1    x x x x x x        attends 0 .. seq_len - q_len + 1
//
// Grid (ceil(total_q / 4), Hkv * n_chunks); warp w of CTA x owns packed query row
// x * 4 + w and, as in decode, the NG query heads of one kv head (K/V loaded once
// per row, used NG times). It finds its sequence by a binary search of
// cu_seqlens_q (no host-side tile plan, no device-to-host sync), then runs the same
// online-softmax loop as decode over its causal range, one warp alone (no split,
// no shared memory). The 4 warps of a CTA are consecutive queries of one sequence
// (mostly), so they walk the same K/V rows at about the same time and share them
// through L1/L2. CUDA cores only (no tensor cores): this kernel is correct and
// memory-friendly, not a FlashAttention-class prefill.
//
// Options, as in decode.cu: a sliding window (window_left >= 0) starts query i's loop
// at max(0, p - window_left), p = seq_len - q_len + i its position, so the pages
// before it are never touched (nor their block-table entries); soft-capping per score
// (cap_log2); sinks (or null) in the final normalisation; fp8 caches with fp32 query
// and output, k_scale folded into scale_log2 and v_scale passed as out_mult.
#include "common.cuh"

#define KV_PREFILL_WARPS 4
// Registers: at least 3 CTAs of 128 threads per SM (<= 168 registers; the widest
// variants take 161). Left to itself ptxas capped some variants at 64 registers and
// spilled up to 12 bytes; at 4 CTAs (128) the NG=4 variants spill. The nvcc test
// holds every instantiation to the bound with no spills.
#define KV_PREFILL_MIN_CTAS 3

template <class T, int D, int NG, bool WIDE>
__global__ void __launch_bounds__(KV_PREFILL_WARPS * 32, KV_PREFILL_MIN_CTAS) prefill(
    const typename Io<T>::type* __restrict__ query,  // [total_q, Hq, D], contiguous
    const T* __restrict__ cache,        // [num_pages, 2, page_size, Hkv, D], strided
    i64 stride_page, i64 stride_kv, i64 stride_tok, i64 stride_head,  // elements
    const i32* __restrict__ block_table, i64 table_stride,            // [B, max_pages]
    const i32* __restrict__ cu_seqlens_q,  // [B + 1], non-decreasing, from 0 to total_q
    const i32* __restrict__ seq_lens,      // [B], tokens, >= q_len
    int batch, int total_q,
    int num_q_heads, int group, int n_chunks,
    float scale_log2,                      // scale * log2(e)
    u32 page_size, u32 ps_mul, u32 ps_shift,
    int window_left,                       // tokens; -1: no window
    float cap_log2,                        // soft cap * log2(e); 0: off
    const float* __restrict__ sinks,       // [Hq] sink logits, or null
    float out_mult,                        // v_scale (1 unless fp8)
    typename Io<T>::type* __restrict__ out) {  // [total_q, Hq, D], contiguous
  typedef Geo<T, D, WIDE> G_;
  constexpr int E = G_::kE;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int qrow = blockIdx.x * KV_PREFILL_WARPS + warp;  // packed query row
  if (qrow >= total_q) return;                            // warp-uniform
  const int kv_head = blockIdx.y / n_chunks;
  const int h0 = (blockIdx.y % n_chunks) * NG;
  const int row = lane / G_::kLanes, c = lane % G_::kLanes;

  // the sequence b with cu_seqlens_q[b] <= qrow < cu_seqlens_q[b + 1] (empty
  // sequences have equal bounds and are skipped by taking the last such b)
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_seqlens_q[mid] <= qrow) lo = mid; else hi = mid - 1;
  }
  const int b = lo;
  const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  const int i = qrow - cu_seqlens_q[b];
  const int t_end = seq_lens[b] - q_len + i + 1;  // tokens t_lo .. t_end - 1
  const int t_lo = window_left >= 0 ? max(0, t_end - 1 - window_left) : 0;

  float q[NG][E];
  kv_load_group<T, D, NG, WIDE>(query + (i64)qrow * num_q_heads * D, kv_head, group, h0, c,
                                scale_log2, q);

  const PagedSeq<T> seq = PagedSeq<T>::at(cache, stride_page, stride_kv, stride_tok, stride_head,
                                          block_table, table_stride, page_size, ps_mul, ps_shift,
                                          b, kv_head);

  Softmax<NG, E> st;
  st.init();
  attend_tokens<T, D, NG, WIDE>(seq, t_lo, t_end, 0, G_::kBlock, cap_log2, q, st);
  merge_rows<T, D, NG, WIDE>(st);

  if (row == 0) {
#pragma unroll
    for (int h = 0; h < NG; ++h) {
      if (h0 + h < group) {
        const int qh = kv_head * group + h0 + h;
        const float sink = sinks != nullptr ? sinks[qh] * KV_LOG2E : 0.f;
        const float inv = kv_norm_with_sink(st.m[h], st.l[h], sinks != nullptr, sink) * out_mult;
        kv_store_row<T, D, WIDE>(out + ((i64)qrow * num_q_heads + qh) * D, c, st.acc[h], inv);
      }
    }
  }
}
