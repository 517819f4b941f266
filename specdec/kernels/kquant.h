// Matrices in llama.cpp's K-quants as GGUF files store them (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_XS:
// super-blocks of 256 weights), times activation rows quantized per super-block of 256 to int8 (as
// llama.cpp's Q8_K: quantize_row's kPer256 in quant.h): written once over the 16-lane int32 vector `VI` and
// included by cpu.cpp after quant.h, for AVX-512 VNNI and for AVX2. `kquant_matmul` runs every quantized
// format: the K-quants here, the others (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) by quant.h, and a
// matrix whose outputs come in runs of different formats (kMixed: a fused q/k/v whose v is stored in
// another type than q and k, as Q4_K_M files do) run by run.
//
// The arithmetic (kernels/blocks.py's block_terms is the same in PyTorch): output n of row m is the
// fp32 sum over super-blocks of 256 k, in order from 0, one mul and one add at a time (no FMA), of
//   Q6_K, Q3_K, IQ4_XS:  (d dx) float(S)
//   Q4_K, Q5_K, Q2_K:    (d dx) float(S) - (dmin dx) float(L)
// with d, dmin the super-block's fp16 scales, dx the activations' scale, and S, L exact integers (int32):
// S = sum_i sc_i s_i over its sub-blocks i (of 32: Q4_K, Q5_K, IQ4_XS; of 16: Q6_K, Q3_K, Q2_K), sc_i the
// sub-block's scale (6-bit; Q6_K int8; Q3_K the 6-bit scale - 32; IQ4_XS ls, 6-bit - 32; Q2_K 4-bit) and
// s_i = sum_k w q over it (w = u - 32 for Q6_K's 6-bit codes u, u - 4 for Q3_K's 3-bit ones, u for Q4_K's,
// Q5_K's and Q2_K's, IQ4_XS's level kIq4Levels[u] - 128); L = sum_i mn_i qsum_i, mn_i the sub-block's min
// (6-bit, Q2_K 4-bit) and qsum_i its sum of q. |S|, |L| < 2^31, whatever order computes them: so only
// the fp32 steps written shape a result, the same on both instruction sets. The integers pay a mul and an
// add a block (VI::mul) and L a madd per two sub-blocks (VI::madd) where the fp32 terms per block of 32
// cost four times as much.
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
// A lane's scale byte reaches an int32 lane as VI::byte; Q4_K's and Q5_K's mins as int16 pairs, VI::pairs.
// IQ4_XS: 16 fp16 d, each output's 6-bit ls of its 8 sub-blocks of 32 as the file holds them (a load of
// lane n = output n's 4 bytes of low nibbles, sub-block c's in bits 4c..4c+3, then 16 x 2 bytes, its high
// bit pairs, c's in bits 2c, 2c+1; read once a super-block, `iq4_xs_scales`), then 8 blocks of codes as
// quant.h's IQ4_NL.
// Q3_K and Q2_K: 16 fp16 d, [Q2_K: 16 fp16 dmin,] the sub-block scales in the file's bits as loads C_t, lane n
// holding output n's sub-blocks 4t..4t+3 (Q3_K: the 6-bit sc + 32 in byte order, held in 3 loads as Q4_K's;
// Q2_K: the file's [sc, mn] nibble bytes in the order 4t, 4t+2, 4t+1, 4t+3, 4 loads, so that the mins of
// sub-blocks 2u, 2u+1 are one load's int16 pair, VI::field), then per
// block of 32 k the low 2 bits of the codes as 2 loads of bit pairs (as Q6_K's high bits), [Q3_K: then their
// third bits as one load laid out as quant.h's Q5_0 fifth bits] -- the file's 3.44 or 2.63 bits a weight.
// Expects, defined before inclusion: what quant.h expects, and quant.h.

// Indexed by I (ktile's): 0 Q4_K, 1 Q6_K, 2 Q5_K, 3 IQ4_XS, 4 Q3_K, 5 Q2_K
constexpr int64_t kSuperBytes[6] = {2304, 3360, 2816, 2176, 1760, 1344};  // 16 outputs x 256 k
constexpr int kScalesAt[6] = {64, 32, 64, 32, 32, 64};                    // bytes before the sub-block scales
constexpr int kScaleBytes[6] = {192, 256, 192, 96, 192, 256};             // bytes of sub-block scales
constexpr int64_t kSuperCodes[6] = {256, 384, 320, 256, 192, 128};        // bytes of codes per block of 32 k
constexpr bool sixteens(int I) { return I == 1 || I == 4 || I == 5; }     // sub-blocks of 16 k (Q6_K, Q3_K, Q2_K)

