// slidekit CPU kernels: what the fused AdamW kernels (fused_adam.cpp, adamw8.cpp, adamwfp8.cpp) share.
//
// * load_grad: a gradient element as float, from FP32 or BF16 (the upcast is exact);
// * to_bf16: round to BF16, nearest even, as c10::BFloat16(float) does;
// * AdamScalars: one step's constants, rounded from Python's doubles to float;
// * adam_update: the per-element AdamW update both kernels run, in the one order of IEEE-754 FP32
//   operations both Python torch paths (layer_adam.py, adamw_8bit.py) replay:
//
//       g   = float(grad[i])                  BF16 upcast is exact
//       p   = p * decay                       only where the range decays; decay = 1 - lr * wd
//       m   = m + w1 * (g - m)                w1 = 1 - beta1
//       v   = v * beta2
//       v   = v + (w2 * g) * g                w2 = 1 - beta2
//       den = sqrt(v) * inv_b2 + eps          inv_b2 = 1 / sqrt(1 - beta2^t); sqrt correctly rounded
//       p   = p + (neg_step * m) / den        neg_step = -lr / (1 - beta1^t)
//       out[i] = bf16(p)                      round to nearest even, when an output is given
//
// * adam_update_to: the same update (the same per-element function, adam_element) reading master and
//   moments from one set of arrays and writing them to another, for an out-of-place pass;
// * adam_update_from: the same update reading the master from one array and writing it to another, the
//   moments in place (adamw8.cpp's portable out-of-place loop: its moments are decoded into local arrays);
// * pick_update / pick_update_to / pick_update_from: each for a gradient dtype, with or without
//   decay and BF16 output, behind one function pointer type each, so a kernel picks once per call and
//   its loops stay branch-free;
// * SLIDEKIT_CHECK, check_vector / check_grad: the argument checks, with messages naming the kernel
//   and argument, thrown as std::runtime_error (Python sees a RuntimeError). The message is built
//   by appending to a std::string (slidekit::message: integers through std::to_string, dtypes
//   through c10::toString), never through an iostream. Why: on the H200 machine's image (torch
//   2.11, its g++) a failing check killed the process with SIGSEGV instead of raising, first with
//   TORCH_CHECK (the GPU gate on 0df1ca2), then with std::runtime_error(c10::str(...)) (the gate on
//   0df7faf): the checks whose message streamed an integer crashed, the ones streaming only text
//   and dtypes raised (tests/plugins/test_kernel_errors.py, 3 of 5 cases). Streaming an integer
//   goes through the stream locale's num_put facet; the crash is consistent with that path being
//   broken in extensions built there, not confirmed further. The same checks raise on the CPU
//   machines. tests/plugins/test_kernel_errors.py calls each kernel's checks in a child process,
//   so a crash is reported as one, with its signal.
//
// Every including file is compiled with -ffp-contract=off and calls no fma, so no multiply and add
// are fused: each element's result is the same whatever the vector width, the split into threads or
// which elements fall into a loop's scalar remainder.
//
// Included by path from the kernel sources beside it; kernel_build.py hashes every *.h here into
// the build's cache key, so a change to this file rebuilds both kernels.

#pragma once

#include <ATen/core/Tensor.h>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace slidekit {

// The pieces of a check's message, appended to a std::string without an iostream (see above).
inline void append_piece(std::string& s, const char* p) { s += p; }
inline void append_piece(std::string& s, const std::string& p) { s += p; }
inline void append_piece(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void append_piece(std::string& s, const c10::Device& d) {
  s += c10::DeviceTypeName(d.type(), /*lower_case=*/true);
  if (d.has_index()) {
    s += ':';
    s += std::to_string(static_cast<int>(d.index()));
  }
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void append_piece(std::string& s, T v) {
  s += std::to_string(v);
}

// The arguments' text, concatenated: strings, integers, dtypes and devices.
template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (append_piece(s, args), ...);
  return s;
}

}  // namespace slidekit

// `cond`, else a std::runtime_error whose message is the arguments concatenated (slidekit::message).
#define SLIDEKIT_CHECK(cond, ...)                                  \
  do {                                                             \
    if (!(cond)) {                                                 \
      throw std::runtime_error(::slidekit::message(__VA_ARGS__));  \
    }                                                              \
  } while (false)

