// Matrices in llama.cpp's K-quants as GGUF files store them (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS:
// super-blocks of 256 weights),
// times activation rows quantized per block of 32 to int8 as for the other quantized formats
// (quantize_row in quant.h): written once over the 16-lane int32 vector `VI` and included by
// cpu.cpp after quant.h, for AVX-512 VNNI and for AVX2. `kquant_matmul` runs every quantized
// format: the K-quants here, the others (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) by quant.h, and a
// matrix whose outputs come in runs of different formats (kMixed: a fused q/k/v whose v is stored in
// another type than q and k, as Q4_K_M files do) run by run.
//
// The arithmetic (kernels/blocks.py's block_terms is the same in PyTorch): output n of row m is the
// fp32 sum over blocks b of 32 k, in order from 0, one mul and one add at a time (no FMA), of
//   Q4_K, Q5_K:  ((d sc) dx) float(s) - ((dmin mn) dx) float(qsum)   s = sum_k u q (u the 4- or 5-bit code)
//   Q6_K:  (d dx) (float(sc_a) float(s_a) + float(sc_c) float(s_c))  s_a = sum over the block's first
//          16 k of (u - 32) q (u the 6-bit code), s_c over its last 16
//   Q3_K:  as Q6_K, of (u - 4) q (u the 3-bit code), sc_a, sc_c the 6-bit scales - 32
//   Q2_K:  (d dx) float(sc_a s_a + sc_c s_c) - (dmin dx) float(mn_a qsum_a + mn_c qsum_c)   s_a = sum over
//          the first 16 k of u q (u the 2-bit code), qsum_a that of q; sc, mn 4-bit
//   IQ4_XS:  ((d ls) dx) float(s)   s = sum_k w q, w the level (quant.h's kIq4Levels - 128) of the 4-bit code
// with d, dmin the super-block's fp16 scales, sc, mn (6-bit), ls (6-bit, -32..31) or sc_a, sc_c (int8)
// the sub-blocks' scales, dx, qsum the activation block's scale and sum of q. d sc, dmin mn and d ls are
// exact in fp32 (11-bit times 6-bit significands); each |sc s| and their sum are integers below 2^24 (exact in
// fp32): so only the fp32 steps written shape a result, the same on both instruction sets.
//
// Packed layout of a matrix (N, K), K a multiple of 256: panels of 16 outputs (zero past N); panel
// p is K/256 super-blocks of kSuperBytes[format] bytes: 16 fp16 d, [Q4_K, Q5_K: 16 fp16 dmin,] the
// sub-block scales, then 8 blocks of 32 k of codes. The scales of Q6_K: 4 vector loads, lane n (4
// bytes) of load t holding output n's sc + 128 of sub-blocks 4t..4t+3 (16 k each). Those of Q4_K (and Q5_K)
// are unpacked into 4 such loads C_t, lane n holding output n's [sc, mn] of sub-blocks 2t and 2t+1,
// from their 6 bits as the file holds them: loads 0 and 1 hold the low 4 bits of C_{2u} (low
// nibbles of load u) and C_{2u+1} (its high nibbles), load 2 their high bit pairs (bits 2t, 2t+1 of
// each byte: C_t's). The codes: Q4_K as quant.h's Q4_x (4 loads of nibbles), Q5_K as quant.h's Q5_0
// (those nibbles, then a load of their fifth bits); Q6_K as many bits as
// the file holds: the low 4 bits of its codes as Q4_x's nibbles, then 2 loads of their high bit
// pairs, lane n byte t of load h holding in bits 2i, 2i+1 those of k = 16h + 4i + t (joined to
// nibble load i: VI::bit_pair).
// A lane's scale byte reaches an int32 lane as VI::dot against x4 = 1 in that byte's place.
// IQ4_XS: 16 fp16 d, each output's 6-bit ls of its 8 sub-blocks of 32 as the file holds them (a load of
// lane n = output n's 4 bytes of low nibbles, sub-block c's in bits 4c..4c+3, then 16 x 2 bytes, its high
// bit pairs, c's in bits 2c, 2c+1; read once a super-block, `iq4_xs_scales`), then 8 blocks of codes as
// quant.h's IQ4_NL.
// Q3_K and Q2_K: 16 fp16 d, [Q2_K: 16 fp16 dmin,] each output's sub-block scales as the file holds them
// (12 bytes of 6-bit scales, Q3_K; 16 bytes of [sc, mn] nibbles, Q2_K; read once a super-block), then per
// block of 32 k the low 2 bits of the codes as 2 loads of bit pairs (as Q6_K's high bits), [Q3_K: then their
// third bits as one load laid out as quant.h's Q5_0 fifth bits] -- the file's 3.44 or 2.63 bits a weight.
// Expects, defined before inclusion: what quant.h expects, and quant.h.

