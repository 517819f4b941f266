// CPU kernels for decoding with bf16-stored or block-quantized weights (Q8_0, Q4_0, Q4_1) and fp32
// arithmetic, for AVX-512 and AVX2.
//
// Why: speculative decoding pays only when verifying k+1 tokens costs about what one token costs.
// One token reads every weight once (memory-bound); k+1 tokens must share each weight load and
// each register tile (compute-bound), and nothing else may eat the step — not Python, not ~30
// PyTorch operators per layer. So a matrix is packed once at load into panels of 16 outputs
// (isa.h), a tile of up to 8 rows (6 on AVX2) x up to 8 panels lives in registers, and a model's decoder
// layers run in one call and one OpenMP parallel region (`Stack`).
//
// The arithmetic contract (what makes greedy speculative decoding exact): every output of a row
// is computed alone, by the same sequence of IEEE fp32 operations whatever else shares the call.
// - matrices: output n of row m is x[m] . W[n] summed over k in order, one FMA at a time in its
//   own vector lane; bf16 -> fp32 is exact (a 16-bit shift), so this is the fp32 product of the
//   stored weights. Neither the row count, nor the tile shape, nor the thread split enters it.
// - attention: a query row reduces over exactly the keys it sees (its committed prefix, then the
//   new tokens it may see — causal, or a tree), key i in lane i mod 16 of the softmax sum.
// - RMSNorm and SwiGLU: per row, in 16 lanes by element index, reduced by a fixed tree.
// - quantized matrices (quant.h): each row's activations quantized per block of 32 to int8, an
//   exact integer dot product per block, then the blocks' fp32 terms added in order.
// Both instruction sets run the same operations on a 16-lane vector (one zmm, or two ymm), so
// AVX-512 and AVX2 give bit-identical results; the tests check it by forcing each. The quantized
// kernels run on AVX-512 VNNI where the CPU has it and on AVX2 otherwise (AVX-512 without VNNI
// included), with the same results (their integer sums are exact).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "threads.h"

// How a matrix is stored (kernels.FORMATS): bf16 panels (isa.h) or blocks of 32 quantized weights (quant.h).
// K-quants and kMixed (runs of outputs in different quantized formats): kquant.h
enum Format : int { kBf16 = 0, kQ8_0 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ4_K = 4, kQ6_K = 5, kMixed = 6 };
constexpr int64_t kBlock = 32;  // weights per quantized block, along K
constexpr int64_t kPanelBlockBytes[6] = {0, 32 + 512, 32 + 256, 64 + 256, 296, 548};  // 16 outputs x 32 k (quant.h)
constexpr int64_t kMixedHeader = 64;  // kMixed: int32 runs, then (format, N) per run; the runs' data follow

struct Mat {  // a packed matrix of N outputs from K inputs
  int format;
  const void* data;
  int64_t N, K;
};

// Activation rows quantized per block of 32 for a quantized matrix: row m's values q + m ld (int8),
// its blocks' scales d + m blocks and sums of q sums + m blocks.
struct QuantRows {
  int8_t* q;
  float* d;
  int32_t* sums;
  int64_t ld, blocks;
};

// Row m's first K values (K a multiple of 32) into `rows`: per block, dx = max|x| / 127 and
// q = round_half_even(x * (1 / dx)) (0 where dx is 0) in [-127, 127], scalar so that every
// instruction set (and kernels.quantize_rows in PyTorch) gets the very same integers.
inline void quantize_row(const float* x, int64_t K, const QuantRows& rows, int64_t m) {
  int8_t* q = rows.q + m * rows.ld;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xb[j] * inv)));
      q[b * kBlock + j] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    rows.d[m * rows.blocks + b] = d;
    rows.sums[m * rows.blocks + b] = sum;
  }
}

using QuantMatmul = void (*)(const QuantRows&, int64_t, const Mat&, float*, int64_t, const float*, const float*,
                             int64_t, int64_t);
struct QuantOps {
  const char* name;
  QuantMatmul matmul;  // kquant.h's kquant_matmul (quant.h's formats and the K-quants)
};
extern const QuantOps* g_quant;  // the quantized kernels chosen for this CPU (see dispatch)

// What the decoder layers read and write, shared by both instruction sets. Biases and q/k norms
// are null where the architecture has none.
struct LayerWeights {
  const float* norm1;       // (C,) the input norm's scale (its offset added: Gemma's 1 + w)
  Mat qkv;                  // E = (H + 2 Hkv) D outputs from C
  const float* qkv_bias;    // (E,)
  Mat o;                    // C outputs from H D
  const float* o_bias;      // (C,)
  const float* norm2;       // (C,)
  Mat gate_up;              // 2F outputs from C: F gate, then F up
  const float* gate_up_bias;  // (2F,)
  Mat down;                 // C outputs from F
  const float* down_bias;   // (C,)
  const float* q_norm;      // (D,) per-head RMSNorm of queries before rotation (Qwen3)
  const float* k_norm;      // (D,) of keys
};

// The architecture's arithmetic (model.Arch, filled in by kernels.stack).
struct Shape {
  int64_t C = 0, H = 0, Hkv = 0, D = 0, F = 0;
  int64_t R = 0;              // rotated dims of each head (its first ones; D but for partial rotary)
  float eps = 0;
  float rotary_factor = 1.f;  // on cos and sin (yarn's attention factor)
  int64_t activation = 0;     // of the gate: 0 silu, 1 gelu (tanh approximation)
};

