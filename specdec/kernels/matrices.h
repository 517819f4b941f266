// The packed matrices a call is given (kernels.Matrix), checked: their format, shape and bytes; and the
// storage of the rows a quantized one multiplies (QuantBuffer).
// Included by cpu.cpp alone (an unnamed namespace: its names stay in that file).
#pragma once

#include <torch/extension.h>

#include "types.h"

namespace {

// The packed float panels `w` (panels, K, 16) of a matrix in float `format` (bf16, f16, f32), checked.
void check_packed(const torch::Tensor& w, int64_t format, int64_t K, int64_t N, const char* what) {
  const auto dtype = format == kF32 ? torch::kFloat32 : format == kF16 ? torch::kFloat16 : torch::kBFloat16;
  TORCH_CHECK(w.scalar_type() == dtype && w.dim() == 3 && w.size(2) == 16 && w.is_contiguous(), what,
              ": expected a packed (panels, K, 16) contiguous ", dtype, " matrix (kernels.Matrix)");
  TORCH_CHECK(w.size(1) == K && w.size(0) == (N + 15) / 16, what, ": packed matrix is (", w.size(0), ", ",
              w.size(1), ", 16), expected (", (N + 15) / 16, ", ", K, ", 16)");
}

// Bytes of a packed matrix of N outputs from K inputs in `format` (not kMixed).
int64_t matrix_bytes(int64_t format, int64_t N, int64_t K) {
  const int64_t panels = (N + 15) / 16;
  if (is_float(format)) return panels * K * 16 * (format == kF32 ? 4 : 2);
  return panels * (K / kBlock) * kPanelBlockBytes[format];
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
    TORCH_CHECK(is_quantized(f) && rows > 0 && (i + 1 == head[0] || rows % 16 == 0), what,
                ": run ", i, " of a mixed matrix is format ", f, " with ", rows, " outputs");
    TORCH_CHECK(K % kFileBlock[f] == 0, what, ": run ", i, " cannot hold rows of ", K);
    n += rows;
    bytes += matrix_bytes(f, rows, K);
  }
  TORCH_CHECK(n == N && w.numel() == bytes, what, ": a mixed matrix's runs hold ", n, " outputs in ", bytes,
              " bytes; expected ", N, " outputs in ", w.numel(), " bytes");
  return {kMixed, w.data_ptr<uint8_t>(), N, K};
}

// The packed matrix `w` in `format` (kernels.FORMATS) with N outputs from K inputs, checked.
Mat matrix(const torch::Tensor& w, int64_t format, int64_t N, int64_t K, const char* what) {
  if (format & kFine) {  // a quantized matrix times its rows and their rounding residuals (fine_matmul)
    TORCH_CHECK(!is_float(format & ~kFine), what, ": fine activations are for a quantized matrix");
    Mat W = matrix(w, format & ~kFine, N, K, what);
    W.fine = true;
    return W;
  }
  if (is_float(format)) {
    check_packed(w, format, K, N, what);
    return {static_cast<int>(format), w.data_ptr(), N, K};
  }
  if (format == kMixed) return mixed_matrix(w, N, K, what);
  TORCH_CHECK(is_quantized(format), what, ": unknown matrix format ", format);
  const int64_t block = kFileBlock[format];  // a K-quant's super-blocks (kquant.h)
  TORCH_CHECK(K % block == 0, what, ": a matrix in this format needs K a multiple of ", block, ", got ", K);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == matrix_bytes(format, N, K), what,
              ": expected its packed blocks as ", matrix_bytes(format, N, K), " contiguous uint8 (kernels.Matrix)");
  return {static_cast<int>(format), w.data_ptr<uint8_t>(), N, K};
}

// Storage for M activation rows of up to K values quantized for a quantized matrix (QuantRows), per block
// of 32 and per super-block of 256.
struct QuantBuffer {
  torch::Tensor q, d, sums, kq, kd, k16, k32;
  QuantRows rows{};
  QuantBuffer(int64_t M, int64_t K)
      : q(torch::empty({M, K}, torch::kInt8)), d(torch::empty({M, K / kBlock}, torch::kFloat32)),
        sums(torch::empty({M, K / kBlock}, torch::kInt32)), kq(torch::empty({M, K}, torch::kInt8)),
        kd(torch::empty({M, (K + kSuper - 1) / kSuper}, torch::kFloat32)),
        k16(torch::empty({M, 2 * (K / kBlock)}, torch::kInt16)), k32(torch::empty({M, K / kBlock}, torch::kInt16)) {
    rows = {q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<int32_t>(), K, K / kBlock, kq.data_ptr<int8_t>(),
            kd.data_ptr<float>(), k16.data_ptr<int16_t>(), k32.data_ptr<int16_t>(), (K + kSuper - 1) / kSuper};
  }
};

}  // namespace
