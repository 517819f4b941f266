// CPU kernels for decoding with bf16-stored weights and fp32 arithmetic (AVX2 + FMA).
//
// Why: on a CPU without native bf16 (AVX2 only), the cost of PyTorch's bf16 matmul grows about in
// proportion to the number of rows M (4 rows cost about 4 times one row), and its fp32 matmul
// (MKL, on an AMD CPU) reads weights at a fraction of the memory bandwidth. Speculative decoding lives on
// verification being almost as cheap as one token, so the matmul must read each weight once
// for all M rows.
//
// linear(x, w): y[m, n] = sum_k x[m, k] * w[n, k], x fp32 (M, K), w bf16 (N, K) as nn.Linear
// stores it. bf16 -> fp32 is exact (a 16-bit shift), so this is the fp32 product of the stored
// weights. Every output is summed in one fixed order (two 8-lane fp32 accumulators over k, then a
// fixed reduction): its value does not depend on M, on the other rows, or on the thread split — the
// same token gives bit-identical logits whether it is verified alone or among k drafts.
//
// rms_norm(x, w, eps): y = x / sqrt(mean(x^2) + eps) * w over the last dimension, fp32, one call
// instead of the six operators PyTorch dispatches for it.
//
// attention(q, k, v, mask, scale): softmax(q k^T * scale + mask) v for cached decoding, one query
// row at a time in a fixed order, so a row's output too is independent of how many rows share the
// call. With linear and rms_norm this makes the whole forward row-invariant: verifying k drafts
// gives each token the logits it would get decoded alone, bit for bit.
//
// attention_input and attention_output_mlp are a decoder layer's two halves around attention in
// one call each (RMSNorm, projections, rotary positions, residuals, SwiGLU): the same row-wise
// arithmetic without the Python and dispatch cost of the ~30 operators eager PyTorch needs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline __m256 load_bf16(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// The scalar tail k = K8..K-1 (K not a multiple of 8), added after the vector sum.
inline float tail(const float* x, const uint16_t* w, int64_t K8, int64_t K) {
  float s = 0.f;
  for (int64_t k = K8; k < K; ++k) s += x[k] * bf16_to_float(w[k]);
  return s;
}

// Rows m0 .. m0+R-1 of x against weight row w: each weight load serves R rows, and each output
// keeps two accumulators (even and odd blocks of 8) so that one row is not bound by FMA latency.
template <int R>
inline void dot_rows(const float* X, const uint16_t* w, float* Y, int64_t m0, int64_t n,
                     int64_t K, int64_t K8, int64_t N) {
  __m256 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K8; k += 16) {
    const __m256 w0 = load_bf16(w + k), w1 = load_bf16(w + k + 8);
    for (int r = 0; r < R; ++r) {
      even[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(X + (m0 + r) * K + k), even[r]);
      odd[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(X + (m0 + r) * K + k + 8), odd[r]);
    }
  }
  if (k < K8) {
    const __m256 w0 = load_bf16(w + k);
    for (int r = 0; r < R; ++r)
      even[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(X + (m0 + r) * K + k), even[r]);
  }
  for (int r = 0; r < R; ++r)
    Y[(m0 + r) * N + n] = hsum(_mm256_add_ps(even[r], odd[r])) + tail(X + (m0 + r) * K, w, K8, K);
}

// All M rows against weight row n, four rows at a time.
inline void all_rows(const float* X, const uint16_t* w, float* Y, int64_t M, int64_t n,
                     int64_t K, int64_t K8, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_rows<4>(X, w, Y, m, n, K, K8, N);
  switch (M - m) {
    case 3: dot_rows<3>(X, w, Y, m, n, K, K8, N); break;
    case 2: dot_rows<2>(X, w, Y, m, n, K, K8, N); break;
    case 1: dot_rows<1>(X, w, Y, m, n, K, K8, N); break;
  }
}

// x . y over n floats (n a multiple of 8): one 8-lane accumulator.
inline float dot(const float* x, const float* y, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(y + c), acc);
  return hsum(acc);
}

// x . y_i for four consecutive rows y_i of length n: the same arithmetic as dot, interleaved.
inline void dot4(const float* x, const float* y, int64_t n, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t c = 0; c < n; c += 8) {
    const __m256 xv = _mm256_loadu_ps(x + c);
    a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y + c), a0);
    a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y + n + c), a1);
    a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y + 2 * n + c), a2);
    a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y + 3 * n + c), a3);
  }
  out[0] = hsum(a0); out[1] = hsum(a1); out[2] = hsum(a2); out[3] = hsum(a3);
}

inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// e^x for x <= 0 (x = -inf and x < -87 give exactly 0): x = n ln2 + f with |f| <= ln2 / 2,
// e^f by its degree-6 Taylor-like minimax polynomial, 2^n through the exponent bits.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)), keep);
}

// silu(g) * u over n floats: g * sigmoid(g) with sigmoid from e = exp(-|g|).
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 gv = _mm256_loadu_ps(g + c);
    const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  // exp(-|g|)
    const __m256 positive = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 negative = _mm256_div_ps(e, _mm256_add_ps(one, e));
    const __m256 sig = _mm256_blendv_ps(positive, negative, _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ));
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + c)));
  }
  for (; c < n; ++c) out[c] = g[c] / (1.f + std::exp(-g[c])) * u[c];
}

}  // namespace

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "linear: x must be float32");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "linear: w must be a contiguous 2-d bfloat16 tensor");
  TORCH_CHECK(x.size(-1) == w.size(1), "linear: x has ", x.size(-1), " features, w expects ", w.size(1));
  const auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = xs.size(0), K = xs.size(1), N = w.size(0), K8 = K / 8 * 8;
  auto y = torch::empty({M, N}, xs.options());
  const float* X = xs.data_ptr<float>();
  const auto* W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) all_rows(X, W + n * K, Y, M, n, K, K8, N);
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

torch::Tensor rms_norm_f32(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "rms_norm: x and w must be float32");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: w must have x's last dimension");
  const auto xs = x.contiguous();
  const auto ws = w.contiguous();
  const int64_t K = xs.size(-1), M = xs.numel() / K;
  auto y = torch::empty_like(xs);
  const float* X = xs.data_ptr<float>();
  const float* Wt = ws.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = X + m * K;
      float ss = 0.f;
      for (int64_t k = 0; k < K; ++k) ss += xr[k] * xr[k];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(K) + static_cast<float>(eps));
      for (int64_t k = 0; k < K; ++k) Y[m * K + k] = xr[k] * r * Wt[k];
    }
  });
  return y;
}

// q (B, H, R, D); k, v (B, H, S, D) with unit stride in D and D in S (a slice of the cache);
// mask (B, T, S) additive, query row r reading mask row r % T, or an empty tensor (all visible).
// Keys past a row's end are masked to exactly zero weight, so the span S a call happens to have
// changes nothing: blocks of 8 keys always start at key 0, and masked keys add exact zeros.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& mask, double scale) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->dim() == 4, "attention: q, k, v must be 4-d float32");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == H && k.size(3) == D,
              "attention: k and v must be (B, H, S, D) matching q");
  TORCH_CHECK(D % 8 == 0, "attention: head_dim must be a multiple of 8");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == D && v.stride(3) == 1 && v.stride(2) == D,
              "attention: k and v rows must be contiguous");
  const bool masked = mask.numel() > 0;
  const auto ms = masked ? mask.contiguous() : mask;
  const int64_t T = masked ? ms.size(1) : 1;
  TORCH_CHECK(!masked || (ms.scalar_type() == torch::kFloat32 && ms.dim() == 3 && ms.size(0) == B &&
                          ms.size(2) == S && R % T == 0), "attention: mask must be (B, T, S) float32");
  const auto qs = q.contiguous();
  auto y = torch::empty({B, H, R, D}, qs.options());
  const float *Q = qs.data_ptr<float>(), *Kp = k.data_ptr<float>(), *Vp = v.data_ptr<float>();
  const float* Mp = masked ? ms.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t S8 = (S + 7) / 8 * 8;
  at::parallel_for(0, B * H * R, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(S8);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * R), h = (i / R) % H, r = i % R;
      const float* qr = Q + i * D;
      const float* kb = Kp + b * k.stride(0) + h * k.stride(1);
      const float* vb = Vp + b * v.stride(0) + h * v.stride(1);
      const float* mr = masked ? Mp + (b * T + r % T) * S : nullptr;
      int64_t j = 0;
      for (; j + 4 <= S; j += 4) dot4(qr, kb + j * D, D, &p[j]);  // four independent chains
      for (; j < S; ++j) p[j] = dot(qr, kb + j * D, D);
      for (j = 0; j < S; ++j) p[j] = p[j] * sc + (masked ? mr[j] : 0.f);
      for (int64_t j = S; j < S8; ++j) p[j] = -INFINITY;
      __m256 top = _mm256_set1_ps(-INFINITY);
      for (int64_t j = 0; j < S8; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(&p[j]));
      const __m256 m = _mm256_set1_ps(hmax(top));
      __m256 total = _mm256_setzero_ps();
      for (int64_t j = 0; j < S8; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&p[j]), m));
        _mm256_storeu_ps(&p[j], e);
        total = _mm256_add_ps(total, e);
      }
      const __m256 inv = _mm256_set1_ps(1.f / hsum(total));
      for (int64_t c0 = 0; c0 < D; c0 += 64) {  // up to 8 accumulators of 8 columns in registers
        const int nc = static_cast<int>(std::min<int64_t>(64, D - c0) / 8);
        __m256 acc[8];
        for (int c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < S; ++jj) {
          const __m256 pj = _mm256_set1_ps(p[jj]);
          const float* vr = vb + jj * D + c0;
          for (int c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * c), acc[c]);
        }
        for (int c = 0; c < nc; ++c) _mm256_storeu_ps(Y + i * D + c0 + 8 * c, _mm256_mul_ps(acc[c], inv));
      }
    }
  });
  return y;
}

