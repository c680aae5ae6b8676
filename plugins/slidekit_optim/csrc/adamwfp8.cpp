// slidekit fused CPU AdamW with FP8 moments: one pass over a unit, block by block, multi-threaded.
//
// State per block of 256 elements: the first moment m as E4M3 codes of m * (448 / A_m), the square
// root of the second moment r = sqrt(v) as UE4M4 codes of r * (496 / A_r) (a nonzero r never takes
// code 0), A_m and A_r the block's FP32 absmax (fp8_codec.h, slidekit_optim/fp8.py). Per block,
// each operation one IEEE-754 FP32 operation rounded to nearest even, in exactly this order (the
// pure-torch fp8.reference_step (slidekit_optim/fp8.py) runs the same sequence as torch ops, so the two
// agree bitwise):
//
//     dm  = A_m / 448,  dr = A_r / 496      once per block
//     m0  = e4m3(code_m) * dm               decoding is exact, then one multiplication
//     r0  = ue4m4(code_r) * dr
//     v0  = r0 * r0
//     then adam_common.h's update, in its order (layer_adam's):
//     p   = p * decay                       decay = 1 - lr * wd; 1 where the range does not decay
//     m   = m0 + w1 * (g - m0)
//     v   = v0 * beta2
//     v   = v + (w2 * g) * g
//     r   = sqrt(v)                         correctly rounded; also the new r
//     den = r * inv_b2 + eps
//     p   = p + (neg_step * m) / den
//     out = bf16(p)                         when an output is given
//     A_m = max |m|, A_r = max r            over the block
//     code_m = e4m3(m * fm),  fm = 448 / A_m (1 where A_m = 0); code_r likewise with 496 / A_r
//
// So per element one square root and one division, as layer_adam, plus integer decoding and
// encoding: no table lookup, no per-element division for the codes. A block runs in two passes
// over 1 KiB stack buffers: (1) decode, update, master and BF16 copy out, new m and r into the
// buffers; (2) their maxima, then the codes. Built for AVX-512 (kernel_build.py's AVX512
// capability) a block runs in zmm registers (fp8_avx512.h); elsewhere in plain loops calling the
// inline functions of fp8_codec.h and adam_common.h, for GCC to vectorize (-O3, -fno-math-errno,
// -fno-trapping-math). Both give the same bits.
//
// The kernel of the adamw_fp8 optimizer (slidekit_optim/adamw_fp8.py, impl="cpp"); measured by
// benchmarks/fp8_codec.py (docs/benchmarks/NOTES.md section 21).
//
// The file is compiled with -ffp-contract=off and calls no fma: each element's result is the same
// whatever the vector width, the split into threads, or which elements fall into a scalar remainder.
// The block maximum is taken on the bit patterns of |x| (for non-NaN floats their unsigned order is
// that of the magnitudes). Scalars arrive as Python floats (double) and are rounded to float here.
// NaN: a NaN in a block makes its scales NaN, as in the torch path; which NaN may differ, so only
// non-NaN results are bitwise identical.
//
// Built on first use through kernel_build.load_kernel; tested by tests/plugins/test_fp8_codec.py
// (bitwise against fp8.reference_step, the pure-torch statement of the step above).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: halves the build time

#include "adam_common.h"     // BF16 rounding, the step's scalars, argument checks
#include "fp8_avx512.h"      // the AVX-512 block pass (only where the build enables AVX-512)
#include "fp8_codec.h"       // the E4M3 / UE4M4 codes
#include "parallel_tasks.h"  // the split into tasks on torch's thread pool

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;  // quant8.BLOCK_SIZE, fp8.py's blocks
constexpr float kMaxM = 448.0f;  // E4M3's largest value
constexpr float kMaxR = 496.0f;  // UE4M4's largest value
constexpr const char* kKernel = "adamwfp8_step";

using slidekit::bits_of;
using slidekit::float_of;

