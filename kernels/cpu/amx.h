// AMX (Advanced Matrix Extensions: Sapphire Rapids and later Xeons): eight tile registers
// of up to 16 rows x 64 bytes and a matrix unit that multiplies them. Built where the
// compiler targets a CPU with AMX-BF16 (-march=native); used only once the kernel has
// granted this process the tile state (amx_ready).
#pragma once

namespace tw {

// Whether the kernels may run on the matrix unit at all (TIDEWIRE_CPU_AMX=0 and tests
// turn it off to reach the AVX-512 paths on an AMX CPU).
inline bool& amx_allowed() {
  static bool allowed = true;
  return allowed;
}

}  // namespace tw

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TW_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tw {

// Linux gives a process AMX's 8 KB of tile state only after it asks for it
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), since 5.16); a tile instruction
// in a process that did not ask faults with SIGILL, whatever CPUID says. oneDNN asks
// before its AMX kernels run; code that trusts CPUID alone dies on its first tile load.
// The permission is the whole process's; asked once, and false where the kernel refuses
// (an old kernel, a hypervisor that hides XTILEDATA), so callers keep their AVX-512 path.
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXTileData = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXTileData) != 0) return false;
    unsigned long features = 0;
    return syscall(SYS_arch_prctl, kGetXcompPerm, &features) == 0 &&
           (features & (1ul << kXTileData)) != 0;
  }();
  return ok;
}

// The tile configuration (palette 1): bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of the whole 64-byte configuration. Not _tile_loadconfig: GCC 12's (Debian
// 12's compiler) is inline asm whose memory operand is 8 bytes (`*(const void **)cfg`),
// so the compiler may treat every store to the configuration past its first 8 bytes as
// dead and drop it. At -O3 -march=sapphirerapids it does, for a function that only fills
// a local configuration and loads it: the tiles are loaded as 0 rows of 0 bytes, and the
// first tile instruction faults with SIGILL. That is what kills ggml's AMX kernels built
// with that compiler (its ggml_tile_config_init compiles to a zeroed configuration with
// palette 1; docs/cpu-engine.md). Naming the whole struct as the operand keeps the stores.
inline void load_tile_config(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }

// Every tile 16 rows of 64 bytes (16 fp32, or 32 bf16: 16 pairs), the shape the bf16
// kernels use. The configuration is per thread: each thread sets it before its tiles.
inline void amx_configure_full() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  load_tile_config(c);
}

// Whether tiles may be used now (allowed and granted).
inline bool amx_on() { return amx_allowed() && amx_ready(); }

// The tile configuration of the calling thread for one parallel region: set where the
// region uses tiles (`on`), released at its end so that the thread's tile state returns
// to its initial state (the kernel then saves nothing of it at a context switch).
class AmxRegion {
 public:
  explicit AmxRegion(bool on) : on_(on) {
    if (on_) amx_configure_full();
  }
  ~AmxRegion() {
    if (on_) _tile_release();
  }
  AmxRegion(const AmxRegion&) = delete;
  AmxRegion& operator=(const AmxRegion&) = delete;

 private:
  bool on_;
};

}  // namespace tw
#endif
