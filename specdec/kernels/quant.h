// Matrices stored in blocks of 32 quantized weights along K (llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), times
// activation rows quantized per block to int8: written once over the 16-lane vectors V and VI of
// the including namespace (vectors.h: AVX-512 VNNI, AVX2) and included by cpu.cpp for each; the
// plain structs (Mat, QuantRows) from types.h; store_tile from isa.h.
//
// The arithmetic (what makes a row's result independent of everything but that row and the
// matrix, and identical on both instruction sets): row m's block b of 32 inputs is quantized to
// q[m][k] = round_half_even(x[m][k] / dx) in [-127, 127], dx = max|x| / 127 (quantize_row).
// Output n of row m is the fp32 sum over blocks b = 0.. in order of
//   Q8_0, Q4_0, Q5_0, IQ4_NL:  (d[n][b] * dx[m][b]) * float(s)          s = sum_k w[n][k] q[m][k]
//   Q4_1, Q5_1:        (d[n][b] * dx[m][b]) * float(s) + (mn[n][b] * dx[m][b]) * float(sum_k q[m][k])
// one mul and one add at a time (no FMA), starting from 0; w is the signed weight (Q8_0: int8,
// Q4_0: 4-bit code - 8, Q5_0: 5-bit code - 16, IQ4_NL: the level kIq4Levels[code] - 128 of its 4-bit code)
// or the 4- or 5-bit code (Q4_1, Q5_1). s is an exact integer
// whatever order or instructions compute it, so only the fp32 steps above, the same everywhere,
// shape the result (a Q5_0 matrix gives the bits of the Q8_0 matrix of the same w and d).
// The kernels compute s as sum_k u q - o sum_k q from the stored unsigned codes u = w + o.
//
// Packed layout of a matrix (N, K): panels of 16 outputs (zero past N); panel p is K/32 blocks of
// kPanelBlockBytes[format] bytes: 16 fp16 scales d, [Q4_1, Q5_1: 16 fp16 mins mn,] then the codes, 64 bytes
// per vector load where lane n (4 bytes) holds 4 consecutive k of output n:
//   Q8_0: 8 loads, load j = k 4j..4j+3 of the block, u = w + 128
//   Q4_x: 4 loads, load i: low nibbles k 4i..4i+3, high nibbles k 16+4i..16+4i+3
//   Q5_0: Q4_x's 4 loads of the codes' low 4 bits, then one load of their fifth bits: lane n byte t
//         holding in bit i that of k 4i+t and in bit 4+i that of k 16+4i+t (a shift, a mask and an
//         or join it to nibble load i: VI::put_bit4) -- 22 bytes per 32 weights, as the file has them
//   Q5_1: as Q5_0 (24 bytes per 32 weights, with the mins)
//   IQ4_NL: as Q4_x; each nibble load's codes looked up in the levels (+128, unsigned: VI::lookup), then
//         summed as Q8_0's bytes (18 bytes per 32 weights, as the file has them)
//
// A tile is R rows x NB panels: each block's codes are loaded and unpacked once per tile and serve
// its R rows; a row's 4 activation bytes are broadcast once and serve its NB panels. On AVX2 a Q4
// block's products are summed in int16 lanes and widened once per block (vectors.h: VI::Sum), a
// Q5_0 or Q5_1 block's twice (VI::kFifthLoads).

// IQ4_NL's (and IQ4_XS's, kquant.h) 16 levels, each + 128: the unsigned bytes Q8_0's dot products take
alignas(16) constexpr uint8_t kIq4Levels[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                129, 141, 153, 166, 181, 197, 217, 241};

constexpr bool has_mins(int F) { return F == kQ4_1 || F == kQ5_1; }   // Q4_1's and Q5_1's mn
constexpr bool has_fifth(int F) { return F == kQ5_0 || F == kQ5_1; }  // codes of 5 bits
constexpr int panel_header(int F) { return has_mins(F) ? 64 : 32; }  // bytes of scales (and mins) per panel block

