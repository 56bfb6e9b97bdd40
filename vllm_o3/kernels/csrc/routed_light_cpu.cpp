// The routed FFN's router and light path, on x86 CPUs with AVX512-BF16 or
// AVX2 (the inner loops: `routed_tiles.h`, per ISA by `isa_tiles.h`). In
// PyTorch they are a dozen small operations per layer (an upcast, two float32
// linears, silu, sigmoid, the threshold, the partition, two bfloat16
// linears), each with its own dispatch: at decode sizes that dispatch made a
// light token cost 40 % of a heavy one on a small model
// (docs/bench_routed_ffn_layer.md).
//
// Per row: the router score sigmoid(w2 . silu(W1 u + b1) + b2) in float32
// (O3_SPEC section 1: upcast inputs, float32 weights), heavy when
// score >= threshold. `route` returns the scores and the heavy and light
// rows; `routed_light`, for decode-sized batches, also gives the light rows
// up(down(u)) in bfloat16 in the same call, the rank-r intermediate rounded
// to bfloat16 as a 16-bit linear's output is (for larger batches the caller
// runs the light rows through a tiled GEMM). Heavy rows are left for the
// caller's full FFN.
//
// Light weights are in "pair" layout (`pack_pairs` in cpu_routed_ffn.py):
// output channels in blocks of 16, input channels in pairs; each (block,
// pair) is 32 bfloat16 values, channel c's pair at 2c and 2c + 1, i.e. one
// operand of VDPBF16PS against a broadcast pair of inputs (two FMAs per 8
// channels on AVX2).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa_tiles.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

constexpr int64_t kRouterChunk = 64;  // router hidden units padded to a multiple of it
// Below this many multiply-adds a thread's share is not worth waking threads.
constexpr int64_t kMinWorkPerThread = 256 * 1024;

constexpr int kRouterRows = 4;  // rows per router tile

void check_rows(const at::Tensor& u, const char* op) {
  TORCH_CHECK(u.dim() == 2 && u.scalar_type() == at::kBFloat16 && u.is_contiguous(), op,
              ": u must be a contiguous 2-D bfloat16 tensor");
  TORCH_CHECK(u.size(1) % kLanes == 0, op, ": hidden size ", u.size(1),
              " is not a multiple of ", kLanes);
}

// float32 [rows] scores of u's rows; threads split tiles of kRouterRows.
at::Tensor router_scores(const at::Tensor& u, const at::Tensor& w1t, const at::Tensor& b1,
                         const at::Tensor& w2, const at::Tensor& b2) {
  check_rows(u, "router_scores");
  const int64_t rows = u.size(0), hidden = u.size(1);
  const int64_t r_pad = w1t.size(1);
  for (const at::Tensor* t : {&w1t, &b1, &w2, &b2})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "router_scores: router weights must be contiguous float32");
  TORCH_CHECK(w1t.dim() == 2 && w1t.size(0) == hidden && r_pad % kRouterChunk == 0 &&
                  b1.numel() == r_pad && w2.numel() == r_pad && b2.numel() == 1,
              "router_scores: router weights must be [", hidden, ", R'], [R'], [R'], [1]",
              " with R' a multiple of ", kRouterChunk);
  at::Tensor scores = at::empty({rows}, u.options().dtype(at::kFloat));
  const auto* up = reinterpret_cast<const uint16_t*>(u.data_ptr());
  float* sp = scores.data_ptr<float>();
  const float* w1 = w1t.data_ptr<float>();
  const float* bias1 = b1.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  const float bias2 = b2.data_ptr<float>()[0];
  const auto router = tiles().router;
  const int64_t row_tiles = (rows + kRouterRows - 1) / kRouterRows;
  const int64_t tile_work = kRouterRows * hidden * r_pad;
  at::parallel_for(0, row_tiles, std::max<int64_t>(1, kMinWorkPerThread / tile_work),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t tile = begin; tile < end; ++tile) {
                       const int64_t t = tile * kRouterRows;
                       router(static_cast<int>(std::min<int64_t>(kRouterRows, rows - t)),
                              up + t * hidden, hidden, w1, bias1, w2p, bias2, r_pad, sp + t);
                     }
                   });
  return scores;
}

// Row r of the product goes from x + x_row[r] * x_stride to
// y + y_row[r] * y_stride (strides in bfloat16 values; x_row/y_row null:
// the identity). Threads split tiles of (rows, output blocks).
void pair_gemm(int64_t rows, const uint16_t* x, const int64_t* x_row,
               int64_t x_stride, const at::Tensor& weight, uint16_t* y,
               const int64_t* y_row, int64_t y_stride, int64_t n_out) {
  const int64_t blocks = weight.size(0), pairs = weight.size(1);
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const Tiles& isa = tiles();
  const int64_t row_tiles = (rows + isa.pair_rows - 1) / isa.pair_rows;
  const int64_t block_tiles = (blocks + isa.pair_blocks - 1) / isa.pair_blocks;
  const int64_t work_per_tile = isa.pair_rows * isa.pair_blocks * kLanes * pairs * 2;
  at::parallel_for(
      0, row_tiles * block_tiles, std::max<int64_t>(1, kMinWorkPerThread / work_per_tile),
      [&](int64_t begin, int64_t end) {
        for (int64_t tile = begin; tile < end; ++tile) {
          const int64_t m0 = tile / block_tiles * isa.pair_rows;
          const int64_t b0 = tile % block_tiles * isa.pair_blocks;
          const int n_rows = static_cast<int>(std::min<int64_t>(isa.pair_rows, rows - m0));
          const int n_blocks = static_cast<int>(std::min<int64_t>(isa.pair_blocks, blocks - b0));
          const uint32_t* xs[kMaxPairTileRows];
          uint16_t* ys[kMaxPairTileRows];
          for (int m = 0; m < n_rows; ++m) {
            const int64_t xr = x_row ? x_row[m0 + m] : m0 + m;
            const int64_t yr = y_row ? y_row[m0 + m] : m0 + m;
            xs[m] = reinterpret_cast<const uint32_t*>(x + xr * x_stride);
            ys[m] = y + yr * y_stride;
          }
          isa.pair_gemm(n_rows, n_blocks, xs, w, pairs, b0, ys, n_out);
        }
      });
}

