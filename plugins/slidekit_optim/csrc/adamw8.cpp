// slidekit fused CPU AdamW with block-wise 8-bit moments: one pass over a unit, block by block.
//
// The state is that of slidekit_optim/quant8.py: per block of 256 elements (the last may be
// shorter) one FP32 scale A and one uint8 code per element, for each moment, decoding to
// map[code] * A. Per block, everything stays in two 1 KiB stack buffers between reading the
// codes and writing the new ones:
//
//     m, v  = m_map[mc] * A_m,  v_map[vc] * A_v           decode (one FP32 multiply each)
//     then per element, all in FP32, one IEEE-754 operation rounded to nearest even at a time,
//     in exactly this order (the torch path of adamw_8bit.py, and layer_adam, run the same):
//       g   = float(grad[i])                  BF16 upcast is exact
//       p   = p * decay                       only where the range decays; decay = 1 - lr * wd
//       m   = m + w1 * (g - m)                w1 = 1 - beta1
//       v   = v * beta2
//       v   = v + (w2 * g) * g                w2 = 1 - beta2
//       den = sqrt(v) * inv_b2 + eps          inv_b2 = 1 / sqrt(1 - beta2^t); sqrt correctly rounded
//       p   = p + (neg_step * m) / den        neg_step = -lr / (1 - beta1^t)
//       out[i] = bf16(p)                      round to nearest even, when an output is given
//     A'    = max |m| over the block          (likewise for v)
//     y     = m / (A' > 0 ? A' : 1)           one FP32 division
//     code  = table[key] + (y > threshold[key]),  key = bits(y) >> 15
//
// The last line is quant8.encode: round to the nearest map value, ties to the smaller code, via
// a 2^17-entry table indexed by y's top 17 bits and one comparison (quant8 proves it equal to a
// binary search over the map's midpoints). The maps and tables come from Python with every call,
// so whatever QuantMap the optimizer holds is the one used.
//
// The file is compiled with -ffp-contract=off and calls no fma, so no multiply and add are
// fused: each element's result is the same whatever the vector width, the split into threads or
// which elements fall into a loop's scalar remainder. The block maximum is taken on the bit
// patterns of |x| (for non-NaN floats their unsigned order is the order of the magnitudes), which
// is exact and vectorizes without -ffast-math. Scalars arrive as Python floats (double) and are
// rounded to float here, as ATen rounds a Python scalar operand of a float tensor.
//
// NaN: a NaN anywhere in a block makes its scale NaN, as in the torch path; which NaN (its sign
// and payload) may differ from the torch path, so only non-NaN results are bitwise identical.
//
// The per-element update (and the BF16 rounding, the scalars and the argument checks) is in
// adam_common.h, shared with fused_adam.cpp; this file decodes, encodes and walks the blocks.
//
// Built on first use by slidekit_optim/adamw_8bit.py (through layer_adam's load_kernel, i.e.
// torch.utils.cpp_extension.load); tested by tests/plugins/test_adamw8_kernel.py (bitwise
// against the pure-torch path).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: halves the build time

#include "adam_common.h"     // the per-element update, BF16 rounding and checks, shared by both kernels
#include "parallel_tasks.h"  // the split into tasks on torch's thread pool, shared by both kernels

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;         // quant8.BLOCK_SIZE
constexpr int kKeyShift = 15;           // quant8: the key is the top 32 - 15 = 17 bits of y
constexpr int64_t kKeys = int64_t{1} << (32 - kKeyShift);

constexpr const char* kKernel = "adamw8_step";

using slidekit::bits_of;
using slidekit::float_of;

// A QuantMap's tensors (quant8.QuantMap): values (256), table (2^17 codes), threshold (2^17).
struct Map {
  const float* values;
  const uint8_t* table;
  const float* threshold;
};

// One quantized moment: codes (n) and block scales (blocks).
struct Moment {
  uint8_t* codes;
  float* absmax;
  Map map;
};

// x[i] = values[codes[i]] * scale.
void decode(int64_t len, const uint8_t* __restrict codes, const float* __restrict values, float scale,
            float* __restrict x) {
  for (int64_t i = 0; i < len; ++i) {
    x[i] = values[codes[i]] * scale;
  }
}