struct Window {  // the new tokens of one forward and where their keys and values go
  int64_t B, T;
  const int64_t* lengths;    // (B,) committed cache entries per row: new token t goes to slot lengths[b] + t
  const int64_t* positions;  // (B, T) rotary positions; null: lengths[b] + t
  const bool* tree;          // (B, T, T) which new tokens each new token sees (itself included); null: causal
  const float* inv_freq;     // (R/2,)
};

struct Cache {  // one layer's keys and values: (B, Hkv, S, D) each
  float* k;
  float* v;
  int64_t S;
};

struct Scratch {  // one forward's intermediate rows (see isa.h's decoder_layers)
  float *h, *qkv, *y, *gu, *act, *rope, *p;
  int64_t p_stride;
  QuantRows xq;  // a quantized matrix's input rows
};

// The sum of 8 lanes by a fixed tree (lanes i and i+4, then i and i+2, then 0 and 1), shared by
// both instruction sets (AVX-512 first folds its 16 lanes to 8 the same way AVX2 does).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
#pragma GCC pop_options

// ---------------------------------------------------------------------------------- AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace avx512 {
constexpr int kRegs = 32, kRegsPerV = 1;

struct V {
  __m512 v;
  static V zero() { return {_mm512_setzero_ps()}; }
  static V bcast(float a) { return {_mm512_set1_ps(a)}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
  static V load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  static V load_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static V fnma(V a, V b, V c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b
  static V add(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
  static V sub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static V mul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static V div(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
  static V max(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
  static V ge_mask(V a, V b) {
    return {_mm512_castsi512_ps(_mm512_movm_epi32(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ)))};
  }
  static V and_mask(V a, V m) { return {_mm512_and_ps(a.v, m.v)}; }
  static V round_nearest(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static V pow2i(V n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
  }
  static V neg_abs(V a) { return {_mm512_or_ps(a.v, _mm512_set1_ps(-0.f))}; }
  static V lt_zero_select(V g, V if_negative, V otherwise) {
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(g.v, _mm512_setzero_ps(), _CMP_LT_OQ), otherwise.v,
                                 if_negative.v)};
  }
  static float hsum(V a) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)));
  }
  static float hmax(V a) { return _mm512_reduce_max_ps(a.v); }
  // out[j] = hsum(a[j]) for 16 vectors at once: the same additions as hsum (lanes i and i+8, then
  // i and i+4, i and i+2, i and i+1) done for 16 sums in parallel by transposing as it folds.
  static void hsum16(const V* a, float* out) {
    __m512 t[8], u[4], v[2];
    for (int m = 0; m < 8; ++m)  // fold 8: two sums per vector, 8 lanes each
      t[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m].v, a[2 * m + 1].v, 0x44),
                           _mm512_shuffle_f32x4(a[2 * m].v, a[2 * m + 1].v, 0xEE));
    for (int m = 0; m < 4; ++m)  // fold 4: quarter c of u[m] is sum 4m + c
      u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0x88),
                           _mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; ++m)  // fold 2, within each quarter
      v[m] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0x44), _mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0xEE));
    // fold 1: element 4q + e is sum 4e + q; put sum j at element j
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, s));
  }
};
#include "isa.h"
}  // namespace avx512
#pragma GCC pop_options

// --------------------------------------------------------------------- AVX-512 VNNI (quantized)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")
namespace avx512_vnni {
using avx512::kLanes;
using avx512::kPrefetch;
using avx512::store_part;
using avx512::V;
constexpr int kRegs = 32, kRegsPerV = 1;

struct VI {  // 16 int32 lanes; 64 bytes of codes hold 4 bytes (4 consecutive k) per lane
  __m512i v;
  using Raw = __m512i;
  using Wide = __m512i;
  static constexpr int kWideOffset = 128;  // dot_wide sums u q for the stored u = w + 128
  static VI zero() { return {_mm512_setzero_si512()}; }
  static Raw load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Raw low_nibbles(Raw a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x0F)); }
  static Raw high_nibbles(Raw a) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0F)); }
  static Wide wide(Raw a) { return a; }
  static int32_t quad(const int8_t* p) {
    int32_t q;
    std::memcpy(&q, p, 4);
    return q;
  }
  // lane n += sum over its 4 bytes u (unsigned) times the 4 signed bytes of x4
  static VI dot(VI acc, Raw u, int32_t x4) { return {_mm512_dpbusd_epi32(acc.v, u, _mm512_set1_epi32(x4))}; }
  static VI dot_wide(VI acc, Wide u, int32_t x4) { return dot(acc, u, x4); }
  static VI sub(VI a, int32_t c) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(c))}; }
  static V to_float(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
};
#include "quant.h"
#include "kquant.h"
}  // namespace avx512_vnni
#pragma GCC pop_options

// ------------------------------------------------------------------------------- AVX2 + FMA
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr int kRegs = 16, kRegsPerV = 2;

inline __m256 bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