// Everything one call needs, shared read-only by the tasks.
struct Args {
  int64_t n;
  float* p;
  const void* g;
  uint16_t* out;
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* r_codes;
  float* r_absmax;
  const int64_t* seg_stop;  // the decay segments tile [0, n): segment k ends at seg_stop[k]
  const float* seg_decay;   // its factor; 1 means no decay (multiplying by 1 changes no bits)
  int64_t segments;
  slidekit::AdamScalars s;
};

// Pass 1 over elements [0, len) of a block (pointers offset to its first element): decode, update,
// write the master (and BF16 copy), the new m and r into m_buf / r_buf.
template <typename G, bool kLowp>
void update(int64_t len, float* __restrict p, const G* __restrict g, uint16_t* __restrict out,
            const uint8_t* __restrict mc, const uint8_t* __restrict rc, float dm, float dr, float decay,
            const slidekit::AdamScalars s, float* __restrict m_buf, float* __restrict r_buf) {
  for (int64_t i = 0; i < len; ++i) {
    const float m0 = slidekit::fp8::decode_e4m3(mc[i]) * dm;
    const float r0 = slidekit::fp8::decode_ue4m4(rc[i]) * dr;
    const float v0 = r0 * r0;
    const float gi = slidekit::load_grad(g, i);
    float pi = p[i] * decay;
    const float mi = m0 + s.w1 * (gi - m0);
    float vi = v0 * s.beta2;
    vi = vi + (s.sq_weight * gi) * gi;
    const float ri = std::sqrt(vi);
    const float den = ri * s.inv_b2 + s.eps;
    pi = pi + (s.neg_step * mi) / den;
    p[i] = pi;
    if constexpr (kLowp) {
      out[i] = slidekit::to_bf16(pi);
    }
    m_buf[i] = mi;
    r_buf[i] = ri;
  }
}

// The largest |x| bit pattern of x[0, len) (a NaN pattern above all).
uint32_t block_top(int64_t len, const float* __restrict x) {
  uint32_t top = 0;
  for (int64_t i = 0; i < len; ++i) {
    top = std::max(top, bits_of(x[i]) & 0x7FFFFFFFu);
  }
  return top;
}

// The encoding factor max / A of a block whose absmax is A (1 for an all-zero block).
inline float factor(float max, float amax) { return amax > 0.0f ? max / amax : 1.0f; }

void encode_m(int64_t len, const float* __restrict x, float f, uint8_t* __restrict codes) {
  for (int64_t i = 0; i < len; ++i) {
    codes[i] = slidekit::fp8::encode_e4m3(x[i] * f);
  }
}

void encode_r(int64_t len, const float* __restrict x, float f, uint8_t* __restrict codes) {
  for (int64_t i = 0; i < len; ++i) {
    codes[i] = slidekit::fp8::encode_ue4m4_nonzero(x[i] * f);
  }
}

// The first decay segment that ends past element i.
int64_t segment_of(const int64_t* seg_stop, int64_t segments, int64_t i) {
  return std::upper_bound(seg_stop, seg_stop + segments, i) - seg_stop;
}

#ifdef SLIDEKIT_ADAMWFP8_AVX512
constexpr int64_t kVectorWidth = 16;

