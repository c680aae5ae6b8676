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
//     code  = quant8.encode(y)                nearest map value, ties to the smaller code
//
// The last line reads quant8's tables in their compact form (QuantMap.packed, quant8_packed.h):
// one int32 lookup per element in a table of ~10 K entries (42 KB), instead of a byte and a float
// from two 2^17-entry tables (640 KB per map, which missed the L1 and, for both maps, the L2).
// The maps come from Python with every call, so whatever QuantMap the optimizer holds is the one
// used. Built for AVX-512 (kernel_build.py's AVX512 capability), a block runs in zmm registers,
// decoding by permutes or by a gather, whichever decode_by_gather() timed faster on this CPU
// (quant8_avx512.h); elsewhere in the portable loops below. All give the same bits.
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
// Speculative clipping (backup_copy.h) takes five more buffers (master, both moments' codes and
// scales), in one of two ways; either way a block's master and codes go there with streaming stores
// where the ISA has them and its two scales with plain stores, and the block is updated by the same
// code on the same values, so no bit of the update changes:
//
// * backup (out_of_place false): each block's old master, codes and scales are copied there right
//   before the block is decoded and updated in place from L1; the backup is the old bytes. Cost:
//   6 B/param more written (16 -> 22 B/param with a BF16 gradient and the BF16 copy: read 2 + 6,
//   write 6 + 2; the scales add 0.03 per copy).
// * out of place (out_of_place true): each block is decoded and updated from the unit's buffers as
//   in place, but its new master and codes are written to an L1 scratch (the BF16 copy as usual),
//   which is then copied out to the buffers, the new scales stored there; master and state are only
//   read (the portable loops through adam_common.h's adam_update_from: the master read from the
//   source, written to the scratch). Cost: the update in place's 16 B/param: the outputs are written
//   instead of the sources, and streaming stores write them without reading their lines first.
//
// The per-element update (and the BF16 rounding, the scalars and the argument checks) is in
// adam_common.h, shared with fused_adam.cpp; this file decodes, encodes and walks the blocks.
// quantize_blockwise_ exposes the encoder alone, so that tests can hold it to quant8.encode on
// every 17-bit key.
//
// Built on first use by slidekit_optim/adamw_8bit.py (through layer_adam's load_kernel, i.e.
// torch.utils.cpp_extension.load); tested by tests/plugins/test_adamw8_kernel.py (bitwise
// against the pure-torch path), tests/plugins/test_adamw8_encoder.py (the encoder),
// tests/plugins/test_fused_backup.py (the backup) and tests/plugins/test_update_out.py (out of place).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: halves the build time

#include "adam_common.h"     // the per-element update, BF16 rounding and checks, shared by both kernels
#include "backup_copy.h"     // the speculative-clipping backup, stored in the update's pass
#include "parallel_tasks.h"  // the split into tasks on torch's thread pool, shared by both kernels
#include "quant8_avx512.h"   // the AVX-512 block pass (only where the build enables AVX-512)
#include "quant8_packed.h"   // quant8's compact encoding table

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;  // quant8.BLOCK_SIZE

constexpr const char* kKernel = "adamw8_step";

#ifdef SLIDEKIT_ADAMW8_AVX512
constexpr int64_t kVectorWidth = 16;  // the AVX-512 block pass (quant8_avx512.h)
static_assert(kBlock == slidekit::avx512::kBlockLen, "quant8_avx512.h's whole block is quant8's");
#else
constexpr int64_t kVectorWidth = 1;  // the portable loops (vectorised by the compiler where it can)
#endif

using slidekit::bits_of;
using slidekit::float_of;
using slidekit::PackedTable;