// A super-block's sum of a row's q over sub-blocks i and i + 1 (of 16 or of 32: `sums`, QuantRows' k16 or
// k32 at i) as two int16 in one int32, low half i's: the pair VI::madd takes.
inline int32_t sum_pair(const int16_t* sums) {
  int32_t pair;
  std::memcpy(&pair, sums, sizeof pair);
  return pair;
}

// Where block b (the c-th of its super-block) of rows r0.. meets panels j of a K-quant matrix: the
// rows' int8 values (per super-block, QuantRows' kq), each panel's super-block (`base`: its d, [dmin,]
// scales) and codes of block c.
template <int R, int NB>
struct KBlock {
  const int8_t* xq[R];
  const uint8_t* base[NB];
  const uint8_t* codes[NB];
  int64_t b, r0;
  int c;
};

// 6-bit sub-block scales held in 3 loads (`packed`: Q4_K's, Q5_K's, Q3_K's) as the 4 loads C_t.
inline void six_bit_scales(const uint8_t* packed, typename VI::Raw (&c)[4]) {
  const auto high = VI::load(packed + 128);
  for (int u = 0; u < 2; ++u) {
    const auto low = VI::load(packed + u * 64);
    c[2 * u] = VI::masked_or(low, 0x0F, VI::bit_pair(high, 2 * u));
    c[2 * u + 1] = VI::masked_or(VI::shift_right(low, 4), 0x0F, VI::bit_pair(high, 2 * u + 1));
  }
}

// Q4_K (F = kQ4_1: nibbles) or Q5_K (F = kQ5_1: nibbles and fifth bits): S[r][j] += sc s for block k.c of the
// super-block (sc its 6-bit scale, from each panel's C_t; s = sum_k u q).
template <int F, int R, int NB>
inline void q4_k_block(const KBlock<R, NB>& k, const typename VI::Raw (&scales)[NB][4], VI (&S)[R][NB]) {
  VI s[R][NB];
  qsums<F, R, NB>(k.codes, k.xq, s);  // quant.h: Q4_K's codes are laid out as Q4_1's, Q5_K's as Q5_1's
  for (int j = 0; j < NB; ++j) {
    const VI sc = VI::byte(scales[j][k.c / 2], 2 * (k.c % 2));
    for (int r = 0; r < R; ++r) S[r][j] = VI::add(S[r][j], VI::mul(s[r][j], sc));
  }
}

// IQ4_XS's sub-block scales of a super-block (`base`: its d, scales): out[c][n] = ls of output n's sub-block c.
inline void iq4_xs_scales(const uint8_t* base, int32_t (&out)[16][kLanes]) {
  for (int n = 0; n < kLanes; ++n) {
    uint32_t low;
    uint16_t high;
    std::memcpy(&low, base + kScalesAt[3] + 4 * n, 4);
    std::memcpy(&high, base + kScalesAt[3] + 64 + 2 * n, 2);
    for (int c = 0; c < 8; ++c) out[c][n] = static_cast<int32_t>(((low >> (4 * c)) & 15) | (((high >> (2 * c)) & 3) << 4)) - 32;
  }
}