// Blocks [b_lo, b_hi), 16 lanes at a time: fp8_avx512.h's two passes per block.
template <typename G, bool kLowp>
void run_blocks(int64_t b_lo, int64_t b_hi, const Args& a) {
  alignas(64) float m[kBlock];
  alignas(64) float r[kBlock];
  int64_t seg = segment_of(a.seg_stop, a.segments, b_lo * kBlock);
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t len = std::min(a.n, lo + kBlock) - lo;
    // The decay factors of elements [lo + i, lo + i + 16): one broadcast unless a segment ends inside.
    auto decay = [&](int64_t i) {
      const int64_t at = lo + i;
      while (a.seg_stop[seg] <= at) {
        ++seg;
      }
      if (a.seg_stop[seg] >= std::min(a.n, at + 16)) {
        return _mm512_set1_ps(a.seg_decay[seg]);
      }
      alignas(64) float lane[16];
      for (int64_t l = 0, s = seg; l < 16; ++l) {
        while (s + 1 < a.segments && a.seg_stop[s] <= at + l) {
          ++s;
        }
        lane[l] = a.seg_decay[s];  // lanes past n: the last segment's, never stored
      }
      return _mm512_load_ps(lane);
    };
    uint32_t m_top = 0;
    uint32_t r_top = 0;
    slidekit::fp8::avx512::update<G, kLowp>(
        len, a.p + lo, static_cast<const G*>(a.g) + lo, a.out == nullptr ? nullptr : a.out + lo,
        a.m_codes + lo, a.r_codes + lo, a.m_absmax[b] / kMaxM, a.r_absmax[b] / kMaxR, a.s, decay, m, r,
        m_top, r_top);
    const float am = float_of(m_top);
    const float ar = float_of(r_top);
    slidekit::fp8::avx512::encode_block<false>(len, m, factor(kMaxM, am), a.m_codes + lo);
    slidekit::fp8::avx512::encode_block<true>(len, r, factor(kMaxR, ar), a.r_codes + lo);
    a.m_absmax[b] = am;
    a.r_absmax[b] = ar;
  }
}
#else
constexpr int64_t kVectorWidth = 1;  // the portable loops (vectorised by the compiler where it can)

// Blocks [b_lo, b_hi): decode, update (per decay segment), encode.
template <typename G, bool kLowp>
void run_blocks(int64_t b_lo, int64_t b_hi, const Args& a) {
  const G* g = static_cast<const G*>(a.g);
  int64_t seg = segment_of(a.seg_stop, a.segments, b_lo * kBlock);
  alignas(64) float m[kBlock];
  alignas(64) float r[kBlock];
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t hi = std::min(a.n, lo + kBlock);
    const float dm = a.m_absmax[b] / kMaxM;
    const float dr = a.r_absmax[b] / kMaxR;
    for (int64_t i = lo; i < hi;) {
      while (a.seg_stop[seg] <= i) {
        ++seg;
      }
      const int64_t j = std::min(hi, a.seg_stop[seg]);
      update<G, kLowp>(j - i, a.p + i, g + i, kLowp ? a.out + i : nullptr, a.m_codes + i, a.r_codes + i, dm,
                       dr, a.seg_decay[seg], a.s, m + (i - lo), r + (i - lo));
      i = j;
    }
    const int64_t len = hi - lo;
    const float am = float_of(block_top(len, m));
    const float ar = float_of(block_top(len, r));
    encode_m(len, m, factor(kMaxM, am), a.m_codes + lo);
    encode_r(len, r, factor(kMaxR, ar), a.r_codes + lo);
    a.m_absmax[b] = am;
    a.r_absmax[b] = ar;
  }
}
#endif

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n) {
  slidekit::check_vector(t, kKernel, name, dtype, n);
}