// A QuantMap as the kernel reads it: its values (256) and its packed encoding table.
struct Map {
  const float* values;
  PackedTable packed;
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

// The largest |x| bit pattern of x[0, len): that of the largest magnitude (a NaN pattern above all).
uint32_t block_top(int64_t len, const float* __restrict x) {
  uint32_t top = 0;
  for (int64_t i = 0; i < len; ++i) {
    top = std::max(top, bits_of(x[i]) & 0x7FFFFFFFu);
  }
  return top;
}

// Encodes the block x (len <= kBlock, x readable to kBlock) whose largest |x| pattern is `top`
// into codes; returns its scale max |x|.
// kFull: len is kBlock (the AVX-512 pass's constant-length form).
template <bool kFull = false>
__attribute__((always_inline)) inline float encode_block(int64_t len, const float* __restrict x, uint32_t top,
                                                         const PackedTable& table, uint8_t* __restrict codes) {
  const float amax = float_of(top);
  const float scale = amax > 0.0f ? amax : 1.0f;  // an all-zero block keeps scale 0, encodes x / 1
#ifdef SLIDEKIT_ADAMW8_AVX512
  slidekit::avx512::encode_block<kFull>(len, x, scale, table, codes);
#else
  (void)kFull;
  slidekit::encode_block_portable(len, x, scale, table, codes);
#endif
  return amax;
}

// A speculative step's five buffers (all null: none): they receive the old values (a backup) or,
// `out_of_place`, the new ones.
struct Backup {
  float* p;
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* v_codes;
  float* v_absmax;
  bool out_of_place;
};

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
  Backup backup;
  // The AVX-512 pass decodes by gather, else by permutes: decode_by_gather(), asked once per call before
  // any task starts, so a bad SLIDEKIT_ADAMW8_DECODE is thrown from the caller's thread.
  bool gather = false;
};

// Block b (elements [lo, lo + len)): its master, codes and scales into the backup, if there is one.
void back_up_block(const Args& a, int64_t b, int64_t lo, int64_t len) {
  const Backup& k = a.backup;
  if (k.p == nullptr) {
    return;
  }
  slidekit::backup_copy(k.p + lo, a.p + lo, len * static_cast<int64_t>(sizeof(float)));
  slidekit::backup_copy(k.m_codes + lo, a.m.codes + lo, len);
  slidekit::backup_copy(k.v_codes + lo, a.v.codes + lo, len);
  k.m_absmax[b] = a.m.absmax[b];
  k.v_absmax[b] = a.v.absmax[b];
}

// One block as its update sees it: the master and codes it reads, where it writes them, and the old
// scales. In place, it reads and writes the unit's own buffers; out of place, it reads them and writes
// an L1 scratch (`Scratch`), which close_block then streams out.
struct BlockData {
  const float* p_in;
  float* p;
  const uint8_t* m_codes_in;
  uint8_t* m_codes;
  const uint8_t* v_codes_in;
  uint8_t* v_codes;
  float m_scale;
  float v_scale;
};

// An out-of-place pass's output for one block: 1.5 KiB, L1-resident.
struct Scratch {
  alignas(64) float p[kBlock];
  alignas(64) uint8_t m_codes[kBlock];
  alignas(64) uint8_t v_codes[kBlock];
};

// Block b (elements [lo, lo + len)) made ready for its update: backed up first if there is a backup;
// out of place, read from the unit's buffers and written to `scratch`.
BlockData open_block(const Args& a, int64_t b, int64_t lo, int64_t len, Scratch& scratch) {
  float* p = a.p + lo;
  uint8_t* mc = a.m.codes + lo;
  uint8_t* vc = a.v.codes + lo;
  if (!a.backup.out_of_place) {
    back_up_block(a, b, lo, len);
    return BlockData{p, p, mc, mc, vc, vc, a.m.absmax[b], a.v.absmax[b]};
  }
  return BlockData{p, scratch.p, mc, scratch.m_codes, vc, scratch.v_codes, a.m.absmax[b], a.v.absmax[b]};
}

