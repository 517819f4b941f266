// Matrices stored in blocks of 32 quantized weights along K (llama.cpp's Q8_0, Q4_0, Q4_1), times
// activation rows quantized per block to int8: written once over a 16-lane int32 vector `VI` and
// included by cpu.cpp for AVX-512 VNNI and for AVX2.
//
// The arithmetic (what makes a row's result independent of everything but that row and the
// matrix, and identical on both instruction sets): row m's block b of 32 inputs is quantized to
// q[m][k] = round_half_even(x[m][k] / dx) in [-127, 127], dx = max|x| / 127 (quantize_row in
// cpu.cpp, scalar and shared). Output n of row m is the fp32 sum over blocks b = 0.. in order of
//   Q8_0, Q4_0:  (d[n][b] * dx[m][b]) * float(s)                        s = sum_k w[n][k] q[m][k]
//   Q4_1:        (d[n][b] * dx[m][b]) * float(s) + (mn[n][b] * dx[m][b]) * float(sum_k q[m][k])
// one mul and one add at a time (no FMA), starting from 0; w is the signed weight (Q8_0: int8,
// Q4_0: 4-bit code - 8) or the 4-bit code (Q4_1). s is an exact integer whatever order or
// instructions compute it, so only the fp32 steps above, the same everywhere, shape the result.
// The kernels compute s as sum_k u q - o sum_k q from the stored unsigned codes u = w + o.
//
// Packed layout of a matrix (N, K): panels of 16 outputs (zero past N); panel p is K/32 blocks of
// kBlockBytes[format] bytes: 16 fp16 scales d, [Q4_1: 16 fp16 mins mn,] then the codes, 64 bytes
// per vector load where lane n (4 bytes) holds 4 consecutive k of output n:
//   Q8_0: 8 loads, load j = k 4j..4j+3 of the block, u = w + 128
//   Q4_x: 4 loads, load i: low nibbles k 4i..4i+3, high nibbles k 16+4i..16+4i+3
// Expects, defined before inclusion: V, VI (see cpu.cpp), kLanes, store_part, kRegs, kRegsPerV.

constexpr int kPanelHeader[4] = {0, 32, 32, 64};  // bytes of scales (and mins) per panel block

