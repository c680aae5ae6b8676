// The memory streams of the host optimizer passes, without their arithmetic: the ceiling of each pass.
//
// benchmarks/fp8_codec.py rate --streams times these beside the real kernels, in the same rounds, so
// "how close is a kernel to its memory roof" and "what ratio of two kernels can the host reach at
// all" are measured on one machine at one time rather than inferred from a triad figure.
//
// Each probe walks [0, n) in contiguous tasks on torch's pool (parallel_tasks.h, as the kernels do)
// and, per element, reads and writes exactly the bytes of one pass, with just enough arithmetic that
// no byte can be skipped by the compiler:
//
//   adam_streams   layer_adam's fused_adam.cpp: a BF16 gradient read; the FP32 master and two FP32
//                  moments read and written in place; a BF16 copy of the master written (28 B).
//   fp8_streams    adamwfp8.cpp / adamw8.cpp: the BF16 gradient read; the FP32 master and two
//                  one-byte codes read and written in place; the BF16 copy written (16 B; the
//                  per-256 scales, 0.06 B, are left out).
//
// `copy` picks how the BF16 copy is written: 0 none (a pass that uploads the master instead),
// 1 plain stores (as the kernels store it today: the line is read before it is written), 2
// streaming stores (no read of the line): straight from the AVX-512 loop, elsewhere through a
// 128-element tile and backup_copy (backup_copy.h; memcpy where the ISA has none). Returns the
// number of pool threads that ran a task.
//
// Built by benchmarks/fp8_codec.py with the kernels' own flags (kernel_build.py) and csrc/ on the
// include path; tested by tests/plugins/test_fp8_codec.py (test_rate_streams).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backup_copy.h"
#include "parallel_tasks.h"

namespace {

constexpr int64_t kTile = 128;

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {  // truncation: a probe needs the bytes, not rounding
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

void check(const torch::Tensor& t, torch::ScalarType dtype, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == n, name,
              ": expected a contiguous tensor of ", n, " elements of ", dtype, ", got ", t.scalar_type(),
              " with ", t.numel());
}

// The streams of one pass over [lo, hi): `state` is float (layer_adam's moments) or uint8_t (the
// 8-bit codes). The AVX-512 loop takes 16 elements a step (the kernels' vector width), the scalar
// loop the rest (and everything in other builds, where the compiler vectorizes what it can).
template <typename State>
void pass(int64_t lo, int64_t hi, int64_t copy, float* p, State* a, State* b, const uint16_t* g,
          uint16_t* out, int64_t out_base = 0) {  // element i's copy goes to out[i - out_base]
  int64_t i = lo;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const bool stream = copy == 2 && (reinterpret_cast<uintptr_t>(out + (lo - out_base)) % 32) == 0;
  for (; i + 16 <= hi; i += 16) {
    const __m512i gi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)));
    const __m512 gf = _mm512_castsi512_ps(_mm512_slli_epi32(gi, 16));
    if constexpr (std::is_same_v<State, float>) {
      const __m512 half = _mm512_set1_ps(0.5f);
      _mm512_storeu_ps(a + i, _mm512_add_ps(_mm512_mul_ps(half, _mm512_loadu_ps(a + i)), gf));
      _mm512_storeu_ps(b + i, _mm512_add_ps(_mm512_mul_ps(half, _mm512_loadu_ps(b + i)), gf));
    } else {
      const __m128i lo8 = _mm512_cvtepi32_epi8(gi);
      const __m128i hi8 = _mm512_cvtepi32_epi8(_mm512_srli_epi32(gi, 8));
      __m128i* pa = reinterpret_cast<__m128i*>(a + i);
      __m128i* pb = reinterpret_cast<__m128i*>(b + i);
      _mm_storeu_si128(pa, _mm_add_epi8(_mm_loadu_si128(pa), lo8));
      _mm_storeu_si128(pb, _mm_xor_si128(_mm_loadu_si128(pb), hi8));
    }
    const __m512 np = _mm512_add_ps(_mm512_loadu_ps(p + i), _mm512_mul_ps(_mm512_set1_ps(1e-30f), gf));
    _mm512_storeu_ps(p + i, np);
    if (copy != 0) {
      const __m256i c = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(np), 16));
      if (stream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out + (i - out_base)), c);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (i - out_base)), c);
      }
    }
  }
