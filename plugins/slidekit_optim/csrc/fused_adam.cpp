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
// The BF16 copy goes through an L1 tile of kBackupTile elements, streamed out with backup_copy: its
// lines are written without being read first (a plain store reads each line it writes: 2 more of the
// pass's 30 bytes; NOTES 41 measured the pass's memory streams 3% faster with the copy streamed on an
// H100 host's 16 cores). The same bits either way (tests/plugins/test_copy_stores.py).
//
// The update itself (and the BF16 rounding, the scalars and the argument checks) is in
// adam_common.h, shared with adamw8.cpp; this file splits a range into tasks and binds it to Python.
//
// Speculative clipping (backup_copy.h) takes three more buffers, backup_master / backup_exp_avg /
// backup_exp_avg_sq, in one of two ways. Either way each task walks its slice in tiles of
// kBackupTile elements (L1-resident) and stores to those buffers with streaming stores where the ISA
// has them, and the tile is updated by the same per-element update (adam_common.h's adam_element)
// on the same values, so no bit of the update changes:
//
// * backup (out_of_place false): the tile's master and moments are copied there right before they
//   are updated in place from L1; the backup is the old bytes. Cost: 12 B/param more written
//   (28 -> 40 B/param in all), where a separate copy reads 12 and writes 12 (and reads those 12 lines
//   first, without streaming stores), and the update then reads the 12 again from wherever the copy
//   left them.
// * out of place (out_of_place true): the tile is updated from master and moments into an L1
//   scratch (adam_update_to; the BF16 copy written as usual), and the scratch is copied out to the
//   three buffers, which receive the new values; master, exp_avg and exp_avg_sq are only read. Cost:
//   the update in place's 28 B/param (read 2 + 12, write 12 + 2): the outputs are written instead of
//   the sources, and streaming stores write them without reading their lines first. Measured on the
//   2-core Xeon (AVX-512) test machine, 20 M parameters, where the pass is bound by the cores (two
//   threads take half the time), not by memory: 1.11-1.17x the update in place (one run of ten
//   1.28x), the backup 1.31-1.37x; the remainder is the scratch's copy out. Copying the sources into the scratch and
//   updating it in place instead cost 1.28-1.35x. Tiles of 128 and 256 cost least (one run, one
//   thread: 64 and 512 +8-10%, 32 +14%, 2048 +23%).
//
// Built on first use by slidekit_optim/layer_adam.py (torch.utils.cpp_extension.load);
// tested by tests/plugins/test_layer_adam.py (bitwise against the pure-torch path),
// tests/plugins/test_fused_backup.py (the backup), tests/plugins/test_update_out.py (out of place) and
// tests/plugins/test_copy_stores.py (the copy's streaming stores, wherever the copy lies).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: halves the build time

#include "adam_common.h"     // the per-element update, BF16 rounding and checks, shared by both kernels
#include "backup_copy.h"     // the speculative-clipping backup, stored in the update's pass
#include "parallel_tasks.h"  // the split into tasks on torch's thread pool, shared by both kernels

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

constexpr const char* kKernel = "fused_adamw";

// One call's vectors and update, which the tasks of a backed or out-of-place pass walk tile by tile.
struct Pass {
  float* p;
  const char* g;   // FP32 or BF16, g_size bytes per element
  int64_t g_size;
  float* m;
  float* v;
  uint16_t* out;   // the BF16 copy, or nullptr
  float* bp;       // backup_master, backup_exp_avg, backup_exp_avg_sq
  float* bm;
  float* bv;
  slidekit::UpdateFn fn;       // in place
  slidekit::UpdateToFn fn_to;  // out of place: the same per-element update (adam_element)
  float decay;
  slidekit::AdamScalars s;
};

constexpr int64_t kFloatBytes = sizeof(float);

// A tile's BF16 copy, written into an L1 buffer `c` by the update, streamed out to the call's lowp_out
// (backup_copy: streaming stores where the ISA has them, so its lines are not read before they are
// written: 2 of the pass's 30 bytes per parameter, NOTES 41). Nothing without a copy.
void copy_out(const Pass& t, int64_t a, int64_t len, const uint16_t* c) {
  if (t.out != nullptr) {
    slidekit::backup_copy(t.out + a, c, len * static_cast<int64_t>(sizeof(uint16_t)));
  }
}