// Encodes the block x (len <= kBlock) into codes; returns its scale max |x|.
float encode_block(int64_t len, const float* __restrict x, const Map& map, uint8_t* __restrict codes) {
  uint32_t top = 0;  // max of the |x| bit patterns: the largest magnitude (a NaN pattern above all)
  for (int64_t i = 0; i < len; ++i) {
    top = std::max(top, bits_of(x[i]) & 0x7FFFFFFFu);
  }
  const float amax = float_of(top);
  const float scale = amax > 0.0f ? amax : 1.0f;  // an all-zero block keeps scale 0, encodes x / 1
  alignas(64) float y[kBlock];
  alignas(64) uint32_t key[kBlock];
  for (int64_t i = 0; i < len; ++i) {
    y[i] = x[i] / scale;
    key[i] = bits_of(y[i]) >> kKeyShift;
  }
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t k = key[i];
    codes[i] = static_cast<uint8_t>(map.table[k] + (y[i] > map.threshold[k] ? 1 : 0));
  }
  return amax;
}

// Everything one call needs, shared read-only by the tasks.
struct Args {
  int64_t n;
  float* p;
  const void* g;
  uint16_t* out;
  Moment m;
  Moment v;
  const int64_t* seg_stop;  // the decay segments tile [0, n): segment k ends at seg_stop[k]
  const float* seg_decay;   // its factor; 1 means no decay (multiplying by 1 changes no bits)
  int64_t segments;
  slidekit::AdamScalars s;
};

// Blocks [b_lo, b_hi): decode, update (per decay segment, adam_common.h's adam_update), encode.
void run_blocks(int64_t b_lo, int64_t b_hi, const Args& a, int64_t g_size, bool bf16_grad) {
  const bool lowp = a.out != nullptr;
  const slidekit::UpdateFn plain = slidekit::pick_update(bf16_grad, false, lowp);
  const slidekit::UpdateFn decayed = slidekit::pick_update(bf16_grad, true, lowp);
  const char* g = static_cast<const char*>(a.g);
  // The first segment that ends past this task's first element.
  int64_t seg = std::upper_bound(a.seg_stop, a.seg_stop + a.segments, b_lo * kBlock) - a.seg_stop;
  alignas(64) float m[kBlock];
  alignas(64) float v[kBlock];
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t hi = std::min(a.n, lo + kBlock);
    const int64_t len = hi - lo;
    decode(len, a.m.codes + lo, a.m.map.values, a.m.absmax[b], m);
    decode(len, a.v.codes + lo, a.v.map.values, a.v.absmax[b], v);
    for (int64_t i = lo; i < hi;) {
      while (a.seg_stop[seg] <= i) {
        ++seg;
      }
      const int64_t j = std::min(hi, a.seg_stop[seg]);
      const float decay = a.seg_decay[seg];
      (decay != 1.0f ? decayed : plain)(
          j - i, a.p + i, g + i * g_size, m + (i - lo), v + (i - lo), lowp ? a.out + i : nullptr, decay, a.s);
      i = j;
    }
    a.m.absmax[b] = encode_block(len, m, a.m.map, a.m.codes + lo);
    a.v.absmax[b] = encode_block(len, v, a.v.map, a.v.codes + lo);
  }
}

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n) {
  slidekit::check_vector(t, kKernel, name, dtype, n);
}

Map check_map(
    const at::Tensor& values, const at::Tensor& table, const at::Tensor& threshold, const char* name) {
  check_vector(values, name, at::kFloat, kBlock);
  check_vector(table, name, at::kByte, kKeys);
  check_vector(threshold, name, at::kFloat, kKeys);
  return Map{values.data_ptr<float>(), table.data_ptr<uint8_t>(), threshold.data_ptr<float>()};
}

