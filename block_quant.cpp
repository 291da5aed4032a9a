// Weight-only block-quantized linear layers for the CPU, with the numbers of GGUF's Q4_0, Q4_1
// and Q8_0 files: out (M, N) = x (M, K) @ w.T, x and out float32, w dequantized in registers.
//
// Layouts, for a weight of N rows (output channels) and K columns, in blocks of 32 columns:
//   q4: qweight uint8 (N, K/2). Block b of a row is bytes 16b..16b+15; byte j holds weight j in
//       its low nibble and weight j+16 in its high one (GGUF's own order). Zero-extending the 16
//       bytes to 32-bit lanes puts weights 0..15 in the low 4 bits and 16..31 four bits up,
//       already in x's order: no shuffle. w = scale * q + offset, q in 0..15
//       (Q4_1: offset = m; Q4_0: offset = -8 * scale).
//   q8: qweight int8 (N, K), w = scale * q.
//   scales, offsets: fp16 (N, K/32): a GGUF file's own numbers, 4 bytes a block fewer to read
//   than fp32 (a q4 block is 20 bytes, not 24).
// With int8_x, on a CPU with AVX512-VNNI, below bf16_rows: x is rounded to int8 per block, as
// llama.cpp multiplies these formats, and the products are summed in int32 (the int8_x section).
// From bf16_rows rows of x (up to 16), on a CPU whose AMX this process may use, linear_q4/q8 compute
// in bf16 instead: x and the dequantized weights rounded to bf16, products summed in fp32, as
// F.linear in bf16 does. The choice is the op's, so a compiled graph holds no branch on the rows.
// fma(q, scale, offset) rounds once, as scale * q + offset does in fp32, because scale * q is
// exact (an 11-bit by at most 8-bit product): the kernels multiply x by the very weights
// dequantize returns, and only the order of the fp32 sums differs from x @ dequantize().T.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BQ_AVX512 1
#include <immintrin.h>
#if defined(__AVX512VNNI__)
#define BQ_VNNI 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BQ_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BQ_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;  // weights per block, as in GGUF's Q4_0, Q4_1 and Q8_0

// One block of 32 fp32 values in registers: of x, or of a dequantized weight block. A tile's
// accumulators are single Vecs, summed across lanes once per output.
#if BQ_AVX512
using Vec = __m512;
#elif BQ_AVX2
using Vec = __m256;
#else
using Vec = float;
#endif
constexpr int VECS = BLOCK * sizeof(float) / sizeof(Vec);
struct Block {
  Vec v[VECS];
};

#if BQ_AVX512

inline Block load(const float* p) { return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)}; }
inline void store(float* p, const Block& b) {
  _mm512_storeu_ps(p, b.v[0]);
  _mm512_storeu_ps(p + 16, b.v[1]);
}
inline void fma_into(Vec& acc, const Block& x, const Block& w) {
  for (int i = 0; i < VECS; i++) acc = _mm512_fmadd_ps(x.v[i], w.v[i], acc);
}
inline float sum(Vec a) { return _mm512_reduce_add_ps(a); }

// A q4 block has 16 possible weights, scale * q + offset: one FMA makes that table and vpermps
// looks each nibble up in it. vpermps reads only the low 4 bits of each lane, so the low
// nibbles need no mask. 7 vector instructions a block (with the 2 FMAs with x), against 9 when
// converting the nibbles to floats, and the throughput follows (~4 cycles a block, measured).
inline Block dequant_q4(const uint8_t* p, float scale, float offset) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_permutexvar_ps(bytes, table), _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table)};
}
inline Block dequant_q8(const int8_t* p, float scale, float offset) {
  __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
  Block w;
  for (int i = 0; i < 2; i++) {
    __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)));
    w.v[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, o);
  }
  return w;
}

// n <= 16 fp16 numbers to fp32
inline void to_float(const at::Half* h, int64_t n, float* out) {
  __mmask16 m = (1u << n) - 1;
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, h)));
}

#elif BQ_AVX2

