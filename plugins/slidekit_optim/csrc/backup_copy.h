// slidekit CPU kernels: speculative clipping's second set of buffers, written in the update's own pass.
//
// A speculating step (slidekit/engine/speculation.py) needs the master and optimizer state of each
// unit as they were before its update, to roll back to if the step clips. The kernels
// (fused_adam.cpp, adamw8.cpp) take a second set of buffers, as large as master and state, and walk
// the update tile by tile (a few KiB, L1-resident), in one of two ways:
//
// * backup (`fused_backup`): they copy each tile's old bytes there right before updating it in
//   place; the update then reads them from L1, so each byte comes from memory once, and the backup
//   costs only its writes;
// * out of place (`fused_update_out`): they update each tile from the sources into an L1 scratch and
//   copy the scratch out there; the sources are only read, so the pass moves the bytes of the update
//   in place, its writes going to the outputs instead of the sources.
//
// backup_copy(dst, src, bytes) stores with non-temporal (streaming) stores where the build's ISA has
// them, for the aligned full vectors of dst (64 bytes with AVX-512, 32 with AVX/AVX2): the buffers
// are read only after the pass (by a rollback, or once swapped in), so they should not evict the
// update's data, nor be read first (write-allocate) as a plain store's line is; its unaligned head
// and tail, and the whole copy in builds without those ISAs (the portable loops,
// ATEN_CPU_CAPABILITY=default), use memcpy. A copy moves bytes, so the buffer equals its source bit
// for bit whichever way it was stored.
//
// Streaming stores are weakly ordered: each task calls backup_fence() once its stores are done, so
// the buffers are complete, for any thread, when the kernel returns.
//
// Included by path from the kernel sources beside it; kernel_build.py hashes every *.h here into
// the build's cache key. Tested by tests/plugins/test_fused_backup.py and
// tests/plugins/test_update_out.py (both ISA paths).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SLIDEKIT_BACKUP_STREAM_BYTES 64
#elif defined(__AVX__)
#include <immintrin.h>
#define SLIDEKIT_BACKUP_STREAM_BYTES 32
#endif

namespace slidekit {

// Elements per tile of a fused backup or of fused_adam.cpp's out-of-place update (adamw8.cpp's tile
// is its 256-element block): each array's tile stays in L1 between the copy and the update (128
// elements: 512 B, 8 cache lines, of each FP32 array). On the 2-core Zen 4 test machine
// (docs/benchmarks/NOTES.md section 23) the backup's tiles of 64 and 128 cost least, 32 and 256 as
// much or more, 512 and 2048 clearly more; plain stores instead of streaming ones cost ~2.5x as much
// again.
constexpr int64_t kBackupTile = 128;

// How the build stores backups: the streaming store's width in bytes, 0 where it copies with memcpy.
#ifdef SLIDEKIT_BACKUP_STREAM_BYTES
constexpr int64_t kBackupStreamBytes = SLIDEKIT_BACKUP_STREAM_BYTES;
#else
constexpr int64_t kBackupStreamBytes = 0;
#endif

// Copies `bytes` bytes from `src` to `dst` (which must not overlap).
inline void backup_copy(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) {
    return;
  }
#ifdef SLIDEKIT_BACKUP_STREAM_BYTES
  constexpr int64_t kVec = SLIDEKIT_BACKUP_STREAM_BYTES;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) % kVec);
  const int64_t head = std::min<int64_t>(bytes, misaligned ? kVec - misaligned : 0);
  std::memcpy(d, s, static_cast<size_t>(head));
  d += head;
  s += head;
  bytes -= head;
  const int64_t body = bytes / kVec * kVec;
  for (int64_t i = 0; i < body; i += kVec) {
#if SLIDEKIT_BACKUP_STREAM_BYTES == 64
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
#else
    _mm256_stream_si256(
        reinterpret_cast<__m256i*>(d + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
#endif
  }
  std::memcpy(d + body, s + body, static_cast<size_t>(bytes - body));
#else
  std::memcpy(dst, src, static_cast<size_t>(bytes));
#endif
}

// Orders this thread's streaming stores before whatever it does next (a no-op without them).
inline void backup_fence() {
#ifdef SLIDEKIT_BACKUP_STREAM_BYTES
  _mm_sfence();
#endif
}

}  // namespace slidekit