// Block b, updated, given its new scales: they are stored in place, or out of place the block is
// streamed out of the scratch to the buffers and its scales stored there.
void close_block(const Args& a, int64_t b, int64_t lo, int64_t len, const BlockData& d, float m_scale,
                 float v_scale) {
  const Backup& k = a.backup;
  if (!k.out_of_place) {
    a.m.absmax[b] = m_scale;
    a.v.absmax[b] = v_scale;
    return;
  }
  slidekit::backup_copy(k.p + lo, d.p, len * static_cast<int64_t>(sizeof(float)));
  slidekit::backup_copy(k.m_codes + lo, d.m_codes, len);
  slidekit::backup_copy(k.v_codes + lo, d.v_codes, len);
  k.m_absmax[b] = m_scale;
  k.v_absmax[b] = v_scale;
}

// The first decay segment that ends past element i.
int64_t segment_of(const int64_t* seg_stop, int64_t segments, int64_t i) {
  return std::upper_bound(seg_stop, seg_stop + segments, i) - seg_stop;
}

#ifdef SLIDEKIT_ADAMW8_AVX512
// Seconds to decode `n` codes (a multiple of 16) into `out` through quant8_avx512.h's decode16.
template <bool kGather>
double time_decode(const float* table, const uint8_t* codes, float* out, int64_t n) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(out + i, slidekit::avx512::decode16<kGather>(table, c));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Whether the AVX-512 pass decodes by gather (else by permutes). SLIDEKIT_ADAMW8_DECODE=gather or
// permute says which; unset or "auto", the faster of the two on 16 K pseudo-random codes, the best
// of 5 interleaved rounds each (well under a millisecond). Both read the same table entries: the
// choice changes the time, never a bit.
bool choose_gather() {
  const char* env = std::getenv("SLIDEKIT_ADAMW8_DECODE");
  const std::string want = env == nullptr ? "auto" : env;
  if (want == "gather" || want == "permute") {
    return want == "gather";
  }
  if (want != "auto") {
    throw std::runtime_error("adamw8: SLIDEKIT_ADAMW8_DECODE=" + want +
                             " is not one of auto, gather, permute; unset it or pick one of those");
  }
  constexpr int64_t kCodes = 1 << 14;
  alignas(64) float table[256];
  for (int i = 0; i < 256; ++i) {
    table[i] = static_cast<float>(i) * 0.5f;
  }
  std::vector<uint8_t> codes(kCodes);
  uint32_t x = 12345u;
  for (auto& c : codes) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<uint8_t>(x >> 24);
  }
  std::vector<float> out(kCodes);
  double permute = std::numeric_limits<double>::infinity();
  double gather = permute;
  for (int round = 0; round < 5; ++round) {
    permute = std::min(permute, time_decode<false>(table, codes.data(), out.data(), kCodes));
    gather = std::min(gather, time_decode<true>(table, codes.data(), out.data(), kCodes));
  }
  return gather < permute;
}

// choose_gather(), once per process (a static's initialization: thread-safe, and an exception from it
// is thrown again at the next call).
bool decode_by_gather() {
  static const bool gather = choose_gather();
  return gather;
}