// n values x (a block of 32, or a super-block of 256) quantized with one scale dx = max|x| / 127 to
// q = round_half_even(x (1 / dx)) (0 where dx is 0), as kernels/blocks.py's quantize_rows; returns dx and
// puts the sum of q of each 16 values in sums16. A block whose largest magnitude is below 2^-64 is first
// scaled by 2^64 (exact), so that 1 / dx neither overflows nor comes from a denormal: its q are
// round_half_even((2^64 x) (1 / ((2^64 max|x|) / 127))) and its dx stays max|x| / 127. Where dx is a normal
// float the scaling cancels exactly: the q are those of the unscaled formula. Every 1 / dx is thus that of a
// normal float, |x (1 / dx)| <= 127 (1 + 2^-22) rounds to at most 127, and q needs no clamp. A block holding
// inf or NaN gets q = 0 and dx = NaN, so its row's outputs are NaN, as fp32 arithmetic would make them.
inline float quantize_block(const float* x, int64_t n, int8_t* q, int32_t* sums16) {
  int32_t top = 0;
  for (int64_t i = 0; i < n; i += kBlock) top = std::max(top, VI::max_abs_bits(V::load(x + i), V::load(x + i + kLanes)));
  const bool finite = top < 0x7F800000;
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  const float d = finite ? amax / 127.f : NAN;
  if (finite && d != 0.f) {
    const float scale = amax < 0x1p-64f ? 0x1p64f : 1.f;
    const V s = V::bcast(scale), inv = V::bcast(1.f / (amax * scale / 127.f));
    for (int64_t i = 0; i < n; i += kLanes) sums16[i / kLanes] = VI::to_int8(V::mul(V::mul(V::load(x + i), s), inv), q + i);
  } else {
    std::memset(q, 0, n);
    std::fill(sums16, sums16 + n / kLanes, 0);
  }
  return d;
}

// Row m of `rows` from x (K values) in `kinds` (types.h): per block of 32 (kPer32; K a multiple of 32) and
// per super-block of 256 (kPer256; K a multiple of 256), each block as quantize_block.
inline void quantize_row(const float* x, int64_t K, const QuantRows& rows, int64_t m, int kinds) {
  int32_t sums[kSuper / kLanes];
  for (int64_t b = 0; (kinds & kPer32) && b < K / kBlock; ++b) {
    rows.d[m * rows.blocks + b] = quantize_block(x + b * kBlock, kBlock, rows.q + m * rows.ld + b * kBlock, sums);
    rows.sums[m * rows.blocks + b] = sums[0] + sums[1];
  }
  for (int64_t u = 0; (kinds & kPer256) && u < K / kSuper; ++u) {
    rows.kd[m * rows.supers + u] = quantize_block(x + u * kSuper, kSuper, rows.kq + m * rows.ld + u * kSuper, sums);
    for (int i = 0; i < 16; ++i) rows.k16[2 * m * rows.blocks + 16 * u + i] = static_cast<int16_t>(sums[i]);
    for (int c = 0; c < 8; ++c) rows.k32[m * rows.blocks + 8 * u + c] = static_cast<int16_t>(sums[2 * c] + sums[2 * c + 1]);
  }
}