struct V {  // lanes 0-7 in lo, 8-15 in hi
  __m256 lo, hi;
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V bcast(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
  static V load_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
  static V load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static V fnma(V a, V b, V c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
  static V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static V sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static V div(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static V max(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  static V ge_mask(V a, V b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ)}; }
  static V and_mask(V a, V m) { return {_mm256_and_ps(a.lo, m.lo), _mm256_and_ps(a.hi, m.hi)}; }
  static V round_nearest(V a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
  }
  static __m256 pow2i8(__m256 n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static V pow2i(V n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
  static V neg_abs(V a) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    return {_mm256_or_ps(a.lo, sign), _mm256_or_ps(a.hi, sign)};
  }
  static V lt_zero_select(V g, V if_negative, V otherwise) {
    const __m256 z = _mm256_setzero_ps();
    return {_mm256_blendv_ps(otherwise.lo, if_negative.lo, _mm256_cmp_ps(g.lo, z, _CMP_LT_OQ)),
            _mm256_blendv_ps(otherwise.hi, if_negative.hi, _mm256_cmp_ps(g.hi, z, _CMP_LT_OQ))};
  }
  static float hsum(V a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
  static float hmax(V a) {
    const __m256 m = _mm256_max_ps(a.lo, a.hi);
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    b = _mm_max_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
  }
  static void hsum16(const V* a, float* out) {
    for (int j = 0; j < 16; ++j) out[j] = hsum(a[j]);
  }
};

struct VI {  // 16 int32 lanes: 0-7 in lo, 8-15 in hi (as V)
  __m256i lo, hi;
  struct Raw {
    __m256i lo, hi;
  };
  struct Wide {  // int8 codes w = u - 128 as |w| and w, for maddubs' unsigned x signed bytes
    __m256i abs_lo, abs_hi, w_lo, w_hi;
  };
  static constexpr int kWideOffset = 0;  // dot_wide sums w q directly
  static VI zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static Raw load(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
  }
  static __m256i nib(__m256i a) { return _mm256_and_si256(a, _mm256_set1_epi8(0x0F)); }
  static Raw low_nibbles(Raw a) { return {nib(a.lo), nib(a.hi)}; }
  static Raw high_nibbles(Raw a) { return {nib(_mm256_srli_epi16(a.lo, 4)), nib(_mm256_srli_epi16(a.hi, 4))}; }
  static Wide wide(Raw a) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    const __m256i lo = _mm256_xor_si256(a.lo, flip), hi = _mm256_xor_si256(a.hi, flip);
    return {_mm256_abs_epi8(lo), _mm256_abs_epi8(hi), lo, hi};
  }
  static int32_t quad(const int8_t* p) {
    int32_t q;
    std::memcpy(&q, p, 4);
    return q;
  }
  // 8 lanes += the sums of 4 products u x (u unsigned, x signed, each pair's sum below 2^15: no saturation)
  static __m256i dot8(__m256i acc, __m256i u, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
  }
  static VI dot(VI acc, Raw u, int32_t x4) {  // u <= 15
    const __m256i x = _mm256_set1_epi32(x4);
    return {dot8(acc.lo, u.lo, x), dot8(acc.hi, u.hi, x)};
  }
  static VI dot_wide(VI acc, const Wide& w, int32_t x4) {  // |w| <= 128, |x| <= 127: w x = |w| (x signed by w)
    const __m256i x = _mm256_set1_epi32(x4);
    return {dot8(acc.lo, w.abs_lo, _mm256_sign_epi8(x, w.w_lo)), dot8(acc.hi, w.abs_hi, _mm256_sign_epi8(x, w.w_hi))};
  }
  static VI sub(VI a, int32_t c) {
    const __m256i v = _mm256_set1_epi32(c);
    return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
  }
  static V to_float(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
};
#include "isa.h"
#include "quant.h"
#include "kquant.h"
}  // namespace avx2
#pragma GCC pop_options

// ------------------------------------------------------------------------------- dispatch

namespace {

struct Ops {
  const char* name;
  void (*matmul_panels)(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t,
                        const float*, const float*, int64_t, int64_t);
  void (*rms_norm_row)(const float*, const float*, float, int64_t, float*);
  float (*fma_loop)(int64_t);
  double fma_loop_flops;  // per repetition of fma_loop
  void (*decoder_layers)(const LayerWeights*, int, const Shape&, const Window&, const Cache*, float*, float* const*,
                         const Scratch&);
};

const Ops kAvx512{"avx512", avx512::matmul_panels, avx512::rms_norm_row, avx512::fma_loop, avx512::kFmaLoopFlops,
                  avx512::decoder_layers};
const Ops kAvx2{"avx2", avx2::matmul_panels, avx2::rms_norm_row, avx2::fma_loop, avx2::kFmaLoopFlops,
                avx2::decoder_layers};

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

const QuantOps kQuantVnni{"avx512_vnni", avx512_vnni::kquant_matmul};
const QuantOps kQuantAvx2{"avx2", avx2::kquant_matmul};

bool has_avx512_vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }

const Ops* g_ops = has_avx512() ? &kAvx512 : &kAvx2;

// Threads for a call that reads `bytes` of weights for `rows` rows: below about a megabyte of
// weight traffic (a draft model's layer, one token) a second thread costs more in wake-ups and
// barriers than it saves; above it, the thread policy's count (threads.h: the cores other
// processes leave free, or a fixed count). Results never depend on it.
int threads(int64_t bytes, int64_t rows) {
  return bytes * rows < (int64_t{1} << 20) ? 1 : thread_policy::threads(std::max(1, at::get_num_threads()));
}

const uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_packed(const torch::Tensor& w, int64_t K, int64_t N, const char* what) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 3 && w.size(2) == 16 && w.is_contiguous(),
              what, ": expected a packed (panels, K, 16) contiguous bfloat16 matrix (kernels.Matrix)");
  TORCH_CHECK(w.size(1) == K && w.size(0) == (N + 15) / 16, what, ": packed matrix is (", w.size(0), ", ",
              w.size(1), ", 16), expected (", (N + 15) / 16, ", ", K, ", 16)");
}

// Bytes of a packed matrix of N outputs from K inputs in `format` (not kMixed).
int64_t matrix_bytes(int64_t format, int64_t N, int64_t K) {
  const int64_t panels = (N + 15) / 16;
  return format == kBf16 ? panels * K * 16 * 2 : panels * (K / kBlock) * kPanelBlockBytes[format];
}

// Bytes of a matrix's weights (kMixed: its runs').
int64_t matrix_bytes(const Mat& W) {
  if (W.format != kMixed) return matrix_bytes(W.format, W.N, W.K);
  const int32_t* head = static_cast<const int32_t*>(W.data);
  int64_t bytes = 0;
  for (int32_t i = 0; i < head[0]; ++i) bytes += matrix_bytes(head[1 + 2 * i], head[2 + 2 * i], W.K);
  return bytes;
}

// A kMixed matrix `w` with N outputs from K inputs, checked: 1 to 7 runs in quantized formats (not
// kMixed), each but the last a whole number of panels, N outputs in all, the bytes they need.
Mat mixed_matrix(const torch::Tensor& w, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() >= kMixedHeader, what,
              ": expected a mixed matrix's header and runs as contiguous uint8 (kernels.Matrix)");
  const int32_t* head = reinterpret_cast<const int32_t*>(w.data_ptr<uint8_t>());
  TORCH_CHECK(head[0] >= 1 && head[0] <= 7, what, ": a mixed matrix has 1 to 7 runs, not ", head[0]);
  int64_t n = 0, bytes = kMixedHeader;
  for (int32_t i = 0; i < head[0]; ++i) {
    const int32_t f = head[1 + 2 * i], rows = head[2 + 2 * i];
    TORCH_CHECK(f >= kQ8_0 && f <= kQ6_K && rows > 0 && (i + 1 == head[0] || rows % 16 == 0), what,
                ": run ", i, " of a mixed matrix is format ", f, " with ", rows, " outputs");
    TORCH_CHECK(K % (f >= kQ4_K ? 256 : kBlock) == 0, what, ": run ", i, " cannot hold rows of ", K);
    n += rows;
    bytes += matrix_bytes(f, rows, K);
  }
  TORCH_CHECK(n == N && w.numel() == bytes, what, ": a mixed matrix's runs hold ", n, " outputs in ", bytes,
              " bytes; expected ", N, " outputs in ", w.numel(), " bytes");
  return {kMixed, w.data_ptr<uint8_t>(), N, K};
}