inline Block load(const float* p) {
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)};
}
inline void store(float* p, const Block& b) {
  for (int i = 0; i < VECS; i++) _mm256_storeu_ps(p + 8 * i, b.v[i]);
}
inline void fma_into(Vec& acc, const Block& x, const Block& w) {
  for (int i = 0; i < VECS; i++) acc = _mm256_fmadd_ps(x.v[i], w.v[i], acc);
}
inline float sum(Vec a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

inline Block dequant_q4(const uint8_t* p, float scale, float offset) {
  __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i b0 = _mm256_cvtepu8_epi32(packed), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8));
  __m256i mask = _mm256_set1_epi32(15);
  __m256i q[4] = {_mm256_and_si256(b0, mask), _mm256_and_si256(b1, mask),  // weights 0..7, 8..15
                  _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};     // 16..23, 24..31
  __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  Block w;
  for (int i = 0; i < 4; i++) w.v[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), s, o);
  return w;
}
inline Block dequant_q8(const int8_t* p, float scale, float offset) {
  __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  Block w;
  for (int i = 0; i < 4; i++) {
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
    w.v[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, o);
  }
  return w;
}

inline void to_float(const at::Half* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i++) out[i] = _cvtsh_ss(h[i].x);
}

#else  // plain C++: the compiler vectorizes what it can

inline Block load(const float* p) {
  Block x;
  std::copy(p, p + BLOCK, x.v);
  return x;
}
inline void store(float* p, const Block& b) { std::copy(b.v, b.v + BLOCK, p); }
inline void fma_into(Vec& acc, const Block& x, const Block& w) {
  for (int i = 0; i < VECS; i++) acc += x.v[i] * w.v[i];
}
inline float sum(Vec a) { return a; }

inline Block dequant_q4(const uint8_t* p, float scale, float offset) {
  Block w;
  for (int j = 0; j < 16; j++) {
    w.v[j] = scale * (p[j] & 15) + offset;
    w.v[j + 16] = scale * (p[j] >> 4) + offset;
  }
  return w;
}
inline Block dequant_q8(const int8_t* p, float scale, float offset) {
  Block w;
  for (int j = 0; j < BLOCK; j++) w.v[j] = scale * p[j] + offset;
  return w;
}

inline void to_float(const at::Half* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i++) out[i] = static_cast<float>(h[i]);
}

#endif

inline void store(at::BFloat16* p, const Block& b) {
#if BQ_AVX512 && defined(__AVX512BF16__)
  for (int i = 0; i < 2; i++)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(b.v[i])));
#else
  alignas(64) float f[BLOCK];
  store(f, b);
  for (int i = 0; i < BLOCK; i++) p[i] = f[i];  // c10's rounding: to nearest even, as .to(torch.bfloat16)
#endif
}

// The two formats: how a block is stored and dequantized.
struct Q4 {
  using Packed = uint8_t;
  static constexpr int64_t BYTES = BLOCK / 2;  // per block
  static Block dequant(const uint8_t* p, float s, float o) { return dequant_q4(p, s, o); }
};
struct Q8 {
  using Packed = int8_t;
  static constexpr int64_t BYTES = BLOCK;
  static Block dequant(const int8_t* p, float s, float o) { return dequant_q8(p, s, o); }
};

template <class F>
struct Weight {
  const typename F::Packed* q;
  const at::Half* scales;
  const at::Half* offsets;  // nullptr: every offset is 0
  int64_t blocks;           // per row: K / 32

  const typename F::Packed* row(int64_t n) const { return q + n * blocks * F::BYTES; }
};

constexpr int64_t CHUNK = 16;
// Bytes ahead of each weight row that a block asks the cache for. A decode step streams every
// weight from memory once: without it, SmolLM2's 120 q4 projections took 12.6 ms a step on 1
// thread (5.2 GB/s), with 2048 9.1 ms, as torch's int4 kernel (512: 10.8, 4096: 9.2; 2 threads
// 7.1 -> 4.8 ms). Hot-cache benchmarks do not show it.
constexpr int64_t PREFETCH = 2048;  // blocks whose scales and offsets are made fp32 at once (one zmm)

// The scales and offsets of blocks b0..b0+len (len <= CHUNK) of row n in fp32, on the stack,
// from where each block broadcasts its own with a plain load: converting fp16 one block at a
// time costs more than the rest of the block.
template <class F>
inline void chunk_scales(const Weight<F>& w, int64_t n, int64_t b0, int64_t len, float* s, float* o) {
  to_float(w.scales + n * w.blocks + b0, len, s);
  if (w.offsets)
    to_float(w.offsets + n * w.blocks + b0, len, o);
  else
    std::fill(o, o + len, 0.f);
}

