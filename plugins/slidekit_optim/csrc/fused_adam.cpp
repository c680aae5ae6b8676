// slidekit fused CPU AdamW: one pass over a unit's flat vectors, multi-threaded, vectorized.
//
// Per element i, all in FP32, each operation one IEEE-754 operation rounded to nearest even,
// in exactly this order (the pure-torch path of slidekit_optim/layer_adam.py runs the same
// sequence as torch ops, so the two agree bitwise):
//
//     g   = float(grad[i])                  BF16 upcast is exact
//     p   = p * decay                       only where the range decays; decay = 1 - lr * wd
//     m   = m + w1 * (g - m)                w1 = 1 - beta1
//     v   = v * beta2
//     v   = v + (w2 * g) * g                w2 = 1 - beta2
//     den = sqrt(v) * inv_b2 + eps          inv_b2 = 1 / sqrt(1 - beta2^t); sqrt correctly rounded
//     p   = p + (neg_step * m) / den        neg_step = -lr / (1 - beta1^t)
//     out[i] = bf16(p)                      round to nearest even, when an output is given
//
// The file is compiled with -ffp-contract=off and calls no fma, so no multiply and add are
// fused: each element's result is the same whatever the vector width, the split into threads or
// which elements fall into a loop's scalar remainder. Scalars arrive as Python floats (double)
// and are rounded to float here, as ATen rounds a Python scalar operand of a float tensor.
//
// Cost: two operations per element use the slow divide/sqrt unit (the square root and one
// division; the bias correction is a multiplication), which bounds a core at about 1.5 G
// elements/s (AVX2, data in cache). That is more than a core's share of memory bandwidth on a
// many-core host, where the pass is memory-bound at about 30 bytes per element: read 2 of BF16
// gradient and 12 of master and moments, write those 12 back and 2 of BF16 copy.
//
// Built on first use by slidekit_optim/layer_adam.py (torch.utils.cpp_extension.load);
// tested by tests/plugins/test_layer_adam.py (bitwise against the pure-torch path).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: halves the build time

#include "parallel_tasks.h"  // the split into tasks on torch's thread pool, shared by both kernels

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// The per-call constants, already rounded to float.
struct StepScalars {
  float decay;       // 1 - lr * weight_decay
  float w1;          // 1 - beta1
  float beta2;
  float sq_weight;   // 1 - beta2
  float inv_b2;      // 1 / sqrt(1 - beta2^t)
  float eps;
  float neg_step;    // -lr / (1 - beta1^t)
};

inline float load_grad(const float* g, int64_t i) { return g[i]; }

inline float load_grad(const uint16_t* g, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(g[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as c10::BFloat16(float) does; NaN becomes the canonical quiet NaN.
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// One contiguous range. A plain loop over restrict pointers, calling nothing but std::sqrt, so
// that GCC vectorizes it (-O3 -fno-math-errno); the remainder runs the very same operations.
template <typename G, bool kDecay, bool kLowp>
void update_range(
    int64_t n,
    float* __restrict p,
    const G* __restrict g,
    float* __restrict m,
    float* __restrict v,
    uint16_t* __restrict out,
    const StepScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = load_grad(g, i);
    float pi = p[i];
    if constexpr (kDecay) {
      pi = pi * s.decay;
    }
    const float mi = m[i] + s.w1 * (gi - m[i]);
    float vi = v[i] * s.beta2;
    vi = vi + (s.sq_weight * gi) * gi;
    const float denom = std::sqrt(vi) * s.inv_b2 + s.eps;
    pi = pi + (s.neg_step * mi) / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kLowp) {
      out[i] = to_bf16(pi);
    }
  }
}

using RangeFn = void (*)(int64_t, float*, const void*, float*, float*, uint16_t*, StepScalars);

template <typename G, bool kDecay, bool kLowp>
void update_range_erased(
    int64_t n, float* p, const void* g, float* m, float* v, uint16_t* out, StepScalars s) {
  update_range<G, kDecay, kLowp>(n, p, static_cast<const G*>(g), m, v, out, s);
}

template <typename G>
RangeFn pick(bool decay, bool lowp) {
  if (decay) {
    return lowp ? &update_range_erased<G, true, true> : &update_range_erased<G, true, false>;
  }
  return lowp ? &update_range_erased<G, false, true> : &update_range_erased<G, false, false>;
}

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), "fused_adamw: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "fused_adamw: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "fused_adamw: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, "fused_adamw: ", name, " has ", t.numel(), " elements, master has ", n);
}

