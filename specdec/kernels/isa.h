// The kernels, written once over a 16-lane fp32 vector `V` and included twice by cpu.cpp: once in
// namespace avx512 (V = one zmm register), once in namespace avx2 (V = two ymm registers), each
// namespace's V, kRegs (vector registers) and kRegsPerV coming from vectors.h; the plain structs
// (LayerWeights, Shape, Window, Cache, Scratch, Mat) from types.h, included before at file scope.
//
// Every value is computed by the same sequence of IEEE operations on both instruction sets, so
// their results are bit-identical, and each output row is computed alone (see cpu.cpp). The
// lane of an element is its index mod 16 in the loop that reduces it, whichever ISA runs.

// ------------------------------------------------------------------------------ elementwise

// e^x for x <= 0 (x = -inf and x < -87 give exactly 0): x = n ln2 + f with |f| <= ln2 / 2,
// e^f by a degree-6 polynomial, 2^n through the exponent bits.
inline V exp_nonpositive(V x) {
  const V lo = V::bcast(-87.f);
  const V keep_mask = V::ge_mask(x, lo);
  x = V::max(x, lo);
  const V n = V::round_nearest(V::mul(x, V::bcast(1.44269504088896341f)));
  V f = V::fnma(n, V::bcast(0.693359375f), x);
  f = V::fnma(n, V::bcast(-2.12194440e-4f), f);
  V y = V::bcast(1.9875691500e-4f);
  y = V::fma(y, f, V::bcast(1.3981999507e-3f));
  y = V::fma(y, f, V::bcast(8.3334519073e-3f));
  y = V::fma(y, f, V::bcast(4.1665795894e-2f));
  y = V::fma(y, f, V::bcast(1.6666665459e-1f));
  y = V::fma(y, f, V::bcast(5.0000001201e-1f));
  y = V::fma(y, V::mul(f, f), V::add(f, V::bcast(1.f)));
  return V::and_mask(V::mul(y, V::pow2i(n)), keep_mask);
}

// sigmoid(s) for 16 lanes, from e = exp(-|s|) without overflow.
inline V sigmoid(V s) {
  const V one = V::bcast(1.f);
  const V e = exp_nonpositive(V::neg_abs(s));
  const V positive = V::div(one, V::add(one, e));
  const V negative = V::div(e, V::add(one, e));
  return V::lt_zero_select(s, negative, positive);
}

// silu(g) * u for 16 lanes: g * sigmoid(g).
inline V silu_mul(V g, V u) { return V::mul(V::mul(g, sigmoid(g)), u); }

// gelu_tanh(g) * u for 16 lanes: 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3).
inline V gelu_tanh_mul(V g, V u) {
  const V c = V::bcast(1.5957691216057308f), c3 = V::bcast(1.5957691216057308f * 0.044715f);
  const V two_z = V::mul(g, V::fma(V::mul(g, g), c3, c));
  return V::mul(V::mul(g, sigmoid(two_z)), u);
}

// Calls f(lane-block start, V) over n floats at p in blocks of 16; the last partial block is
// read from a zero-padded copy and written back partially, so a tail costs the same arithmetic.
template <class F>
inline void blocks16(const float* p, int64_t n, F f) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) f(c, V::load(p + c), kLanes);
  if (c < n) {
    alignas(64) float buf[kLanes] = {};
    std::memcpy(buf, p + c, (n - c) * sizeof(float));
    f(c, V::load(buf), static_cast<int>(n - c));
  }
}

inline void store_part(float* dst, V v, int n) {
  if (n == kLanes) return V::store(dst, v);
  alignas(64) float buf[kLanes];
  V::store(buf, v);
  std::memcpy(dst, buf, n * sizeof(float));
}