// The packed matrix `w` in `format` (kernels.FORMATS) with N outputs from K inputs, checked.
Mat matrix(const torch::Tensor& w, int64_t format, int64_t N, int64_t K, const char* what) {
  if (format == kBf16) {
    check_packed(w, K, N, what);
    return {kBf16, bf16_data(w), N, K};
  }
  if (format == kMixed) return mixed_matrix(w, N, K, what);
  TORCH_CHECK(format >= kQ8_0 && format <= kQ6_K, what, ": unknown matrix format ", format);
  const int64_t block = format >= kQ4_K ? 256 : kBlock;  // a K-quant's super-blocks (kquant.h)
  TORCH_CHECK(K % block == 0, what, ": a matrix in this format needs K a multiple of ", block, ", got ", K);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == matrix_bytes(format, N, K), what,
              ": expected its packed blocks as ", matrix_bytes(format, N, K), " contiguous uint8 (kernels.Matrix)");
  return {static_cast<int>(format), w.data_ptr<uint8_t>(), N, K};
}

// Storage for M activation rows of up to K values quantized for a quantized matrix (QuantRows).
struct QuantBuffer {
  torch::Tensor q, d, sums;
  QuantRows rows{};
  QuantBuffer(int64_t M, int64_t K)
      : q(torch::empty({M, K}, torch::kInt8)), d(torch::empty({M, K / kBlock}, torch::kFloat32)),
        sums(torch::empty({M, K / kBlock}, torch::kInt32)) {
    rows = {q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<int32_t>(), K, K / kBlock};
  }
};