// out[m..m+R, n..n+C]: each weight block of the C rows is dequantized once and used for the R
// rows of x (register tiling: R*C accumulators and 2*C weight vectors of the 32 zmm).
// noinline: inlined into the parallel loop, GCC kept the row pointers on the stack (+25 %).
struct XFloat {  // x (M, K) as it is
  const float* p;
  int64_t K;
};

template <class F, int R, int C>
__attribute__((noinline)) void tile(const XFloat& x, const Weight<F>& w, int64_t m, int64_t n, float* out,
                                    int64_t N) {
  const typename F::Packed* q[C];
  for (int c = 0; c < C; c++) q[c] = w.row(n + c);
  const float* xr[R];
  for (int r = 0; r < R; r++) xr[r] = x.p + (m + r) * x.K;
  Vec acc[R][C] = {};
  for (int64_t b0 = 0; b0 < w.blocks; b0 += CHUNK) {
    int64_t len = std::min(CHUNK, w.blocks - b0);
    alignas(64) float s[C][CHUNK], o[C][CHUNK];
    for (int c = 0; c < C; c++) chunk_scales(w, n + c, b0, len, s[c], o[c]);
    for (int64_t b = 0; b < len; b++) {
      Block wb[C];
      for (int c = 0; c < C; c++) {
        __builtin_prefetch(reinterpret_cast<const char*>(q[c]) + PREFETCH);
        wb[c] = F::dequant(q[c], s[c][b], o[c][b]);
        q[c] += F::BYTES;
      }
      for (int r = 0; r < R; r++) {
        Block xb = load(xr[r]);
        xr[r] += BLOCK;
        for (int c = 0; c < C; c++) fma_into(acc[r][c], xb, wb[c]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) out[(m + r) * N + n + c] = sum(acc[r][c]);
}

#if BQ_VNNI
// ---- int8_x: x quantized per block, the products summed in int32 (AVX512-VNNI) ----
// As llama.cpp's CPU backend multiplies these formats: each block of 32 of x becomes int8 with a
// scale of its own (Q8_0's: d = max |x| / 127, q = x * (127 / max |x|) rounded to nearest
// even), and vpdpbusd sums four int8 products a 32-bit lane, 64 a vector, two blocks at once; a
// block's sum is then scaled by the weight's scale times d in fp32. A q4 block's offset o adds
// o * sum(x), with x's own sum. Per weight that is half the fp32 path's instructions, which
// bound it at a few rows (a decode step), and the weights are read as they are stored.

constexpr int64_t PAIR = 2 * BLOCK;  // x's int8 per block pair (a vector)

struct XInt8 {  // x (M, K) quantized, each row padded to whole block pairs
  int64_t pairs;            // block pairs per row
  std::vector<int8_t> q;    // (M, pairs, 64), in the weights' order within a pair (pair_x)
  std::vector<float> d, s;  // (M, stride()): each block's scale and x's sum over it
  // d and s are read a chunk (16 blocks) at a time: zeros past a row's blocks
  int64_t stride() const { return 2 * pairs + CHUNK; }
};

// The 32 lanes of a vpdpbusd sum are 16 lanes of 4 products; this lays a pair of x's blocks a and
// b out in the order in which the weights come: q8: a's 32 then b's; q4 (nibbles: a block's
// low nibbles are weights 0..15, its high ones 16..31): a 0..15, b 0..15, a 16..31, b 16..31.
template <class F>
inline void pair_x(const int8_t* a, const int8_t* b, int8_t* dst) {
  if constexpr (std::is_same_v<F, Q8>) {
    std::copy(a, a + BLOCK, dst), std::copy(b, b + BLOCK, dst + BLOCK);
  } else {
    std::copy(a, a + 16, dst), std::copy(b, b + 16, dst + 16);
    std::copy(a + 16, a + 32, dst + 32), std::copy(b + 16, b + 32, dst + 48);
  }
}

// Which block of a pair each 32-bit lane of its sum belongs to (0: a, 1: b)
template <class F>
inline __m512i pair_lanes() {
  if constexpr (std::is_same_v<F, Q8>) return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
}

// One block of x to int8 (q), its scale and its sum
inline void quantize_block(const float* p, int8_t* q, float& d, float& s) {
  __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  s = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  d = amax / 127;
  __m512 inv = _mm512_set1_ps(amax > 0 ? 127 / amax : 0.f);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv))));
}