// y = x / sqrt(mean(x^2) + eps) * w over one row of K floats: the sum of squares in 16 lanes
// (element c in lane c mod 16), reduced by a fixed tree.
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t K, float* y) {
  V acc = V::zero();
  blocks16(x, K, [&](int64_t, V v, int) { acc = V::fma(v, v, acc); });
  const float r = 1.f / std::sqrt(V::hsum(acc) / static_cast<float>(K) + eps);
  const V rv = V::bcast(r);
  blocks16(x, K, [&](int64_t c, V v, int n) {
    alignas(64) float wb[kLanes] = {};
    std::memcpy(wb, w + c, n * sizeof(float));
    store_part(y + c, V::mul(V::mul(v, rv), V::load(wb)), n);
  });
}

// ------------------------------------------------------------------------------ matrices

// A packed matrix holds the weight W (N, K) in bf16, f16 or f32 (F: kBf16, kF16, kF32) as panels of 16
// outputs: panel p is (K, 16), element [k][l] = W[16 p + l][k] (zero past N). Output n of row m is the sum
// over k = 0..K-1, in that order, of x[m][k] * W[n][k], one FMA at a time in its own lane (each format's
// weights widened to fp32 exactly: a shift, F16C's conversion, or none): its value depends on nothing but
// x[m] and W[n] — not on the row count, the tile shape, the thread split, the ISA or the format that
// holds W's values.

// A tile's sums (rows r0.., panels p0..) to Y: acc + bias, then add + that (the projection's bias
// and the residual, each after the whole sum), the outputs past N left out.
template <int R, int NB>
inline void store_tile(const V (&acc)[R][NB], int64_t p0, int64_t r0, float* Y, int64_t ldy, int64_t N,
                       const float* add, const float* bias) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t n0 = (p0 + j) * kLanes;
      const int n = static_cast<int>(std::min<int64_t>(kLanes, N - n0));
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
      store_part(Y + (r0 + r) * ldy + n0, v, n);
    }
}

// The weights of one k of a panel (16 of them at p), in fp32, exactly.
template <int F>
inline V load_weights(const void* p) {
  if constexpr (F == kF32) return V::load(static_cast<const float*>(p));
  if constexpr (F == kF16) return V::load_f16(static_cast<const uint16_t*>(p));
  return V::load_bf16(static_cast<const uint16_t*>(p));
}

// Rows r0..r0+R-1 of X against panels p0..p0+NB-1: R x NB accumulators held in registers, so
// each weight load serves R rows and each row load serves NB panels.
template <int F, int R, int NB>
inline void tile(const float* X, int64_t ldx, const void* W, int64_t K, int64_t p0, int64_t r0,
                 float* Y, int64_t ldy, int64_t N, const float* add, const float* bias) {
  constexpr int64_t size = F == kF32 ? 4 : 2;  // bytes per weight
  V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = V::zero();
  const char* wp = static_cast<const char*>(W) + p0 * K * kLanes * size;
  const float* xr = X + r0 * ldx;
  for (int64_t k = 0; k < K; ++k) {
    if (size == 4 || (k & 1) == 0)  // one cache line of each panel per k (or two); fetched kPrefetch lines ahead
      for (int j = 0; j < NB; ++j) _mm_prefetch(wp + (j * K + k) * kLanes * size + kPrefetch * 64, _MM_HINT_T0);
    V w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load_weights<F>(wp + (j * K + k) * kLanes * size);
    for (int r = 0; r < R; ++r) {
      const V xb = V::bcast(xr[r * ldx + k]);
      for (int j = 0; j < NB; ++j) acc[r][j] = V::fma(xb, w[j], acc[r][j]);
    }
  }
  store_tile<R, NB>(acc, p0, r0, Y, ldy, N, add, bias);
}