// Rows r0..r0+R-1 (quantized) against panels p0..p0+NB-1 of a matrix in format F.
template <int F, int R, int NB>
inline void qtile(const QuantRows& x, const uint8_t* W, int64_t nblocks, int64_t p0, int64_t r0, float* Y,
                  int64_t ldy, int64_t N, const float* add, const float* bias) {
  constexpr int64_t PB = kPanelBlockBytes[F];
  constexpr int offset = F == kQ8_0 ? VI::kWideOffset : F == kQ4_0 ? 8 : 0;  // o in s = sum u q - o sum q
  const int64_t stride = nblocks * PB;  // bytes of one panel
  V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = V::zero();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* block = W + p0 * stride + b * PB;
    VI s[R][NB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) s[r][j] = VI::zero();
    const int8_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.q + (r0 + r) * x.ld + b * kBlock;
    if constexpr (F == kQ8_0) {
      for (int i = 0; i < 8; ++i) {
        typename VI::Wide w[NB];
        for (int j = 0; j < NB; ++j) {
          const uint8_t* p = block + j * stride + kPanelHeader[F] + i * 64;
          _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch * 64, _MM_HINT_T0);
          w[j] = VI::wide(VI::load(p));
        }
        for (int r = 0; r < R; ++r) {
          const int32_t x4 = VI::quad(xq[r] + 4 * i);
          for (int j = 0; j < NB; ++j) s[r][j] = VI::dot_wide(s[r][j], w[j], x4);
        }
      }
    } else {
      for (int i = 0; i < 4; ++i) {
        typename VI::Raw lo[NB], hi[NB];
        for (int j = 0; j < NB; ++j) {
          const uint8_t* p = block + j * stride + kPanelHeader[F] + i * 64;
          _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch * 64, _MM_HINT_T0);
          const auto v = VI::load(p);
          lo[j] = VI::low_nibbles(v);
          hi[j] = VI::high_nibbles(v);
        }
        for (int r = 0; r < R; ++r) {
          const int32_t xlo = VI::quad(xq[r] + 4 * i), xhi = VI::quad(xq[r] + 16 + 4 * i);
          for (int j = 0; j < NB; ++j) s[r][j] = VI::dot(VI::dot(s[r][j], lo[j], xlo), hi[j], xhi);
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const uint8_t* head = block + j * stride;
      const V d = V::load_f16(reinterpret_cast<const uint16_t*>(head));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.blocks + b;
        const V dx = V::bcast(x.d[at]);
        const int32_t qsum = x.sums[at];
        if constexpr (F == kQ4_1) {
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
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t n0 = (p0 + j) * kLanes;
      const int n = static_cast<int>(std::min<int64_t>(kLanes, N - n0));
      float* y = Y + (r0 + r) * ldy + n0;
      V v = acc[r][j];
      if (bias) {
        alignas(64) float buf[kLanes] = {};
        std::memcpy(buf, bias + n0, n * sizeof(float));
        v = V::add(v, V::load(buf));
      }
      if (add) {
        alignas(64) float buf[kLanes] = {};
        std::memcpy(buf, add + (r0 + r) * ldy + n0, n * sizeof(float));
        v = V::add(V::load(buf), v);
      }
      store_part(y, v, n);
    }
}

// Panels per tile for R rows: a float and an int accumulator per (row, panel), one code vector
// (two for the nibbles) per panel.
constexpr int qpanels_for(int R) {
  const int n = (kRegs - 4) / ((2 * R + 2) * kRegsPerV);
  return n < 1 ? 1 : n > 4 ? 4 : n;
}
constexpr int kMaxQRows = kRegs >= 32 ? 4 : 2;  // rows per block: AVX2's 16 registers hold 2 rows' accumulators

template <int F, int R, int NB>
inline void qtile_nb(int nb, const QuantRows& x, const uint8_t* W, int64_t nblocks, int64_t p0, int64_t r0, float* Y,
                     int64_t ldy, int64_t N, const float* add, const float* bias) {
  if constexpr (NB >= 1) {
    if (nb == NB) return qtile<F, R, NB>(x, W, nblocks, p0, r0, Y, ldy, N, add, bias);
    return qtile_nb<F, R, NB - 1>(nb, x, W, nblocks, p0, r0, Y, ldy, N, add, bias);
  }
}

// Y (M, N) = the quantized product of x's M rows and the panels [q0, q1) of W [+ bias] [+ add].
template <int F>
inline void qmatmul_format(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                           const float* bias, int64_t q0, int64_t q1) {
  const int64_t blocks = (M + kMaxQRows - 1) / kMaxQRows, rows = (M + blocks - 1) / blocks;
  const int G = qpanels_for(static_cast<int>(rows));
  const uint8_t* data = static_cast<const uint8_t*>(W.data);
  const int64_t nblocks = W.K / kBlock;
  for (int64_t p = q0; p < q1; p += G) {
    const int nb = static_cast<int>(std::min<int64_t>(G, q1 - p));
    for (int64_t r0 = 0; r0 < M; r0 += rows) {
      switch (static_cast<int>(std::min<int64_t>(rows, M - r0))) {
        case 1: qtile_nb<F, 1, qpanels_for(1)>(nb, x, data, nblocks, p, r0, Y, ldy, W.N, add, bias); break;
        case 2: qtile_nb<F, 2, qpanels_for(2)>(nb, x, data, nblocks, p, r0, Y, ldy, W.N, add, bias); break;
        case 3: qtile_nb<F, 3, qpanels_for(3)>(nb, x, data, nblocks, p, r0, Y, ldy, W.N, add, bias); break;
        default: qtile_nb<F, kMaxQRows, qpanels_for(kMaxQRows)>(nb, x, data, nblocks, p, r0, Y, ldy, W.N, add, bias);
      }
    }
  }
}

inline void qmatmul_panels(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                           const float* bias, int64_t q0, int64_t q1) {
  switch (W.format) {
    case kQ8_0: return qmatmul_format<kQ8_0>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kQ4_0: return qmatmul_format<kQ4_0>(x, M, W, Y, ldy, add, bias, q0, q1);
    default: return qmatmul_format<kQ4_1>(x, M, W, Y, ldy, add, bias, q0, q1);
  }
}