// x (M, C); returns qkv (M, E) = rms_norm(x) W_qkv^T with rotary positions applied to the first
// `rotated` heads of width D (the query and key heads): out_i = x_i cos_i - x_{i+D/2} sin_i for
// i < D/2, x_i cos_i + x_{i-D/2} sin_i above; cos and sin are (M, D).
torch::Tensor attention_input(const torch::Tensor& x, const torch::Tensor& norm_w, double eps,
                              const torch::Tensor& w_qkv, const torch::Tensor& cos,
                              const torch::Tensor& sin, int64_t rotated, int64_t D) {
  const auto h = rms_norm_f32(x, norm_w, eps);
  auto qkv = linear_bf16(h, w_qkv);
  const int64_t M = qkv.numel() / qkv.size(-1), E = qkv.size(-1), half = D / 2;
  TORCH_CHECK(rotated * D <= E && D % 2 == 0, "attention_input: bad head layout");
  const auto cs = cos.reshape({M, D}).contiguous(), sn = sin.reshape({M, D}).contiguous();
  TORCH_CHECK(cs.scalar_type() == torch::kFloat32 && sn.scalar_type() == torch::kFloat32,
              "attention_input: cos and sin must be float32");
  float* Q = qkv.data_ptr<float>();
  const float *Cp = cs.data_ptr<float>(), *Sp = sn.data_ptr<float>();
  std::vector<float> tmp(D);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t hd = 0; hd < rotated; ++hd) {
      float* v = Q + m * E + hd * D;
      const float *c = Cp + m * D, *s = Sp + m * D;
      for (int64_t i = 0; i < half; ++i) {
        tmp[i] = v[i] * c[i] - v[i + half] * s[i];
        tmp[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
      }
      std::memcpy(v, tmp.data(), D * sizeof(float));
    }
  return qkv;
}

// x (M, C) the layer input, y (M, H*D) the attention output; returns
// x2 + W_down (silu(g) * u) where x2 = x + y W_o^T and [g, u] = rms_norm(x2) W_gu^T.
torch::Tensor attention_output_mlp(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& w_o,
                                   const torch::Tensor& norm_w, double eps, const torch::Tensor& w_gu,
                                   const torch::Tensor& w_down) {
  auto x2 = linear_bf16(y, w_o).reshape(x.sizes()).add_(x);
  const auto gu = linear_bf16(rms_norm_f32(x2, norm_w, eps), w_gu);
  const int64_t F = gu.size(-1) / 2, M = gu.numel() / (2 * F);
  auto act = torch::empty({M, F}, gu.options());
  const float* G = gu.data_ptr<float>();
  float* A = act.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) silu_mul(G + m * 2 * F, G + m * 2 * F + F, A + m * F, F);
  return x2.add_(linear_bf16(act, w_down).reshape(x.sizes()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_input", &attention_input, "RMSNorm, the q/k/v projection and rotary positions");
  m.def("attention_output_mlp", &attention_output_mlp, "o projection, residual, RMSNorm, SwiGLU MLP, residual");
  m.def("attention", &attention, "cached attention, one query row at a time (see above)");
  m.def("linear", &linear_bf16, "x (..., K) fp32 times bf16 weight (N, K) transposed, fp32 out");
  m.def("rms_norm", &rms_norm_f32, "RMSNorm over the last dimension, fp32");
}
