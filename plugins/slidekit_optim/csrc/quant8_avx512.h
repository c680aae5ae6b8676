// slidekit adamw8.cpp, AVX-512 build: one block of 8-bit AdamW, 16 lanes at a time.
//
// * decode: values[code] from the 256-entry map, one of two ways giving the same value (a table
//   entry, read exactly): read as 16 zmm loads (L1), eight two-table permutes (vpermt2ps: 32
//   entries each, chosen by the code's low 5 bits) and seven blends by its bits 5, 6 and 7 (15
//   port-5 instructions per 16 codes); or one gather from the 1 KiB table. A gather is microcoded
//   on Zen 4 and slowed by the Downfall mitigation on Intel cores up to Ice Lake, and native on
//   later Intel cores, where it is the faster (1.16x the whole kernel on one core of the test
//   machine, NOTES 44): adamw8.cpp's decode_by_gather() times both once per process and takes the
//   faster (SLIDEKIT_ADAMW8_DECODE=gather|permute overrides it).
// * encode: quant8_packed.h's lookup, one gather of `code | cut << 8` per 16 elements from the
//   compact table (42 KB for the signed dynamic map, 21 KB for the unsigned one: L1/L2-resident),
//   four in flight, then one integer comparison.
// * a block is two passes over 16-element vectors: (1) decode m and v, the AdamW update (the
//   operations of adam_common.h in its order, one rounding each, no FMA: intrinsics, and the file
//   is compiled with -ffp-contract=off), the master and BF16 copy out, the new m and v into two
//   1 KiB buffers (L1) and the running maxima of their |x| bit patterns; (2) per moment, y = x /
//   scale (one division, as the torch path) and the lookup. The short last block runs the same
//   code under lane masks; what the masked-off lanes compute is never stored.
//
// Measured on Zen 4 (docs/benchmarks/NOTES.md section 13): as fast as the portable loops built with
// the same flags, both ~1.25x the former two-table kernel; the gather is a third of the time.
// Compiled only where the build enables AVX-512 F/BW/DQ/VL (kernel_build.py's AVX512 capability);
// elsewhere adamw8.cpp runs its portable loops, which give the same bits. Tested by
// tests/plugins/test_adamw8_kernel.py (the whole step, bitwise against the torch path) and
// tests/plugins/test_adamw8_encoder.py (the encoder against quant8.encode on every 17-bit key).

#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define SLIDEKIT_ADAMW8_AVX512 1

#include <immintrin.h>

#include <cstdint>

#include "adam_common.h"
#include "quant8_packed.h"

namespace slidekit::avx512 {

// t[idx] for idx in [0, 32 * kPairs), t[0 .. 32 * kPairs) readable: kPairs two-table permutes by the
// index's low 5 bits and kPairs - 1 blends by its bits 5, 6, 7.
template <int kPairs>
inline __m512 lookup(const float* t, __m512i idx) {
  if constexpr (kPairs == 1) {
    return _mm512_permutex2var_ps(_mm512_loadu_ps(t), idx, _mm512_loadu_ps(t + 16));
  } else {
    constexpr int kHalf = kPairs / 2;
    const __mmask16 upper = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32 * kHalf));
    return _mm512_mask_blend_ps(upper, lookup<kHalf>(t, idx), lookup<kHalf>(t + 32 * kHalf, idx));
  }
}

// quant8_packed.h's lookup for 16 lanes at a time: its table's constants, broadcast once per block (a
// loop that rebuilt them would spend nine broadcasts per round of four vectors).
struct Encoder {
  __m512i lo_p, lo_n, top_p, top_n, base_n, one, key_mask, low_mask, code_mask;
  const int32_t* entries;
  explicit Encoder(const PackedTable& t)
      : lo_p(_mm512_set1_epi32(t.lo[0] - 2)),
        lo_n(_mm512_set1_epi32(t.lo[1] - 2)),
        top_p(_mm512_set1_epi32(t.top[0])),
        top_n(_mm512_set1_epi32(t.top[1])),
        base_n(_mm512_set1_epi32(t.base[1] - t.base[0])),
        one(_mm512_set1_epi32(1)),
        key_mask(_mm512_set1_epi32(0xFFFF)),
        low_mask(_mm512_set1_epi32(0x7FFF)),
        code_mask(_mm512_set1_epi32(0xFF)),
        entries(t.entries + t.base[0]) {}