// Walks elements [lo, hi) in tiles of kBackupTile (L1-resident): body(a, len, c) for each tile at `a`,
// `c` an L1 buffer for the tile's BF16 copy; then fences the pass's streaming stores.
template <typename Body>
void for_each_tile(int64_t lo, int64_t hi, Body&& body) {
  for (int64_t a = lo; a < hi; a += slidekit::kBackupTile) {
    const int64_t len = std::min(hi, a + slidekit::kBackupTile) - a;
    alignas(64) uint16_t c[slidekit::kBackupTile];
    body(a, len, c);
  }
  slidekit::backup_fence();
}

// Elements [lo, hi) in place, the BF16 copy through L1 tiles (copy_out); without a copy, one call.
void update_in_place(const Pass& t, int64_t lo, int64_t hi) {
  if (t.out == nullptr) {
    t.fn(hi - lo, t.p + lo, t.g + lo * t.g_size, t.m + lo, t.v + lo, nullptr, t.decay, t.s);
    return;
  }
  for_each_tile(lo, hi, [&](int64_t a, int64_t len, uint16_t* c) {
    t.fn(len, t.p + a, t.g + a * t.g_size, t.m + a, t.v + a, c, t.decay, t.s);
    copy_out(t, a, len, c);
  });
}

// Elements [lo, hi) with a backup: each tile's old master and moments copied to bp/bm/bv, then updated
// in place from L1.
void update_backed(const Pass& t, int64_t lo, int64_t hi) {
  for_each_tile(lo, hi, [&](int64_t a, int64_t len, uint16_t* c) {
    slidekit::backup_copy(t.bp + a, t.p + a, len * kFloatBytes);
    slidekit::backup_copy(t.bm + a, t.m + a, len * kFloatBytes);
    slidekit::backup_copy(t.bv + a, t.v + a, len * kFloatBytes);
    t.fn(len, t.p + a, t.g + a * t.g_size, t.m + a, t.v + a, t.out ? c : nullptr, t.decay, t.s);
    copy_out(t, a, len, c);
  });
}

// Elements [lo, hi) out of place: each tile updated from master and moments into an L1 scratch (the
// same per-element update as in place, so the same bits), then streamed out to bp/bm/bv. The sources
// are only read.
void update_out_of_place(const Pass& t, int64_t lo, int64_t hi) {
  alignas(64) float p[slidekit::kBackupTile];
  alignas(64) float m[slidekit::kBackupTile];
  alignas(64) float v[slidekit::kBackupTile];
  for_each_tile(lo, hi, [&](int64_t a, int64_t len, uint16_t* c) {
    t.fn_to(len, t.p + a, t.g + a * t.g_size, t.m + a, t.v + a, p, m, v, t.out ? c : nullptr, t.decay, t.s);
    copy_out(t, a, len, c);
    slidekit::backup_copy(t.bp + a, p, len * kFloatBytes);
    slidekit::backup_copy(t.bm + a, m, len * kFloatBytes);
    slidekit::backup_copy(t.bv + a, v, len * kFloatBytes);
  });
}