constexpr int64_t kSuper = 256;                       // weights per super-block, along K
// Indexed by I (ktile's): 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 IQ4_XS, 4 Q3_K, 5 Q2_K
constexpr int64_t kSuperBytes[6] = {2304, 3360, 2816, 2176, 1760, 1344};  // 16 outputs x 256 k
constexpr int kScalesAt[6] = {64, 32, 64, 32, 32, 64};                    // bytes before the sub-block scales
constexpr int kScaleBytes[6] = {192, 256, 192, 96, 192, 256};             // bytes of sub-block scales
constexpr int64_t kSuperCodes[6] = {256, 384, 320, 256, 192, 128};        // bytes of codes per block of 32 k
constexpr bool sixteens(int I) { return I == 1 || I == 4 || I == 5; }     // sub-blocks of 16 k (Q6_K, Q3_K, Q2_K)

// The sum of q over the first 16 k of each block of 32, rows [0, M) of x (Q6_K's first sub-block;
// the second is the block's sum minus it), into `out` (M x x.blocks).
inline void first_half_sums(const QuantRows& x, int64_t M, std::vector<int32_t>& out) {
  out.resize(M * x.blocks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < x.blocks; ++b) {
      const int8_t* q = x.q + m * x.ld + b * kBlock;
      int32_t sum = 0;
      for (int k = 0; k < 16; ++k) sum += q[k];
      out[m * x.blocks + b] = sum;
    }
}

// Byte `at` (0-3) of each lane of a scales load, as fp32 lanes (minus `offset`).
inline V scale_bytes(typename VI::Raw raw, int at, int32_t offset) {
  return VI::to_float(VI::sub(VI::dot(VI::zero(), raw, int32_t{1} << (8 * at)), offset));
}

// Where block b (the c-th of its super-block) of rows r0.. meets panels j of a K-quant matrix: the
// rows' int8 values, each panel's super-block (`base`: its d, [dmin,] scales) and codes of block c.
template <int R, int NB>
struct KBlock {
  const int8_t* xq[R];
  const uint8_t* base[NB];
  const uint8_t* codes[NB];
  int64_t b, r0;
  int c;
};

// Q4_K's sub-block scales of a super-block (`base`: its d, dmin, scales) as the 4 loads C_t.
inline void q4_k_scales(const uint8_t* base, typename VI::Raw (&c)[4]) {
  const uint8_t* packed = base + kScalesAt[0];
  const auto high = VI::load(packed + 128);
  for (int u = 0; u < 2; ++u) {
    const auto low = VI::load(packed + u * 64);
    c[2 * u] = VI::join(VI::low_nibbles(low), VI::bit_pair(high, 2 * u));
    c[2 * u + 1] = VI::join(VI::high_nibbles(low), VI::bit_pair(high, 2 * u + 1));
  }
}

// Q4_K (F = kQ4_1: nibbles) or Q5_K (F = kQ5_1: nibbles and fifth bits): acc[r][j] += ((d sc) dx) float(s) -
// ((dmin mn) dx) float(qsum) for block k.b (scales: the super-block's C_t of each panel).
template <int F, int R, int NB>
inline void q4_k_block(const KBlock<R, NB>& k, const QuantRows& x, const V (&d)[NB], const V (&dmin)[NB],
                       const typename VI::Raw (&scales)[NB][4], V (&acc)[R][NB]) {
  VI s[R][NB];
  qsums<F, R, NB>(k.codes, k.xq, s);  // quant.h: Q4_K's codes are laid out as Q4_1's, Q5_K's as Q5_1's
  for (int j = 0; j < NB; ++j) {
    const auto raw = scales[j][k.c / 2];
    const V scale = V::mul(d[j], scale_bytes(raw, 2 * (k.c % 2), 0));
    const V low = V::mul(dmin[j], scale_bytes(raw, 2 * (k.c % 2) + 1, 0));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (k.r0 + r) * x.blocks + k.b;
      const V dx = V::bcast(x.d[at]);
      const V part = V::sub(V::mul(V::mul(scale, dx), VI::to_float(s[r][j])),
                            V::mul(V::mul(low, dx), V::bcast(static_cast<float>(x.sums[at]))));
      acc[r][j] = V::add(acc[r][j], part);
    }
  }
}

