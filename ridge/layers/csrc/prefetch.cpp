// The streaming kernels' prefetch policy (linear_call.h): one table per CPU (Intel, AMD Zen 4
// and older, Zen 5 and later), each what was last measured best on such a machine, and the
// process's policy, set at load.
//
// Why fetch at all. Far, into L2 (the block formats always; bf16 where bf16_far): alone, the
// hardware prefetcher keeps too few lines in flight for a core to stream at what the memory
// gives, and fewer the more work a kernel does per byte. Near, into L1 (quant_near_rows,
// quant_near_every): a block's arithmetic depends on its loads, so a load that waits on L2 holds
// the integer work back, and with it the loop's progress through memory.
//
// What was measured (kernel alone unless said; one row unless said):
// - 2 Zen 4 cores (AMD EPYC), 2026-11-22 to 11-24: the block formats' far fetch, one 11264 x
//   2048 matmul: int4 26.0 -> 30.5 GB/s, Q4_K 23.2 -> 31.1, Q8_0 30.4 either way; the same for
//   every tile size: 8 rows int4 0.91 -> 0.66 ms, Q6_K 1.61 -> 0.93, 16 and 64 rows 4-15%. The near
//   fetch (the group 8 ahead, its first line and the one 256 bytes on) only for tiles of 8+
//   rows, whose arithmetic would otherwise hold the loads back: fewer rows streamed better with
//   the hardware prefetcher alone. bf16 without far prefetch ran its files' batch-1 decode at
//   96-97% of the floor, and an L1 prefetch at 1-2 rows was 5-13% slower than none
//   (linear_bf16.cpp keeps it for 8+ rows).
// - 2-core Intel Xeon with AMX, 2026-11-26: bf16_far: bf16 1.10-1.12x; the far fetch for Q8_0
//   too (it had gained nothing on the AMD machine): 1.07-1.14x; bf16 without AMX at 2 and 4 rows
//   1.19x and 1.34x (24, 128 and 192 KiB ahead no better than 64). Without a near fetch the int4
//   kernel streamed 0.83x of a load-only loop over the same 600 MB, though in cache it runs 2-3x
//   faster than memory serves. Every line of the group 8 ahead, every tile, over the first lines
//   for 8+ rows (22 TinyLlama-1.1B layers of random weights, same bytes, builds alternated): 1 row
//   int4 1.11x, Q4_K 1.09x, Q6_K 1.06-1.09x, int8 1.05x, IQ4_XS/NL 1.07-1.08x, Q3_K 1.08x, Q2_K
//   1.01x; 2-16 rows 1.02-1.10x. 4 groups ahead was 0.97x of 8, 16 groups 1.00-1.02x.
//   2026-11-27, benchmarks/prefetch.py, this table against the AMD's: block formats 1.02-1.09x
//   at one row, 0.99-1.09x at 2-8 rows; bf16 1.38x at one row.
// - 2 Zen 5 cores (AMD EPYC family 26 model 2), 2026-11-27, benchmarks/prefetch.py, 7 rounds
//   alternated, the Xeon's table against the Zen 4 one: bf16 4-8 rows 1.13-1.19x (1-2 rows
//   0.99-1.01x); block formats at one row 1.01-1.10x (Q6_K 1.06-1.10x), 4 rows 1.05-1.16x, 8 rows
//   1.03-1.38x (Q4_K); int8 alone lost, 0.97x at one and two rows in both runs. A second run
//   with no near fetch at one row (quant_near_rows 2) gave back the block formats' one-row gain.
//   So Zen 5 takes the Xeon's values as its own table ("zen5"); Zen 4 keeps its measured one
//   ("amd"), which was never measured against the others there. int8 (Q8_0), the kernel with
//   the least work a byte, lost at one row with the near fetch in three runs (0.97x) and gained
//   from 4 rows (1.05x; 0.95x without it at 4 rows): so int8_near_rows, its own threshold, is 2
//   on Zen 5 (1.03x at one row over 1, 15 rounds) and stays the other keys' value elsewhere.
// - The same Zen 5 host, 2026-11-27 (stop 49): the block formats' far fetch as prefetchnta
//   (quant_far_nta) against prefetcht2, benchmarks/prefetch.py, 11 and 21 rounds alternated,
//   medians: one row 1.03-1.13x (IQ4_XS 1.12-1.13x, int4 1.06x, Q4_K 1.03x, Q6_K 1.04-1.07x,
//   Q3_K and Q5_K 1.04-1.06x, Q2_K 1.01-1.06x, int8 1.01-1.07x), 2 rows 0.98-1.10x, 4 and 8 rows
//   0.98-1.05x; Q4_K_M's file, ridge bench latency at batch 1, 3 of 4 rounds 1.03-1.05x (the
//   fourth caught the memory's level changing). Zen 5 takes it; Zen 4 and Intel, not measured
//   with it, keep prefetcht2.
// - The same Zen 5 host, 2026-11-28 (stop 54): the far fetch line by line (quant_far_lines), each
//   line of the window once as the loop reaches the bytes 64 KiB before it, against a chunk's
//   lines a group (some lines twice: a chunk is not whole lines). At the fast level a Q4_K row
//   with its dot products and scales taken out streamed no faster (0.99x) with this table's
//   fetches, and 1.16x with the far fetch alone, line by line: what the loop issues besides its
//   loads holds one row back there, not its arithmetic. Kernels alone (22 layers, alternated,
//   5-9 rounds, in an experiment's build with every variant behind a switch): Q8_0 one row
//   1.04x at the slow level and 1.10-1.11x at the fast one (the landed build, prefetch.py:
//   1.00x and 1.05x), 2-4 rows
//   1.01-1.06x, 8 rows 1.00-1.04x; one row of Q4_0 1.01-1.04x, Q4_K 1.01-1.06x, Q5_K 1.04x,
//   Q6_K 1.02-1.04x; but 2-8 rows of the 4-bit formats 0.96-1.05x, Q6_K and Q2_K at 8 rows
//   0.81-0.87x, Q3_K at 4 rows 0.77x, IQ4_XS one row 0.97x, Q2_K one row 0.96-0.98x, Q3_K and
//   IQ4_NL one row 1.00x. So it walks by line only Q8_0's tiles and one-row tiles of Q4_0,
//   Q4_K, Q5_K and Q6_K (linear_quant.cpp). Whole decode steps at batch 1 (the files, 6 rounds
//   alternated in one process, the fast level): Q8_0 1.029x (1.013-1.035 every round), Q4_K_M
//   1.009x, Q6_K 1.013x. Zen 5 takes it; Zen 4 and Intel, not measured with it, keep a chunk's
//   lines a group.
// - The same Zen 5 host, 2026-11-28 (stop 55): one-row tiles' far fetch 24 KiB ahead instead of
//   64 (quant_far_kib), in an experiment's build with the distance behind a switch, 22 layers,
//   7-9 rounds alternated. At the fast level (bf16's kernel 67-74 GB/s): Q4_K 1.058-1.063x (three
//   runs, 20-28 KiB 1.04-1.07x, 40 KiB 1.01-1.02x, 16 KiB 0.99x), int4 1.070x, int8 1.019x (20
//   KiB 1.036x), Q6_K 1.034x, Q5_K 1.011x. At the slow level (41-49 GB/s): IQ4_XS 1.035x, Q2_K
//   1.047x, Q3_K 1.071x, Q6_K 0.995x, Q4_K 0.98-1.02x. Tiles of 2+ rows were not measured with
//   it and keep 64 KiB. Zen 4 and Intel, not measured with it, keep 64.
// - The same Zen 5 host, 2026-11-28 (stop 56): with the far fetch 24 KiB ahead, one-row tiles
//   of the block formats without the near fetch (quant_near_rows 2; int8 had it off already),
//   22 layers, 5-7 rounds alternated. Fast level (bf16's kernel 73-76 GB/s): Q4_K 1.035-1.055x
//   (four runs), int4 1.034-1.047x, IQ4_XS 1.033-1.055x, Q3_K 1.035x, Q5_K 1.026-1.035x, Q6_K
//   1.003-1.010x, Q2_K 0.998-1.008x; slow level (~50 GB/s): Q6_K 1.006x, Q5_K 1.023x. (It was
//   0.97-1.05x with the far fetch 64 KiB ahead, stops 50 and 54.) Whole batch-1 steps of the
//   files, the policies alternated in one process, 6-8 rounds: Q4_K_M 1.045x (every round
//   1.002-1.077), Q4_0 1.038x (every round), IQ4_XS 1.036x, Q3_K_M 1.038x, Q2_K 1.037x, Q5_K_M
//   0.995x, Q6_K 0.972x and 1.012x (two runs, 0.93-1.07 a round). Other distances without it:
//   16 KiB 0.99-1.05x, 32 KiB 1.01-1.02x, 48 KiB 1.00-1.01x of 24. Without the scales' fetches
//   too: 0.91-1.00x. Zen 4 and Intel, not measured with it, keep their values.
// - 2-core Intel Xeon with AMX, 2026-12-02 (stop 73): a group's fetches (far and near) one
//   after each of its weight loads (quant_interleave) instead of in a run before them. A loop
//   of 64-byte loads alone over 600 MB, 2 threads, a prefetcht2 64 KiB ahead for each line:
//   38-39 GB/s with each fetch after its load, 31 with a run of 4 or 8 fetches and then the
//   loads (either order), 37 with one fetch and one load a loop; the bf16 kernel, one fetch a
//   load, streamed 37-39 where the block formats read 27-30. benchmarks/prefetch.py, 22 layers,
//   7 rounds alternated, this table with it against without: one row int8 1.10x, int4 1.13x,
//   Q4_K 1.10x, Q6_K 1.04-1.06x, Q3_K 1.11x, Q2_K 1.06x, IQ4_XS 1.16x; 2 rows 1.05-1.19x; 4 rows
//   1.01-1.19x; 8 rows 0.99-1.15x. Whole batch-1 steps of the files (loaded once, the policies
//   alternated, 5-7 rounds of 64 tokens): Q4_K_M 1.094x (1.058-1.106 a round), Q8_0 1.104x,
//   Q6_K 1.069x, Q2_K 1.081x. Other keys with it (near_rows 2, near_every 0, far_lines 1, the
//   near lines in a run after the loads): 0.95-1.03x. Intel takes it; the AMD tables, not
//   measured with it, keep 0.
// - q3_k_set1_rows is not a fetch: how the Q3_K loop broadcasts x, a choice the CPUs measured
//   apart (Zen 5 8, the others 17: never; linear_quant.cpp says what was measured).
// - quant_shift_rows is not a fetch either: from how many rows of x a block format's VNNI tile
//   unpacks its codes by shifts and masks rather than GFNI (linear_quant.cpp's load_weights).
//   2-core AMD EPYC Zen 4, 2026-12-05 (stop 95): 8 rows over 22 layers 1.00-1.09x with shifts,
//   one row 0.87-0.93x; the AMD tables take 4 (Zen 5 not measured). 2-core Intel Xeon with AMX,
//   2026-12-05 (stop 96; benchmarks/prefetch.py, 22 layers, 7 rounds, intel against
//   intel,quant_shift_rows=4 and =16 on one build): with shifts from 4 rows Q6_K 0.959x, 0.943x
//   and 0.983x at 4, 8 and 16 rows, int4 0.966x at 4, Q5_K 0.961x, Q2_K 0.966x, IQ4_XS 0.975x, Q4_K
//   1.019x, Q3_K 1.046x (0.98-1.10), at 8 rows 0.98-1.00x but Q6_K; from 16 rows 0.98-1.03x (int8,
//   which unpacks nothing, 1.000-1.005x). On Intel vpsrlw zmm issues on port 0, as vpdpbusd does:
//   Intel takes 17.
// - quant_far_scales: the far fetch takes the next block's scales only (a block's codes lie in
//   one run, its scales after them: a second, short stream a block that stop 94's synthetic
//   loops on Zen 4 found the hardware prefetcher does not follow, 0.57-0.61 of a load loop with
//   no software fetch, 0.79-0.83 with the far fetch of every line, 1.00-1.07 for one stream in
//   address order). 2-core Intel Xeon with AMX, 2026-12-05 (stop 97; benchmarks/prefetch.py, 22
//   layers, 5 rounds, intel against intel,quant_far_scales=1, prefetch_far_scales_xeon.json):
//   one row int8 0.925x, int4 0.898x, Q4_K 0.963x, Q5_K 0.919x, Q6_K 0.936x, IQ4_XS 0.917x, Q3_K
//   0.905x, Q2_K 0.903x; 8 rows 0.96-1.08x; whole batch-1 steps of the files (prefetch.py
//   --steps, 7 rounds, prefetch_steps.json) Q4_0 0.897x, Q4_K_M 0.958x, Q6_K 0.941x: this
//   Xeon's prefetchers do not carry the codes alone, and Intel keeps 0. Zen 4, where the far
//   fetch caps the stream, is where it may pay: not measured there yet, every table keeps 0.
// - quant_alternate: every other call the threads take their runs in reverse order, so the
//   thread that read up to one call's last byte starts the next call at its first (the step's
//   matrices lie end to end in call order, weight_arena.h), and its far fetch goes on past the
//   last block by the window: half the runs of a step continue a stream instead of starting one
//   (stop 95 put what Zen 4 loses over a step at the calls' edges, where each run starts over).
//   2-core Intel Xeon with AMX, 2026-12-05 (stop 98): one int4 matrix of a step's bytes (473,088
//   x 2048) called as 88 row slices, 9 rounds: 12.7 us a call over one call, 14.9 with it (0.88-1.07
//   a round); whole batch-1 steps (prefetch.py --steps, 7 rounds) Q4_0 0.997x, Q4_K_M 1.000x:
//   this Xeon's far fetch already hides a run's start (stop 97: fetching a run's first window at
//   its start, 0.998x). Not measured on Zen 4; every table keeps 0.
// benchmarks/prefetch.py compares the tables (and any other policy) on one machine's bytes.
// quant_near_rows (int8_near_rows for int8) 17 turns the near fetch off (tiles have at most 16 rows).
#include <map>
#include <string>

