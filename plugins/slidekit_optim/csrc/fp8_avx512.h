// slidekit adamwfp8.cpp, AVX-512 build: one block of FP8-moment AdamW, 16 lanes at a time.
//
// The operations of adamwfp8.cpp's portable loops (fp8_codec.h, adam_common.h), giving the same
// bits, with two shortcuts that change no result:
// * decoding through FP16: an E4M3 code's bits moved into an FP16 pattern (sign to bit 15, the
//   exponent and mantissa to bits 13..7; UE4M4's to bits 13..6) are an FP16 number of exactly the
//   code's value times 2^-8 (FP16's exponent bias is 15, the codes' 7), subnormals included (an
//   exponent field of 0 is subnormal in both), which vcvtph2ps widens exactly; times (A / max) * 2^8, exact too, the product is the
//   same real number as value * (A / max), so it rounds the same;
// * encoding folds the exponent rebias into the rounding constant (a normal's pattern is at least
//   that of 2^-6, so the subtraction never wraps).
// A block is two passes: (1) decode, update (adam_common.h's order, intrinsics, no FMA), master and
// BF16 copy out, the new m and r into two 1 KiB buffers and the running maxima of their bit
// patterns; (2) per moment, y = x * (max / A) and the codes. The short last block runs under lane
// masks; what masked-off lanes compute is never stored.
//
// Compiled only where the build enables AVX-512 F/BW/DQ/VL (kernel_build.py's AVX512 capability);
// elsewhere adamwfp8.cpp runs its portable loops. Tested by tests/plugins/test_fp8_codec.py and
// tests/plugins/test_update_out.py (out of place).

#pragma once

#include "fp8_codec.h"      // the formats' constants
#include "quant8_avx512.h"  // lanes, to_bf16, load_grad (and SLIDEKIT_ADAMW8_AVX512 where enabled)

#ifdef SLIDEKIT_ADAMW8_AVX512  // vcvtph2ps on zmm is AVX-512 F
#define SLIDEKIT_ADAMWFP8_AVX512 1

namespace slidekit::fp8::avx512 {

using slidekit::avx512::lanes;

// 16 E4M3 codes as FP32 values times 2^-8.
inline __m512 decode_e4m3_scaled(__m128i c8) {
  const __m256i w = _mm256_cvtepu8_epi16(c8);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(w, 8);  // bit 7 to bit 15 (the lower bits are masked off)
  // 0xF8: a | (b & c), with a = mag, b = sign, c = 0x8000
  const __m256i h = _mm256_ternarylogic_epi32(mag, sign, _mm256_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
  return _mm512_cvtph_ps(h);
}

// 16 UE4M4 codes as FP32 values times 2^-8.
inline __m512 decode_ue4m4_scaled(__m128i c8) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(c8), 6));
}

// The magnitude codes of |y| clamped to `top` (M mantissa bits), nearest even, as 32-bit lanes; and
// the |y| bit patterns before clamping, in `bits`.
template <int M>
inline __m512i encode_magnitude(__m512 y, float top, __m512i& bits) {
  constexpr int kShift = 23 - M;
  constexpr float kMagic = static_cast<float>(1u << (17 - M));
  bits = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 mag = _mm512_min_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(top));
  const __m512i u = _mm512_castps_si512(mag);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, kShift), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_set1_epi32(static_cast<int32_t>((1u << (kShift - 1)) - 1u - kRebias));
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), odd), kShift);
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(mag, _mm512_set1_ps(kMagic))),
                                       _mm512_set1_epi32(static_cast<int32_t>(bits_of(kMagic))));
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(u, _mm512_set1_epi32(static_cast<int32_t>(kMinNormalBits)));
  return _mm512_mask_blend_epi32(is_sub, normal, sub);
}

// Codes of the 16 elements x[0, 16) * factor (the lanes of k stored): E4M3 (kUnsigned false) or
// UE4M4 with keep_nonzero.
template <bool kUnsigned>
inline void encode16(const float* __restrict x, __m512 factor, uint8_t* __restrict codes, __mmask16 k) {
  const __m512 y = _mm512_mul_ps(_mm512_load_ps(x), factor);
  __m512i bits;
  __m512i c;
  if constexpr (kUnsigned) {
    c = encode_magnitude<4>(y, 496.0f, bits);
    c = _mm512_mask_max_epu32(c, _mm512_test_epi32_mask(bits, bits), c, _mm512_set1_epi32(1));
  } else {
    c = encode_magnitude<3>(y, 448.0f, bits);
    const __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(y), 24);
    c = _mm512_ternarylogic_epi32(c, sign, _mm512_set1_epi32(0x80), 0xF8);  // c | (sign & 0x80)
  }
  _mm_mask_storeu_epi8(codes, k, _mm512_cvtepi32_epi8(c));  // register vpmovdb: a masked store form is slower on Zen 4
}

