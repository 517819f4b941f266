// CPU kernels for decoding with float-stored (bf16, f16, f32) or block-quantized weights (Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, IQ4_NL; the K-quants Q4_K, Q5_K, Q6_K and IQ4_XS) and fp32 arithmetic, for AVX-512 and AVX2.
//
// Why: speculative decoding pays only when verifying k+1 tokens costs about what one token costs.
// One token reads every weight once (memory-bound); k+1 tokens must share each weight load and
// each register tile (compute-bound), and nothing else may eat the step — not Python, not ~30
// PyTorch operators per layer. So a matrix is packed once at load into panels of 16 outputs
// (isa.h), a tile of up to 8 rows (6 on AVX2) x up to 8 panels lives in registers, and a model's decoder
// layers run in one call and one OpenMP parallel region (`Stack`).
//
// The files: types.h (the plain structs every part shares), vectors.h (the 16-lane vector types of
// each instruction set), isa.h (the kernels over them: matrices, attention, the decoder layers),
// quant.h (the quantized matrices), threads.h (how many threads a call runs on), matrices.h (the packed
// matrices a call is given, checked); this file compiles
// isa.h and quant.h once per instruction set, picks one at run time and binds them to Python.
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
#include <utility>
#include <vector>

#include "matrices.h"
#include "threads.h"
#include "types.h"
#include "vectors.h"

// ---------------------------------------------------------------------------------- AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace avx512 {
#include "isa.h"
}  // namespace avx512
#pragma GCC pop_options

// --------------------------------------------------------------------- AVX-512 VNNI (quantized)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")
namespace avx512_vnni {
using avx512::store_tile;
#include "quant.h"
#include "kquant.h"
}  // namespace avx512_vnni
#pragma GCC pop_options

// ------------------------------------------------------------------------------- AVX2 + FMA
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "isa.h"
#include "quant.h"
#include "kquant.h"
}  // namespace avx2
#pragma GCC pop_options

// ------------------------------------------------------------------------------- dispatch