template <class F>
XInt8 quantize_x(const float* x, int64_t M, int64_t K) {
  int64_t blocks = K / BLOCK, pairs = (blocks + 1) / 2;
  XInt8 xq{pairs, std::vector<int8_t>(M * pairs * PAIR)};
  int64_t stride = xq.stride();
  xq.d.resize(M * stride), xq.s.resize(M * stride);
  for (int64_t m = 0; m < M; m++) {
    alignas(64) int8_t qa[BLOCK], qb[BLOCK];
    for (int64_t p = 0; p < pairs; p++) {
      int64_t a = 2 * p, i = m * stride + a;
      quantize_block(x + m * K + a * BLOCK, qa, xq.d[i], xq.s[i]);
      if (a + 1 < blocks)
        quantize_block(x + m * K + (a + 1) * BLOCK, qb, xq.d[i + 1], xq.s[i + 1]);
      else
        std::fill(qb, qb + BLOCK, 0);  // an odd last block's partner: nothing
      pair_x<F>(qa, qb, xq.q.data() + (m * pairs + p) * PAIR);
    }
  }
  return xq;
}

// A pair of weight blocks as vpdpbusd's unsigned operand (into u) and, for q8, the lanes whose
// x must change sign (w < 0: u holds |w|); len: 1 where the pair is an odd last block alone
template <class F>
inline void load_pair(const typename F::Packed* p, int len, __m512i& u, __mmask64& negative) {
  if constexpr (std::is_same_v<F, Q8>) {
    __m512i w = len == 2 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p);
    u = _mm512_abs_epi8(w), negative = _mm512_movepi8_mask(w);
  } else {
    __m256i b = len == 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi8(0xFFFF, p);
    __m512i both = _mm512_broadcast_i64x4(b);  // the upper half takes the high nibbles
    u = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), _mm512_set1_epi8(15));
    negative = 0;
  }
}