// Panels per tile for a block of R rows: as many accumulators as the registers hold.
constexpr int panels_for(int R) {
  return R * kRegsPerV * 8 <= kRegs - 4 ? 8 : (kRegs - 4) / (R * kRegsPerV) < 1 ? 1 : (kRegs - 4) / (R * kRegsPerV);
}
// rows per block: AVX-512 8 (x 3 panels in 24 registers), AVX2 6 (x 1 panel in 12)
constexpr int kMaxRows = kRegs >= 32 ? 8 : 6;
// Panels per tile where the call has one row (plain decoding): enough independent FMA chains to keep
// up with memory, few enough streams of weights at once: 4 streamed fastest of 2, 4 and 8
// (benchmarks/kernel_efficiency.py streaming; docs/evidence/behind-the-code.md).
constexpr int kOneRowPanels = 4;

template <int F, int R, int NB>
inline void tile_dispatch_nb(int nb, const float* X, int64_t ldx, const void* W, int64_t K, int64_t p0,
                             int64_t r0, float* Y, int64_t ldy, int64_t N, const float* add, const float* bias) {
  if constexpr (NB >= 1) {
    if (nb == NB) return tile<F, R, NB>(X, ldx, W, K, p0, r0, Y, ldy, N, add, bias);
    return tile_dispatch_nb<F, R, NB - 1>(nb, X, ldx, W, K, p0, r0, Y, ldy, N, add, bias);
  }
}

template <int F, int R>
inline void tile_rows(int nb, const float* X, int64_t ldx, const void* W, int64_t K, int64_t p0,
                      int64_t r0, float* Y, int64_t ldy, int64_t N, const float* add, const float* bias) {
  tile_dispatch_nb<F, R, panels_for(R)>(nb, X, ldx, W, K, p0, r0, Y, ldy, N, add, bias);
}

// Y (M, N) = X (M, K) W^T [+ bias (N,)] [+ add], for the panels [q0, q1) of the packed W in format F: the
// share of one thread. bias and add may be null.
template <int F>
inline void matmul_panels_of(const float* X, int64_t M, int64_t ldx, const void* W, int64_t K, int64_t N,
                             float* Y, int64_t ldy, const float* add, const float* bias, int64_t q0, int64_t q1) {
  // rows in blocks of nearly equal size (8 = 4 + 4, not 6 + 2), panels per tile as many as the
  // registers hold for the largest block; the row blocks of a tile reuse its panels from cache
  if (M == 0) return;
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows, rows = (M + blocks - 1) / blocks;
  const int G = M == 1 ? kOneRowPanels : panels_for(static_cast<int>(rows));
  for (int64_t p = q0; p < q1; p += G) {
    const int nb = static_cast<int>(std::min<int64_t>(G, q1 - p));
    for (int64_t r0 = 0; r0 < M; r0 += rows) {
      const int R = static_cast<int>(std::min<int64_t>(rows, M - r0));
      switch (R) {
        case 1: tile_rows<F, 1>(nb, X, ldx, W, K, p, r0, Y, ldy, N, add, bias); break;
        case 2: tile_rows<F, 2>(nb, X, ldx, W, K, p, r0, Y, ldy, N, add, bias); break;
        case 3: tile_rows<F, 3>(nb, X, ldx, W, K, p, r0, Y, ldy, N, add, bias); break;
        case 4: tile_rows<F, 4>(nb, X, ldx, W, K, p, r0, Y, ldy, N, add, bias); break;
        case 5: tile_rows<F, 5>(nb, X, ldx, W, K, p, r0, Y, ldy, N, add, bias); break;
        case 6: tile_rows<F, 6>(nb, X, ldx, W, K, p, r0, Y, ldy, N, add, bias); break;
        case 7: tile_rows<F, 7>(nb, X, ldx, W, K, p, r0, Y, ldy, N, add, bias); break;
        default: tile_rows<F, 8>(nb, X, ldx, W, K, p, r0, Y, ldy, N, add, bias); break;
      }
    }
  }
}