// Pass 2 for one moment: the codes of x[0, len) * f (x: 256 floats; lanes past len read, ignored).
template <bool kUnsigned>
inline void encode_block(int64_t len, const float* __restrict x, float f, uint8_t* __restrict codes) {
  const __m512 factor = _mm512_set1_ps(f);
  for (int64_t i = 0; i < len; i += 16) {
    encode16<kUnsigned>(x + i, factor, codes + i, lanes(len - i));
  }
}

// Pass 1 over one block's elements [0, len) (pointers offset to the block): decode with the block's
// dm = A_m / 448 and dr = A_r / 496, update the master read from p_in and write it to p (the same
// array in place; out of place, adamwfp8.cpp's L1 scratch, so the source is only read), and the BF16
// copy; the new m and r go to m_buf / r_buf (256 floats each) and the maxima of their |x| bit
// patterns to m_top / r_top. decay(i) is the vector of the decay factors of the block's elements
// [i, i + 16).
template <typename G, bool kLowp, typename DecayAt>
inline void update(int64_t len, const float* p_in, float* p, const G* g, uint16_t* out, const uint8_t* mc,
                   const uint8_t* rc, float dm, float dr, const AdamScalars& s, DecayAt&& decay,
                   float* __restrict m_buf, float* __restrict r_buf, uint32_t& m_top, uint32_t& r_top) {
  const __m512 m_scale = _mm512_set1_ps(dm * 256.0f);  // exact: a power of two, never overflowing
  const __m512 r_scale = _mm512_set1_ps(dr * 256.0f);
  const __m512 w1 = _mm512_set1_ps(s.w1);
  const __m512 beta2 = _mm512_set1_ps(s.beta2);
  const __m512 w2 = _mm512_set1_ps(s.sq_weight);
  const __m512 inv_b2 = _mm512_set1_ps(s.inv_b2);
  const __m512 eps = _mm512_set1_ps(s.eps);
  const __m512 neg_step = _mm512_set1_ps(s.neg_step);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i m_max = _mm512_setzero_si512();
  __m512i r_max = _mm512_setzero_si512();
  for (int64_t i = 0; i < len; i += 16) {
    const __mmask16 k = lanes(len - i);
    const __m512 m0 = _mm512_mul_ps(decode_e4m3_scaled(_mm_maskz_loadu_epi8(k, mc + i)), m_scale);
    const __m512 r0 = _mm512_mul_ps(decode_ue4m4_scaled(_mm_maskz_loadu_epi8(k, rc + i)), r_scale);
    const __m512 gi = slidekit::avx512::load_grad(g + i, k);
    __m512 pi = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p_in + i), decay(i));
    const __m512 m = _mm512_add_ps(m0, _mm512_mul_ps(w1, _mm512_sub_ps(gi, m0)));
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(r0, r0), beta2);
    v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_mul_ps(w2, gi), gi));
    const __m512 r = _mm512_sqrt_ps(v);
    const __m512 den = _mm512_add_ps(_mm512_mul_ps(r, inv_b2), eps);
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(neg_step, m), den));
    _mm512_mask_storeu_ps(p + i, k, pi);
    if constexpr (kLowp) {
      slidekit::avx512::store_copy(out + i, k, slidekit::avx512::to_bf16(pi));
    }
    _mm512_store_ps(m_buf + i, m);
    _mm512_store_ps(r_buf + i, r);
    m_max = _mm512_mask_max_epu32(m_max, k, m_max, _mm512_and_si512(_mm512_castps_si512(m), magnitude));
    r_max = _mm512_mask_max_epu32(r_max, k, r_max, _mm512_and_si512(_mm512_castps_si512(r), magnitude));
  }
  m_top = _mm512_reduce_max_epu32(m_max);
  r_top = _mm512_reduce_max_epu32(r_max);
}

}  // namespace slidekit::fp8::avx512

#endif
