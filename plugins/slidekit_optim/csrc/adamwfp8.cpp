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
// Speculative clipping out of place (out_of_place true; adamw_fp8's fused_update_out; backup_copy.h):
// five more buffers (master, both moments' codes and scales) receive the update, and master and state
// are only read. Each block is decoded and updated from the unit's buffers by the same per-element
// code on the same values as in place (fp8_avx512.h's update, or the portable loop's `element`), but
// the master is read from the source and the new master and codes go to an L1 scratch (1.5 KiB),
// which is then copied out to the buffers with streaming stores where the ISA has them (memcpy in the
// build without vector ISA flags), the block's two new scales stored there with plain stores; the
// BF16 copy is written as in place. So no bit of the update changes. Cost in bytes per parameter, with
// a BF16 gradient and the BF16 copy (the scales add 2 x 4 / 256 = 0.03 read and as much written): in
// place 16, reading the master 4, gradient 2 and codes 2, writing the master 4, codes 2 and copy 2 (18
// with an FP32 gradient); out of place the same 16: the outputs are written instead of the sources,
// and the streaming stores write their lines without reading them first (plain stores would read
// them: 6 more). This kernel writes no backup of the old values (fused_backup): it takes the five
// buffers only with out_of_place.
//
// Built on first use through kernel_build.load_kernel; tested by tests/plugins/test_fp8_codec.py
// (bitwise against fp8.reference_step, the pure-torch statement of the step above) and
// tests/plugins/test_update_out.py (out of place against in place, both ISA paths).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: halves the build time

#include "adam_common.h"     // BF16 rounding, the step's scalars, argument checks
#include "backup_copy.h"     // the out-of-place update's streaming copy out of L1
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

// The out-of-place update's five outputs (the call's backup_* buffers, named as adamw8.cpp's); all
// null: the update runs in place.
struct UpdateOut {
  float* p;
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* r_codes;
  float* r_absmax;
};

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
  UpdateOut to;
};

// One block as its update sees it: the master and codes it reads, where it writes them, and the old
// scales' decoding factors. In place it reads and writes the unit's own buffers; out of place it reads
// them and writes an L1 scratch (`Scratch`), which close_block then streams out.
struct BlockData {
  const float* p_in;
  float* p;
  const uint8_t* m_codes_in;
  uint8_t* m_codes;
  const uint8_t* r_codes_in;
  uint8_t* r_codes;
  float dm;  // A_m / 448
  float dr;  // A_r / 496
};

// An out-of-place block's new master and codes: 1.5 KiB, L1-resident.
struct Scratch {
  alignas(64) float p[kBlock];
  alignas(64) uint8_t m_codes[kBlock];
  alignas(64) uint8_t r_codes[kBlock];
};

// Block b, whose first element is lo, made ready for its update: in place it reads and writes the
// unit's buffers; out of place it reads them and its new master and codes go to `scratch`.
BlockData open_block(const Args& a, int64_t b, int64_t lo, Scratch& scratch) {
  float* p = a.p + lo;
  uint8_t* mc = a.m_codes + lo;
  uint8_t* rc = a.r_codes + lo;
  const float dm = a.m_absmax[b] / kMaxM;
  const float dr = a.r_absmax[b] / kMaxR;
  if (a.to.p == nullptr) {
    return BlockData{p, p, mc, mc, rc, rc, dm, dr};
  }
  return BlockData{p, scratch.p, mc, scratch.m_codes, rc, scratch.r_codes, dm, dr};
}

// Block b, updated, given its new scales: they are stored in place, or out of place the block is
// streamed out of the scratch to the outputs and its scales stored there.
void close_block(const Args& a, int64_t b, int64_t lo, int64_t len, const BlockData& d, float am, float ar) {
  const UpdateOut& o = a.to;
  if (o.p == nullptr) {
    a.m_absmax[b] = am;
    a.r_absmax[b] = ar;
    return;
  }
  slidekit::backup_copy(o.p + lo, d.p, len * static_cast<int64_t>(sizeof(float)));
  slidekit::backup_copy(o.m_codes + lo, d.m_codes, len);
  slidekit::backup_copy(o.r_codes + lo, d.r_codes, len);
  o.m_absmax[b] = am;
  o.r_absmax[b] = ar;
}