// Blocks [b_lo, b_hi), 16 lanes at a time: quant8_avx512.h's two passes per block.
template <typename G, bool kLowp, bool kGather>
void run_blocks_avx512(int64_t b_lo, int64_t b_hi, const Args& a) {
  alignas(64) float m[kBlock];
  alignas(64) float v[kBlock];
  Scratch scratch;
  int64_t seg = segment_of(a.seg_stop, a.segments, b_lo * kBlock);
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t len = std::min(a.n, lo + kBlock) - lo;
    const BlockData d = open_block(a, b, lo, len, scratch);
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
    const slidekit::avx512::Block blk{len,
                                      d.p_in,
                                      d.p,
                                      static_cast<const G*>(a.g) + lo,
                                      a.out == nullptr ? nullptr : a.out + lo,
                                      d.m_codes_in,
                                      d.v_codes_in,
                                      d.m_scale,
                                      d.v_scale};
    uint32_t m_top = 0;
    uint32_t v_top = 0;
    while (a.seg_stop[seg] <= lo) {
      ++seg;
    }
    float m_scale = 0.0f;
    float v_scale = 0.0f;
    if (len == kBlock && a.seg_stop[seg] >= lo + len) {
      // A whole block inside one decay segment (all but a unit's last block and the few a segment
      // ends in): constant lanes, one factor.
      const __m512 factor = _mm512_set1_ps(a.seg_decay[seg]);
      auto one = [factor](int64_t) { return factor; };
      slidekit::avx512::update<G, kLowp, kGather, true>(blk, a.m.map.values, a.v.map.values, a.s, one, m, v,
                                                         m_top, v_top);
      m_scale = encode_block<true>(len, m, m_top, a.m.map.packed, d.m_codes);
      v_scale = encode_block<true>(len, v, v_top, a.v.map.packed, d.v_codes);
    } else {
      slidekit::avx512::update<G, kLowp, kGather, false>(blk, a.m.map.values, a.v.map.values, a.s, decay, m, v,
                                                          m_top, v_top);
      m_scale = encode_block(len, m, m_top, a.m.map.packed, d.m_codes);
      v_scale = encode_block(len, v, v_top, a.v.map.packed, d.v_codes);
    }
    close_block(a, b, lo, len, d, m_scale, v_scale);
  }
  slidekit::backup_fence();  // this task's streaming stores (the copy's, the outputs'), complete on return
}
#endif

enum class Decode { kGather, kPermute, kPortable };

// How this build decodes the codes: the AVX-512 pass's choice (decided on the first call), or the
// portable loops'.
Decode decode_way() {
#ifdef SLIDEKIT_ADAMW8_AVX512
  return decode_by_gather() ? Decode::kGather : Decode::kPermute;
#else
  return Decode::kPortable;
#endif
}

// Blocks [b_lo, b_hi): decode, update (per decay segment, adam_common.h's adam_update), encode.
void run_blocks(int64_t b_lo, int64_t b_hi, const Args& a, int64_t g_size, bool bf16_grad) {
  const bool lowp = a.out != nullptr;
#ifdef SLIDEKIT_ADAMW8_AVX512
  (void)g_size;
  using Run = void (*)(int64_t, int64_t, const Args&);
  // [gather][bf16_grad][lowp]
  static constexpr Run kRuns[2][2][2] = {
      {{&run_blocks_avx512<float, false, false>, &run_blocks_avx512<float, true, false>},
       {&run_blocks_avx512<uint16_t, false, false>, &run_blocks_avx512<uint16_t, true, false>}},
      {{&run_blocks_avx512<float, false, true>, &run_blocks_avx512<float, true, true>},
       {&run_blocks_avx512<uint16_t, false, true>, &run_blocks_avx512<uint16_t, true, true>}}};
  kRuns[a.gather][bf16_grad][lowp](b_lo, b_hi, a);
#else
  const slidekit::UpdateFn plain = slidekit::pick_update(bf16_grad, false, lowp);
  const slidekit::UpdateFn decayed = slidekit::pick_update(bf16_grad, true, lowp);
  // Out of place: the master read from the unit's buffer, written to the scratch (never the source).
  const slidekit::UpdateFromFn plain_from = slidekit::pick_update_from(bf16_grad, false, lowp);
  const slidekit::UpdateFromFn decayed_from = slidekit::pick_update_from(bf16_grad, true, lowp);
  const bool from = a.backup.out_of_place;
  const char* g = static_cast<const char*>(a.g);
  int64_t seg = segment_of(a.seg_stop, a.segments, b_lo * kBlock);
  alignas(64) float m[kBlock];
  alignas(64) float v[kBlock];
  Scratch scratch;
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t hi = std::min(a.n, lo + kBlock);
    const int64_t len = hi - lo;
    const BlockData d = open_block(a, b, lo, len, scratch);
    decode(len, d.m_codes_in, a.m.map.values, d.m_scale, m);
    decode(len, d.v_codes_in, a.v.map.values, d.v_scale, v);
    for (int64_t i = lo; i < hi;) {
      while (a.seg_stop[seg] <= i) {
        ++seg;
      }
      const int64_t j = std::min(hi, a.seg_stop[seg]);
      const float decay = a.seg_decay[seg];
      uint16_t* out = lowp ? a.out + i : nullptr;
      if (from) {
        (decay != 1.0f ? decayed_from : plain_from)(
            j - i, d.p_in + (i - lo), d.p + (i - lo), g + i * g_size, m + (i - lo), v + (i - lo), out, decay, a.s);
      } else {
        (decay != 1.0f ? decayed : plain)(
            j - i, d.p + (i - lo), g + i * g_size, m + (i - lo), v + (i - lo), out, decay, a.s);
      }
      i = j;
    }
    const float m_scale = encode_block(len, m, block_top(len, m), a.m.map.packed, d.m_codes);
    const float v_scale = encode_block(len, v, block_top(len, v), a.v.map.packed, d.v_codes);
    close_block(a, b, lo, len, d, m_scale, v_scale);
  }