#include "cpu_vendor.h"
#include "kernels.h"
#include "linear_call.h"

namespace {

constexpr PrefetchPolicy AMD = {0, 8, 0, 8, 0, 0, 64, 0, 17, 4, 0, 0};  // Zen 4 and older
constexpr PrefetchPolicy ZEN5 = {1, 2, 1, 2, 1, 1, 24, 0, 8, 4, 0, 0};  // AMD family 26 (0x1A) and later
constexpr PrefetchPolicy INTEL = {1, 1, 1, 1, 0, 0, 64, 1, 17, 17, 0, 0};

// Every key of a policy, its member and whether it is a switch (0 or 1) or a row count (>= 0):
// the one list that naming, checking and setting a policy read
struct Key {
  const char* name;
  int64_t PrefetchPolicy::*member;
  bool is_switch;
};
constexpr Key KEYS[] = {
    {"bf16_far", &PrefetchPolicy::bf16_far, true},
    {"quant_near_rows", &PrefetchPolicy::quant_near_rows, false},
    {"quant_near_every", &PrefetchPolicy::quant_near_every, true},
    {"int8_near_rows", &PrefetchPolicy::int8_near_rows, false},
    {"quant_far_nta", &PrefetchPolicy::quant_far_nta, true},
    {"quant_far_lines", &PrefetchPolicy::quant_far_lines, true},
    {"quant_far_kib", &PrefetchPolicy::quant_far_kib, false},
    {"quant_interleave", &PrefetchPolicy::quant_interleave, true},
    {"q3_k_set1_rows", &PrefetchPolicy::q3_k_set1_rows, false},
    {"quant_shift_rows", &PrefetchPolicy::quant_shift_rows, false},
    {"quant_far_scales", &PrefetchPolicy::quant_far_scales, true},
    {"quant_alternate", &PrefetchPolicy::quant_alternate, true},
};

const Key* find_key(const std::string& name) {
  for (const Key& k : KEYS)
    if (name == k.name) return &k;
  return nullptr;
}

std::string key_names() {
  std::string names;
  for (const Key& k : KEYS) names += (names.empty() ? "" : ", ") + std::string(k.name);
  return names;
}

std::map<std::string, int64_t> as_map(const PrefetchPolicy& p) {
  std::map<std::string, int64_t> out;
  for (const Key& k : KEYS) out[k.name] = p.*k.member;
  return out;
}

const PrefetchPolicy& vendor_table() {
  static const PrefetchPolicy table = !ridge_shared::cpu_is_amd() ? INTEL : ridge_shared::cpu_family() >= 0x1A ? ZEN5 : AMD;
  return table;
}

}  // namespace