// One element of pass 1, in the header's order: its codes, gradient, the block's decoding factors
// and the decay in; the master p updated, the new m and r out. Both instances of `update` below
// run it, so an update in place and one out of place give the same bits.
inline void element(uint8_t mc, uint8_t rc, float gi, float dm, float dr, float decay,
                    const slidekit::AdamScalars& s, float& p, float& m, float& r) {
  const float m0 = slidekit::fp8::decode_e4m3(mc) * dm;
  const float r0 = slidekit::fp8::decode_ue4m4(rc) * dr;
  const float v0 = r0 * r0;
  p = p * decay;
  m = m0 + s.w1 * (gi - m0);
  float v = v0 * s.beta2;
  v = v + (s.sq_weight * gi) * gi;
  r = std::sqrt(v);
  const float den = r * s.inv_b2 + s.eps;
  p = p + (s.neg_step * m) / den;
}

// Pass 1 over elements [0, len) of a block (pointers offset to its first element): decode, update,
// write the master (and BF16 copy), the new m and r into m_buf / r_buf. In place (kOut false) the
// master is read and written at p (p_in unused); out of place it is read from p_in, the source, and
// written to p, the scratch. Two instances rather than p_in == p in place: every pointer stays
// restrict, so GCC vectorizes without runtime alias checks (which an in-place call would fail, and
// run scalar), and the source is not first copied into the scratch (that copy cost the AVX2 build's
// pass out of place ~1.3x the pass in place, against ~1.07x without it, on the 2-core test machine).
template <typename G, bool kLowp, bool kOut>
void update(int64_t len, const float* __restrict p_in, float* __restrict p, const G* __restrict g,
            uint16_t* __restrict out, const uint8_t* __restrict mc, const uint8_t* __restrict rc, float dm,
            float dr, float decay, const slidekit::AdamScalars s, float* __restrict m_buf,
            float* __restrict r_buf) {
  for (int64_t i = 0; i < len; ++i) {
    float pi = kOut ? p_in[i] : p[i];
    float mi;
    float ri;
    element(mc[i], rc[i], slidekit::load_grad(g, i), dm, dr, decay, s, pi, mi, ri);
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
  Scratch scratch;
  int64_t seg = segment_of(a.seg_stop, a.segments, b_lo * kBlock);
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t len = std::min(a.n, lo + kBlock) - lo;
    const BlockData d = open_block(a, b, lo, scratch);
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
        len, d.p_in, d.p, static_cast<const G*>(a.g) + lo, a.out == nullptr ? nullptr : a.out + lo,
        d.m_codes_in, d.r_codes_in, d.dm, d.dr, a.s, decay, m, r, m_top, r_top);
    const float am = float_of(m_top);
    const float ar = float_of(r_top);
    slidekit::fp8::avx512::encode_block<false>(len, m, factor(kMaxM, am), d.m_codes);
    slidekit::fp8::avx512::encode_block<true>(len, r, factor(kMaxR, ar), d.r_codes);
    close_block(a, b, lo, len, d, am, ar);
  }
  slidekit::backup_fence();  // this task's streaming stores (the copy's, the outputs'), complete on return
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
  Scratch scratch;
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t hi = std::min(a.n, lo + kBlock);
    const int64_t len = hi - lo;
    const BlockData d = open_block(a, b, lo, scratch);
    for (int64_t i = lo; i < hi;) {
      while (a.seg_stop[seg] <= i) {
        ++seg;
      }
      const int64_t j = std::min(hi, a.seg_stop[seg]);
      const int64_t at = i - lo;
      uint16_t* out = kLowp ? a.out + i : nullptr;
      if (a.to.p == nullptr) {  // the master updated where it is
        update<G, kLowp, false>(j - i, nullptr, d.p + at, g + i, out, d.m_codes_in + at, d.r_codes_in + at,
                                d.dm, d.dr, a.seg_decay[seg], a.s, m + at, r + at);
      } else {  // read from the source, written to the scratch
        update<G, kLowp, true>(j - i, d.p_in + at, d.p + at, g + i, out, d.m_codes_in + at, d.r_codes_in + at,
                               d.dm, d.dr, a.seg_decay[seg], a.s, m + at, r + at);
      }
      i = j;
    }
    const float am = float_of(block_top(len, m));
    const float ar = float_of(block_top(len, r));
    encode_m(len, m, factor(kMaxM, am), d.m_codes);
    encode_r(len, r, factor(kMaxR, ar), d.r_codes);
    close_block(a, b, lo, len, d, am, ar);
  }
  if (a.to.p != nullptr) {
    slidekit::backup_fence();  // this task's streaming stores (AVX2 builds), complete on return
  }
}
#endif

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n) {
  slidekit::check_vector(t, kKernel, name, dtype, n);
}

