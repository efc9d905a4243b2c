// AMX tile configuration, shared by the bf16 (linear_bf16.cpp) and int8 (linear_quant.cpp)
// kernels.
#pragma once
#include <immintrin.h>

#include <cstdint>

// Palette 1: tile t holds rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12's intrinsics tell the compiler less than the instructions touch: _tile_loadconfig
// reads 8 bytes of the config (it may then move the stores of rows and colsb past it, and a
// tile left unconfigured makes the next tile op SIGILL), and _tile_loadd reads no memory at
// all. A compiler barrier before each makes every store before it visible to the tile unit.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

inline void load_tile_config(const TileConfig& cfg) {
  memory_barrier();
  _tile_loadconfig(&cfg);
}