template <class F, int R, int C>
__attribute__((noinline)) void tile(const XInt8& x, const Weight<F>& w, int64_t m, int64_t n, float* out,
                                    int64_t N) {
  const typename F::Packed* q[C];
  for (int c = 0; c < C; c++) q[c] = w.row(n + c);
  int64_t stride = x.stride();
  const int8_t* xr[R];
  for (int r = 0; r < R; r++) xr[r] = x.q.data() + (m + r) * x.pairs * PAIR;
  const __m512i lanes = pair_lanes<F>(), zero = _mm512_setzero_si512();
  __m512 acc[R][C] = {};
  for (int64_t b0 = 0; b0 < w.blocks; b0 += CHUNK) {
    int64_t len = std::min(CHUNK, w.blocks - b0);
    alignas(64) float s[C][CHUNK], o[C][CHUNK];
    alignas(64) float sd[R][C][CHUNK];  // the weight's scale times x's, by block
    for (int c = 0; c < C; c++) chunk_scales(w, n + c, b0, len, s[c], o[c]);
    for (int r = 0; r < R; r++) {
      const float* d = x.d.data() + (m + r) * stride + b0;
      for (int c = 0; c < C; c++) {
        _mm512_store_ps(sd[r][c], _mm512_mul_ps(_mm512_load_ps(s[c]), _mm512_loadu_ps(d)));
        if constexpr (std::is_same_v<F, Q4>)  // o * sum(x), lane by lane: the lanes are summed at the end
          acc[r][c] = _mm512_fmadd_ps(_mm512_load_ps(o[c]), _mm512_loadu_ps(x.s.data() + (m + r) * stride + b0),
                                      acc[r][c]);
      }
    }
    for (int64_t b = 0; b < len; b += 2) {
      int pair = std::min<int64_t>(2, len - b);
      __m512i xv[R];
      for (int r = 0; r < R; r++) {
        xv[r] = _mm512_loadu_si512(xr[r]);
        xr[r] += PAIR;
      }
      __m512i lane_block = _mm512_add_epi32(lanes, _mm512_set1_epi32(b));
      for (int c = 0; c < C; c++) {
        __builtin_prefetch(reinterpret_cast<const char*>(q[c]) + PREFETCH);
        __m512i u;
        __mmask64 negative;
        load_pair<F>(q[c], pair, u, negative);
        q[c] += 2 * F::BYTES;
        for (int r = 0; r < R; r++) {
          __m512i sx = _mm512_mask_sub_epi8(xv[r], negative, zero, xv[r]);
          __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, u, sx));
          acc[r][c] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lane_block, _mm512_load_ps(sd[r][c])), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) out[(m + r) * N + n + c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

// Tile sizes, measured (1 thread, K = 576 and 1536, cycles per row of x and block): one row of x
// takes 4 weight rows a tile (2 rows: 10 % slower; 3, 6 or 8: the same within the noise); 8
// rows of x take 2 weight rows (2.0, against 2.3 with 4x4, 4x3 or 6x3 tiles).
constexpr int TILE_M = 8;  // rows of x per tile, at most
template <int R>
constexpr int tile_n() { return R <= 4 ? 4 : 2; }  // weight rows per tile
constexpr int64_t ROWS_PER_TASK = 16;  // weight rows a task computes for every row of x, in L1

// X: XFloat, or XInt8 (below, the int8 products): each has its own tile()
template <class F, int R, class X>
void tiles(const X& x, const Weight<F>& w, int64_t m, int64_t n0, int64_t n1, float* out, int64_t N) {
  constexpr int C = tile_n<R>();
  int64_t n = n0;
  for (; n + C <= n1; n += C) tile<F, R, C>(x, w, m, n, out, N);
  for (; n < n1; n++) tile<F, R, 1>(x, w, m, n, out, N);
}

template <class F, class X>
void rows(const X& x, int64_t M, const Weight<F>& w, int64_t n0, int64_t n1, float* out, int64_t N) {
  for (int64_t m = 0; m < M; m += TILE_M) {
    switch (std::min<int64_t>(TILE_M, M - m)) {
      case 1: tiles<F, 1>(x, w, m, n0, n1, out, N); break;
      case 2: tiles<F, 2>(x, w, m, n0, n1, out, N); break;
      case 3: tiles<F, 3>(x, w, m, n0, n1, out, N); break;
      case 4: tiles<F, 4>(x, w, m, n0, n1, out, N); break;
      case 5: tiles<F, 5>(x, w, m, n0, n1, out, N); break;
      case 6: tiles<F, 6>(x, w, m, n0, n1, out, N); break;
      case 7: tiles<F, 7>(x, w, m, n0, n1, out, N); break;
      case 8: tiles<F, 8>(x, w, m, n0, n1, out, N); break;
    }
  }
}

// out (M, N) = x @ w.T on the register tiles, tasks of ROWS_PER_TASK weight rows
template <class F, class X>
void linear_tiles(const X& x, int64_t M, int64_t K, const Weight<F>& w, int64_t N, float* op) {
  int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  // at least ~64K multiply-adds per thread: below that, waking another thread costs more than it saves
  int64_t grain = std::max<int64_t>(1, 65536 / (M * K * ROWS_PER_TASK));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) rows(x, M, w, t * ROWS_PER_TASK, std::min(N, (t + 1) * ROWS_PER_TASK), op, N);
  });
}

void check_shapes(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* offsets, int64_t K,
                  int64_t bytes_per_block, at::ScalarType packed) {
  TORCH_CHECK(K > 0 && K % BLOCK == 0, "K must be a positive multiple of 32, got ", K);
  int64_t N = qweight.size(0);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == packed && qweight.is_contiguous() &&
                  qweight.size(1) == K / BLOCK * bytes_per_block,
              "qweight must be contiguous ", packed, " (N, ", K / BLOCK * bytes_per_block, ") for K = ", K);
  for (const at::Tensor* t : {&scales, offsets})
    if (t)
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                      t->size(1) == K / BLOCK,
                  "scales and offsets must be contiguous float16 (N, K/32) = (", N, ", ", K / BLOCK, ")");
}