// Updates master, exp_avg and exp_avg_sq in place, or out of place into the backup_* buffers (and
// writes lowp_out either way), for one range that shares its weight decay; `decay` is applied when
// `apply_decay`. The buffers must not overlap (the caller checks). At most `max_tasks` threads of
// torch's intra-op pool take part (0: as many as torch uses); the result does not depend on it.
// Returns how many threads took part. `backup_*`: all three or none (the caller checks they overlap
// nothing); each gets the old values of its buffer, or with `out_of_place` the new ones, master and
// moments then left unchanged.
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
    int64_t max_tasks,
    std::optional<at::Tensor> backup_master,
    std::optional<at::Tensor> backup_exp_avg,
    std::optional<at::Tensor> backup_exp_avg_sq,
    bool out_of_place) {
  const int64_t n = master.numel();
  slidekit::check_vector(master, kKernel, "master", at::kFloat, n);
  slidekit::check_grad(grad, kKernel, n);
  slidekit::check_vector(exp_avg, kKernel, "exp_avg", at::kFloat, n);
  slidekit::check_vector(exp_avg_sq, kKernel, "exp_avg_sq", at::kFloat, n);
  const bool lowp = lowp_out.has_value();
  if (lowp) {
    slidekit::check_vector(*lowp_out, kKernel, "lowp_out", at::kBFloat16, n);
  }
  const bool backup = backup_master.has_value();
  SLIDEKIT_CHECK(
      backup == backup_exp_avg.has_value() && backup == backup_exp_avg_sq.has_value(), kKernel,
      ": give backup_master, backup_exp_avg and backup_exp_avg_sq together, or none of them");
  SLIDEKIT_CHECK(
      backup || !out_of_place, kKernel,
      ": out_of_place writes the update into backup_master, backup_exp_avg and backup_exp_avg_sq; give them");
  if (backup) {
    slidekit::check_vector(*backup_master, kKernel, "backup_master", at::kFloat, n);
    slidekit::check_vector(*backup_exp_avg, kKernel, "backup_exp_avg", at::kFloat, n);
    slidekit::check_vector(*backup_exp_avg_sq, kKernel, "backup_exp_avg_sq", at::kFloat, n);
  }
  if (n == 0) {
    return 0;
  }

  const auto s = slidekit::AdamScalars::from(w1, beta2, sq_weight, inv_b2, eps, neg_step);
  const float decay_f = static_cast<float>(decay);
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  const slidekit::UpdateFn fn = slidekit::pick_update(bf16_grad, apply_decay, lowp);

  float* p = master.data_ptr<float>();
  const char* g = static_cast<const char*>(grad.data_ptr());
  const int64_t g_size = grad.element_size();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  uint16_t* out = lowp ? reinterpret_cast<uint16_t*>(lowp_out->data_ptr<at::BFloat16>()) : nullptr;
  float* bp = backup ? backup_master->data_ptr<float>() : nullptr;
  float* bm = backup ? backup_exp_avg->data_ptr<float>() : nullptr;
  float* bv = backup ? backup_exp_avg_sq->data_ptr<float>() : nullptr;

  // One contiguous slice per task, its ends on 64-element boundaries (whole cache lines of every
  // array), at least kMinPerTask elements each: small ranges run on fewer threads, down to one.
  constexpr int64_t kAlign = 64;
  constexpr int64_t kMinPerTask = int64_t{1} << 15;
  const slidekit::UpdateToFn fn_to = slidekit::pick_update_to(bf16_grad, apply_decay, lowp);
  const Pass t{p, g, g_size, m, v, out, bp, bm, bv, fn, fn_to, decay_f, s};
  return slidekit::run_in_tasks(n, kMinPerTask, kAlign, max_tasks, [&](int64_t lo, int64_t hi) {
    if (!backup) {
      update_in_place(t, lo, hi);
    } else if (out_of_place) {
      update_out_of_place(t, lo, hi);
    } else {
      update_backed(t, lo, hi);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "slidekit fused CPU AdamW step (see fused_adam.cpp)";
  module.def("backup_stream_bytes", []() { return slidekit::kBackupStreamBytes; },
             "the width of the backup's streaming stores in this build, 0 where it copies with memcpy");
  module.def(
      "fused_adamw_",
      &fused_adamw_,
      "One AdamW step over a contiguous range, in place (or, out_of_place, into the backup buffers), "
      "optionally writing a BF16 copy",
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
      pybind11::arg("backup_master") = pybind11::none(),
      pybind11::arg("backup_exp_avg") = pybind11::none(),
      pybind11::arg("backup_exp_avg_sq") = pybind11::none(),
      pybind11::arg("out_of_place") = false,
      // The update runs for tens of milliseconds: let the engine's other Python threads run.
      pybind11::call_guard<pybind11::gil_scoped_release>());
}
