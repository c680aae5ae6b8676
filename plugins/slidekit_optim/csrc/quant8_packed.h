// slidekit adamw8.cpp: quant8's compact encoding table (QuantMap.packed), read and looked up.
//
// One int32 entry per 17-bit key holds both of quant8's answers, `code | cut << 8`; only the keys
// whose entry differs from its neighbours' are stored (per sign: key 0, one entry for every key
// below a window, the window, one entry for every key above). The layout, and its check against
// quant8's two tables for every key, are quant8._packed_table's:
//
//     K     = (bits(y) >> 15) & 0xFFFF,  s = the sign bit of y
//     entry = entries[base[s] + (K == 0 ? 0 : clamp(K - lo[s] + 2, 1, top[s]))]
//     low   = bits(y) & 0x7FFF, bit-inverted when s is set (so a larger value is a larger float)
//     code  = (entry & 0xFF) + (low > entry >> 8)
//
// which is quant8.encode's table[key] + (y > threshold[key]) for every float32 y, NaN included.
// The portable block encoder is here; quant8_avx512.h has a 16-lane form.

#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "adam_common.h"

namespace slidekit {

constexpr int64_t kPackedHeader = 8;  // quant8.PACKED_HEADER

struct PackedTable {
  const int32_t* entries;  // the whole tensor; the header's bases count from its start
  int32_t lo[2];           // per sign (0: positive): the window's first key
  int32_t top[2];          // the slot of the entry above the window
  int32_t base[2];         // the slot of the sign's first entry (that of key 0)
};

// The table of a QuantMap.packed tensor, its header checked against its size (else a RuntimeError
// naming `kernel` and `name`), so no lookup can leave it.
inline PackedTable read_packed(const at::Tensor& packed, const char* kernel, const char* name) {
  SLIDEKIT_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
                  packed.dim() == 1 && packed.numel() > kPackedHeader,
              kernel, ": ", name, " must be a QuantMap's packed table (a contiguous CPU int32 vector), got ",
              packed.scalar_type(), " with ", packed.numel(), " elements on ", packed.device());
  const int32_t* e = packed.data_ptr<int32_t>();
  PackedTable t{e, {e[0], e[3]}, {e[1], e[4]}, {e[2], e[5]}};
  const bool laid_out = t.base[0] == kPackedHeader && t.top[0] >= 2 && t.top[1] >= 2 &&
                        t.base[1] == t.base[0] + t.top[0] + 1 &&
                        packed.numel() == int64_t{t.base[1]} + t.top[1] + 1;
  SLIDEKIT_CHECK(laid_out, kernel, ": ", name, "'s header [", e[0], ", ", e[1], ", ", e[2], ", ", e[3], ", ",
              e[4], ", ", e[5], "] does not match its ", packed.numel(),
              " elements; build the map with quant8.QuantMap.build");
  return t;
}

// The codes of x[i] / scale, i < len (<= 256): the lookup above, in two loops without branches, so
// that GCC vectorizes all but the table reads (which it issues as scalar loads).
inline void encode_block_portable(int64_t len, const float* __restrict x, float scale,
                                  const PackedTable& t, uint8_t* __restrict codes) {
  alignas(64) uint32_t bits[256];
  alignas(64) int32_t slot[256];
  const int32_t lo0 = t.lo[0] - 2, lo1 = t.lo[1] - 2;  // slot = key - lo + 2
  const int32_t top0 = t.top[0], top1 = t.top[1];
  const int32_t base0 = t.base[0], base1 = t.base[1];
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t u = bits_of(x[i] / scale);
    const bool negative = static_cast<int32_t>(u) < 0;
    const int32_t key = static_cast<int32_t>((u >> 15) & 0xFFFFu);
    const int32_t clamped = std::min(std::max(key - (negative ? lo1 : lo0), 1), negative ? top1 : top0);
    bits[i] = u;
    slot[i] = (negative ? base1 : base0) + (key == 0 ? 0 : clamped);
  }
  const int32_t* entries = t.entries;
  for (int64_t i = 0; i < len; ++i) {
    const int32_t entry = entries[slot[i]];
    const uint32_t low = (bits[i] ^ (0u - (bits[i] >> 31))) & 0x7FFFu;  // bit-inverted when negative
    codes[i] = static_cast<uint8_t>((entry & 0xFF) + (low > static_cast<uint32_t>(entry >> 8) ? 1 : 0));
  }
}

}  // namespace slidekit