template <class F>
Weight<F> weight(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* offsets) {
  return {qweight.data_ptr<typename F::Packed>(), scales.data_ptr<at::Half>(),
          offsets ? offsets->data_ptr<at::Half>() : nullptr, scales.size(1)};
}

#if BQ_AMX
// ---- AMX: a tile of 16 weight rows dequantized to bf16 in L1, tdpbf16ps with x in bf16 ----
// One tile product covers 16 weight rows, 32 columns and up to 16 rows of x, so that at 8 rows
// of x the fp32 FMAs, which bound linear_q4 there, are gone; what is left is dequantizing each
// weight once, into a buffer the tiles load from.

// The OS lends the tile registers only to a process that asks (Linux's ARCH_REQ_XCOMP_PERM for
// XTILEDATA); where it refuses (an old kernel, a VM without AMX), the kernels stay in fp32.
bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// tile registers (the intrinsics take literal numbers): 0 the accumulator, 1 the weights, 2 x
constexpr int64_t TILE_ROWS = 16;      // weight rows a tile holds
constexpr int64_t CHUNK_STRIDE = CHUNK * BLOCK + 32;  // bf16 per buffered row: a chunk, padded off 1 KiB strides

// x in bf16 as the tiles take it: xb[k / 2][m][k % 2], so that a block's 16 pairs of k are a
// tile of M * 4 bytes a row. paired (q4): k in the order within blocks b, b+1 (b even, b+1
// present) that q4_pair writes, 0..15 of both blocks then 16..31 of both, which swaps bits 4 and
// 5 of k; a last odd block, and q8's blocks, keep their own order.
at::Tensor x_tiles(const at::Tensor& x, bool paired) {
  int64_t M = x.size(0), K = x.size(1), paired_end = paired ? K / 64 * 64 : 0;
  std::vector<uint32_t> rows(M * K / 2);  // x in bf16, row by row, in tile order: 2 k a word
  const float* src = x.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) {
    const float* xm = src + m * K;
    __m512i* dst = reinterpret_cast<__m512i*>(rows.data() + m * K / 2);
    for (int64_t k = 0; k < K; k += 2 * BLOCK) {
      bool swap = k < paired_end;  // else the 32 k at k (and at k + 32) stay in order
      for (int64_t half = 0; half < 2 && k + half * BLOCK < K; half++) {
        int64_t a = swap ? 16 * half : 32 * half;  // k of the first 16 of this 32, then a + (swap ? 32 : 16)
        __m512 lo = _mm512_loadu_ps(xm + k + a), hi = _mm512_loadu_ps(xm + k + a + (swap ? 32 : 16));
        _mm512_storeu_si512(dst++, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
      }
    }
  }
  at::Tensor xb = at::empty({K / 2, M * 2}, x.options().dtype(at::kBFloat16));
  uint32_t* out = reinterpret_cast<uint32_t*>(xb.data_ptr<at::BFloat16>());
  for (int64_t j = 0; j < K / 2; j++)
    for (int64_t m = 0; m < M; m++) out[j * M + m] = rows[m * K / 2 + j];
  return xb;
}

// Blocks b and b+1 of a q4 row as bf16, in x_tiles' order: each block's 16 weights
// (scale * q + offset) in one zmm table, vpermw looks the 32 nibbles of each half up.
inline void q4_pair(const uint8_t* p, const float* s, const float* o, at::BFloat16* dst) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[0]), _mm512_set1_ps(o[0]));
  __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[1]), _mm512_set1_ps(o[1]));
  __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(t1, t0));  // 0..15: block b, 16..31: b+1
  __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
  __m512i low = _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi16(15)), second);
  __m512i high = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), second);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(low, table));
  _mm512_storeu_si512(dst + BLOCK, _mm512_permutexvar_epi16(high, table));
}