// matmul_panels_of for the float format of W (kBf16, kF16, kF32).
inline void matmul_panels(const float* X, int64_t M, int64_t ldx, const void* W, int format, int64_t K, int64_t N,
                          float* Y, int64_t ldy, const float* add, const float* bias, int64_t q0, int64_t q1) {
  if (format == kF32) return matmul_panels_of<kF32>(X, M, ldx, W, K, N, Y, ldy, add, bias, q0, q1);
  if (format == kF16) return matmul_panels_of<kF16>(X, M, ldx, W, K, N, Y, ldy, add, bias, q0, q1);
  return matmul_panels_of<kBf16>(X, M, ldx, W, K, N, Y, ldy, add, bias, q0, q1);
}

// `reps` rounds of 12 independent FMA chains on 16 lanes: the core's FMA throughput, nothing else.
constexpr double kFmaLoopFlops = 12.0 * 16 * 2;
inline float fma_loop(int64_t reps) {
  V acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = V::bcast(static_cast<float>(i));
  const V a = V::bcast(0.999f), b = V::bcast(1e-3f);
  for (int64_t r = 0; r < reps; ++r)
    for (int i = 0; i < 12; ++i) acc[i] = V::fma(acc[i], a, b);
  V total = V::zero();
  for (int i = 0; i < 12; ++i) total = V::add(total, acc[i]);
  return V::hsum(total);
}

// ------------------------------------------------------------------------------ attention

// 16 cached floats, from a float32 or a bf16 cache (Cache::bf16).
inline V load_cached(const float* p) { return V::load(p); }
inline V load_cached(const uint16_t* p) { return V::load_bf16(p); }

// The 16 lanes of q . k over D floats: lane l sums the products of the columns l mod 16, in order.
template <class T>
inline V key_dot(const float* q, const T* k, int64_t D) {
  V acc = V::zero();
  for (int64_t c = 0; c < D; c += kLanes) acc = V::fma(V::load(q + c), load_cached(k + c), acc);
  return acc;
}

// One query row q (D floats) over `n` visible keys given by key(i) -> row pointer in the cache, float
// or bf16 (i = 0..n-1, in key order): out = softmax(q k^T * scale) v. The score of key i lives in lane
// i mod 16 of the softmax sum, whatever other keys the cache holds: a row's output depends only
// on its own visible keys (so a token verified in a window, or a tree node, gets what it gets
// decoded alone). p: scratch of at least n rounded up to 16 floats. Each key's sums are computed
// alone (key_dot), so that on AVX2 too they stay in registers.
template <class KeyRow>
inline void attend_row(const float* q, int64_t D, int64_t n, KeyRow krow, KeyRow vrow, float scale,
                       float* p, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {  // 16 keys at a time, their 16 sums reduced together
    V acc[kLanes];
    for (int j = 0; j < kLanes; ++j) acc[j] = key_dot(q, krow(i + j), D);
    alignas(64) float sums[kLanes];
    V::hsum16(acc, sums);
    for (int j = 0; j < kLanes; ++j) p[i + j] = sums[j] * scale;
  }
  for (; i < n; ++i) p[i] = V::hsum(key_dot(q, krow(i), D)) * scale;
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t i = n; i < n16; ++i) p[i] = -INFINITY;
  V top = V::bcast(-INFINITY);
  for (int64_t i = 0; i < n16; i += kLanes) top = V::max(top, V::load(p + i));
  const V m = V::bcast(V::hmax(top));
  V total = V::zero();
  for (int64_t i = 0; i < n16; i += kLanes) {
    const V e = exp_nonpositive(V::sub(V::load(p + i), m));
    V::store(p + i, e);
    total = V::add(total, e);
  }
  const V inv = V::bcast(1.f / V::hsum(total));
  for (int64_t c0 = 0; c0 < D; c0 += 4 * kLanes) {  // up to 4 x 16 output columns in registers
    const int nc = static_cast<int>(std::min<int64_t>(4 * kLanes, D - c0) / kLanes);
    V acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
    for (int64_t i = 0; i < n; ++i) {
      const V pi = V::bcast(p[i]);
      const auto* vr = vrow(i) + c0;
      for (int c = 0; c < nc; ++c) acc[c] = V::fma(pi, load_cached(vr + kLanes * c), acc[c]);
    }
    for (int c = 0; c < nc; ++c) V::store(out + c0 + kLanes * c, V::mul(acc[c], inv));
  }
}

