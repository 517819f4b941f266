// The vector types the kernels are written over (isa.h, quant.h), one set per instruction set, each
// compiled for its own target: V, 16 fp32 lanes (one zmm for AVX-512, two ymm for AVX2 + FMA), and
// VI, the quantized kernels' 16 int32 lanes with the integer steps of a block's dot product (AVX-512
// VNNI's vpdpbusd, or AVX2's vpmaddubsw). Every operation of V is the same IEEE operation lane by
// lane on both, so results are bit-identical (cpu.cpp's arithmetic contract); VI's sums are exact.
// Included once by cpu.cpp at file scope, after its intrinsics headers.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

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
      v[m] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0x44),
                           _mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0xEE));
    // fold 1: element 4q + e is sum 4e + q; put sum j at element j
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, s));
  }
};
}  // namespace avx512
#pragma GCC pop_options

// --------------------------------------------------------------------- AVX-512 VNNI (quantized)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")
namespace avx512_vnni {
using avx512::V;
constexpr int kRegs = 32, kRegsPerV = 1;

struct VI {  // 16 int32 lanes; 64 bytes of codes hold 4 bytes (4 consecutive k) per lane
  __m512i v;
  using Raw = __m512i;
  using Wide = __m512i;
  using Sum = __m512i;                      // a block's nibble products: int32 lanes
  static constexpr int kWideOffset = 128;  // dot_wide sums u q for the stored u = w + 128
  static VI zero() { return {_mm512_setzero_si512()}; }
  static Raw load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Raw low_nibbles(Raw a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x0F)); }
  static Raw high_nibbles(Raw a) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0F)); }
  // bits 2i, 2i+1 of each byte of a as bits 4, 5, the others 0 (Q6_K's high bits above their nibble, kquant.h): one
  // shift of the 16-bit lanes (what crosses a byte lands outside bits 4, 5) and a mask
  static Raw bit_pair(Raw a, int i) {
    return _mm512_and_si512(i < 3 ? _mm512_slli_epi16(a, 4 - 2 * i) : _mm512_srli_epi16(a, 2), _mm512_set1_epi8(0x30));
  }
  // (a & m) | b for b without bits in the byte mask m: one ternary-logic op
  static Raw masked_or(Raw a, uint8_t m, Raw b) {
    return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi8(static_cast<char>(m)), 0xEC);
  }
  static Raw mask(Raw a, uint8_t m) { return _mm512_and_si512(a, _mm512_set1_epi8(static_cast<char>(m))); }  // a & m
  // each byte i (0-15) of a as table[i] (IQ4's levels, quant.h)
  static Raw lookup(Raw a, const uint8_t* table) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), a);
  }
  // Q5_0's fifth bits (quant.h): the bytes of a shifted by n, then bit 4 of b's bytes or-ed into a's
  static Raw shift_left(Raw a, int n) { return _mm512_slli_epi16(a, n); }
  static Raw shift_right(Raw a, int n) { return _mm512_srli_epi16(a, n); }
  static Raw put_bit4(Raw a, Raw b) { return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi8(0x10), 0xF8); }  // a | b & c
  static constexpr int kFifthLoads = 4;  // Sum's int32 lanes hold a whole block's Q5_0 products
  static Wide wide(Raw a) { return a; }
  static int32_t quad(const int8_t* p) {
    int32_t q;
    std::memcpy(&q, p, 4);
    return q;
  }
  // lane n += sum over its 4 bytes u (unsigned) times the 4 signed bytes of x4
  static Sum sum_zero() { return _mm512_setzero_si512(); }
  static Sum dot_nibbles(Sum acc, Raw u, int32_t x4) { return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(x4)); }
  static VI finish(Sum a) { return {a}; }
  static VI dot(VI acc, Raw u, int32_t x4) { return {dot_nibbles(acc.v, u, x4)}; }  // int32 sums (kquant.h)
  static VI dot_wide(VI acc, Wide u, int32_t x4) { return {dot_nibbles(acc.v, u, x4)}; }
  static VI sub(VI a, int32_t c) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(c))}; }
  static VI add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
  static V to_float(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
  static VI mul(VI a, VI b) { return {_mm512_mullo_epi32(a.v, b.v)}; }  // int32 products (kquant.h: exact)
  static VI lanes(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
  // each int32 lane of a shifted right by `shift`, and-ed with `mask`
  static Raw field(Raw a, int shift, int32_t mask) {
    return _mm512_and_si512(_mm512_srli_epi32(a, shift), _mm512_set1_epi32(mask));
  }
  static VI byte(Raw a, int at) { return {field(a, 8 * at, 0xFF)}; }    // byte `at` of each int32 lane
  static VI nibble(Raw a, int at) { return {field(a, 4 * at, 0xF)}; }  // nibble `at` (0-7) of each int32 lane
  // int16 lanes: bytes `at` and `at` + 2 of each int32 lane
  static Raw pairs(Raw a, int at) { return field(a, 8 * at, 0x00FF00FF); }
  // acc + the int16 pairs of a times those of `pair` (low by low, high by high), summed per int32 lane
  static VI madd(VI acc, Raw a, int32_t pair) { return {_mm512_dpwssd_epi32(acc.v, a, _mm512_set1_epi32(pair))}; }
  // The largest |x| of the 32 floats a, b as its bit pattern: integers order non-negative floats as
  // floats do, and put inf, then NaN, above every finite value.
  static int32_t max_abs_bits(V a, V b) {
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
    return _mm512_reduce_max_epi32(_mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(a.v), mask),
                                                    _mm512_and_si512(_mm512_castps_si512(b.v), mask)));
  }
  // q[0..15] = a rounded half to even (the MXCSR's default), |a| < 127.5; returns their sum
  static int32_t to_int8(V a, int8_t* q) {
    const __m512i i = _mm512_cvtps_epi32(a.v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(i));
    return _mm512_reduce_add_epi32(i);
  }
};
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
  // A block's nibble products in int16 lanes, two per output: each of a block's 8 maddubs adds
  // two products u x (u <= 15, |x| <= 127) to a lane, so a lane holds at most 16 x 15 x 127 =
  // 30480 < 2^15 in magnitude: exact, one madd per block instead of one per maddubs.
  struct Sum {
    __m256i lo, hi;
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
  static __m256i pair(__m256i a, int i) {
    return _mm256_and_si256(i < 3 ? _mm256_slli_epi16(a, 4 - 2 * i) : _mm256_srli_epi16(a, 2), _mm256_set1_epi8(0x30));
  }
  static Raw bit_pair(Raw a, int i) { return {pair(a.lo, i), pair(a.hi, i)}; }  // as AVX-512's
  static Raw masked_or(Raw a, uint8_t m, Raw b) {  // as AVX-512's
    const Raw am = mask(a, m);
    return {_mm256_or_si256(am.lo, b.lo), _mm256_or_si256(am.hi, b.hi)};
  }
  static Raw mask(Raw a, uint8_t m) {  // as AVX-512's
    const __m256i v = _mm256_set1_epi8(static_cast<char>(m));
    return {_mm256_and_si256(a.lo, v), _mm256_and_si256(a.hi, v)};
  }
  static Raw lookup(Raw a, const uint8_t* table) {  // as AVX-512's
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
    return {_mm256_shuffle_epi8(t, a.lo), _mm256_shuffle_epi8(t, a.hi)};
  }
  static Raw shift_left(Raw a, int n) { return {_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)}; }  // as AVX-512's
  static Raw shift_right(Raw a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
  static Raw put_bit4(Raw a, Raw b) {
    const __m256i bit = _mm256_set1_epi8(0x10);
    return {_mm256_or_si256(a.lo, _mm256_and_si256(b.lo, bit)), _mm256_or_si256(a.hi, _mm256_and_si256(b.hi, bit))};
  }
  // Q5_0's codes reach 31: the int16 lanes of a Sum hold the products of two loads of them (8 per
  // lane, at most 8 x 31 x 127 = 31496 < 2^15), so quant.h widens a Q5_0 block's sums twice
  static constexpr int kFifthLoads = 2;
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
  static Sum sum_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static Sum dot_nibbles(Sum acc, Raw u, int32_t x4) {  // u <= 15
    const __m256i x = _mm256_set1_epi32(x4);
    return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(u.lo, x)),
            _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(u.hi, x))};
  }
  static VI finish(Sum a) {
    const __m256i one = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(a.lo, one), _mm256_madd_epi16(a.hi, one)};
  }
  // 8 lanes += the sums of 4 products u x (u unsigned, x signed, each pair's sum below 2^15: no
  // saturation; two pairs may reach 2 x 32512, so Q8_0 widens to int32 after every maddubs)
  static __m256i dot8(__m256i acc, __m256i u, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
  }
  static VI dot(VI acc, Raw u, int32_t x4) {  // int32 sums, widened after every maddubs (kquant.h: u <= 63)
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
  static VI add(VI a, VI b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
  static V to_float(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
  static VI mul(VI a, VI b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }  // as AVX-512's
  static VI lanes(const int32_t* p) {
    const Raw a = load(reinterpret_cast<const uint8_t*>(p));
    return {a.lo, a.hi};
  }
  static Raw field(Raw a, int shift, int32_t mask) {  // as AVX-512's
    const __m256i m = _mm256_set1_epi32(mask);
    return {_mm256_and_si256(_mm256_srli_epi32(a.lo, shift), m), _mm256_and_si256(_mm256_srli_epi32(a.hi, shift), m)};
  }
  static VI byte(Raw a, int at) {  // as AVX-512's
    const Raw f = field(a, 8 * at, 0xFF);
    return {f.lo, f.hi};
  }
  static VI nibble(Raw a, int at) {  // as AVX-512's
    const Raw f = field(a, 4 * at, 0xF);
    return {f.lo, f.hi};
  }
  static Raw pairs(Raw a, int at) { return field(a, 8 * at, 0x00FF00FF); }  // as AVX-512's
  static VI madd(VI acc, Raw a, int32_t pair) {  // as AVX-512's
    const __m256i p = _mm256_set1_epi32(pair);
    return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, p)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, p))};
  }
  static int32_t imax8(__m256i a) {
    __m128i b = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    b = _mm_max_epi32(b, _mm_shuffle_epi32(b, 0x4E));
    return _mm_cvtsi128_si32(_mm_max_epi32(b, _mm_shuffle_epi32(b, 0xB1)));
  }
  static int32_t isum8(__m256i a) {
    __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(b, _mm_shuffle_epi32(b, 0xB1)));
  }
  // The largest |x| of the 32 floats a, b as its bit pattern: integers order non-negative floats as
  // floats do, and put inf, then NaN, above every finite value.
  static int32_t max_abs_bits(V a, V b) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    auto bits = [&](__m256 v) { return _mm256_castps_si256(_mm256_and_ps(v, mask)); };
    return imax8(_mm256_max_epi32(_mm256_max_epi32(bits(a.lo), bits(a.hi)), _mm256_max_epi32(bits(b.lo), bits(b.hi))));
  }
  // q[0..15] = a rounded half to even (the MXCSR's default), |a| < 127.5; returns their sum
  static int32_t to_int8(V a, int8_t* q) {
    const __m256i i0 = _mm256_cvtps_epi32(a.lo), i1 = _mm256_cvtps_epi32(a.hi);
    const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(i0), _mm256_extracti128_si256(i0, 1));
    const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(i1), _mm256_extracti128_si256(i1, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(w0, w1));
    return isum8(_mm256_add_epi32(i0, i1));
  }
};
}  // namespace avx2
#pragma GCC pop_options