// The out-of-place update's outputs, checked: all five buffers with `out_of_place`, none without
// (this kernel writes no backup of the old values); all null for an update in place.
UpdateOut check_update_out(int64_t n, int64_t blocks, bool out_of_place, const std::optional<at::Tensor>& p,
                           const std::optional<at::Tensor>& m_codes, const std::optional<at::Tensor>& m_absmax,
                           const std::optional<at::Tensor>& r_codes, const std::optional<at::Tensor>& r_absmax) {
  const bool given = p.has_value();
  SLIDEKIT_CHECK(
      given == m_codes.has_value() && given == m_absmax.has_value() && given == r_codes.has_value() &&
          given == r_absmax.has_value(),
      kKernel, ": give all five backup buffers (master, both moments' codes and absmax) or none");
  SLIDEKIT_CHECK(
      given || !out_of_place, kKernel,
      ": out_of_place writes the update into the five backup buffers (master, both moments' codes and ",
      "absmax); give them");
  SLIDEKIT_CHECK(
      out_of_place || !given, kKernel,
      ": the five backup buffers receive the update out of place; pass out_of_place=True (this kernel ",
      "writes no backup of the old values: adamw_fp8 does not declare fused_backup)");
  if (!given) {
    return UpdateOut{nullptr, nullptr, nullptr, nullptr, nullptr};
  }
  check_vector(*p, "backup_master", at::kFloat, n);
  check_vector(*m_codes, "backup_exp_avg_codes", at::kByte, n);
  check_vector(*m_absmax, "backup_exp_avg_absmax", at::kFloat, blocks);
  check_vector(*r_codes, "backup_exp_avg_sq_sqrt_codes", at::kByte, n);
  check_vector(*r_absmax, "backup_exp_avg_sq_sqrt_absmax", at::kFloat, blocks);
  return UpdateOut{p->data_ptr<float>(), m_codes->data_ptr<uint8_t>(), m_absmax->data_ptr<float>(),
                   r_codes->data_ptr<uint8_t>(), r_absmax->data_ptr<float>()};
}

// One AdamW step over a whole unit, in place (or, `out_of_place`, into the five backup_* buffers):
// master, both moments' codes and scales, and the BF16 copy when `lowp_out` is given.
// `seg_stop`/`seg_decay` tile [0, n) in order; a decay of 1 means none. At most `max_tasks` threads
// of torch's intra-op pool take part (0: as many as torch uses); the result does not depend on it.
// Returns how many threads took part. `backup_*`: all five or none, and only with `out_of_place` (the
// caller checks they overlap nothing); they get the values the update in place would leave in master
// and state, which are then only read.
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
    int64_t max_tasks,
    std::optional<at::Tensor> backup_master,
    std::optional<at::Tensor> backup_m_codes,
    std::optional<at::Tensor> backup_m_absmax,
    std::optional<at::Tensor> backup_r_codes,
    std::optional<at::Tensor> backup_r_absmax,
    bool out_of_place) {
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
  const UpdateOut to = check_update_out(
      n, blocks, out_of_place, backup_master, backup_m_codes, backup_m_absmax, backup_r_codes, backup_r_absmax);
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
      slidekit::AdamScalars::from(w1, beta2, sq_weight, inv_b2, eps, neg_step),
      to};
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
      "One FP8-moment AdamW step over a unit, in place (or, out_of_place, into the backup buffers), "
      "optionally writing a BF16 copy",
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
      pybind11::arg("backup_master") = pybind11::none(),
      pybind11::arg("backup_m_codes") = pybind11::none(),
      pybind11::arg("backup_m_absmax") = pybind11::none(),
      pybind11::arg("backup_r_codes") = pybind11::none(),
      pybind11::arg("backup_r_absmax") = pybind11::none(),
      pybind11::arg("out_of_place") = false,
      // The update runs for tens of milliseconds: let the engine's other Python threads run.
      pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("encode_", &encode_, "fp8.encode with the kernel's encoder (for tests)", pybind11::arg("x"),
             pybind11::arg("codes"), pybind11::arg("unsigned_r"));
  module.def("backup_stream_bytes", []() { return slidekit::kBackupStreamBytes; },
             "the width of the out-of-place copy's streaming stores in this build, 0 where it copies with memcpy");
  module.def("vector_width", []() { return kVectorWidth; }, "16 where built for AVX-512, else 1");
  module.def("decode_", &decode_, "fp8.decode with the kernel's decoder (for tests)", pybind11::arg("codes"),
             pybind11::arg("x"), pybind11::arg("unsigned_r"));
}