// The exact integer sums s[r][j] of one block: rows xq[0..R-1] (their 32 int8 of this block) against
// the codes at codes[j] (Q8_0's 8 loads of bytes; IQ4_NL's, and kquant.h's IQ4_XS's, 4 loads of nibbles
// standing for their levels; or 4 loads of nibbles: Q4_0, Q4_1, kquant.h's Q4_K;
// Q5_0's and Q5_1's, and kquant.h's Q5_K's, joined to their fifth bits).
template <int F, int R, int NB>
inline void qsums(const uint8_t* const (&codes)[NB], const int8_t* const (&xq)[R], VI (&s)[R][NB]) {
  if constexpr (F == kQ8_0) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) s[r][j] = VI::zero();
    for (int i = 0; i < 8; ++i) {
      typename VI::Wide w[NB];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = codes[j] + i * 64;
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch * 64, _MM_HINT_T0);
        w[j] = VI::wide(VI::load(p));
      }
      for (int r = 0; r < R; ++r) {
        const int32_t x4 = VI::quad(xq[r] + 4 * i);
        for (int j = 0; j < NB; ++j) s[r][j] = VI::dot_wide(s[r][j], w[j], x4);
      }
    }
  } else if constexpr (F == kIQ4_NL) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) s[r][j] = VI::zero();
    for (int i = 0; i < 4; ++i) {
      typename VI::Wide lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = codes[j] + i * 64;
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch * 64, _MM_HINT_T0);
        const auto v = VI::load(p);
        lo[j] = VI::wide(VI::lookup(VI::low_nibbles(v), kIq4Levels));
        hi[j] = VI::wide(VI::lookup(VI::high_nibbles(v), kIq4Levels));
      }
      for (int r = 0; r < R; ++r) {
        const int32_t xlo = VI::quad(xq[r] + 4 * i), xhi = VI::quad(xq[r] + 16 + 4 * i);
        for (int j = 0; j < NB; ++j) s[r][j] = VI::dot_wide(VI::dot_wide(s[r][j], lo[j], xlo), hi[j], xhi);
      }
    }
  } else {
    // loads whose products a Sum lane holds: a 5-bit code is up to 31 (AVX2's int16: two loads)
    constexpr int every = has_fifth(F) ? VI::kFifthLoads : 4;
    typename VI::Sum t[R][NB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) t[r][j] = VI::sum_zero();
    auto load = [&](int i) __attribute__((always_inline)) {  // load i: its codes' products into t
      typename VI::Raw lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = codes[j] + i * 64;
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch * 64, _MM_HINT_T0);
        const auto v = VI::load(p);
        lo[j] = VI::low_nibbles(v);
        hi[j] = VI::high_nibbles(v);
        if constexpr (has_fifth(F)) {  // bit i of a fifth-bits byte to bit 4 of the low nibble, bit 4 + i of the high
          const uint8_t* fifth = codes[j] + 256;
          if (i == 0) _mm_prefetch(reinterpret_cast<const char*>(fifth) + kPrefetch * 64, _MM_HINT_T0);
          const auto bits = VI::load(fifth);
          lo[j] = VI::put_bit4(lo[j], VI::shift_left(bits, 4 - i));
          hi[j] = VI::put_bit4(hi[j], VI::shift_right(bits, i));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int32_t xlo = VI::quad(xq[r] + 4 * i), xhi = VI::quad(xq[r] + 16 + 4 * i);
        for (int j = 0; j < NB; ++j) t[r][j] = VI::dot_nibbles(VI::dot_nibbles(t[r][j], lo[j], xlo), hi[j], xhi);
      }
      if constexpr (every < 4) {
        if ((i + 1) % every == 0)
          for (int r = 0; r < R; ++r)
            for (int j = 0; j < NB; ++j) {
              s[r][j] = i + 1 == every ? VI::finish(t[r][j]) : VI::add(s[r][j], VI::finish(t[r][j]));
              t[r][j] = VI::sum_zero();
            }
      }
    };
    if constexpr (has_fifth(F)) {
#pragma GCC unroll 4  // constant shifts (measured: a third faster in cache on AVX2, a sixth on AVX-512)
      for (int i = 0; i < 4; ++i) load(i);
    } else {
#pragma GCC unroll 1  // unrolled, GCC reassociates the int16 sums and spills every product
      for (int i = 0; i < 4; ++i) load(i);
    }
    if constexpr (every == 4)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NB; ++j) s[r][j] = VI::finish(t[r][j]);
  }
}

// acc[r][j] += block b's fp32 term (see the top) for rows r0.. and the panels whose headers (scales,
// Q4_1's and Q5_1's mins) are at block + j stride.
template <int F, int R, int NB>
inline void qterms(const uint8_t* block, int64_t stride, const QuantRows& x, int64_t r0, int64_t b,
                   const VI (&s)[R][NB], V (&acc)[R][NB]) {
  // s = sum u q - o sum q
  constexpr int offset = F == kQ8_0 || F == kIQ4_NL ? VI::kWideOffset : F == kQ4_0 ? 8 : F == kQ5_0 ? 16 : 0;
  for (int j = 0; j < NB; ++j) {
    const uint8_t* head = block + j * stride;
    const V d = V::load_f16(reinterpret_cast<const uint16_t*>(head));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.blocks + b;
      const V dx = V::bcast(x.d[at]);
      const int32_t qsum = x.sums[at];
      if constexpr (has_mins(F)) {
        const V mn = V::load_f16(reinterpret_cast<const uint16_t*>(head + 32));
        const V part = V::add(V::mul(V::mul(d, dx), VI::to_float(s[r][j])),
                              V::mul(V::mul(mn, dx), V::bcast(static_cast<float>(qsum))));
        acc[r][j] = V::add(acc[r][j], part);
      } else {
        const VI exact = offset ? VI::sub(s[r][j], offset * qsum) : s[r][j];
        acc[r][j] = V::add(acc[r][j], V::mul(V::mul(d, dx), VI::to_float(exact)));
      }
    }
  }
}