#endif
  for (; i < hi; ++i) {
    const uint16_t gb = g[i];
    const float gf = bf16_to_float(gb);
    if constexpr (std::is_same_v<State, float>) {
      a[i] = 0.5f * a[i] + gf;
      b[i] = 0.5f * b[i] + gf;
    } else {
      a[i] = static_cast<uint8_t>(a[i] + static_cast<uint8_t>(gb));
      b[i] = static_cast<uint8_t>(b[i] ^ static_cast<uint8_t>(gb >> 8));
    }
    const float np = p[i] + 1e-30f * gf;
    p[i] = np;
    if (copy != 0) {
      out[i - out_base] = float_to_bf16_bits(np);
    }
  }
}

// Streaming stores where this build has no AVX-512 loop: each tile's copy through backup_copy.
template <typename State>
void pass_tiled(int64_t lo, int64_t hi, int64_t copy, float* p, State* a, State* b, const uint16_t* g,
                uint16_t* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  pass(lo, hi, copy, p, a, b, g, out);
#else
  if (copy != 2) {
    pass(lo, hi, copy, p, a, b, g, out);
    return;
  }
  alignas(64) uint16_t tile[kTile];
  for (int64_t t = lo; t < hi; t += kTile) {
    const int64_t end = std::min(hi, t + kTile);
    pass(t, end, int64_t{1}, p, a, b, g, tile, t);  // element i's copy to tile[i - t]
    slidekit::backup_copy(out + t, tile, (end - t) * static_cast<int64_t>(sizeof(uint16_t)));
  }
#endif
}

template <typename State>
int64_t run(torch::Tensor master, torch::Tensor grad, torch::Tensor a, torch::Tensor b, torch::Tensor lowp,
            int64_t copy, int64_t threads, torch::ScalarType state_dtype) {
  TORCH_CHECK(copy >= 0 && copy <= 2, "copy must be 0 (none), 1 (plain stores) or 2 (streaming), got ",
              copy);
  const int64_t n = master.numel();
  check(master, torch::kFloat32, n, "master");
  check(grad, torch::kBFloat16, n, "grad");
  check(a, state_dtype, n, "first state");
  check(b, state_dtype, n, "second state");
  check(lowp, torch::kBFloat16, n, "lowp");
  float* p = master.data_ptr<float>();
  State* pa = static_cast<State*>(a.data_ptr());
  State* pb = static_cast<State*>(b.data_ptr());
  const uint16_t* g = reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(lowp.data_ptr<at::BFloat16>());
  return slidekit::run_in_tasks(n, 1 << 16, kTile, threads, [&](int64_t lo, int64_t hi) {
    pass_tiled(lo, hi, copy, p, pa, pb, g, out);
    slidekit::backup_fence();
  });
}

int64_t adam_streams(torch::Tensor master, torch::Tensor grad, torch::Tensor m, torch::Tensor v,
                     torch::Tensor lowp, int64_t copy, int64_t threads) {
  return run<float>(master, grad, m, v, lowp, copy, threads, torch::kFloat32);
}

int64_t fp8_streams(torch::Tensor master, torch::Tensor grad, torch::Tensor mc, torch::Tensor vc,
                    torch::Tensor lowp, int64_t copy, int64_t threads) {
  return run<uint8_t>(master, grad, mc, vc, lowp, copy, threads, torch::kUInt8);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("adam_streams", &adam_streams, "layer_adam's streams (28 B/param with the copy)");
  module.def("fp8_streams", &fp8_streams, "the 8-bit optimizers' streams (16 B/param with the copy)");
}