// IQ4_XS: S[r][j] += ls s for block k.b (ls: the super-block's, iq4_xs_scales; s = sum_k w q over the levels w).
template <int R, int NB>
inline void iq4_xs_block(const KBlock<R, NB>& k, const QuantRows& x, const int32_t (&ls)[NB][16][kLanes],
                         VI (&S)[R][NB]) {
  VI s[R][NB];
  qsums<kIQ4_NL, R, NB>(k.codes, k.xq, s);  // quant.h: IQ4_XS's codes are laid out as IQ4_NL's
  for (int j = 0; j < NB; ++j) {
    const VI scale = VI::lanes(ls[j][k.c]);
    for (int r = 0; r < R; ++r) {
      const VI exact = VI::sub(s[r][j], VI::kWideOffset * x.k32[(k.r0 + r) * x.blocks + k.b]);
      S[r][j] = VI::add(S[r][j], VI::mul(exact, scale));
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
      const auto a = VI::shift_right(pa[j], 2 * i), c = VI::shift_right(pc[j], 2 * i);
      if constexpr (H) {  // bit i (k 4i + t) and bit 4 + i (k 16 + 4i + t) of a third-bits byte to bit 2
        first[j] = VI::masked_or(a, 3, VI::mask(VI::shift_right(VI::shift_left(third[j], 2), i), 4));
        second[j] = VI::masked_or(c, 3, VI::mask(VI::shift_right(third[j], i + 2), 4));
      } else {
        first[j] = VI::mask(a, 3);
        second[j] = VI::mask(c, 3);
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

// S[r][j] += sc_a (s_a - o qsum_a) + sc_c (s_c - o qsum_c) for block k.b: its sub-blocks a, c of 16 (s: the sums
// u q, sa and sc; o: the codes' offset; qsum: the row's sums of q, QuantRows' k16).
template <int R, int NB>
inline void add_sixteens(const KBlock<R, NB>& k, const QuantRows& x, int32_t o, const VI (&sa)[R][NB],
                         const VI (&sc)[R][NB], const VI (&fa)[NB], const VI (&fc)[NB], VI (&S)[R][NB]) {
  for (int r = 0; r < R; ++r) {
    const int16_t* q = x.k16 + 2 * ((k.r0 + r) * x.blocks + k.b);
    for (int j = 0; j < NB; ++j)
      S[r][j] = VI::add(S[r][j], VI::add(VI::mul(fa[j], VI::sub(sa[r][j], o * q[0])),
                                         VI::mul(fc[j], VI::sub(sc[r][j], o * q[1]))));
  }
}

// Q3_K (H) or Q2_K: S[r][j] += sc_a s_a + sc_c s_c for block k.b, s over (u - 4) q or u q (its sub-blocks 2c,
// 2c + 1 in load C_{c/2} of the super-block's scales: Q3_K's 6-bit sc + 32 in bytes 2h, 2h + 1, Q2_K's sc in the
// low nibbles of bytes h, 2 + h, h = c % 2).
template <bool H, int R, int NB>
inline void low_bit_block(const KBlock<R, NB>& k, const QuantRows& x, const typename VI::Raw (&scales)[NB][4],
                          VI (&S)[R][NB]) {
  VI sa[R][NB], sb[R][NB], fa[NB], fc[NB];
  low_bit_sums<H, R, NB>(k, sa, sb);
  const int h = k.c % 2;
  for (int j = 0; j < NB; ++j) {
    const auto& c = scales[j][k.c / 2];
    fa[j] = H ? VI::sub(VI::byte(c, 2 * h), 32) : VI::nibble(c, 2 * h);
    fc[j] = H ? VI::sub(VI::byte(c, 2 * h + 1), 32) : VI::nibble(c, 4 + 2 * h);
  }
  add_sixteens<R, NB>(k, x, H ? 4 : 0, sa, sb, fa, fc, S);
}

// Q6_K: S[r][j] += sc_a s_a + sc_c s_c for block k.b, s over (u - 32) q.
template <int R, int NB>
inline void q6_k_block(const KBlock<R, NB>& k, const QuantRows& x, VI (&S)[R][NB]) {
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
      first[j] = VI::masked_or(v, 0x0F, VI::bit_pair(top_a[j], i));
      second[j] = VI::masked_or(VI::shift_right(v, 4), 0x0F, VI::bit_pair(top_c[j], i));
    }
    for (int r = 0; r < R; ++r) {
      const int32_t xa = VI::quad(k.xq[r] + 4 * i), xc = VI::quad(k.xq[r] + 16 + 4 * i);
      for (int j = 0; j < NB; ++j) {
        sa[r][j] = VI::dot(sa[r][j], first[j], xa);
        sc[r][j] = VI::dot(sc[r][j], second[j], xc);
      }
    }
  }
  VI fa[NB], fc[NB];  // the sub-blocks' int8 scales, stored + 128
  for (int j = 0; j < NB; ++j) {
    const auto raw = VI::load(k.base[j] + kScalesAt[1] + (k.c / 2) * 64);
    fa[j] = VI::sub(VI::byte(raw, 2 * (k.c % 2)), 128);
    fc[j] = VI::sub(VI::byte(raw, 2 * (k.c % 2) + 1), 128);
  }
  add_sixteens<R, NB>(k, x, 32, sa, sc, fa, fc, S);
}

// Rows r0..r0+R-1 (quantized per super-block) against panels p0..p0+NB-1 of a K-quant matrix (I: 0 Q4_K,
// 1 Q6_K, 2 Q5_K, 3 IQ4_XS, 4 Q3_K, 5 Q2_K): per super-block, the integers S (and the mins' sum) over its
// 8 blocks, then one fp32 term per row and output.
template <int I, int R, int NB>
inline void ktile(const QuantRows& x, const uint8_t* W, int64_t nsuper, int64_t p0, int64_t r0, float* Y, int64_t ldy,
                  int64_t N, const float* add, const float* bias) {
  const int64_t stride = nsuper * kSuperBytes[I];  // bytes of one panel
  constexpr int64_t codes_at = kScalesAt[I] + kScaleBytes[I];
  constexpr bool six = I == 0 || I == 2 || I == 4;  // 6-bit scales in 3 loads: Q4_K's and Q5_K's (sc, m), Q3_K's sc
  constexpr bool loads = six || I == 5, mins = I == 0 || I == 2 || I == 5;  // Q2_K's [sc, m] in 4 loads
  V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = V::zero();
  KBlock<R, NB> k{};
  k.r0 = r0;
  for (int64_t sb = 0; sb < nsuper; ++sb) {
    V d[NB], dmin[NB];
    typename VI::Raw scales[loads ? NB : 1][4];
    alignas(64) int32_t ls[I == 3 ? NB : 1][16][kLanes];
    for (int j = 0; j < NB; ++j) {
      k.base[j] = W + (p0 + j) * stride + sb * kSuperBytes[I];
      d[j] = V::load_f16(reinterpret_cast<const uint16_t*>(k.base[j]));
      if constexpr (mins) dmin[j] = V::load_f16(reinterpret_cast<const uint16_t*>(k.base[j] + 32));
      if constexpr (six) six_bit_scales(k.base[j] + kScalesAt[I], scales[j]);
      if constexpr (I == 5)
        for (int t = 0; t < 4; ++t) scales[j][t] = VI::load(k.base[j] + kScalesAt[I] + 64 * t);
      if constexpr (I == 3) iq4_xs_scales(k.base[j], ls[j]);
    }
    VI S[R][NB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) S[r][j] = VI::zero();
    for (k.c = 0; k.c < 8; ++k.c) {
      k.b = sb * 8 + k.c;
      for (int r = 0; r < R; ++r) k.xq[r] = x.kq + (r0 + r) * x.ld + k.b * kBlock;
      for (int j = 0; j < NB; ++j) k.codes[j] = k.base[j] + codes_at + k.c * kSuperCodes[I];
      if constexpr (I == 0)
        q4_k_block<kQ4_1, R, NB>(k, scales, S);
      else if constexpr (I == 2)
        q4_k_block<kQ5_1, R, NB>(k, scales, S);
      else if constexpr (I == 3)
        iq4_xs_block<R, NB>(k, x, ls, S);
      else if constexpr (I == 4 || I == 5)
        low_bit_block<I == 4, R, NB>(k, x, scales, S);
      else
        q6_k_block<R, NB>(k, x, S);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const V dx = V::bcast(x.kd[row * x.supers + sb]);
      for (int j = 0; j < NB; ++j) {
        V term = V::mul(V::mul(d[j], dx), VI::to_float(S[r][j]));
        if constexpr (mins) {  // sum mn qsum over the sub-blocks: of 32 (Q4_K, Q5_K) or of 16 (Q2_K)
          VI low = VI::zero();
          if constexpr (I != 5)
            for (int t = 0; t < 4; ++t)
              low = VI::madd(low, VI::pairs(scales[j][t], 1), sum_pair(x.k32 + row * x.blocks + 8 * sb + 2 * t));
          else  // the high nibbles of bytes h and 2 + h of C_{u/2}: mn of sub-blocks 2u, 2u + 1 (h = u % 2)
            for (int u = 0; u < 8; ++u)
              low = VI::madd(low, VI::field(scales[j][u / 2], 8 * (u % 2) + 4, 0x000F000F),
                             sum_pair(x.k16 + 2 * row * x.blocks + 16 * sb + 2 * u));
          term = V::sub(term, V::mul(V::mul(dmin[j], dx), VI::to_float(low)));
        }
        acc[r][j] = V::add(acc[r][j], term);
      }
    }
  }
  store_tile<R, NB>(acc, p0, r0, Y, ldy, N, add, bias);
}

// The most rows per tile: an int accumulator per row for the block's sums and one for the super-block's, a float
// one for the output, each row's (a tile is one panel: a call of any number of rows streams the matrix as one
// run of bytes per thread, which ran faster than tiles of 2 to 4 panels at every row count).
constexpr int kMaxKRows = kRegs >= 32 ? 8 : 2;

// Y (M, N) = the product of x's M rows and the panels [q0, q1) of a K-quant W [+ bias] [+ add].
template <int I>
inline void kmatmul_format(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                           const float* bias, int64_t q0, int64_t q1) {
  const int64_t blocks = (M + kMaxKRows - 1) / kMaxKRows, rows = (M + blocks - 1) / blocks;
  const uint8_t* data = static_cast<const uint8_t*>(W.data);
  const int64_t nsuper = W.K / kSuper;
  for (int64_t p = q0; p < q1; ++p)
    for (int64_t r0 = 0; r0 < M; r0 += rows) {
      switch (static_cast<int>(std::min<int64_t>(rows, M - r0))) {
        case 1: ktile<I, 1, 1>(x, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        case 2: ktile<I, 2, 1>(x, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        case 3: ktile<I, 3, 1>(x, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        case 4: ktile<I, 4, 1>(x, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        case 5: ktile<I, 5, 1>(x, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        case 6: ktile<I, 6, 1>(x, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        case 7: ktile<I, 7, 1>(x, data, nsuper, p, r0, Y, ldy, W.N, add, bias); break;
        default: ktile<I, kMaxKRows, 1>(x, data, nsuper, p, r0, Y, ldy, W.N, add, bias);
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