// One AdamW step over a whole unit, in place: master, both moments' codes and scales, and the
// BF16 copy when `lowp_out` is given. `seg_stop`/`seg_decay` tile [0, n) in order; a decay of 1
// means none. At most `max_tasks` threads of torch's intra-op pool take part (0: as many as torch
// uses); the result does not depend on it. Returns how many threads took part.
//
// at::parallel_for is a header template: its OpenMP form is compiled here, so this file is built
// with -fopenmp but linked without an OpenMP runtime of its own. Its few OpenMP calls then bind
// to the one torch loaded, and so use torch's pool and torch.get_num_threads().
int64_t adamw8_step_(
    at::Tensor master,
    const at::Tensor& grad,
    at::Tensor m_codes,
    at::Tensor m_absmax,
    at::Tensor v_codes,
    at::Tensor v_absmax,
    std::optional<at::Tensor> lowp_out,
    const at::Tensor& m_values,
    const at::Tensor& m_table,
    const at::Tensor& m_threshold,
    const at::Tensor& v_values,
    const at::Tensor& v_table,
    const at::Tensor& v_threshold,
    const std::vector<int64_t>& seg_stop,
    const std::vector<double>& seg_decay,
    double w1,
    double beta2,
    double sq_weight,
    double inv_b2,
    double eps,
    double neg_step,
    int64_t max_tasks) {
  const int64_t n = master.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  check_vector(master, "master", at::kFloat, n);
  slidekit::check_grad(grad, kKernel, n);
  check_vector(m_codes, "exp_avg_codes", at::kByte, n);
  check_vector(m_absmax, "exp_avg_absmax", at::kFloat, blocks);
  check_vector(v_codes, "exp_avg_sq_codes", at::kByte, n);
  check_vector(v_absmax, "exp_avg_sq_absmax", at::kFloat, blocks);
  const bool lowp = lowp_out.has_value();
  if (lowp) {
    check_vector(*lowp_out, "lowp_out", at::kBFloat16, n);
  }
  const Map m_map = check_map(m_values, m_table, m_threshold, "the exp_avg map");
  const Map v_map = check_map(v_values, v_table, v_threshold, "the exp_avg_sq map");
  if (n == 0) {
    return 0;
  }
  TORCH_CHECK(
      !seg_stop.empty() && seg_stop.size() == seg_decay.size() && seg_stop.back() == n &&
          seg_stop.front() > 0 && std::is_sorted(seg_stop.begin(), seg_stop.end()),
      "adamw8_step: the decay segments must tile [0, ", n, ") in order");
  std::vector<float> decay(seg_decay.size());
  std::transform(
      seg_decay.begin(), seg_decay.end(), decay.begin(), [](double d) { return static_cast<float>(d); });

  const Args a{
      n,
      master.data_ptr<float>(),
      grad.data_ptr(),
      lowp ? reinterpret_cast<uint16_t*>(lowp_out->data_ptr<at::BFloat16>()) : nullptr,
      Moment{m_codes.data_ptr<uint8_t>(), m_absmax.data_ptr<float>(), m_map},
      Moment{v_codes.data_ptr<uint8_t>(), v_absmax.data_ptr<float>(), v_map},
      seg_stop.data(),
      decay.data(),
      static_cast<int64_t>(seg_stop.size()),
      slidekit::AdamScalars::from(w1, beta2, sq_weight, inv_b2, eps, neg_step)};
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  const int64_t g_size = grad.element_size();

  // One contiguous run of whole blocks per task, at least kMinBlocks (32 Ki elements) each:
  // small units run on fewer threads, down to one.
  constexpr int64_t kMinBlocks = 128;
  return slidekit::run_in_tasks(blocks, kMinBlocks, 1, max_tasks, [&](int64_t lo, int64_t hi) {
    run_blocks(lo, hi, a, g_size, bf16_grad);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "slidekit fused CPU AdamW step with block-wise 8-bit moments (see adamw8.cpp)";
  module.def(
      "adamw8_step_",
      &adamw8_step_,
      "One 8-bit AdamW step over a unit, in place, optionally writing a BF16 copy",
      pybind11::arg("master"),
      pybind11::arg("grad"),
      pybind11::arg("m_codes"),
      pybind11::arg("m_absmax"),
      pybind11::arg("v_codes"),
      pybind11::arg("v_absmax"),
      pybind11::arg("lowp_out"),
      pybind11::arg("m_values"),
      pybind11::arg("m_table"),
      pybind11::arg("m_threshold"),
      pybind11::arg("v_values"),
      pybind11::arg("v_table"),
      pybind11::arg("v_threshold"),
      pybind11::arg("seg_stop"),
      pybind11::arg("seg_decay"),
      pybind11::arg("w1"),
      pybind11::arg("beta2"),
      pybind11::arg("sq_weight"),
      pybind11::arg("inv_b2"),
      pybind11::arg("eps"),
      pybind11::arg("neg_step"),
      pybind11::arg("max_tasks"),
      // The update runs for tens of milliseconds: let the engine's other Python threads run.
      pybind11::call_guard<pybind11::gil_scoped_release>());
}