// IQ4_XS's sub-block scales of a super-block (`base`: its d, scales) as floats: out[c][n] = ls of output n's
// sub-block c, exact.
inline void iq4_xs_scales(const uint8_t* base, float (&out)[8][kLanes]) {
  for (int n = 0; n < kLanes; ++n) {
    uint32_t low;
    uint16_t high;
    std::memcpy(&low, base + kScalesAt[3] + 4 * n, 4);
    std::memcpy(&high, base + kScalesAt[3] + 64 + 2 * n, 2);
    for (int c = 0; c < 8; ++c)
      out[c][n] = static_cast<float>(static_cast<int>(((low >> (4 * c)) & 15) | (((high >> (2 * c)) & 3) << 4)) - 32);
  }
}

// IQ4_XS: acc[r][j] += ((d ls) dx) float(s) for block k.b (ls: the super-block's, iq4_xs_scales).
template <int R, int NB>
inline void iq4_xs_block(const KBlock<R, NB>& k, const QuantRows& x, const V (&d)[NB], const float (&ls)[NB][8][kLanes],
                         V (&acc)[R][NB]) {
  VI s[R][NB];
  qsums<kIQ4_NL, R, NB>(k.codes, k.xq, s);  // quant.h: IQ4_XS's codes are laid out as IQ4_NL's
  for (int j = 0; j < NB; ++j) {
    const V scale = V::mul(d[j], V::load(ls[j][k.c]));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (k.r0 + r) * x.blocks + k.b;
      const VI exact = VI::sub(s[r][j], VI::kWideOffset * x.sums[at]);
      acc[r][j] = V::add(acc[r][j], V::mul(V::mul(scale, V::bcast(x.d[at])), VI::to_float(exact)));
    }
  }
}

// Q3_K's (low: the 6-bit scales - 32) or Q2_K's (low: sc, high: mn) sub-block scales of a super-block
// (`base`: its d, [dmin,] scales) as floats: low[i][n] (and high[i][n]) of output n's sub-block i of 16, exact.
template <int I>
inline void low_bit_scales(const uint8_t* base, float (&low)[16][kLanes], float (&high)[16][kLanes]) {
  for (int n = 0; n < kLanes; ++n) {
    const uint8_t* s = base + kScalesAt[I] + (I == 4 ? 12 : 16) * n;
    for (int i = 0; i < 16; ++i) {
      if constexpr (I == 4) {
        const int six = ((i < 8 ? s[i] : s[i - 8] >> 4) & 15) | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
        low[i][n] = static_cast<float>(six - 32);
      } else {
        low[i][n] = static_cast<float>(s[i] & 15);
        high[i][n] = static_cast<float>(s[i] >> 4);
      }
    }
  }
}

// The sums u q over the first 16 k (sa) and the last 16 (sc) of block k.b: u Q3_K's 3-bit codes (H: the
// low 2 bits' loads, then the third bits') or Q2_K's 2-bit ones.
template <bool H, int R, int NB>
inline void low_bit_sums(const KBlock<R, NB>& k, VI (&sa)[R][NB], VI (&sc)[R][NB]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) sa[r][j] = sc[r][j] = VI::zero();
  typename VI::Raw pa[NB], pc[NB], third[NB];
  for (int j = 0; j < NB; ++j) {
    for (int at = 0; at < (H ? 192 : 128); at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(k.codes[j]) + at + kPrefetch * 64, _MM_HINT_T0);
    pa[j] = VI::load(k.codes[j]);
    pc[j] = VI::load(k.codes[j] + 64);
    if constexpr (H) third[j] = VI::load(k.codes[j] + 128);
  }
  for (int i = 0; i < 4; ++i) {
    typename VI::Raw first[NB], second[NB];
    for (int j = 0; j < NB; ++j) {
      first[j] = VI::mask(VI::shift_right(pa[j], 2 * i), 3);
      second[j] = VI::mask(VI::shift_right(pc[j], 2 * i), 3);
      if constexpr (H) {  // bit i (k 4i + t) and bit 4 + i (k 16 + 4i + t) of a third-bits byte to bit 2
        first[j] = VI::join(first[j], VI::mask(VI::shift_right(VI::shift_left(third[j], 2), i), 4));
        second[j] = VI::join(second[j], VI::mask(VI::shift_right(third[j], i + 2), 4));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int32_t xa = VI::quad(k.xq[r] + 4 * i), xc = VI::quad(k.xq[r] + 16 + 4 * i);
      for (int j = 0; j < NB; ++j) {
        sa[r][j] = VI::dot(sa[r][j], first[j], xa);
        sc[r][j] = VI::dot(sc[r][j], second[j], xc);
      }
    }
  }
}