namespace slidekit {

inline float load_grad(const float* g, int64_t i) { return g[i]; }

inline float load_grad(const uint16_t* g, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(g[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Round to nearest even, as c10::BFloat16(float) does; NaN becomes the canonical quiet NaN.
inline uint16_t to_bf16(float x) {
  const uint32_t bits = bits_of(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// One step's constants, already rounded to float (as ATen rounds a Python scalar operand of a
// float tensor). The decay factor is per range, so it is passed apart.
struct AdamScalars {
  float w1;         // 1 - beta1
  float beta2;
  float sq_weight;  // 1 - beta2
  float inv_b2;     // 1 / sqrt(1 - beta2^t)
  float eps;
  float neg_step;   // -lr / (1 - beta1^t)

  static AdamScalars from(
      double w1, double beta2, double sq_weight, double inv_b2, double eps, double neg_step) {
    return AdamScalars{
        static_cast<float>(w1),
        static_cast<float>(beta2),
        static_cast<float>(sq_weight),
        static_cast<float>(inv_b2),
        static_cast<float>(eps),
        static_cast<float>(neg_step)};
  }
};

// One element's update, the sequence above: p, m and v before it in, after it out. Both loops below
// run it, so an update in place and one out of place give the same bits.
template <bool kDecay>
inline void adam_element(float gi, float& p, float& m, float& v, float decay, const AdamScalars& s) {
  if constexpr (kDecay) {
    p = p * decay;
  }
  m = m + s.w1 * (gi - m);
  v = v * s.beta2;
  v = v + (s.sq_weight * gi) * gi;
  const float denom = std::sqrt(v) * s.inv_b2 + s.eps;
  p = p + (s.neg_step * m) / denom;
}

// The update of `n` consecutive elements: reads the master from p_in (kFromP) or p, the moments from
// m_in and v_in (kFromMV) or m and v, writes p, m and v (and out when kLowp). One loop for the three
// forms below; a source it does not read is passed as nullptr, so no two restrict pointers it
// dereferences alias. A plain loop over restrict pointers, calling nothing but std::sqrt, so that GCC
// vectorizes it (-O3 -fno-math-errno); the remainder runs the very same operations.
template <typename G, bool kDecay, bool kLowp, bool kFromP, bool kFromMV>
void adam_loop(
    int64_t n,
    const float* __restrict p_in,
    const float* __restrict m_in,
    const float* __restrict v_in,
    const G* __restrict g,
    float* __restrict p,
    float* __restrict m,
    float* __restrict v,
    uint16_t* __restrict out,
    float decay,
    const AdamScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float pi;
    float mi;
    float vi;
    if constexpr (kFromP) {
      pi = p_in[i];
    } else {
      pi = p[i];
    }
    if constexpr (kFromMV) {
      mi = m_in[i];
      vi = v_in[i];
    } else {
      mi = m[i];
      vi = v[i];
    }
    adam_element<kDecay>(load_grad(g, i), pi, mi, vi, decay, s);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (kLowp) {
      out[i] = to_bf16(pi);
    }
  }
}

// The update in place on p, m and v.
template <typename G, bool kDecay, bool kLowp>
void adam_update(
    int64_t n, float* p, const G* g, float* m, float* v, uint16_t* out, float decay, const AdamScalars s) {
  adam_loop<G, kDecay, kLowp, false, false>(n, nullptr, nullptr, nullptr, g, p, m, v, out, decay, s);
}

// adam_update out of place: reads p_in, m_in and v_in, writes p, m and v (and out when kLowp), which
// must be other arrays (restrict). fused_adam.cpp's out-of-place pass writes into an L1 scratch that
// it then streams out, so the sources are read once and never written.
template <typename G, bool kDecay, bool kLowp>
void adam_update_to(
    int64_t n, const float* p_in, const G* g, const float* m_in, const float* v_in, float* p, float* m,
    float* v, uint16_t* out, float decay, const AdamScalars s) {
  adam_loop<G, kDecay, kLowp, true, true>(n, p_in, m_in, v_in, g, p, m, v, out, decay, s);
}

// adam_update with the master read from p_in and written to p (another array), the moments in place.
// adamw8.cpp's portable out-of-place loop decodes the moments into local arrays and writes the new
// master into an L1 scratch; reading it from the source saves copying it there first (which cost
// adamwfp8.cpp's portable build 1.32x the update in place, against 1.07x reading the source).
template <typename G, bool kDecay, bool kLowp>
void adam_update_from(
    int64_t n, const float* p_in, float* p, const G* g, float* m, float* v, uint16_t* out, float decay,
    const AdamScalars s) {
  adam_loop<G, kDecay, kLowp, true, false>(n, p_in, nullptr, nullptr, g, p, m, v, out, decay, s);
}

// adam_update with the gradient's type erased: (n, p, g, m, v, out, decay, scalars).
using UpdateFn = void (*)(int64_t, float*, const void*, float*, float*, uint16_t*, float, AdamScalars);

// adam_update_to with the gradient's type erased: (n, p_in, g, m_in, v_in, p, m, v, out, decay, scalars).
using UpdateToFn = void (*)(
    int64_t, const float*, const void*, const float*, const float*, float*, float*, float*, uint16_t*, float,
    AdamScalars);

// adam_update_from with the gradient's type erased: (n, p_in, p, g, m, v, out, decay, scalars).
using UpdateFromFn =
    void (*)(int64_t, const float*, float*, const void*, float*, float*, uint16_t*, float, AdamScalars);

template <typename G, bool kDecay, bool kLowp>
void adam_update_from_erased(
    int64_t n, const float* p_in, float* p, const void* g, float* m, float* v, uint16_t* out, float decay,
    AdamScalars s) {
  adam_update_from<G, kDecay, kLowp>(n, p_in, p, static_cast<const G*>(g), m, v, out, decay, s);
}

template <typename G>
UpdateFromFn pick_update_from(bool decay, bool lowp) {
  if (decay) {
    return lowp ? &adam_update_from_erased<G, true, true> : &adam_update_from_erased<G, true, false>;
  }
  return lowp ? &adam_update_from_erased<G, false, true> : &adam_update_from_erased<G, false, false>;
}

// The update reading the master from another array, for a BF16 (else FP32) gradient, with or without
// decay and BF16 output.
inline UpdateFromFn pick_update_from(bool bf16_grad, bool decay, bool lowp) {
  return bf16_grad ? pick_update_from<uint16_t>(decay, lowp) : pick_update_from<float>(decay, lowp);
}

template <typename G, bool kDecay, bool kLowp>
void adam_update_erased(
    int64_t n, float* p, const void* g, float* m, float* v, uint16_t* out, float decay, AdamScalars s) {
  adam_update<G, kDecay, kLowp>(n, p, static_cast<const G*>(g), m, v, out, decay, s);
}

template <typename G, bool kDecay, bool kLowp>
void adam_update_to_erased(
    int64_t n, const float* p_in, const void* g, const float* m_in, const float* v_in, float* p, float* m,
    float* v, uint16_t* out, float decay, AdamScalars s) {
  adam_update_to<G, kDecay, kLowp>(n, p_in, static_cast<const G*>(g), m_in, v_in, p, m, v, out, decay, s);
}

template <typename G>
UpdateFn pick_update(bool decay, bool lowp) {
  if (decay) {
    return lowp ? &adam_update_erased<G, true, true> : &adam_update_erased<G, true, false>;
  }
  return lowp ? &adam_update_erased<G, false, true> : &adam_update_erased<G, false, false>;
}

template <typename G>
UpdateToFn pick_update_to(bool decay, bool lowp) {
  if (decay) {
    return lowp ? &adam_update_to_erased<G, true, true> : &adam_update_to_erased<G, true, false>;
  }
  return lowp ? &adam_update_to_erased<G, false, true> : &adam_update_to_erased<G, false, false>;
}

// The update for a BF16 (else FP32) gradient, with or without decay and BF16 output.
inline UpdateFn pick_update(bool bf16_grad, bool decay, bool lowp) {
  return bf16_grad ? pick_update<uint16_t>(decay, lowp) : pick_update<float>(decay, lowp);
}

// The out-of-place update for a BF16 (else FP32) gradient, with or without decay and BF16 output.
inline UpdateToFn pick_update_to(bool bf16_grad, bool decay, bool lowp) {
  return bf16_grad ? pick_update_to<uint16_t>(decay, lowp) : pick_update_to<float>(decay, lowp);
}

// `t` is a contiguous CPU vector of `n` elements of `dtype`; else a RuntimeError naming `kernel` and `name`.
inline void check_vector(
    const at::Tensor& t, const char* kernel, const char* name, at::ScalarType dtype, int64_t n) {
  SLIDEKIT_CHECK(t.device().is_cpu(), kernel, ": ", name, " must be on the CPU, got ", t.device());
  SLIDEKIT_CHECK(t.scalar_type() == dtype, kernel, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  SLIDEKIT_CHECK(t.is_contiguous(), kernel, ": ", name, " must be contiguous");
  SLIDEKIT_CHECK(t.numel() == n, kernel, ": ", name, " has ", t.numel(), " elements, expected ", n);
}

// The gradient: FP32 or BF16, a contiguous CPU vector of `n` elements.
inline void check_grad(const at::Tensor& grad, const char* kernel, int64_t n) {
  SLIDEKIT_CHECK(
      grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
      kernel, ": grad must be float32 or bfloat16, got ", grad.scalar_type());
  check_vector(grad, kernel, "grad", grad.scalar_type(), n);
}

}  // namespace slidekit