namespace {

struct Ops {
  const char* name;
  void (*matmul_panels)(const float*, int64_t, int64_t, const void*, int, int64_t, int64_t, float*, int64_t,
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

const QuantOps kQuantVnni{"avx512_vnni", avx512_vnni::kquant_matmul, avx512_vnni::quantize_row};
const QuantOps kQuantAvx2{"avx2", avx2::kquant_matmul, avx2::quantize_row};

bool has_avx512_vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }

const Ops* g_ops = has_avx512() ? &kAvx512 : &kAvx2;

// Threads for a call that reads `bytes` of weights for `rows` rows: below about a megabyte of
// weight traffic (a draft model's layer, one token) a second thread costs more in wake-ups and
// barriers than it saves; above it, the thread policy's count (threads.h: the cores other
// processes leave free, or a fixed count). Results never depend on it.
int threads(int64_t bytes, int64_t rows) {
  return bytes * rows < (int64_t{1} << 20) ? 1 : thread_policy::threads(std::max(1, at::get_num_threads()));
}

void run_matmul(const Mat& W, const float* X, int64_t M, float* Y, const float* add, const float* bias);

// run_matmul for a quantized W with fine activations (kernels.Matrix.fine): each row x of X and its
// rounding residual r = x - q dx (q, dx: x quantized as W's format reads it, quantize_row; fp32 products and
// differences)
// are multiplied as two rows of one call, whose weights are read once for both; row m of Y is then
// (x W^T + r W^T) [+ bias] [+ add], added in that order. r's own rounding is ~1/254 of r's largest
// value per block, itself ~1/254 of x's: the product is within ~1e-5 of x's largest magnitude per block
// where one pass is within ~4e-3.
void fine_matmul(const Mat& W, const float* X, int64_t M, float* Y, const float* add, const float* bias) {
  TORCH_CHECK(W.format != kMixed, "fine activations are for a matrix of one format");
  const int64_t K = W.K, N = W.N;
  const int kind = quant_kind(W.format);
  std::vector<float> rows(2 * M * K), y(2 * M * N);
  QuantBuffer xq(1, K);
  const int8_t* q = kind == kPer256 ? xq.rows.kq : xq.rows.q;
  const float* d = kind == kPer256 ? xq.rows.kd : xq.rows.d;
  const int64_t width = kind == kPer256 ? kSuper : kBlock;
  for (int64_t m = 0; m < M; ++m) {
    const float* x = X + m * K;
    float* r = rows.data() + (2 * m + 1) * K;
    g_quant->quantize_row(x, K, xq.rows, 0, kind);
    std::memcpy(rows.data() + 2 * m * K, x, K * sizeof(float));
    for (int64_t k = 0; k < K; ++k) r[k] = x[k] - static_cast<float>(q[k]) * d[k / width];
  }
  Mat coarse = W;
  coarse.fine = false;
  run_matmul(coarse, rows.data(), 2 * M, y.data(), nullptr, nullptr);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float v = y[2 * m * N + n] + y[(2 * m + 1) * N + n];
      if (bias) v += bias[n];
      if (add) v += add[m * N + n];
      Y[m * N + n] = v;
    }
}

// Y (M, N) = X (M, K) W^T [+ bias (N,)] [+ add (M, N)] on the threads the weight traffic calls for.
void run_matmul(const Mat& W, const float* X, int64_t M, float* Y, const float* add, const float* bias) {
  const int64_t P = (W.N + 15) / 16;
  if (M == 0 || P == 0) return;  // nothing to compute (and no thread to run it on)
  if (W.fine) return fine_matmul(W, X, M, Y, add, bias);
  const bool quantized = !is_float(W.format);
  QuantBuffer xq(quantized ? M : 0, quantized ? W.K : 0);
  for (int64_t m = 0; quantized && m < M; ++m) g_quant->quantize_row(X + m * W.K, W.K, xq.rows, m, quant_kinds(W));
  const int nt = static_cast<int>(std::min<int64_t>(threads(matrix_bytes(W), M), P));
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t q0 = P * tid / n, q1 = P * (tid + 1) / n;
    if (quantized)
      g_quant->matmul(xq.rows, M, W, Y, W.N, add, bias, q0, q1);
    else
      g_ops->matmul_panels(X, M, W.K, W.data, W.format, W.K, W.N, Y, W.N, add, bias, q0, q1);
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
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t format, int64_t N,
                     const torch::Tensor& add, const torch::Tensor& bias) {
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

// The rows of x (M, K) quantized as the quantized kernels quantize them per block of `width` (32, or 256 for
// the K-quants): (q int8 (M, K), d (M, K/width), sums of q (M, K/32) int32 or per sub-block of 16 (M, K/16)
// int16) — for the tests of blocks.quantize_rows.
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, int64_t width) {
  TORCH_CHECK(width == kBlock || width == kSuper, "quantize_rows: width must be 32 or 256");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.size(1) % width == 0,
              "quantize_rows: x must be (M, K) float32 with K a multiple of ", width);
  const auto xs = x.contiguous();
  QuantBuffer out(xs.size(0), xs.size(1));
  const int kind = width == kSuper ? kPer256 : kPer32;
  for (int64_t m = 0; m < xs.size(0); ++m)
    g_quant->quantize_row(xs.data_ptr<float>() + m * xs.size(1), xs.size(1), out.rows, m, kind);
  if (kind == kPer256) return {out.kq, out.kd, out.k16};
  return {out.q, out.d, out.sums};
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "rms_norm: x and w must be float32");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: w must have x's last dimension");
  const auto xs = x.contiguous();
  const auto ws = w.contiguous();
  const int64_t K = xs.size(-1), M = K ? xs.numel() / K : 0;
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
  bool wide = false;        // its first layer is EAGLE-3's: q/k/v read 2C-wide rows (forward's `wide`)

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
        TORCH_CHECK(it != layer.end() && f != formats[i].end(), "Stack: a layer has no '", name,
                    "' or no format for it");
        owned.push_back(it->second);
        const Mat m = matrix(it->second, f->second, N, K, name);
        TORCH_CHECK(!m.fine, "Stack: ", name, " has fine activations, which only a lone matrix's call multiplies");
        total_bytes += matrix_bytes(m);
        if (!is_float(m.format)) quantized_k = std::max(quantized_k, K);
        return m;
      };
      const float* norm1 = floats(layer, "norm1", s.C, true);  // none: an EAGLE-3 layer (types.h), first of its stack
      TORCH_CHECK(norm1 || i == 0, "Stack: only the first layer may read 2C-wide rows (no norm1)");
      wide = wide || !norm1;
      LayerWeights L{norm1, packed("qkv", norm1 ? s.C : 2 * s.C, E), floats(layer, "qkv_bias", E, true),
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

  // x (B, T, C) the layer input; k_pool, v_pool (L', N, Hkv, BLOCK, D) views of a pool of N blocks
  // (lm/kv_cache.py), with this stack's layers at layer0..; table (B, W) int32 each row's blocks; lengths (B,)
  // committed entries; positions (B, T) or empty (lengths[b] + t); tree (B, T, T) bool or empty (causal).
  // Returns [x after the last layer, then x after each layer in `keep`]; the cache gains the new
  // entries at positions lengths[b] + t (the caller lent their blocks, and advances the lengths).
  // With an EAGLE-3 first layer, `wide` (B, T, 2C) is what its q/k/v read (x: the residual, g).
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                     const torch::Tensor& table,
                                     int64_t layer0, const torch::Tensor& lengths, const torch::Tensor& positions,
                                     const torch::Tensor& inv_freq, const torch::Tensor& tree,
                                     const std::vector<int64_t>& keep, const torch::Tensor& wide_rows) {
    const auto& s = shape;
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.size(2) == s.C,
                "Stack: x must be (B, T, C) float32");
    const int64_t B = x.size(0), T = x.size(1), M = B * T, nl = static_cast<int64_t>(layers.size());
    TORCH_CHECK(wide_rows.numel() == (wide ? 2 * M * s.C : 0) &&
                    (!wide || (wide_rows.scalar_type() == torch::kFloat32 && wide_rows.is_contiguous())),
                wide ? "Stack: an EAGLE-3 layer needs its (B, T, 2C) contiguous float32 input rows"
                     : "Stack: 2C-wide rows are for an EAGLE-3 layer");
    const int64_t BS = k_pool.dim() == 5 ? k_pool.size(3) : 0;
    for (const auto* c : {&k_pool, &v_pool})
      TORCH_CHECK((c->scalar_type() == torch::kFloat32 || c->scalar_type() == torch::kBFloat16) &&
                  c->scalar_type() == k_pool.scalar_type() && c->dim() == 5 && c->sizes() == k_pool.sizes() &&
                  c->strides() == k_pool.strides() && c->size(2) == s.Hkv && c->size(4) == s.D &&
                  c->stride(4) == 1 && c->stride(3) == s.D && c->stride(2) == BS * s.D && BS > 0 &&
                  (BS & (BS - 1)) == 0 && layer0 >= 0 && layer0 + nl <= c->size(0),
                  "Stack: the pools must be (layers, N, Hkv, BLOCK, D) float32 or bf16 views, each block's "
                  "(Hkv, BLOCK, D) contiguous, BLOCK a power of two, holding this stack's layers");
    TORCH_CHECK(table.scalar_type() == torch::kInt32 && table.is_contiguous() && table.dim() == 2 && table.size(0) == B,
                "Stack: table must be (B, W) int32");
    const int32_t* blocks = table.data_ptr<int32_t>();
    for (int64_t i = 0; i < table.numel(); ++i)
      TORCH_CHECK(blocks[i] >= 0 && blocks[i] < k_pool.size(1), "Stack: block ", blocks[i], " outside the pool of ",
                  k_pool.size(1));
    TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.is_contiguous() && lengths.numel() == B,
                "Stack: lengths must be (B,) int64");
    const bool given = positions.numel() > 0;
    TORCH_CHECK(!given ||
                    (positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == M),
                "Stack: positions must be (B, T) int64, or empty for each row's length + 0..T-1");
    TORCH_CHECK(inv_freq.scalar_type() == torch::kFloat32 && inv_freq.is_contiguous() && inv_freq.numel() == s.R / 2,
                "Stack: inv_freq must be (R/2,) float32");
    const bool treed = tree.numel() > 0;
    TORCH_CHECK(!treed || (tree.scalar_type() == torch::kBool && tree.is_contiguous() && tree.numel() == B * T * T),
                "Stack: tree must be (B, T, T) bool");
    const int64_t S = table.size(1) * BS;
    const int64_t* len = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(len[b] >= 0 && len[b] + T <= S, "Stack: row ", b, " has ", len[b], " cached entries; ", T,
                  " more do not fit in the ", S, " positions of its blocks");
    for (int64_t l : keep) TORCH_CHECK(l >= 0 && l < nl, "Stack: kept layer ", l, " out of range");

    auto out = x.contiguous().clone();
    const auto opts = x.options();
    const int64_t E = (s.H + 2 * s.Hkv) * s.D;
    const int nt = threads(layer_bytes, M);
    const int64_t own = M == 1 ? nt : M;  // one row: h, act and xq a row per thread (isa.h's each_row)
    auto h = torch::empty({own, s.C}, opts), qkv = torch::empty({M, E}, opts), y = torch::empty({M, s.H * s.D}, opts);
    auto gu = torch::empty({M, 2 * s.F}, opts), act = torch::empty({own, s.F}, opts), rope = torch::empty({M, s.R}, opts);
    const int64_t ps = (S + 15) / 16 * 16 + T;
    auto p = torch::empty({nt, ps}, opts);
    QuantBuffer xq(quantized_k ? own : 0, quantized_k);
    std::vector<torch::Tensor> result{out};
    std::vector<float*> kept(nl, nullptr);
    for (int64_t l : keep) {
      result.push_back(torch::empty({B, T, s.C}, opts));
      kept[l] = result.back().data_ptr<float>();
    }
    std::vector<Cache> caches;
    const int64_t per_layer = k_pool.stride(0) * k_pool.element_size();
    const bool bf16 = k_pool.scalar_type() == torch::kBFloat16;
    int64_t shift = 0;
    while ((int64_t{1} << shift) < BS) ++shift;
    for (int64_t l = 0; l < nl; ++l)
      caches.push_back({static_cast<char*>(k_pool.data_ptr()) + (layer0 + l) * per_layer,
                        static_cast<char*>(v_pool.data_ptr()) + (layer0 + l) * per_layer, k_pool.stride(1), blocks,
                        table.size(1), shift, bf16});
    const Window w{B, T, len, given ? positions.data_ptr<int64_t>() : nullptr, treed ? tree.data_ptr<bool>() : nullptr,
                         inv_freq.data_ptr<float>()};
    const Scratch scratch{h.data_ptr<float>(), qkv.data_ptr<float>(), y.data_ptr<float>(), gu.data_ptr<float>(),
                          act.data_ptr<float>(), rope.data_ptr<float>(), p.data_ptr<float>(), ps, xq.rows,
                          wide ? wide_rows.data_ptr<float>() : nullptr};
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
                                       const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                       const torch::Tensor& cache_table, const torch::Tensor& lengths,
                                       const torch::Tensor& positions,
                                       const torch::Tensor& inv_freq, const torch::Tensor& columns,
                                       const torch::Tensor& norm, double eps, const torch::Tensor& unembed,
                                       int64_t unembed_format, const torch::Tensor& vocab_ids, bool logits) {
  const int64_t C = stack.shape.C;
  TORCH_CHECK(table.scalar_type() == torch::kFloat32 && table.is_contiguous() && table.dim() == 2 && table.size(1) == C,
              "draft_block: the embedding must be (V, C) contiguous float32");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.is_contiguous() && ids.dim() == 2,
              "draft_block: ids must be (B, W) int64");
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
  TORCH_CHECK(stack.wide == (fused && proj.numel() == 0),
              stack.wide ? "draft_block: an EAGLE-3 layer reads [RMSNorm(emb); RMSNorm(prev)] itself: pass prev, "
                           "no projection"
                         : "draft_block: a standard layer reads proj([RMSNorm(emb); RMSNorm(prev)]): pass the "
                           "projection");
  const Mat Pj = fused && !stack.wide ? matrix(proj, proj_format, C, 2 * C, "draft_block input projection") : Mat{};
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < V, "draft_block: token id ", id[i], " outside the embedding (", V, " rows)");
  const float* T = table.data_ptr<float>();
  auto x = torch::empty({B, W, C}, table.options());
  float* X = x.data_ptr<float>();
  auto both = torch::empty({fused ? M : 0, 2 * C}, table.options());
  if (!fused) {
    for (int64_t i = 0; i < M; ++i) std::memcpy(X + i * C, T + id[i] * C, C * sizeof(float));
  } else {  // [RMSNorm(emb); RMSNorm(prev)] (M, 2C), then the projection to C, or (EAGLE-3) the layer's own
    float* Z = both.data_ptr<float>();
    const float* Pv = prev.data_ptr<float>();
    for (int64_t i = 0; i < M; ++i) {
      g_ops->rms_norm_row(T + id[i] * C, embed_norm.data_ptr<float>(), static_cast<float>(eps), C, Z + i * 2 * C);
      g_ops->rms_norm_row(Pv + i * C, prev_norm.data_ptr<float>(), static_cast<float>(eps), C, Z + i * 2 * C + C);
    }
    if (stack.wide)
      std::memcpy(X, Pv, M * C * sizeof(float));  // the residual is prev itself
    else
      run_matmul(Pj, Z, M, X, nullptr, nullptr);
  }
  const auto out = stack.forward(x, k_pool, v_pool, cache_table, 0, lengths, positions, inv_freq,
                                 torch::empty({0}, ids.options().dtype(torch::kBool)), {},
                                 stack.wide ? both : torch::empty({0}, table.options()))[0];
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