// Blocks b0..b0+len of weight rows n0..n0+16 (zeros past n1) into buf as bf16, in x_tiles' order.
template <class F>
void dequantize_tile(const Weight<F>& w, int64_t n0, int64_t n1, int64_t b0, int64_t len, at::BFloat16* buf) {
  alignas(64) float s[CHUNK], o[CHUNK];
  for (int64_t r = 0; r < TILE_ROWS; r++) {
    at::BFloat16* dst = buf + r * CHUNK_STRIDE;
    if (n0 + r >= n1) {
      std::fill(dst, dst + len * BLOCK, at::BFloat16(0.f));
      continue;
    }
    chunk_scales(w, n0 + r, b0, len, s, o);
    const typename F::Packed* q = w.row(n0 + r) + b0 * F::BYTES;
    int64_t b = 0;
    if constexpr (std::is_same_v<F, Q4>)
      for (; b + 1 < len; b += 2) {
        __builtin_prefetch(reinterpret_cast<const char*>(q + b * F::BYTES) + PREFETCH);
        q4_pair(q + b * F::BYTES, s + b, o + b, dst + b * BLOCK);
      }
    for (; b < len; b++) {  // q8, and a q4 row's last odd block
      __builtin_prefetch(reinterpret_cast<const char*>(q + b * F::BYTES) + PREFETCH);
      store(dst + b * BLOCK, F::dequant(q + b * F::BYTES, s[b], o[b]));
    }
  }
}

// out[:, n0..n1] (n1 - n0 <= 16) for all M rows of x, a chunk of blocks at a time, so that the
// buffer (16 rows x 16 blocks, 17 KB) stays in L1.
template <class F>
void amx_tile(const Weight<F>& w, const at::BFloat16* xb, int64_t M, int64_t n0, int64_t n1, float* out, int64_t N,
              at::BFloat16* buf) {
  _tile_zero(0);
  for (int64_t b0 = 0; b0 < w.blocks; b0 += CHUNK) {
    int64_t len = std::min(CHUNK, w.blocks - b0);
    // a pair split across chunks would break x_tiles' order: CHUNK is even, so pairs never are
    dequantize_tile(w, n0, n1, b0, len, buf);
    for (int64_t b = 0; b < len; b++) {
      _tile_loadd(1, buf + b * BLOCK, CHUNK_STRIDE * 2);
      _tile_loadd(2, xb + (b0 + b) * BLOCK * M, M * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
  }
  alignas(64) float c[TILE_ROWS * 16];
  _tile_stored(0, c, M * 4);
  for (int64_t r = 0; r < n1 - n0; r++)
    for (int64_t m = 0; m < M; m++) out[m * N + n0 + r] = c[r * M + m];
}

constexpr int64_t AMX_MAX_ROWS = 16;  // rows of x a tile holds

// out = x @ w.T for M <= 16 rows of x (contiguous), in bf16
template <class F>
void linear_bf16(const at::Tensor& x, const Weight<F>& w, int64_t N, float* op) {
  int64_t M = x.size(0);
  at::Tensor xb = x_tiles(x, std::is_same_v<F, Q4>);
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  at::parallel_for(0, (N + TILE_ROWS - 1) / TILE_ROWS, 1, [&](int64_t t0, int64_t t1) {
    TileConfig cfg;  // a thread's own tile registers
    cfg.rows[0] = TILE_ROWS, cfg.colsb[0] = M * 4;   // out: weight rows x rows of x, fp32
    cfg.rows[1] = TILE_ROWS, cfg.colsb[1] = BLOCK * 2;  // weights: rows x a block, bf16
    cfg.rows[2] = BLOCK / 2, cfg.colsb[2] = M * 4;   // x: the block's 16 pairs x rows of x, bf16 pairs
    // GCC 12's _tile_loadconfig declares 8 bytes of operand and drops the config's stores
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
    std::vector<at::BFloat16> buf(TILE_ROWS * CHUNK_STRIDE);
    for (int64_t t = t0; t < t1; t++)
      amx_tile(w, xp, M, t * TILE_ROWS, std::min(N, (t + 1) * TILE_ROWS), op, N, buf.data());
    _tile_release();
  });
}
#else
bool amx_usable() { return false; }
constexpr int64_t AMX_MAX_ROWS = 0;
template <class F>
void linear_bf16(const at::Tensor&, const Weight<F>&, int64_t, float*) {}
#endif

template <class F>
at::Tensor linear(const at::Tensor& x_, const at::Tensor& qweight, const at::Tensor& scales,
                  const at::Tensor* offsets, int64_t bf16_rows, bool int8_x) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "x must be float32 (M, K)");
  int64_t M = x_.size(0), K = x_.size(1), N = qweight.size(0);
  check_shapes(qweight, scales, offsets, K, F::BYTES, c10::CppTypeToScalarType<typename F::Packed>::value);
  at::Tensor x = x_.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  Weight<F> w = weight<F>(qweight, scales, offsets);
  float* op = out.data_ptr<float>();
  if (M >= bf16_rows && M <= AMX_MAX_ROWS && amx_usable()) {
    linear_bf16(x, w, N, op);
    return out;
  }
#if BQ_VNNI
  if (int8_x && M < bf16_rows) {  // from bf16_rows without AMX: fp32, as with AMX it is bf16
    linear_tiles(quantize_x<F>(x.data_ptr<float>(), M, K), M, K, w, N, op);
    return out;
  }
#endif
  linear_tiles(XFloat{x.data_ptr<float>(), K}, M, K, w, N, op);
  return out;
}