void check_pair_weight(const at::Tensor& w, int64_t in, int64_t out, const char* name) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 2 * kLanes && w.scalar_type() == at::kShort &&
                  w.is_contiguous(),
              "routed_light: ", name, " must be int16 [blocks, pairs, 32]");
  TORCH_CHECK(w.size(1) * 2 >= in && w.size(1) * 2 <= in + 1 &&
                  w.size(0) * kLanes >= out && w.size(0) * kLanes < out + kLanes,
              "routed_light: ", name, " holds ", w.size(1) * 2, " x ", w.size(0) * kLanes,
              " channels, not ", in, " x ", out);
}

// (scores, heavy row indices, light row indices), each list in row order;
// `counts` (optional) gains [heavy rows, rows]: the router statistics,
// without another operation.
std::tuple<at::Tensor, at::Tensor, at::Tensor> route(
    const at::Tensor& u, const at::Tensor& w1t, const at::Tensor& b1,
    const at::Tensor& w2, const at::Tensor& b2, double threshold,
    const std::optional<at::Tensor>& counts) {
  TORCH_CHECK(!counts.has_value() || (counts->scalar_type() == at::kLong &&
                                      counts->numel() == 2 && counts->is_contiguous()),
              "route: counts must be a contiguous int64 [2]");
  at::Tensor scores = router_scores(u, w1t, b1, w2, b2);
  const int64_t rows = u.size(0);
  const float* sp = scores.data_ptr<float>();
  // Compared in float32, as torch compares a float32 tensor with a scalar.
  const float cut = static_cast<float>(threshold);
  int64_t num_heavy = 0;
  for (int64_t t = 0; t < rows; ++t) num_heavy += sp[t] >= cut;
  at::Tensor heavy_rows = at::empty({num_heavy}, u.options().dtype(at::kLong));
  at::Tensor light_rows = at::empty({rows - num_heavy}, u.options().dtype(at::kLong));
  int64_t* hp = heavy_rows.data_ptr<int64_t>();
  int64_t* lp = light_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) *(sp[t] >= cut ? hp++ : lp++) = t;
  if (counts.has_value()) {
    int64_t* cp = counts->data_ptr<int64_t>();
    cp[0] += num_heavy;
    cp[1] += rows;
  }
  return {scores, heavy_rows, light_rows};
}

// route(), then the light path on the light rows: (y, scores, heavy rows),
// y [0, H] when no row is light.
std::tuple<at::Tensor, at::Tensor, at::Tensor> routed_light(
    const at::Tensor& u, const at::Tensor& w1t, const at::Tensor& b1,
    const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& down,
    const at::Tensor& up, int64_t rank, double threshold,
    const std::optional<at::Tensor>& counts) {
  check_rows(u, "routed_light");
  const int64_t hidden = u.size(1);
  check_pair_weight(down, hidden, rank, "down");
  check_pair_weight(up, rank, hidden, "up");
  auto [scores, heavy_rows, light_rows] = route(u, w1t, b1, w2, b2, threshold, counts);
  const int64_t num_light = light_rows.size(0);
  // No light row: nothing to write, and the caller runs the full FFN on u.
  at::Tensor y = num_light > 0 ? at::empty_like(u) : at::empty({0, hidden}, u.options());
  if (num_light > 0) {
    const int64_t mid_width = down.size(0) * kLanes;  // >= rank + 1 when odd
    at::Tensor mid = at::empty({num_light, mid_width}, u.options());
    auto* mp = reinterpret_cast<uint16_t*>(mid.data_ptr());
    const int64_t* light = light_rows.data_ptr<int64_t>();
    // Every column of `mid` is written (padded channels' weights are zero),
    // so the up projection's padded input pair reads zeros.
    pair_gemm(num_light, reinterpret_cast<const uint16_t*>(u.data_ptr()), light, hidden,
              down, mp, nullptr, mid_width, mid_width);
    pair_gemm(num_light, mp, nullptr, mid_width, up,
              reinterpret_cast<uint16_t*>(y.data_ptr()), light, hidden, hidden);
  }
  return {y, scores, heavy_rows};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(o3_cpu, m) {
  m.def("routed_light(Tensor u, Tensor w1t, Tensor b1, Tensor w2, Tensor b2, Tensor down, "
        "Tensor up, int rank, float threshold, Tensor(a!)? counts) -> (Tensor, Tensor, Tensor)");
  m.impl("routed_light", c10::DispatchKey::CPU, TORCH_FN(routed_light));
  m.def("route(Tensor u, Tensor w1t, Tensor b1, Tensor w2, Tensor b2, float threshold, "
        "Tensor(a!)? counts) -> (Tensor, Tensor, Tensor)");
  m.impl("route", c10::DispatchKey::CPU, TORCH_FN(route));
}