// Rows r0..r0+R-1 (quantized) against panels p0..p0+NB-1 of a matrix in format F.
template <int F, int R, int NB>
inline void qtile(const QuantRows& x, const uint8_t* W, int64_t nblocks, int64_t p0, int64_t r0, float* Y,
                  int64_t ldy, int64_t N, const float* add, const float* bias) {
  constexpr int64_t PB = kPanelBlockBytes[F];
  const int64_t stride = nblocks * PB;  // bytes of one panel
  V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = V::zero();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* block = W + p0 * stride + b * PB;
    const int8_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.q + (r0 + r) * x.ld + b * kBlock;
    const uint8_t* codes[NB];
    for (int j = 0; j < NB; ++j) codes[j] = block + j * stride + panel_header(F);
    VI s[R][NB];
    qsums<F, R, NB>(codes, xq, s);
    qterms<F, R, NB>(block, stride, x, r0, b, s, acc);
  }
  store_tile<R, NB>(acc, p0, r0, Y, ldy, N, add, bias);
}

// Tile shapes, measured (SmolLM2-135M's matrices, one thread): one panel per tile, whose codes stream
// through the cache once per tile (on AVX-512 four panels at a time read a matrix that does not fit in
// L2 slower at 1 and 4 rows); rows per tile as many as the registers hold the int sums of:
// AVX2's 16 the int16 sums of 4 rows (two registers each) beside the panel's codes, AVX-512's 32 those of 8.
// The fp32 sums, touched once per block, may live in L1.
constexpr int kMaxQRows = kRegs >= 32 ? 8 : 4;
constexpr int qpanels_for(int) { return 1; }

template <int F, int R, int NB>
inline void qtile_nb(int nb, const QuantRows& x, const uint8_t* W, int64_t nblocks, int64_t p0, int64_t r0, float* Y,
                     int64_t ldy, int64_t N, const float* add, const float* bias) {
  if constexpr (NB >= 1) {
    if (nb == NB) return qtile<F, R, NB>(x, W, nblocks, p0, r0, Y, ldy, N, add, bias);
    return qtile_nb<F, R, NB - 1>(nb, x, W, nblocks, p0, r0, Y, ldy, N, add, bias);
  }
}

// A tile of `rows` rows (1..R) and `nb` panels (1..qpanels_for(rows)).
template <int F, int R>
inline void qtile_rows(int rows, int nb, const QuantRows& x, const uint8_t* W, int64_t nblocks, int64_t p0,
                       int64_t r0, float* Y, int64_t ldy, int64_t N, const float* add, const float* bias) {
  if constexpr (R >= 1) {
    if (rows == R) return qtile_nb<F, R, qpanels_for(R)>(nb, x, W, nblocks, p0, r0, Y, ldy, N, add, bias);
    return qtile_rows<F, R - 1>(rows, nb, x, W, nblocks, p0, r0, Y, ldy, N, add, bias);
  }
}

// Y (M, N) = the quantized product of x's M rows and the panels [q0, q1) of W [+ bias] [+ add].
template <int F>
inline void qmatmul_format(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                           const float* bias, int64_t q0, int64_t q1) {
  if (M == 0) return;
  const int64_t blocks = (M + kMaxQRows - 1) / kMaxQRows, rows = (M + blocks - 1) / blocks;
  const int G = qpanels_for(static_cast<int>(rows));
  const uint8_t* data = static_cast<const uint8_t*>(W.data);
  const int64_t nblocks = W.K / kBlock;
  for (int64_t p = q0; p < q1; p += G) {
    const int nb = static_cast<int>(std::min<int64_t>(G, q1 - p));
    for (int64_t r0 = 0; r0 < M; r0 += rows)
      qtile_rows<F, kMaxQRows>(static_cast<int>(std::min<int64_t>(rows, M - r0)), nb, x, data, nblocks, p, r0, Y, ldy,
                               W.N, add, bias);
  }
}

inline void qmatmul_panels(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                           const float* bias, int64_t q0, int64_t q1) {
  switch (W.format) {
    case kQ8_0: return qmatmul_format<kQ8_0>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kQ4_0: return qmatmul_format<kQ4_0>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kQ5_0: return qmatmul_format<kQ5_0>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kQ5_1: return qmatmul_format<kQ5_1>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kIQ4_NL: return qmatmul_format<kIQ4_NL>(x, M, W, Y, ldy, add, bias, q0, q1);
    default: return qmatmul_format<kQ4_1>(x, M, W, Y, ldy, add, bias, q0, q1);
  }
}