// Y (M, N) = X (M, K) W^T [+ bias (N,)] [+ add (M, N)] on the threads the weight traffic calls for.
void run_matmul(const Mat& W, const float* X, int64_t M, float* Y, const float* add, const float* bias) {
  const bool quantized = W.format != kBf16;
  QuantBuffer xq(quantized ? M : 0, quantized ? W.K : 0);
  for (int64_t m = 0; quantized && m < M; ++m) quantize_row(X + m * W.K, W.K, xq.rows, m);
  const int64_t P = (W.N + 15) / 16;
  const int nt = static_cast<int>(std::min<int64_t>(threads(matrix_bytes(W), M), P));
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t q0 = P * tid / n, q1 = P * (tid + 1) / n;
    if (quantized)
      g_quant->matmul(xq.rows, M, W, Y, W.N, add, bias, q0, q1);
    else
      g_ops->matmul_panels(X, M, W.K, static_cast<const uint16_t*>(W.data), W.K, W.N, Y, W.N, add, bias, q0, q1);
  }
}

}  // namespace

const QuantOps* g_quant = has_avx512_vnni() ? &kQuantVnni : &kQuantAvx2;

std::string isa() { return g_ops->name; }

std::string quant_isa() { return g_quant->name; }

void set_isa(const std::string& name) {
  if (name == "avx2") {
    g_ops = &kAvx2;
    g_quant = &kQuantAvx2;
  } else if (name == "avx512") {
    TORCH_CHECK(has_avx512(), "this CPU has no AVX-512 (F, BW, DQ, VL): use SPECDEC_ISA=avx2");
    g_ops = &kAvx512;
    g_quant = has_avx512_vnni() ? &kQuantVnni : &kQuantAvx2;
  } else {
    TORCH_CHECK(false, "unknown instruction set '", name, "': use avx512 or avx2");
  }
}

// y = x (..., K) @ W^T for a packed W in `format` with N outputs [+ bias (N,)] [+ add, same shape as y], fp32.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t format, int64_t N, const torch::Tensor& add,
                     const torch::Tensor& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "linear: x must be float32");
  const auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = xs.size(0), K = xs.size(1);
  const Mat W = matrix(w, format, N, K, "linear");
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto y = torch::empty({M, N}, xs.options());
  const bool adding = add.numel() > 0;
  const auto as = adding ? add.reshape({M, N}).contiguous() : add;
  TORCH_CHECK(!adding || as.scalar_type() == torch::kFloat32, "linear: add must be float32");
  const bool biased = bias.numel() > 0;
  TORCH_CHECK(!biased || (bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() && bias.numel() == N),
              "linear: bias must be (N,) contiguous float32");
  run_matmul(W, xs.data_ptr<float>(), M, y.data_ptr<float>(), adding ? as.data_ptr<float>() : nullptr,
             biased ? bias.data_ptr<float>() : nullptr);
  return y.view(shape);
}

// The rows of x (M, K) quantized as the quantized kernels quantize them: (q int8 (M, K), d (M, K/32),
// sums (M, K/32) int32) — for the tests of kernels.quantize_rows.
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) % kBlock == 0,
              "quantize_rows: x must be (M, K) float32 with K a multiple of 32");
  const auto xs = x.contiguous();
  QuantBuffer out(xs.size(0), xs.size(1));
  for (int64_t m = 0; m < xs.size(0); ++m) quantize_row(xs.data_ptr<float>() + m * xs.size(1), xs.size(1), out.rows, m);
  return {out.q, out.d, out.sums};
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "rms_norm: x and w must be float32");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: w must have x's last dimension");
  const auto xs = x.contiguous();
  const auto ws = w.contiguous();
  const int64_t K = xs.size(-1), M = xs.numel() / K;
  auto y = torch::empty_like(xs);
  const float *X = xs.data_ptr<float>(), *Wt = ws.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) g_ops->rms_norm_row(X + m * K, Wt, static_cast<float>(eps), K, Y + m * K);
  return y;
}