#endif
  if (a.backup.p != nullptr) {
    slidekit::backup_fence();
  }
}

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n) {
  slidekit::check_vector(t, kKernel, name, dtype, n);
}

Map check_map(const at::Tensor& values, const at::Tensor& packed, const char* name) {
  check_vector(values, name, at::kFloat, kBlock);
  return Map{values.data_ptr<float>(), slidekit::read_packed(packed, kKernel, name)};
}

// One AdamW step over a whole unit, in place (or, `out_of_place`, into the backup buffers): master,
// both moments' codes and scales, and the BF16 copy when `lowp_out` is given. `seg_stop`/`seg_decay`
// tile [0, n) in order; a decay of 1 means none. At most `max_tasks` threads of torch's intra-op
// pool take part (0: as many as torch uses); the result does not depend on it. Returns how many
// threads took part. `backup_*`: all five or none (the caller checks they overlap nothing); each gets
// the old values of its buffer, or with `out_of_place` the new ones, master and state then left
// unchanged.
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
    const at::Tensor& m_packed,
    const at::Tensor& v_values,
    const at::Tensor& v_packed,
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
    std::optional<at::Tensor> backup_v_codes,
    std::optional<at::Tensor> backup_v_absmax,
    bool out_of_place) {
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
  const bool backup = backup_master.has_value();
  SLIDEKIT_CHECK(
      backup == backup_m_codes.has_value() && backup == backup_m_absmax.has_value() &&
          backup == backup_v_codes.has_value() && backup == backup_v_absmax.has_value(),
      kKernel, ": give all five backup buffers (master, both moments' codes and absmax) or none");
  SLIDEKIT_CHECK(
      backup || !out_of_place, kKernel,
      ": out_of_place writes the update into the five backup buffers (master, both moments' codes and ",
      "absmax); give them");
  Backup saved{nullptr, nullptr, nullptr, nullptr, nullptr, false};
  if (backup) {
    check_vector(*backup_master, "backup_master", at::kFloat, n);
    check_vector(*backup_m_codes, "backup_exp_avg_codes", at::kByte, n);
    check_vector(*backup_m_absmax, "backup_exp_avg_absmax", at::kFloat, blocks);
    check_vector(*backup_v_codes, "backup_exp_avg_sq_codes", at::kByte, n);
    check_vector(*backup_v_absmax, "backup_exp_avg_sq_absmax", at::kFloat, blocks);
    saved = Backup{backup_master->data_ptr<float>(), backup_m_codes->data_ptr<uint8_t>(),
                   backup_m_absmax->data_ptr<float>(), backup_v_codes->data_ptr<uint8_t>(),
                   backup_v_absmax->data_ptr<float>(), out_of_place};
  }
  const Map m_map = check_map(m_values, m_packed, "the exp_avg map");
  const Map v_map = check_map(v_values, v_packed, "the exp_avg_sq map");
  if (n == 0) {
    return 0;
  }
  SLIDEKIT_CHECK(
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
      slidekit::AdamScalars::from(w1, beta2, sq_weight, inv_b2, eps, neg_step),
      saved,
      decode_way() == Decode::kGather};
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  const int64_t g_size = grad.element_size();

  // One contiguous run of whole blocks per task, at least kMinBlocks (32 Ki elements) each:
  // small units run on fewer threads, down to one.
  constexpr int64_t kMinBlocks = 128;
  return slidekit::run_in_tasks(blocks, kMinBlocks, 1, max_tasks, [&](int64_t lo, int64_t hi) {
    run_blocks(lo, hi, a, g_size, bf16_grad);
  });
}