// One AdamW step over a whole unit, in place: master, both moments' codes and scales, and the BF16
// copy when `lowp_out` is given. `seg_stop`/`seg_decay` tile [0, n) in order; a decay of 1 means
// none. At most `max_tasks` threads of torch's intra-op pool take part (0: as many as torch uses);
// the result does not depend on it. Returns how many threads took part.
int64_t adamwfp8_step_(
    at::Tensor master,
    const at::Tensor& grad,
    at::Tensor m_codes,
    at::Tensor m_absmax,
    at::Tensor r_codes,
    at::Tensor r_absmax,
    std::optional<at::Tensor> lowp_out,
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
  check_vector(r_codes, "exp_avg_sq_sqrt_codes", at::kByte, n);
  check_vector(r_absmax, "exp_avg_sq_sqrt_absmax", at::kFloat, blocks);
  const bool lowp = lowp_out.has_value();
  if (lowp) {
    check_vector(*lowp_out, "lowp_out", at::kBFloat16, n);
  }
  if (n == 0) {
    return 0;
  }
  SLIDEKIT_CHECK(
      !seg_stop.empty() && seg_stop.size() == seg_decay.size() && seg_stop.back() == n &&
          seg_stop.front() > 0 && std::is_sorted(seg_stop.begin(), seg_stop.end()),
      kKernel, ": the decay segments must tile [0, ", n, ") in order");
  std::vector<float> decay(seg_decay.size());
  std::transform(
      seg_decay.begin(), seg_decay.end(), decay.begin(), [](double d) { return static_cast<float>(d); });

  const Args a{
      n,
      master.data_ptr<float>(),
      grad.data_ptr(),
      lowp ? reinterpret_cast<uint16_t*>(lowp_out->data_ptr<at::BFloat16>()) : nullptr,
      m_codes.data_ptr<uint8_t>(),
      m_absmax.data_ptr<float>(),
      r_codes.data_ptr<uint8_t>(),
      r_absmax.data_ptr<float>(),
      seg_stop.data(),
      decay.data(),
      static_cast<int64_t>(seg_stop.size()),
      slidekit::AdamScalars::from(w1, beta2, sq_weight, inv_b2, eps, neg_step)};
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  auto body = bf16_grad ? (lowp ? &run_blocks<uint16_t, true> : &run_blocks<uint16_t, false>)
                        : (lowp ? &run_blocks<float, true> : &run_blocks<float, false>);

  // One contiguous run of whole blocks per task, at least kMinBlocks (32 Ki elements) each:
  // small units run on fewer threads, down to one.
  constexpr int64_t kMinBlocks = 128;
  return slidekit::run_in_tasks(blocks, kMinBlocks, 1, max_tasks, [&](int64_t lo, int64_t hi) {
    body(lo, hi, a);
  });
}

// fp8.py's codec with this kernel's functions, for tests: codes of x (E4M3 when `unsigned_r` is
// false, else UE4M4 with keep_nonzero), and the values of codes.
void encode_(const at::Tensor& x, at::Tensor codes, bool unsigned_r) {
  const int64_t n = x.numel();
  slidekit::check_vector(x, "encode", "x", at::kFloat, n);
  slidekit::check_vector(codes, "encode", "codes", at::kByte, n);
  (unsigned_r ? encode_r : encode_m)(n, x.data_ptr<float>(), 1.0f, codes.data_ptr<uint8_t>());
}

void decode_(const at::Tensor& codes, at::Tensor x, bool unsigned_r) {
  const int64_t n = codes.numel();
  slidekit::check_vector(codes, "decode", "codes", at::kByte, n);
  slidekit::check_vector(x, "decode", "x", at::kFloat, n);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  float* out = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    out[i] = unsigned_r ? slidekit::fp8::decode_ue4m4(c[i]) : slidekit::fp8::decode_e4m3(c[i]);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "slidekit fused CPU AdamW step with block-wise FP8 moments (see adamwfp8.cpp)";
  module.def(
      "adamwfp8_step_",
      &adamwfp8_step_,
      "One FP8-moment AdamW step over a unit, in place, optionally writing a BF16 copy",
      pybind11::arg("master"),
      pybind11::arg("grad"),
      pybind11::arg("m_codes"),
      pybind11::arg("m_absmax"),
      pybind11::arg("r_codes"),
      pybind11::arg("r_absmax"),
      pybind11::arg("lowp_out"),
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
  module.def("encode_", &encode_, "fp8.encode with the kernel's encoder (for tests)", pybind11::arg("x"),
             pybind11::arg("codes"), pybind11::arg("unsigned_r"));
  module.def("vector_width", []() { return kVectorWidth; }, "16 where built for AVX-512, else 1");
  module.def("decode_", &decode_, "fp8.decode with the kernel's decoder (for tests)", pybind11::arg("codes"),
             pybind11::arg("x"), pybind11::arg("unsigned_r"));
}