// The fp32 FMA rate of this machine's cores (GFLOP/s) with `threads` threads over about
// `seconds`: independent accumulators in registers, no memory traffic — the compute roof the
// matrix kernels are measured against.
double fma_peak(int64_t threads_, double seconds) {
  const int nt = static_cast<int>(std::max<int64_t>(1, threads_));
  const int64_t reps = 1 << 16;
  double best = 0;
  for (int trial = 0; trial < 5; ++trial) {
    const auto t0 = std::chrono::steady_clock::now();
    int64_t rounds = 0;
    double elapsed = 0;
    while (elapsed < seconds / 5) {
      float sink = 0;
#pragma omp parallel num_threads(nt) reduction(+ : sink)
      sink += g_ops->fma_loop(reps);
      if (sink == 1.2345f) std::printf(" ");  // keep the loop's result alive
      ++rounds;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    best = std::max(best, rounds * reps * g_ops->fma_loop_flops * nt / elapsed / 1e9);
  }
  return best;
}

// A model's decoder layers (or an MTP head's one layer) with their matrices packed, run in one call.
struct Stack {
  std::vector<torch::Tensor> owned;  // keeps the weights alive
  std::vector<LayerWeights> layers;
  Shape shape;
  int64_t layer_bytes = 0;  // packed matrix bytes of one layer
  int64_t quantized_k = 0;  // the longest input of a quantized matrix (0: none)

  // layers: per layer its tensors by name (kernels.stack): norm1, qkv, qkv_bias, o, o_bias, norm2,
  // gate_up, gate_up_bias, down, down_bias, q_norm, k_norm; a bias or q/k norm may be empty (none).
  // formats: per layer the format of each matrix (qkv, o, gate_up, down; kernels.FORMATS).
  Stack(const std::vector<std::map<std::string, torch::Tensor>>& weights,
        const std::vector<std::map<std::string, int64_t>>& formats, const Shape& shape_) : shape(shape_) {
    const auto& s = shape;
    TORCH_CHECK(!weights.empty(), "Stack: no layers");
    TORCH_CHECK(formats.size() == weights.size(), "Stack: one map of formats per layer");
    TORCH_CHECK(s.D % 16 == 0 && s.H % s.Hkv == 0, "Stack: head_dim must be a multiple of 16 (kernels.cannot_stack)");
    TORCH_CHECK(s.R > 0 && s.R % 2 == 0 && s.R <= s.D, "Stack: rotated dims R must be even and at most head_dim");
    TORCH_CHECK(s.activation == 0 || s.activation == 1, "Stack: activation must be 0 (silu) or 1 (gelu_tanh)");
    const int64_t E = (s.H + 2 * s.Hkv) * s.D;
    auto floats = [&](const std::map<std::string, torch::Tensor>& layer, const char* name, int64_t n,
                      bool optional) -> const float* {
      const auto it = layer.find(name);
      TORCH_CHECK(it != layer.end(), "Stack: a layer has no '", name, "'");
      const auto& t = it->second;
      if (optional && t.numel() == 0) return nullptr;
      TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n, "Stack: ", name,
                  " must be contiguous float32 of size ", n);
      owned.push_back(t);
      return t.data_ptr<float>();
    };
    int64_t total_bytes = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      const auto& layer = weights[i];
      auto packed = [&](const char* name, int64_t K, int64_t N) -> Mat {
        const auto it = layer.find(name);
        const auto f = formats[i].find(name);
        TORCH_CHECK(it != layer.end() && f != formats[i].end(), "Stack: a layer has no '", name, "' or no format for it");
        owned.push_back(it->second);
        const Mat m = matrix(it->second, f->second, N, K, name);
        total_bytes += matrix_bytes(m);
        if (m.format != kBf16) quantized_k = std::max(quantized_k, K);
        return m;
      };
      LayerWeights L{floats(layer, "norm1", s.C, false), packed("qkv", s.C, E), floats(layer, "qkv_bias", E, true),
                     packed("o", s.H * s.D, s.C), floats(layer, "o_bias", s.C, true),
                     floats(layer, "norm2", s.C, false), packed("gate_up", s.C, 2 * s.F),
                     floats(layer, "gate_up_bias", 2 * s.F, true), packed("down", s.F, s.C),
                     floats(layer, "down_bias", s.C, true), floats(layer, "q_norm", s.D, true),
                     floats(layer, "k_norm", s.D, true)};
      TORCH_CHECK((L.q_norm == nullptr) == (L.k_norm == nullptr), "Stack: q_norm and k_norm come together");
      layers.push_back(L);
    }
    layer_bytes = total_bytes / static_cast<int64_t>(weights.size());
  }

  // x (B, T, C) the layer input; k_cache, v_cache (L', B, Hkv, S, D) with this stack's layers at
  // layer0..; lengths (B,) committed entries; positions (B, T) or empty (lengths[b] + t); tree
  // (B, T, T) bool or empty (causal).
  // Returns [x after the last layer, then x after each layer in `keep`]; the cache gains the new
  // entries at slots lengths[b] + t (the caller advances the lengths).
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                     int64_t layer0, const torch::Tensor& lengths, const torch::Tensor& positions,
                                     const torch::Tensor& inv_freq, const torch::Tensor& tree,
                                     const std::vector<int64_t>& keep) {
    const auto& s = shape;
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.size(2) == s.C, "Stack: x must be (B, T, C) float32");
    const int64_t B = x.size(0), T = x.size(1), M = B * T, nl = static_cast<int64_t>(layers.size());
    for (const auto* c : {&k_cache, &v_cache})
      TORCH_CHECK(c->scalar_type() == torch::kFloat32 && c->is_contiguous() && c->dim() == 5 && c->size(1) == B &&
                  c->size(2) == s.Hkv && c->size(4) == s.D && layer0 >= 0 && layer0 + nl <= c->size(0),
                  "Stack: caches must be contiguous (layers, B, Hkv, S, D) float32 holding this stack's layers");
    TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.is_contiguous() && lengths.numel() == B,
                "Stack: lengths must be (B,) int64");
    const bool given = positions.numel() > 0;
    TORCH_CHECK(!given || (positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == M),
                "Stack: positions must be (B, T) int64, or empty for each row's length + 0..T-1");
    TORCH_CHECK(inv_freq.scalar_type() == torch::kFloat32 && inv_freq.is_contiguous() && inv_freq.numel() == s.R / 2,
                "Stack: inv_freq must be (R/2,) float32");
    const bool treed = tree.numel() > 0;
    TORCH_CHECK(!treed || (tree.scalar_type() == torch::kBool && tree.is_contiguous() && tree.numel() == B * T * T),
                "Stack: tree must be (B, T, T) bool");
    const int64_t S = k_cache.size(3);
    const int64_t* len = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(len[b] >= 0 && len[b] + T <= S, "Stack: row ", b, " has ", len[b], " cached entries; ", T,
                  " more do not fit in the cache of ", S);
    for (int64_t l : keep) TORCH_CHECK(l >= 0 && l < nl, "Stack: kept layer ", l, " out of range");

    auto out = x.contiguous().clone();
    const auto opts = x.options();
    const int64_t E = (s.H + 2 * s.Hkv) * s.D;
    auto h = torch::empty({M, s.C}, opts), qkv = torch::empty({M, E}, opts), y = torch::empty({M, s.H * s.D}, opts);
    auto gu = torch::empty({M, 2 * s.F}, opts), act = torch::empty({M, s.F}, opts), rope = torch::empty({M, s.R}, opts);
    const int nt = threads(layer_bytes, M);
    const int64_t ps = (S + 15) / 16 * 16 + T;
    auto p = torch::empty({nt, ps}, opts);
    QuantBuffer xq(quantized_k ? M : 0, quantized_k);
    std::vector<torch::Tensor> result{out};
    std::vector<float*> kept(nl, nullptr);
    for (int64_t l : keep) {
      result.push_back(torch::empty({B, T, s.C}, opts));
      kept[l] = result.back().data_ptr<float>();
    }
    std::vector<Cache> caches;
    const int64_t per_layer = B * s.Hkv * S * s.D;
    for (int64_t l = 0; l < nl; ++l)
      caches.push_back({k_cache.data_ptr<float>() + (layer0 + l) * per_layer, v_cache.data_ptr<float>() + (layer0 + l) * per_layer, S});
    const Window w{B, T, len, given ? positions.data_ptr<int64_t>() : nullptr, treed ? tree.data_ptr<bool>() : nullptr,
                         inv_freq.data_ptr<float>()};
    const Scratch scratch{h.data_ptr<float>(), qkv.data_ptr<float>(), y.data_ptr<float>(), gu.data_ptr<float>(),
                          act.data_ptr<float>(), rope.data_ptr<float>(), p.data_ptr<float>(), ps, xq.rows};
