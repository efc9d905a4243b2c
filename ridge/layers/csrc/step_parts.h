// Where a CPU decode step's time goes besides its weights' stream: the seconds each kind of op
// took since the last take_step_parts(), the process's calls of either extension added up.
//
// The decode plans (decode_layers.cpp, avx2_plan.cpp) time their ops by kind; the block
// formats' matmul (linear_quant.cpp, segments_slab) splits its own time into what it does
// before its threads start (x quantized, the tiles set up: "matmul_setup") and what its threads
// spend not computing while the region lasts ("matmul_wait": the region's wall time less the
// mean of the threads' busy times, i.e. starting late, waiting for the slower one, the join).
// The engine's telemetry reads them after each step (worker.py), next to the matmuls' time: a
// step's time outside its matmuls, op by op, and the matmuls' own overhead (a draft model's
// passes, run in the same process after the step is read, count with the next step). Timing
// costs two clock reads an op (~40 ns; ~10 us a step of a 22-layer model), always on, as the
// matmuls' time is. Never changes a result.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ridge_shared {

enum StepPart : int {
  PART_ATTENTION,  // decode attention (the paged kernels; MLA's latent attention too)
  PART_NORMS,  // RMS norms (with the residual adds fused into them)
  PART_ROPE_KV,  // rotary embeddings and the KV cache writes
  PART_ACTIVATION,  // SiLU-gating
  PART_ROUTING,  // an MoE's router, top-k, its rows sorted by expert and gathered
  PART_COMBINE,  // an MoE's expert outputs weighted and summed (its shared expert's gate too)
  PART_SAMPLING,  // greedy decode's argmax and the next pass's embedding rows
  // inside the matmuls' time (the names that start "matmul_": telemetry.py tells them apart so)
  PART_MATMUL_SETUP,  // before the threads start
  PART_MATMUL_WAIT,  // threads not computing within the region
  STEP_PARTS,
};

inline constexpr const char* STEP_PART_NAMES[STEP_PARTS] = {
    "attention", "norms", "rope_kv", "activation", "routing", "combine", "sampling", "matmul_setup", "matmul_wait",
};

// One set for the process (an inline variable is one object, whichever extension adds to it).
// Written by the thread that calls the kernels, between and around their parallel regions.
inline double g_step_parts[STEP_PARTS] = {};

inline double clock_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Adds the seconds from its construction to its end to a total (the plans' matmul time, a part).
struct AddTime {
  double& total;
  double start = clock_s();
  explicit AddTime(double& t) : total(t) {}
  AddTime(const AddTime&) = delete;
  AddTime& operator=(const AddTime&) = delete;
  ~AddTime() { total += clock_s() - start; }
};

struct PartTimer : AddTime {
  explicit PartTimer(StepPart p) : AddTime(g_step_parts[p]) {}
};

// f() with its time added to part p
template <class F>
auto timed(StepPart p, F&& f) {
  PartTimer t(p);
  return f();
}

// take_step_parts(): [(name, seconds)] since the last call, in StepPart's order, and the count
// starts again. One definition of the binding for each extension's module.
template <class Module>
void def_step_parts(Module& m) {
  m.def("take_step_parts", [] {
    std::vector<std::pair<std::string, double>> out;
    for (int p = 0; p < STEP_PARTS; ++p) out.emplace_back(STEP_PART_NAMES[p], g_step_parts[p]), g_step_parts[p] = 0.0;
    return out;
  }, "seconds by kind of op since the last call (decode plans, block-format matmuls), then zero");
}

}  // namespace ridge_shared
