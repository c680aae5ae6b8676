// slidekit CPU kernels: the block-wise scaled 8-bit float codes of slidekit_optim/fp8.py, in C++.
//
// Two formats with 4 exponent bits (bias 7) and subnormals: E4M3 (signed, 3 mantissa bits, largest
// 448: OCP FP8 e4m3fn without its NaN codes) and UE4M4 (unsigned, 4 mantissa bits, largest 496).
// Decoding is exact; encoding rounds to nearest, ties to even, by integer arithmetic on the FP32
// pattern (normals) or one FP32 addition whose ulp is the subnormal step (subnormals): the very
// operations of fp8.py's torch codec, so the two give the same codes for every non-NaN input.
//
// Plain branch-free functions on one element (selects, no table), written for GCC to vectorize
// the loops that call them (-O3, -fno-trapping-math lets it if-convert the selects).
// Included by path from adamwfp8.cpp; kernel_build.py hashes every *.h here into the build's key.

#pragma once

#include <algorithm>
#include <cstdint>

#include "adam_common.h"  // bits_of, float_of

namespace slidekit::fp8 {

constexpr uint32_t kMinNormalBits = 121u << 23;  // 2^-6, both formats' smallest normal
constexpr uint32_t kRebias = 120u << 23;         // exponent bias 127 -> 7

// The value of magnitude code c (exponent and mantissa bits, M of them mantissa), exactly.
template <int M>
inline float decode_magnitude(uint32_t c) {
  constexpr int kShift = 23 - M;
  const bool subnormal = (c >> M) == 0;
  const float x = float_of((c << kShift) + (subnormal ? kMinNormalBits : kRebias));
  return subnormal ? x - 0x1p-6f : x;  // subnormal: 2^-6 (1 + m / 2^M) - 2^-6, exact
}

inline float decode_e4m3(uint8_t c) {
  const float mag = decode_magnitude<3>(c & 0x7Fu);
  return (c & 0x80u) ? -mag : mag;
}

inline float decode_ue4m4(uint8_t c) { return decode_magnitude<4>(c); }

// The magnitude code of |y| (the caller clamped it to the format's largest value): nearest, ties even.
template <int M>
inline uint32_t encode_magnitude(float mag) {
  constexpr int kShift = 23 - M;
  constexpr float kMagic = static_cast<float>(1u << (17 - M));  // its ulp is the subnormal step
  const uint32_t u = bits_of(mag);
  const uint32_t normal = ((u + ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u)) >> kShift) - (kRebias >> kShift);
  const uint32_t sub = bits_of(mag + kMagic) - bits_of(kMagic);  // the addition rounds to nearest even
  return u < kMinNormalBits ? sub : normal;
}

inline uint8_t encode_e4m3(float y) {
  const uint32_t sign = (bits_of(y) >> 24) & 0x80u;
  const float mag = std::min(float_of(bits_of(y) & 0x7FFFFFFFu), 448.0f);
  return static_cast<uint8_t>(encode_magnitude<3>(mag) | sign);
}

// keep_nonzero: a nonzero value never takes code 0.
inline uint8_t encode_ue4m4_nonzero(float y) {
  const float mag = std::min(float_of(bits_of(y) & 0x7FFFFFFFu), 496.0f);
  const uint32_t code = encode_magnitude<4>(mag);
  return static_cast<uint8_t>(std::max(code, static_cast<uint32_t>(bits_of(mag) != 0)));
}

}  // namespace slidekit::fp8