#pragma omp parallel num_threads(nt)
    g_ops->decoder_layers(layers.data(), static_cast<int>(nl), s, w, caches.data(), out.data_ptr<float>(), kept.data(),
                          scratch);
    return result;
  }
};

// A drafter's whole step in one call (proposers/parallel.py, proposers/eagle.py): the embedding
// rows of `ids` (B, W) — for an EAGLE head fused with its previous output `prev` (B, W, C) as
// proj([RMSNorm(emb); RMSNorm(prev)]) — the decoder layers over them (Stack::forward, the cache
// gaining their entries), the final RMSNorm at `columns` (B, m) and the unembedding over a draft
// vocabulary `unembed` (packed, N rows whose target ids are `vocab_ids` (N,)), then each slot's
// argmax, the first on ties as numpy's. Returns [the argmax as target ids (B, m) int64, the logits
// (B, m, N) where `logits` is asked (else empty), the layers' output at the columns (B, m, C)].
// proj and unembed may be in any format (proj_format, unembed_format: kernels.FORMATS).
// Every number is the one the separate calls (embedding, rms_norm, linear, Stack) compute.
std::vector<torch::Tensor> draft_block(Stack& stack, const torch::Tensor& table, const torch::Tensor& ids,
                                       const torch::Tensor& prev, const torch::Tensor& embed_norm,
                                       const torch::Tensor& prev_norm, const torch::Tensor& proj, int64_t proj_format,
                                       const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                       const torch::Tensor& lengths, const torch::Tensor& positions,
                                       const torch::Tensor& inv_freq, const torch::Tensor& columns,
                                       const torch::Tensor& norm, double eps, const torch::Tensor& unembed,
                                       int64_t unembed_format, const torch::Tensor& vocab_ids, bool logits) {
  const int64_t C = stack.shape.C;
  TORCH_CHECK(table.scalar_type() == torch::kFloat32 && table.is_contiguous() && table.dim() == 2 && table.size(1) == C,
              "draft_block: the embedding must be (V, C) contiguous float32");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.is_contiguous() && ids.dim() == 2, "draft_block: ids must be (B, W) int64");
  TORCH_CHECK(columns.scalar_type() == torch::kInt64 && columns.is_contiguous() && columns.dim() == 2 &&
              columns.size(0) == ids.size(0), "draft_block: columns must be (B, m) int64");
  for (const auto* w : {&norm, &embed_norm, &prev_norm})
    TORCH_CHECK(w->numel() == 0 || (w->scalar_type() == torch::kFloat32 && w->is_contiguous() && w->numel() == C),
                "draft_block: norms must be (C,) float32");
  TORCH_CHECK(norm.numel() == C, "draft_block: the final norm is needed");
  TORCH_CHECK(vocab_ids.scalar_type() == torch::kInt64 && vocab_ids.is_contiguous() && vocab_ids.dim() == 1,
              "draft_block: vocab_ids must be (N,) int64");
  const int64_t B = ids.size(0), W = ids.size(1), m = columns.size(1), V = table.size(0), N = vocab_ids.numel();
  const int64_t M = B * W;
  const Mat U = matrix(unembed, unembed_format, N, C, "draft_block unembedding");
  const bool fused = prev.numel() > 0;
  if (fused) {
    TORCH_CHECK(prev.scalar_type() == torch::kFloat32 && prev.is_contiguous() && prev.numel() == M * C,
                "draft_block: prev must be (B, W, C) contiguous float32");
    TORCH_CHECK(embed_norm.numel() == C && prev_norm.numel() == C, "draft_block: prev needs both input norms");
  }
  const Mat Pj = fused ? matrix(proj, proj_format, C, 2 * C, "draft_block input projection") : Mat{};
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < V, "draft_block: token id ", id[i], " outside the embedding (", V, " rows)");
  const float* T = table.data_ptr<float>();
  auto x = torch::empty({B, W, C}, table.options());
  float* X = x.data_ptr<float>();
  if (!fused) {
    for (int64_t i = 0; i < M; ++i) std::memcpy(X + i * C, T + id[i] * C, C * sizeof(float));
  } else {  // [RMSNorm(emb); RMSNorm(prev)] (M, 2C), then the projection to C
    auto both = torch::empty({M, 2 * C}, table.options());
    float* Z = both.data_ptr<float>();
    const float* Pv = prev.data_ptr<float>();
    for (int64_t i = 0; i < M; ++i) {
      g_ops->rms_norm_row(T + id[i] * C, embed_norm.data_ptr<float>(), static_cast<float>(eps), C, Z + i * 2 * C);
      g_ops->rms_norm_row(Pv + i * C, prev_norm.data_ptr<float>(), static_cast<float>(eps), C, Z + i * 2 * C + C);
    }
    run_matmul(Pj, Z, M, X, nullptr, nullptr);
  }
  const auto out = stack.forward(x, k_cache, v_cache, 0, lengths, positions, inv_freq,
                                 torch::empty({0}, ids.options().dtype(torch::kBool)), {})[0];
  const int64_t* col = columns.data_ptr<int64_t>();
  auto picked = torch::empty({B, m, C}, table.options()), h = torch::empty({B * m, C}, table.options());
  const float* O = out.data_ptr<float>();
  float *Pk = picked.data_ptr<float>(), *Hn = h.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < m; ++j) {
      const int64_t c = col[b * m + j], r = b * m + j;
      TORCH_CHECK(c >= 0 && c < W, "draft_block: column ", c, " outside the window of ", W);
      std::memcpy(Pk + r * C, O + (b * W + c) * C, C * sizeof(float));
      g_ops->rms_norm_row(Pk + r * C, norm.data_ptr<float>(), static_cast<float>(eps), C, Hn + r * C);
    }
  auto y = torch::empty({B * m, N}, table.options());
  float* Y = y.data_ptr<float>();
  run_matmul(U, Hn, B * m, Y, nullptr, nullptr);
  auto tokens = torch::empty({B, m}, ids.options());
  int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* vid = vocab_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < B * m; ++r) {
    const float* row = Y + r * N;
    int64_t best = 0;
    for (int64_t n = 1; n < N; ++n)
      if (row[n] > row[best]) best = n;
    tok[r] = vid[best];
  }
  return {tokens, logits ? y.view({B, m, N}) : torch::empty({0}, table.options()), picked};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set the kernels run on: avx512 or avx2");
  m.def("quant_isa", &quant_isa, "the instruction set the quantized kernels run on: avx512_vnni or avx2");
  m.def("set_isa", &set_isa, "run on avx512 or avx2 (same results; for tests and measurements)");
  m.def("linear", &linear, "x (..., K) fp32 times a packed matrix (format) with N outputs, transposed [+ bias] [+ add]");
  m.def("quantize_rows", &quantize_rows, "x (M, K) quantized per block of 32 as the quantized kernels do: q, d, sums");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, fp32");
  m.def("fma_peak", &fma_peak, "measured fp32 FMA GFLOP/s with N threads (the compute roof)");
  pybind11::class_<Shape>(m, "Shape")
      .def(pybind11::init<>())
      .def_readwrite("C", &Shape::C)
      .def_readwrite("H", &Shape::H)
      .def_readwrite("Hkv", &Shape::Hkv)
      .def_readwrite("D", &Shape::D)
      .def_readwrite("F", &Shape::F)
      .def_readwrite("R", &Shape::R)
      .def_readwrite("eps", &Shape::eps)
      .def_readwrite("rotary_factor", &Shape::rotary_factor)
      .def_readwrite("activation", &Shape::activation);
  m.def("set_fixed_threads", [](int64_t n) { thread_policy::g_fixed = static_cast<int>(n); },
        "run every call on N threads (0: auto, the cores other processes leave free)");
  m.def("thread_state", [] {
    return std::make_tuple(thread_policy::g_fixed.load(), thread_policy::g_chosen.load(),
                           thread_policy::g_others.load(), thread_policy::cores());
  }, "(fixed threads or 0, threads auto chose last or 0, cores others used over the last window or -1, cores)");
  pybind11::class_<Stack>(m, "Stack")
      .def(pybind11::init<const std::vector<std::map<std::string, torch::Tensor>>&,
                          const std::vector<std::map<std::string, int64_t>>&, const Shape&>())
      .def("forward", &Stack::forward, "the decoder layers over a window of new tokens, with a KV cache");
  m.def("draft_block", &draft_block, "a drafter's step in one call: embedding, the Stack, the final norm at the "
        "block's columns, the draft-vocabulary unembedding and each slot's argmax");
}