// Q3_K: acc[r][j] += (d dx) (float(sc_a) float(s_a) + float(sc_c) float(s_c)) for block k.b, s over (u - 4) q
// (sc: the super-block's, low_bit_scales).
template <int R, int NB>
inline void q3_k_block(const KBlock<R, NB>& k, const QuantRows& x, const int32_t* halves, const V (&d)[NB],
                       const float (&sc)[NB][16][kLanes], V (&acc)[R][NB]) {
  VI sa[R][NB], sb[R][NB];
  low_bit_sums<true, R, NB>(k, sa, sb);
  for (int j = 0; j < NB; ++j) {
    const V fa = V::load(sc[j][2 * k.c]), fc = V::load(sc[j][2 * k.c + 1]);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (k.r0 + r) * x.blocks + k.b;
      const int32_t qa = halves[at], qc = x.sums[at] - qa;
      const V exact = V::add(V::mul(fa, VI::to_float(VI::sub(sa[r][j], 4 * qa))),
                             V::mul(fc, VI::to_float(VI::sub(sb[r][j], 4 * qc))));
      acc[r][j] = V::add(acc[r][j], V::mul(V::mul(d[j], V::bcast(x.d[at])), exact));
    }
  }
}

// Q2_K: acc[r][j] += (d dx) float(sc_a s_a + sc_c s_c) - (dmin dx) float(mn_a qsum_a + mn_c qsum_c) for
// block k.b (sc, mn: the super-block's, low_bit_scales).
template <int R, int NB>
inline void q2_k_block(const KBlock<R, NB>& k, const QuantRows& x, const int32_t* halves, const V (&d)[NB],
                       const V (&dmin)[NB], const float (&sc)[NB][16][kLanes], const float (&mn)[NB][16][kLanes],
                       V (&acc)[R][NB]) {
  VI sa[R][NB], sb[R][NB];
  low_bit_sums<false, R, NB>(k, sa, sb);
  for (int j = 0; j < NB; ++j) {
    const V fa = V::load(sc[j][2 * k.c]), fc = V::load(sc[j][2 * k.c + 1]);
    const V ma = V::load(mn[j][2 * k.c]), mc = V::load(mn[j][2 * k.c + 1]);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (k.r0 + r) * x.blocks + k.b;
      const int32_t qa = halves[at], qc = x.sums[at] - qa;
      const V dx = V::bcast(x.d[at]);
      const V exact = V::add(V::mul(fa, VI::to_float(sa[r][j])), V::mul(fc, VI::to_float(sb[r][j])));
      const V low = V::add(V::mul(ma, V::bcast(static_cast<float>(qa))), V::mul(mc, V::bcast(static_cast<float>(qc))));
      acc[r][j] = V::add(acc[r][j], V::sub(V::mul(V::mul(d[j], dx), exact), V::mul(V::mul(dmin[j], dx), low)));
    }
  }
}

// Q6_K: acc[r][j] += (d dx) (float(sc_a) float(s_a) + float(sc_c) float(s_c)) for block k.b.
template <int R, int NB>
inline void q6_k_block(const KBlock<R, NB>& k, const QuantRows& x, const int32_t* halves, const V (&d)[NB],
                       V (&acc)[R][NB]) {
  VI sa[R][NB], sc[R][NB];  // sum u q over the block's first 16 k, its last 16
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) sa[r][j] = sc[r][j] = VI::zero();
  typename VI::Raw top_a[NB], top_c[NB];  // the codes' high bit pairs: the first 16 k, the last 16
  for (int j = 0; j < NB; ++j) {
    top_a[j] = VI::load(k.codes[j] + 256);
    top_c[j] = VI::load(k.codes[j] + 320);
  }
  for (int i = 0; i < 4; ++i) {
    typename VI::Raw first[NB], second[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* p = k.codes[j] + i * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch * 64, _MM_HINT_T0);
      if (i < 2) _mm_prefetch(reinterpret_cast<const char*>(p) + 256 + kPrefetch * 64, _MM_HINT_T0);
      const auto v = VI::load(p);
      first[j] = VI::join(VI::low_nibbles(v), VI::bit_pair(top_a[j], i));
      second[j] = VI::join(VI::high_nibbles(v), VI::bit_pair(top_c[j], i));
    }
    for (int r = 0; r < R; ++r) {
      const int32_t xa = VI::quad(k.xq[r] + 4 * i), xc = VI::quad(k.xq[r] + 16 + 4 * i);
      for (int j = 0; j < NB; ++j) {
        sa[r][j] = VI::dot(sa[r][j], first[j], xa);
        sc[r][j] = VI::dot(sc[r][j], second[j], xc);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const auto raw = VI::load(k.base[j] + kScalesAt[1] + (k.c / 2) * 64);
    const V fa = scale_bytes(raw, 2 * (k.c % 2), 128), fc = scale_bytes(raw, 2 * (k.c % 2) + 1, 128);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (k.r0 + r) * x.blocks + k.b;
      const int32_t qa = halves[at], qc = x.sums[at] - qa;
      const V exact = V::add(V::mul(fa, VI::to_float(VI::sub(sa[r][j], 32 * qa))),
                             V::mul(fc, VI::to_float(VI::sub(sc[r][j], 32 * qc))));
      acc[r][j] = V::add(acc[r][j], V::mul(V::mul(d[j], V::bcast(x.d[at])), exact));
    }
  }
}