PrefetchPolicy g_prefetch = vendor_table();

// Every check of a policy, as text rather than a throw: Python asks first and raises its own
// error (a C++ throw through pybind11 crashed the process on one GPU image's build).
std::string prefetch_error(const std::string& preset, const std::map<std::string, int64_t>& values) {
  if (!preset.empty() && preset != "amd" && preset != "zen5" && preset != "intel" && preset != "cpu")
    return "unknown prefetch preset '" + preset + "' (amd, zen5, intel, cpu)";
  for (const auto& [name, v] : values) {
    const Key* k = find_key(name);
    if (k == nullptr) return "unknown prefetch key '" + name + "' (" + key_names() + ")";
    if (k->is_switch && v != 0 && v != 1) return "prefetch " + name + " must be 0 or 1, got " + std::to_string(v);
    if (!k->is_switch && v < 0) return "prefetch " + name + " must be >= 0, got " + std::to_string(v);
    if (!k->is_switch && v > (1 << 20)) return "prefetch " + name + " must be at most 1048576, got " + std::to_string(v);
  }
  return "";
}

std::map<std::string, int64_t> prefetch_preset(const std::string& name) {
  const std::string error = prefetch_error(name, {});
  TORCH_CHECK(!name.empty() && error.empty(), error.empty() ? "a prefetch preset needs a name" : error);
  return as_map(name == "amd" ? AMD : name == "zen5" ? ZEN5 : name == "intel" ? INTEL : vendor_table());
}

std::map<std::string, int64_t> prefetch_policy() { return as_map(g_prefetch); }

void set_prefetch_policy(const std::map<std::string, int64_t>& values) {
  const std::string error = prefetch_error("", values);
  TORCH_CHECK(error.empty(), error);
  PrefetchPolicy p = g_prefetch;
  for (const auto& [name, v] : values) p.*find_key(name)->member = v;
  g_prefetch = p;
}
