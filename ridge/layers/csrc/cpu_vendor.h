// The CPU's vendor and family, for the choices the kernels make per CPU (the AVX-512 kernels'
// prefetch tables, prefetch.cpp; where the AVX2 kernels fetch their weights, avx2_simd.h).
// Compiled into both CPU extensions.
#pragma once
#include <cpuid.h>

#include <cstring>

namespace ridge_shared {

inline bool cpu_is_amd() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
  return std::strcmp(vendor, "AuthenticAMD") == 0;
}

inline unsigned cpu_family() {  // base family, plus the extended family where the base is 15
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const unsigned base = (a >> 8) & 0xF;
  return base == 0xF ? base + ((a >> 20) & 0xFF) : base;
}

}  // namespace ridge_shared