// ------------------------------------------------------------------------------ decoder layers

// The share [q0, q1) of n items for thread tid of nt.
inline void share(int64_t n, int tid, int nt, int64_t& q0, int64_t& q1) {
  q0 = n * tid / nt;
  q1 = n * (tid + 1) / nt;
}

// Y (M, N) = X (M, K) W^T [+ bias] [+ add] for thread tid's share of W's panels: float panels here,
// a quantized format by the quantized kernels (quant.h; xq: X's rows quantized, quantize_row).
inline void matmul(const Mat& W, const float* X, int64_t ldx, const QuantRows& xq, int64_t M, float* Y, int64_t ldy,
                   const float* add, const float* bias, int tid, int nt) {
  int64_t q0, q1;
  share((W.N + kLanes - 1) / kLanes, tid, nt, q0, q1);
  if (is_float(W.format))
    matmul_panels(X, M, ldx, W.data, W.format, W.K, W.N, Y, ldy, add, bias, q0, q1);
  else
    g_quant->matmul(xq, M, W, Y, ldy, add, bias, q0, q1);
}

// The rotary table of the window's rows: rope (M, R), cos then sin halves, times the rotary factor.
inline void rope_table(const Shape& s, const Window& w, float* rope) {
  const int64_t M = w.B * w.T, half = s.R / 2;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < half; ++i) {
      const int64_t position = w.positions ? w.positions[m] : w.lengths[m / w.T] + m % w.T;
      const float a = static_cast<float>(position) * w.inv_freq[i];
      rope[m * s.R + i] = std::cos(a) * s.rotary_factor;
      rope[m * s.R + half + i] = std::sin(a) * s.rotary_factor;
    }
}

// qkv (M, E) in place: [q/k norms,] rotary positions on queries and keys; keys and values to the cache.
inline void rotate_and_cache(const LayerWeights& L, const Shape& s, const Window& w, const Cache& cache, float* qkv,
                             const float* rope) {
  const int64_t M = w.B * w.T, D = s.D, half = s.R / 2, E = (s.H + 2 * s.Hkv) * D;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const int64_t b = m / w.T, t = m % w.T, slot = w.lengths[b] + t;
    const float *c = rope + m * s.R, *sn = rope + m * s.R + half;
    for (int64_t hd = 0; hd < s.H + s.Hkv; ++hd) {
      float* v = qkv + m * E + hd * D;
      if (L.q_norm) rms_norm_row(v, hd < s.H ? L.q_norm : L.k_norm, s.eps, D, v);  // in place: x read before y written
      for (int64_t i = 0; i < half; ++i) {
        const float lo = v[i], hi = v[i + half];
        v[i] = lo * c[i] - hi * sn[i];
        v[i + half] = hi * c[i] + lo * sn[i];
      }
    }
    for (int64_t kv = 0; kv < s.Hkv; ++kv) {
      const int64_t at = cache.at(b, kv, slot, D);
      const float *k = qkv + m * E + (s.H + kv) * D, *v = qkv + m * E + (s.H + s.Hkv + kv) * D;
      if (cache.bf16) {
        for (int64_t i = 0; i < D; ++i) {
          static_cast<uint16_t*>(cache.k)[at + i] = to_bf16(k[i]);
          static_cast<uint16_t*>(cache.v)[at + i] = to_bf16(v[i]);
        }
      } else {
        std::memcpy(static_cast<float*>(cache.k) + at, k, D * sizeof(float));
        std::memcpy(static_cast<float*>(cache.v) + at, v, D * sizeof(float));
      }
    }
  }
}