// Updates master, exp_avg and exp_avg_sq in place (and writes lowp_out) for one range that
// shares its weight decay; `decay` is applied when `apply_decay`. The buffers must not overlap
// (the caller checks). At most `max_tasks` threads of torch's intra-op pool take part (0: as
// many as torch uses); the result does not depend on it. Returns how many threads took part.
//
// at::parallel_for is a header template: its OpenMP form is compiled here, so this file is built
// with -fopenmp but linked without an OpenMP runtime of its own. Its few OpenMP calls then bind
// to the one torch loaded, and so use torch's pool and torch.get_num_threads().
int64_t fused_adamw_(
    at::Tensor master,
    const at::Tensor& grad,
    at::Tensor exp_avg,
    at::Tensor exp_avg_sq,
    std::optional<at::Tensor> lowp_out,
    bool apply_decay,
    double decay,
    double w1,
    double beta2,
    double sq_weight,
    double inv_b2,
    double eps,
    double neg_step,
    int64_t max_tasks) {
  const int64_t n = master.numel();
  check_vector(master, "master", at::kFloat, n);
  TORCH_CHECK(
      grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
      "fused_adamw: grad must be float32 or bfloat16, got ", grad.scalar_type());
  check_vector(grad, "grad", grad.scalar_type(), n);
  check_vector(exp_avg, "exp_avg", at::kFloat, n);
  check_vector(exp_avg_sq, "exp_avg_sq", at::kFloat, n);
  const bool lowp = lowp_out.has_value();
  if (lowp) {
    check_vector(*lowp_out, "lowp_out", at::kBFloat16, n);
  }
  if (n == 0) {
    return 0;
  }

  const StepScalars s{
      static_cast<float>(decay),
      static_cast<float>(w1),
      static_cast<float>(beta2),
      static_cast<float>(sq_weight),
      static_cast<float>(inv_b2),
      static_cast<float>(eps),
      static_cast<float>(neg_step)};
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  const RangeFn fn = bf16_grad ? pick<uint16_t>(apply_decay, lowp) : pick<float>(apply_decay, lowp);

  float* p = master.data_ptr<float>();
  const char* g = static_cast<const char*>(grad.data_ptr());
  const int64_t g_size = grad.element_size();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  uint16_t* out = lowp ? reinterpret_cast<uint16_t*>(lowp_out->data_ptr<at::BFloat16>()) : nullptr;

  // One contiguous slice per task, its ends on 64-element boundaries (whole cache lines of every
  // array), at least kMinPerTask elements each: small ranges run on fewer threads, down to one.
  constexpr int64_t kAlign = 64;
  constexpr int64_t kMinPerTask = int64_t{1} << 15;
  return slidekit::run_in_tasks(n, kMinPerTask, kAlign, max_tasks, [&](int64_t lo, int64_t hi) {
    fn(hi - lo, p + lo, g + lo * g_size, m + lo, v + lo, out ? out + lo : nullptr, s);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "slidekit fused CPU AdamW step (see fused_adam.cpp)";
  module.def(
      "fused_adamw_",
      &fused_adamw_,
      "One AdamW step over a contiguous range, in place, optionally writing a BF16 copy",
      pybind11::arg("master"),
      pybind11::arg("grad"),
      pybind11::arg("exp_avg"),
      pybind11::arg("exp_avg_sq"),
      pybind11::arg("lowp_out"),
      pybind11::arg("apply_decay"),
      pybind11::arg("decay"),
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