// Rows r0..r0+R-1 (quantized; halves: their first-16 sums, Q6_K) against panels p0..p0+NB-1 of a
// K-quant matrix (I: 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 IQ4_XS, 4 Q3_K, 5 Q2_K).
template <int I, int R, int NB>
inline void ktile(const QuantRows& x, const int32_t* halves, const uint8_t* W, int64_t nsuper, int64_t p0, int64_t r0,
                  float* Y, int64_t ldy, int64_t N, const float* add, const float* bias) {
  const int64_t stride = nsuper * kSuperBytes[I];  // bytes of one panel
  constexpr int64_t codes_at = kScalesAt[I] + kScaleBytes[I];
  V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = V::zero();
  KBlock<R, NB> k{};
  k.r0 = r0;
  for (int64_t sb = 0; sb < nsuper; ++sb) {
    V d[NB], dmin[NB];
    constexpr bool six = I == 0 || I == 2;  // Q4_K's and Q5_K's 6-bit (sc, m)
    typename VI::Raw scales[six ? NB : 1][4];
    alignas(64) float ls[I == 3 ? NB : 1][8][kLanes];
    alignas(64) float low[I >= 4 ? NB : 1][16][kLanes], high[I == 5 ? NB : 1][16][kLanes];
    for (int j = 0; j < NB; ++j) {
      k.base[j] = W + (p0 + j) * stride + sb * kSuperBytes[I];
      d[j] = V::load_f16(reinterpret_cast<const uint16_t*>(k.base[j]));
      if constexpr (six || I == 5) dmin[j] = V::load_f16(reinterpret_cast<const uint16_t*>(k.base[j] + 32));
      if constexpr (six) q4_k_scales(k.base[j], scales[j]);
      if constexpr (I == 3) iq4_xs_scales(k.base[j], ls[j]);
      if constexpr (I >= 4) low_bit_scales<I>(k.base[j], low[j], high[I == 5 ? j : 0]);
    }
    for (k.c = 0; k.c < 8; ++k.c) {
      k.b = sb * 8 + k.c;
      for (int r = 0; r < R; ++r) k.xq[r] = x.q + (r0 + r) * x.ld + k.b * kBlock;
      for (int j = 0; j < NB; ++j) k.codes[j] = k.base[j] + codes_at + k.c * kSuperCodes[I];
      if constexpr (I == 0)
        q4_k_block<kQ4_1, R, NB>(k, x, d, dmin, scales, acc);
      else if constexpr (I == 2)
        q4_k_block<kQ5_1, R, NB>(k, x, d, dmin, scales, acc);
      else if constexpr (I == 3)
        iq4_xs_block<R, NB>(k, x, d, ls, acc);
      else if constexpr (I == 4)
        q3_k_block<R, NB>(k, x, halves, d, low, acc);
      else if constexpr (I == 5)
        q2_k_block<R, NB>(k, x, halves, d, dmin, low, high, acc);
      else
        q6_k_block<R, NB>(k, x, halves, d, acc);
    }
  }
  store_tile<R, NB>(acc, p0, r0, Y, ldy, N, add, bias);
}