// y (M, H D) = each query head's attention over its committed keys and the new ones it sees. p: this
// thread's scratch (Scratch.p), its last T ints the new tokens a query sees.
inline void attend(const Shape& s, const Window& w, const Cache& cache, const float* qkv, float* y, float* p,
                   int64_t p_stride) {
  const int64_t M = w.B * w.T, D = s.D, G = s.H / s.Hkv, E = (s.H + 2 * s.Hkv) * D, HD = s.H * D;
  int* visible = reinterpret_cast<int*>(p + p_stride - w.T);
#pragma omp for schedule(static)
  for (int64_t item = 0; item < M * s.H; ++item) {  // (b, t, kv head, group member)
    const int64_t m = item / s.H, head = item % s.H, kv = head / G, b = m / w.T, t = m % w.T;
    const int64_t committed = w.lengths[b];
    int64_t n_new = 0;
    for (int64_t u = 0; u < w.T; ++u)
      if (w.tree ? w.tree[(b * w.T + t) * w.T + u] : u <= t) visible[n_new++] = static_cast<int>(u);
    auto key = [&](const auto* base) {  // through the row's block table, in position order
      return [=, &cache](int64_t i) {
        return base + cache.at(b, kv, i < committed ? i : committed + visible[i - committed], D);
      };
    };
    const float *q = qkv + m * E + head * D, scale = 1.f / std::sqrt(static_cast<float>(D));
    if (cache.bf16)
      attend_row(q, D, committed + n_new, key(static_cast<const uint16_t*>(cache.k)),
                 key(static_cast<const uint16_t*>(cache.v)), scale, p, y + m * HD + head * D);
    else
      attend_row(q, D, committed + n_new, key(static_cast<const float*>(cache.k)),
                 key(static_cast<const float*>(cache.v)), scale, p, y + m * HD + head * D);
  }
}

// Row m of a matrix's input, quantized for W where W is quantized (Scratch.xq).
inline void quantize_input(const Mat& W, const float* row, const QuantRows& xq, int64_t m) {
  if (!is_float(W.format)) g_quant->quantize_row(row, W.K, xq, m, quant_kinds(W));
}

// f(m) for the rows m = 0..M-1 of a step between two matrices (a norm, an activation, a row's
// quantization): split among the threads, who then meet at the loop's barrier; or, for one row
// (`alone`: plain decoding's step), computed by every thread itself into its own copy of the
// outputs (Scratch's per-thread rows), so that no barrier is met for a few microseconds of work.
// The same operations either way: the values do not change.
template <class F>
inline void each_row(int64_t M, bool alone, F f) {
  if (alone) return f(0);
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m) f(m);
}

// The rows this thread writes its steps between matrices to: its own where `alone` (Scratch).
struct Rows {
  float *h, *act;
  QuantRows xq;
};

inline Rows rows_of(const Scratch& sc, const Shape& s, bool alone, int tid) {
  if (!alone) return {sc.h, sc.act, sc.xq};
  QuantRows xq = sc.xq;
  xq.q += tid * xq.ld;
  xq.d += tid * xq.blocks;
  xq.sums += tid * xq.blocks;
  xq.kq += tid * xq.ld;
  xq.kd += tid * xq.supers;
  xq.k16 += 2 * tid * xq.blocks;
  xq.k32 += tid * xq.blocks;
  return {sc.h + tid * s.C, sc.act + tid * s.F, xq};
}

// h (M, C) = RMSNorm(x) with scale w, each row quantized for W, the matrix it enters.
inline void norm_rows(const float* x, const float* w, const Shape& s, int64_t M, const Mat& W, const Rows& own,
                      bool alone) {
  each_row(M, alone, [&](int64_t m) {
    rms_norm_row(x + m * s.C, w, s.eps, s.C, own.h + m * s.C);
    quantize_input(W, own.h + m * s.C, own.xq, m);
  });
}