// quant8.quantize_blockwise of the FP32 vector x into codes and absmax, in place, with the encoder
// adamw8_step_ uses (AVX-512 or portable, as built): what tests hold to quant8.encode.
void quantize_blockwise_(const at::Tensor& x, const at::Tensor& packed, at::Tensor codes, at::Tensor absmax) {
  constexpr const char* kName = "quantize_blockwise";
  const int64_t n = x.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  slidekit::check_vector(x, kName, "x", at::kFloat, n);
  slidekit::check_vector(codes, kName, "codes", at::kByte, n);
  slidekit::check_vector(absmax, kName, "absmax", at::kFloat, blocks);
  const PackedTable table = slidekit::read_packed(packed, kName, "packed");
  const float* src = x.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* scales = absmax.data_ptr<float>();
  alignas(64) float buf[kBlock] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t len = std::min(n, lo + kBlock) - lo;
    std::copy(src + lo, src + lo + len, buf);
    // as the update pass encodes: a whole block by the constant-length form
    scales[b] = len == kBlock ? encode_block<true>(len, buf, block_top(len, buf), table, out + lo)
                              : encode_block(len, buf, block_top(len, buf), table, out + lo);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "slidekit fused CPU AdamW step with block-wise 8-bit moments (see adamw8.cpp)";
  module.def(
      "adamw8_step_",
      &adamw8_step_,
      "One 8-bit AdamW step over a unit, in place (or, out_of_place, into the backup buffers), "
      "optionally writing a BF16 copy",
      pybind11::arg("master"),
      pybind11::arg("grad"),
      pybind11::arg("m_codes"),
      pybind11::arg("m_absmax"),
      pybind11::arg("v_codes"),
      pybind11::arg("v_absmax"),
      pybind11::arg("lowp_out"),
      pybind11::arg("m_values"),
      pybind11::arg("m_packed"),
      pybind11::arg("v_values"),
      pybind11::arg("v_packed"),
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
      pybind11::arg("backup_v_codes") = pybind11::none(),
      pybind11::arg("backup_v_absmax") = pybind11::none(),
      pybind11::arg("out_of_place") = false,
      // The update runs for tens of milliseconds: let the engine's other Python threads run.
      pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def(
      "quantize_blockwise_",
      &quantize_blockwise_,
      "quant8.quantize_blockwise with this kernel's encoder, in place (for tests)",
      pybind11::arg("x"),
      pybind11::arg("packed"),
      pybind11::arg("codes"),
      pybind11::arg("absmax"),
      pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("backup_stream_bytes", []() { return slidekit::kBackupStreamBytes; },
             "the width of the backup's streaming stores in this build, 0 where it copies with memcpy");
  module.def("vector_width", []() { return kVectorWidth; }, "16 where built for AVX-512, else 1");
  module.def(
      "decode_way",
      []() {
        const Decode way = decode_way();
        return std::string(way == Decode::kGather ? "gather" : way == Decode::kPermute ? "permute" : "portable");
      },
      "how the codes are decoded: 'gather' or 'permute' (the AVX-512 pass's choice, SLIDEKIT_ADAMW8_DECODE or "
      "timed on first use), 'portable' where built without AVX-512");
}
