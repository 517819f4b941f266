// What the kernels share whatever instruction set runs them: how a matrix is stored, the rows a
// quantized matrix multiplies, a model's decoder layers, the window of new tokens and its cache.
// Plain data, no vector types: cpu.cpp includes it once at file scope, before the vector types
// (vectors.h) and the kernels written over them (isa.h, quant.h).
#pragma once

#include <cstdint>
#include <cstring>

constexpr int kLanes = 16;     // fp32 lanes of a vector V, outputs per packed panel (kernels.LANES)
constexpr int kPrefetch = 48;  // cache lines ahead in each stream of packed weights

// How a matrix is stored (kernels.KERNEL_FORMAT, blocks.BLOCK_FORMATS): panels of 16-bit or 32-bit floats
// (bf16, f16, f32: isa.h) or blocks of 32 quantized weights (quant.h); K-quants and kMixed (runs of outputs
// in different quantized formats): kquant.h. Below kFine, which flags a format.
enum Format : int { kBf16 = 0, kQ8_0 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 4, kQ4_K = 5, kQ6_K = 6, kMixed = 7,
                    kQ5_1 = 8, kQ5_K = 9, kF16 = 10, kF32 = 11, kIQ4_NL = 12, kIQ4_XS = 13, kQ3_K = 14, kQ2_K = 15 };
constexpr int kFormats = 16;
constexpr int64_t kBlock = 32;  // weights per quantized block, along K
// bytes per 16 outputs x 32 k of a quantized format (the file's bytes: 16 outputs' blocks of 32, or an eighth
// of their super-blocks of 256), 0 for the others (quant.h; the K-quants': kquant.h)
constexpr int64_t kPanelBlockBytes[kFormats] = {0, 544, 288, 320, 352, 288, 420, 0, 384, 352, 0, 0, 288, 272, 220, 168};
// weights along K per block of the file: 32, or a K-quant's super-block of 256
constexpr int64_t kFileBlock[kFormats] = {1, 32, 32, 32, 32, 256, 256, 1, 32, 256, 1, 1, 32, 256, 256, 256};
inline bool is_quantized(int64_t format) { return format >= 0 && format < kFormats && kPanelBlockBytes[format] > 0; }
// panels of floats, fp32 activations times the stored weights (isa.h)
inline bool is_float(int64_t format) { return format == kBf16 || format == kF16 || format == kF32; }
constexpr int64_t kMixedHeader = 64;  // kMixed: int32 runs, then (format, N) per run; the runs' data follow
constexpr int kFine = 32;  // a format's flag: a quantized matrix times its rows' rounding residuals too (Mat::fine)
constexpr int64_t kSuper = 256;  // weights per K-quant super-block, along K

// The activation quantizations a quantized format reads (QuantRows): per block of 32 (kPer32), or for a
// K-quant per super-block of 256 (kPer256, as llama.cpp's Q8_K).
constexpr int kPer32 = 1, kPer256 = 2;
inline int quant_kind(int64_t format) { return kFileBlock[format] == kSuper ? kPer256 : kPer32; }

struct Mat {  // a packed matrix of N outputs from K inputs
  int format;
  const void* data;
  int64_t N, K;
  bool fine = false;  // times each input row and its rounding residual, quantized (cpu.cpp: fine_matmul)
};

// The activation quantizations a quantized W reads: its format's kind, or its runs' (kMixed).
inline int quant_kinds(const Mat& W) {
  if (W.format != kMixed) return quant_kind(W.format);
  const int32_t* head = static_cast<const int32_t*>(W.data);
  int kinds = 0;
  for (int32_t i = 0; i < head[0]; ++i) kinds |= quant_kind(head[1 + 2 * i]);
  return kinds;
}

// Activation rows quantized for a quantized matrix (quantize_row), in the kinds its formats read. Per block of
// 32 (kPer32): row m's values q + m ld (int8), its blocks' scales d + m blocks and sums of q sums + m blocks.
// Per super-block of 256 (kPer256): its values kq + m ld, its super-blocks' scales kd + m supers, and the sums
// of q of its sub-blocks of 16, k16 + 2 m blocks, and of 32, k32 + m blocks (int16: |sum| <= 32 x 127).
struct QuantRows {
  int8_t* q;
  float* d;
  int32_t* sums;
  int64_t ld, blocks;
  int8_t* kq;
  float* kd;
  int16_t *k16, *k32;
  int64_t supers;
};

// The quantized kernels of one instruction set (quant.h), chosen for this CPU (cpu.cpp's dispatch).
struct QuantOps {
  const char* name;
  // Y (M, N) = the rows x (quantized) times the panels [q0, q1) of W [+ bias (N,)] [+ add (M, N)]
  void (*matmul)(const QuantRows& x, int64_t M, const Mat& W, float* Y, int64_t ldy, const float* add,
                 const float* bias, int64_t q0, int64_t q1);
  // row m of `rows` from the first K values (K a multiple of 32; of 256 for kPer256) at x, in `kinds`
  void (*quantize_row)(const float* x, int64_t K, const QuantRows& rows, int64_t m, int kinds);
};
extern const QuantOps* g_quant;

// What the decoder layers read and write. Biases and q/k norms are null where the architecture has none.
struct LayerWeights {
  const float* norm1;       // (C,) the input norm's scale (its offset added: Gemma's 1 + w); null: an
                            // EAGLE-3 layer, whose q/k/v read Scratch.wide and whose residual is x as given
  Mat qkv;                  // E = (H + 2 Hkv) D outputs from C (an EAGLE-3 layer: from 2C)
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

// One layer's keys and values in blocks of 2^shift positions (lm/kv_cache.py), float32 or bf16: a block
// is (Hkv, 2^shift, D) elements, block_stride elements after the one before it in the pool; row b's
// position i lies in block table[b * W + (i >> shift)].
struct Cache {
  void* k;
  void* v;
  int64_t block_stride;
  const int32_t* table;  // (B, W) each row's blocks, in position order
  int64_t W;
  int64_t shift;
  bool bf16;

  int64_t S() const { return W << shift; }  // the positions a row's table covers
  // the element offset of row b's key (or value) of kv head `kv` at position i
  int64_t at(int64_t b, int64_t kv, int64_t i, int64_t D) const {
    return table[b * W + (i >> shift)] * block_stride + ((kv << shift) + (i & ((int64_t{1} << shift) - 1))) * D;
  }
};

// x rounded to bf16, to nearest even (as PyTorch converts); a NaN stays a NaN.
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct Scratch {  // one forward's intermediate rows (see isa.h's decoder_layers)
  float *h, *qkv, *y, *gu, *act, *rope, *p;
  int64_t p_stride;
  QuantRows xq;  // a quantized matrix's input rows
  const float* wide = nullptr;  // (M, 2C) what an EAGLE-3 layer's q/k/v read (LayerWeights.norm1 null)
};