// x += the gated MLP of RMSNorm(x) (+ biases), for rows (M, C) of x.
inline void mlp(const LayerWeights& L, const Shape& s, int64_t M, float* x, const Scratch& sc, const Rows& own,
                bool alone, int tid, int nt) {
  const int64_t C = s.C, F2 = 2 * s.F;
  norm_rows(x, L.norm2, s, M, L.gate_up, own, alone);
  matmul(L.gate_up, own.h, C, own.xq, M, sc.gu, F2, nullptr, L.gate_up_bias, tid, nt);
#pragma omp barrier
  each_row(M, alone, [&](int64_t m) {
    const float* g = sc.gu + m * F2;
    blocks16(g, s.F, [&](int64_t c, V gv, int n) {
      alignas(64) float ub[kLanes] = {};
      std::memcpy(ub, g + s.F + c, n * sizeof(float));
      store_part(own.act + m * s.F + c, s.activation == 0 ? silu_mul(gv, V::load(ub)) : gelu_tanh_mul(gv, V::load(ub)),
                 n);
    });
    quantize_input(L.down, own.act + m * s.F, own.xq, m);
  });
  matmul(L.down, own.act, s.F, own.xq, M, x, C, x, L.down_bias, tid, nt);  // x += act W_down^T [+ b_down]
#pragma omp barrier
}

// Runs `layers` over x (B*T, C) in place, inside an OpenMP parallel region (every thread calls
// it; the steps are separated by barriers). kept[l], if not null, receives x after layer l.
// Scratch (struct Scratch): h (M, C), qkv (M, E), y (M, H D), gu (M, 2F), act (M, F), rope (M, R) cos then
// sin halves (R: the rotated dims of a head, its first ones), p (threads, p_stride) with p_stride >= S
// rounded up to 16, plus T; and a quantized matrix's input rows (xq). For one row (M = 1) h, act and
// xq hold a row per thread (each_row).
inline void decoder_layers(const LayerWeights* layers, int nl, const Shape& s, const Window& w,
                           const Cache* caches, float* x, float* const* kept, const Scratch& sc) {
  const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
  const int64_t M = w.B * w.T, C = s.C, E = (s.H + 2 * s.Hkv) * s.D, HD = s.H * s.D;
  const bool alone = M == 1;
  const Rows own = rows_of(sc, s, alone, tid);
  rope_table(s, w, sc.rope);
  for (int l = 0; l < nl; ++l) {
    const LayerWeights& L = layers[l];
    if (L.norm1) {
      norm_rows(x, L.norm1, s, M, L.qkv, own, alone);
      matmul(L.qkv, own.h, C, own.xq, M, sc.qkv, E, nullptr, L.qkv_bias, tid, nt);
    } else {  // EAGLE-3's layer: q/k/v from the normalised [embedding; g] rows, the attention added to x = g
      if (L.qkv.format != kBf16)
        each_row(M, alone, [&](int64_t m) { quantize_input(L.qkv, sc.wide + m * 2 * C, own.xq, m); });
      matmul(L.qkv, sc.wide, 2 * C, own.xq, M, sc.qkv, E, nullptr, L.qkv_bias, tid, nt);
    }
#pragma omp barrier
    rotate_and_cache(L, s, w, caches[l], sc.qkv, sc.rope);
    attend(s, w, caches[l], sc.qkv, sc.y, sc.p + tid * sc.p_stride, sc.p_stride);
    if (L.o.format != kBf16) each_row(M, alone, [&](int64_t m) { quantize_input(L.o, sc.y + m * HD, own.xq, m); });
    matmul(L.o, sc.y, HD, own.xq, M, x, C, x, L.o_bias, tid, nt);  // x += y W_o^T [+ b_o]
#pragma omp barrier
    mlp(L, s, M, x, sc, own, alone, tid, nt);
    if (kept[l]) {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) std::memcpy(kept[l] + m * C, x + m * C, C * sizeof(float));
    }
  }
}