  // The codes of kVec x 16 values y. The gathers are issued together: they are the slow part, and
  // independent of each other.
  template <int kVec>
  __attribute__((always_inline)) inline void operator()(const __m512* y, __m512i* code) const {
    __m512i entry[kVec];
    for (int j = 0; j < kVec; ++j) {
      const __m512i u = _mm512_castps_si512(y[j]);
      const __mmask16 negative = _mm512_movepi32_mask(u);
      const __m512i key = _mm512_and_si512(_mm512_srli_epi32(u, 15), key_mask);
      __m512i slot = _mm512_sub_epi32(key, _mm512_mask_blend_epi32(negative, lo_p, lo_n));
      slot = _mm512_min_epi32(_mm512_max_epi32(slot, one), _mm512_mask_blend_epi32(negative, top_p, top_n));
      slot = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(key, key), slot);  // key 0: slot 0
      slot = _mm512_mask_add_epi32(slot, negative, slot, base_n);
      entry[j] = _mm512_i32gather_epi32(slot, entries, 4);
    }
    for (int j = 0; j < kVec; ++j) {
      const __m512i u = _mm512_castps_si512(y[j]);
      const __m512i flip = _mm512_srai_epi32(u, 31);  // all ones where negative: invert the low bits
      const __m512i low = _mm512_and_si512(_mm512_xor_si512(u, flip), low_mask);
      const __m512i c = _mm512_and_si512(entry[j], code_mask);
      const __mmask16 up = _mm512_cmpgt_epi32_mask(low, _mm512_srli_epi32(entry[j], 8));
      code[j] = _mm512_mask_add_epi32(c, up, c, one);
    }
  }
};

// Elements in a whole block (adamw8.cpp's kBlock, quant8.BLOCK_SIZE); only a unit's last block is shorter.
constexpr int64_t kBlockLen = 256;

// The lanes of a vector that hold elements: all 16, the first `left`, or none.
inline __mmask16 lanes(int64_t left) {
  if (left <= 0) {
    return 0;
  }
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// Round to BF16, nearest even; NaN becomes 0x7FC0 (adam_common.h's to_bf16, 16 lanes).
inline __m512i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
}

// Stores the BF16 copy's 16 lanes (to_bf16's) at out: a full vector at a 32-byte boundary with a
// streaming store, which writes the line without reading it first (the copy is read next by the
// upload's DMA, not by this core: the read was 2 of the pass's 18 bytes per parameter, NOTES 41);
// a partial or misaligned one with the masked plain store. The caller fences before returning
// (backup_copy.h's backup_fence), as for any streaming store. The same bits either way.
inline void store_copy(uint16_t* out, __mmask16 k, __m512i lanes16) {
  if (k == static_cast<__mmask16>(0xFFFF) && (reinterpret_cast<uintptr_t>(out) & 31) == 0) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(lanes16));
  } else {
    _mm512_mask_cvtepi32_storeu_epi16(out, k, lanes16);
  }
}

// 16 gradient elements as float: FP32, or BF16 widened exactly.
inline __m512 load_grad(const float* g, __mmask16 k) { return _mm512_maskz_loadu_ps(k, g); }

inline __m512 load_grad(const uint16_t* g, __mmask16 k) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, g));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// One block's tensors (offset to the block) and its old scales.
struct Block {
  int64_t len;             // elements, 1..256
  const float* p_in;       // master, read here ...
  float* p;                // ... and written here: the same array in place, a scratch out of place
  const void* g;           // gradient, FP32 or BF16
  uint16_t* out;           // BF16 copy, or nullptr
  const uint8_t* m_codes;  // read here; the new codes are written by encode_block
  const uint8_t* v_codes;
  float m_scale;
  float v_scale;
};

// Pass 1 over one block: decode, update, write the master (and BF16 copy) to b.p; the new moments go to
// m_buf / v_buf (256 floats each) and the maxima of their |x| bit patterns to m_top / v_top.
// decay(i) is the vector of the decay factors of the block's elements [i, i + 16).
// values[codes] for 16 codes (32-bit lanes, each < 256): by permutes, or (kGather) one gather.
template <bool kGather>
inline __m512 decode16(const float* values, __m512i codes) {
  if constexpr (kGather) {
    return _mm512_i32gather_ps(codes, values, 4);
  } else {
    return lookup<8>(values, codes);
  }
}