template <int I, int R, int NB>
inline void ktile_nb(int nb, const QuantRows& x, const int32_t* halves, const uint8_t* W, int64_t nsuper, int64_t p0,
                     int64_t r0, float* Y, int64_t ldy, int64_t N, const float* add, const float* bias) {
  if constexpr (NB >= 1) {
    if (nb == NB) return ktile<I, R, NB>(x, halves, W, nsuper, p0, r0, Y, ldy, N, add, bias);
    return ktile_nb<I, R, NB - 1>(nb, x, halves, W, nsuper, p0, r0, Y, ldy, N, add, bias);
  }
}

// The K-quant tiles' shape: panels per tile for R rows (a float and an int accumulator per (row,
// panel), one code vector (two for the nibbles) per panel), and the most rows per tile. A call of one
// row (plain decoding) takes one panel per tile, so the matrix streams as one run of bytes: it streamed
// faster than tiles of 4 panels (benchmarks/kernel_efficiency.py streaming; docs/evidence/behind-the-code.md).
constexpr int kpanels_for(int R) {
  const int n = (kRegs - 4) / ((2 * R + 2) * kRegsPerV);
  return n < 1 ? 1 : n > 4 ? 4 : n;
}
constexpr int kMaxKRows = kRegs >= 32 ? 4 : 2;

// Y (M, N) = the product of x's M rows and the panels [q0, q1) of a K-quant W [+ bias] [+ add].
template <int I>
inline void kmatmul_format(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                           const float* bias, int64_t q0, int64_t q1) {
  thread_local std::vector<int32_t> halves;
  if constexpr (sixteens(I)) first_half_sums(x, M, halves);
  const int64_t blocks = (M + kMaxKRows - 1) / kMaxKRows, rows = (M + blocks - 1) / blocks;
  const int G = M == 1 ? 1 : kpanels_for(static_cast<int>(rows));
  const uint8_t* data = static_cast<const uint8_t*>(W.data);
  const int64_t nsuper = W.K / kSuper;
  const int32_t* h = halves.data();
  for (int64_t p = q0; p < q1; p += G) {
    const int nb = static_cast<int>(std::min<int64_t>(G, q1 - p));
    for (int64_t r0 = 0; r0 < M; r0 += rows) {
      switch (static_cast<int>(std::min<int64_t>(rows, M - r0))) {
        case 1: ktile_nb<I, 1, kpanels_for(1)>(nb, x, h, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        case 2: ktile_nb<I, 2, kpanels_for(2)>(nb, x, h, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        case 3: ktile_nb<I, 3, kpanels_for(3)>(nb, x, h, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        default: ktile_nb<I, kMaxKRows, kpanels_for(kMaxKRows)>(nb, x, h, data, nsuper, p, r0, Y, ldy, W.N, add, bias);
      }
    }
  }
}

inline void kquant_matmul(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                          const float* bias, int64_t q0, int64_t q1);

// A kMixed matrix: each run (its outputs' columns of Y, bias and add) for its panels within [q0, q1).
inline void mixed_matmul(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                         const float* bias, int64_t q0, int64_t q1) {
  const int32_t* head = static_cast<const int32_t*>(W.data);
  const uint8_t* data = static_cast<const uint8_t*>(W.data) + kMixedHeader;
  int64_t p = 0;  // the run's first panel
  for (int32_t i = 0; i < head[0]; ++i) {
    const int format = head[1 + 2 * i];
    const int64_t n = head[2 + 2 * i], panels = (n + kLanes - 1) / kLanes;
    const int64_t a = std::max(q0, p), b = std::min(q1, p + panels), c = p * kLanes;
    if (a < b)
      kquant_matmul(x, M, Mat{format, data, n, W.K}, Y + c, ldy, add ? add + c : nullptr, bias ? bias + c : nullptr,
                    a - p, b - p);
    data += panels * (W.K / kBlock) * kPanelBlockBytes[format];
    p += panels;
  }
}

// Every quantized format: the K-quants here, the others by quant.h, runs of several (kMixed) run by run.
inline void kquant_matmul(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                          const float* bias, int64_t q0, int64_t q1) {
  switch (W.format) {
    case kQ4_K: return kmatmul_format<0>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kQ6_K: return kmatmul_format<1>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kQ5_K: return kmatmul_format<2>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kIQ4_XS: return kmatmul_format<3>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kQ3_K: return kmatmul_format<4>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kQ2_K: return kmatmul_format<5>(x, M, W, Y, ldy, add, bias, q0, q1);
    case kMixed: return mixed_matmul(x, M, W, Y, ldy, add, bias, q0, q1);
    default: return qmatmul_panels(x, M, W, Y, ldy, add, bias, q0, q1);
  }
}