// The 32-bit hashes behind seeded sampling's Gumbel noise (decoding/sampling.py, noise_rows): for
// key r and token id v < length, mix32(mix32(v ^ low[r]) ^ high[r]), Wellons' lowbias32 — the very
// integers of the NumPy reference, in a loop the compiler vectorises (`hash_rows`; NumPy takes ~20
// passes over temporaries for the same row).
static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Compiled for AVX2 (the kernels run only where it is: kernels.compiled), whose 8-lane 32-bit products
// the loop is vectorised with; this file's baseline, SSE2, has none, and the loop ran several times slower
// there (docs/evidence/behind-the-code.md).
__attribute__((target("avx2"))) static void hash_rows(const uint32_t* L, const uint32_t* H, int64_t R,
                                                       int64_t length, uint32_t* O) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < length; ++v) O[r * length + v] = mix32(mix32(static_cast<uint32_t>(v) ^ L[r]) ^ H[r]);
}

torch::Tensor noise_hashes(const torch::Tensor& low, const torch::Tensor& high, int64_t length) {
  TORCH_CHECK(low.scalar_type() == torch::kInt32 && high.scalar_type() == torch::kInt32 && low.dim() == 1 &&
              low.sizes() == high.sizes() && length >= 0, "noise_hashes: low and high int32 (R,), length >= 0");
  const auto lo = low.contiguous(), hi = high.contiguous();
  const int64_t R = lo.size(0);
  auto out = torch::empty({R, length}, lo.options());
  const auto* L = reinterpret_cast<const uint32_t*>(lo.data_ptr<int32_t>());
  const auto* H = reinterpret_cast<const uint32_t*>(hi.data_ptr<int32_t>());
  hash_rows(L, H, R, length, reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction set the kernels run on: avx512 or avx2");
  m.def("quant_isa", &quant_isa, "the instruction set the quantized kernels run on: avx512_vnni or avx2");
  m.def("set_isa", &set_isa, "run on avx512 or avx2 (same results; for tests and measurements)");
  m.def("linear", &linear,
        "x (..., K) fp32 times a packed matrix (format) with N outputs, transposed [+ bias] [+ add]");
  m.def("format_table", [] {
    std::vector<std::pair<int64_t, int64_t>> table;
    for (int f = 0; f < kFormats; ++f) table.emplace_back(kPanelBlockBytes[f], kFileBlock[f]);
    return table;
  }, "per Format (types.h): a quantized format's bytes per 16 outputs x 32 k (0: not one), its file's block along K");
  m.def("quantize_rows", &quantize_rows, "x (M, K) quantized per block of width (32 or 256) as the quantized kernels "
        "do: q, d, sums", py::arg("x"), py::arg("width") = kBlock);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, fp32");
  m.def("noise_hashes", &noise_hashes, "(R, length) int32: seeded sampling's 32-bit hashes of token ids 0.. per key");
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