// kFull: the block is whole (b.len == kBlockLen), so every vector's lanes are all 16, a constant: the
// loads, stores and maxima go unmasked and no mask is computed (the kmovw of a computed mask issues on
// port 5, one of the two that run 512-bit arithmetic). The same bits either way.
template <typename G, bool kLowp, bool kGather, bool kFull, typename DecayAt>
inline void update(const Block& b, const float* m_values, const float* v_values, const AdamScalars& s,
                   DecayAt&& decay, float* __restrict m_buf, float* __restrict v_buf, uint32_t& m_top,
                   uint32_t& v_top) {
  const G* g = static_cast<const G*>(b.g);
  const __m512 m_scale = _mm512_set1_ps(b.m_scale);
  const __m512 v_scale = _mm512_set1_ps(b.v_scale);
  const __m512 w1 = _mm512_set1_ps(s.w1);
  const __m512 beta2 = _mm512_set1_ps(s.beta2);
  const __m512 w2 = _mm512_set1_ps(s.sq_weight);
  const __m512 inv_b2 = _mm512_set1_ps(s.inv_b2);
  const __m512 eps = _mm512_set1_ps(s.eps);
  const __m512 neg_step = _mm512_set1_ps(s.neg_step);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i m_max = _mm512_setzero_si512();
  __m512i v_max = _mm512_setzero_si512();
  const int64_t len = kFull ? kBlockLen : b.len;
  for (int64_t i = 0; i < len; i += 16) {
    const __mmask16 k = kFull ? static_cast<__mmask16>(0xFFFF) : lanes(len - i);
    const __m512i mc = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, b.m_codes + i));
    const __m512i vc = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, b.v_codes + i));
    const __m512 gi = load_grad(g + i, k);
    const __m512 m0 = _mm512_mul_ps(decode16<kGather>(m_values, mc), m_scale);
    const __m512 v0 = _mm512_mul_ps(decode16<kGather>(v_values, vc), v_scale);
    __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, b.p_in + i), decay(i));
    const __m512 m = _mm512_add_ps(m0, _mm512_mul_ps(w1, _mm512_sub_ps(gi, m0)));
    __m512 v = _mm512_mul_ps(v0, beta2);
    v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_mul_ps(w2, gi), gi));
    const __m512 den = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), inv_b2), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step, m), den));
    _mm512_mask_storeu_ps(b.p + i, k, p);
    if constexpr (kLowp) {
      store_copy(b.out + i, k, to_bf16(p));
    }
    _mm512_store_ps(m_buf + i, m);
    _mm512_store_ps(v_buf + i, v);
    m_max = _mm512_mask_max_epu32(m_max, k, m_max, _mm512_and_si512(_mm512_castps_si512(m), magnitude));
    v_max = _mm512_mask_max_epu32(v_max, k, v_max, _mm512_and_si512(_mm512_castps_si512(v), magnitude));
  }
  m_top = _mm512_reduce_max_epu32(m_max);
  v_top = _mm512_reduce_max_epu32(v_max);
}

// Pass 2 for one moment: the codes of x / scale. x: 256 floats (lanes past len read, ignored). kFull: len
// is kBlockLen (update's kFull).
// Always inlined, so that the encoder's constants are built once per block, outside its loop (a called
// clone rebuilt them every round, NOTES 55).
template <bool kFull>
__attribute__((always_inline)) inline void encode_block(int64_t len, const float* __restrict x, float scale,
                                                        const PackedTable& t, uint8_t* __restrict codes) {
  constexpr int kVec = 4;  // 64 elements per round: four gathers in flight
  const Encoder encode(t);  // built from a copy: the byte stores below cannot alias it
  const __m512 sc = _mm512_set1_ps(scale);
  if constexpr (kFull) {
    len = kBlockLen;
  }
  for (int64_t i = 0; i < len; i += 16 * kVec) {
    __m512 y[kVec];
    __m512i c[kVec];
    for (int j = 0; j < kVec; ++j) {
      y[j] = _mm512_div_ps(_mm512_load_ps(x + i + 16 * j), sc);
    }
    encode.operator()<kVec>(y, c);
    for (int j = 0; j < kVec; ++j) {
      if constexpr (kFull) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i + 16 * j), _mm512_cvtepi32_epi8(c[j]));
      } else {
        _mm512_mask_cvtepi32_storeu_epi8(codes + i + 16 * j, lanes(len - i - 16 * j), c[j]);
      }
    }
  }
}

}  // namespace slidekit::avx512

#endif