template <class F, class T>
void dequantize_rows(const Weight<F>& w, T* out, int64_t n0, int64_t n1) {
  alignas(64) float s[CHUNK], o[CHUNK];
  for (int64_t n = n0; n < n1; n++) {
    const typename F::Packed* q = w.row(n);
    T* row = out + n * w.blocks * BLOCK;
    for (int64_t b0 = 0; b0 < w.blocks; b0 += CHUNK) {
      int64_t len = std::min(CHUNK, w.blocks - b0);
      chunk_scales(w, n, b0, len, s, o);
      for (int64_t b = 0; b < len; b++) store(row + (b0 + b) * BLOCK, F::dequant(q + (b0 + b) * F::BYTES, s[b], o[b]));
    }
  }
}

// The weight as dtype (float32: exactly the weights the kernels use; bfloat16: those rounded)
template <class F>
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* offsets,
                      at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize gives float32 or bfloat16, not ", dtype);
  int64_t N = qweight.size(0), K = scales.size(1) * BLOCK;
  check_shapes(qweight, scales, offsets, K, F::BYTES, c10::CppTypeToScalarType<typename F::Packed>::value);
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(dtype));
  if (N == 0) return out;
  Weight<F> w = weight<F>(qweight, scales, offsets);
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t n0, int64_t n1) {
    if (dtype == at::kFloat)
      dequantize_rows(w, out.data_ptr<float>(), n0, n1);
    else
      dequantize_rows(w, out.data_ptr<at::BFloat16>(), n0, n1);
  });
  return out;
}



at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const at::Tensor& offsets, int64_t bf16_rows, bool int8_x) {
  return linear<Q4>(x, qweight, scales, &offsets, bf16_rows, int8_x);
}
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t bf16_rows,
                     bool int8_x) {
  return linear<Q8>(x, qweight, scales, nullptr, bf16_rows, int8_x);
}
#if BQ_VNNI
bool vnni() { return true; }
#else
bool vnni() { return false; }
#endif
at::Tensor dequantize_q4(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& offsets,
                         at::ScalarType dtype) {
  return dequantize<Q4>(qweight, scales, &offsets, dtype);
}
at::Tensor dequantize_q8(const at::Tensor& qweight, const at::Tensor& scales, at::ScalarType dtype) {
  return dequantize<Q8>(qweight, scales, nullptr, dtype);
}

}  // namespace

TORCH_LIBRARY(block_quant, m) {
  m.def("linear_q4(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int bf16_rows, bool int8_x) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor qweight, Tensor scales, int bf16_rows, bool int8_x) -> Tensor");
  m.def("amx() -> bool", amx_usable);  // whether bf16_rows can take effect
  m.def("vnni() -> bool", vnni);       // whether int8_x can
  m.def("dequantize_q4(Tensor qweight, Tensor scales, Tensor offsets, ScalarType dtype) -> Tensor");
  m.def("dequantize_q8(Tensor qweight, Tensor scales, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(block_quant, CPU, m) {
  m.impl("linear_q4", linear_q4);
  m.impl("linear_q8", linear_q8);
  m.impl("dequantize_q4", dequantize_q4);
  m.impl("dequantize_q8", dequantize_q8);
}
