// EfficientMoE's fast level for one layer-step, compiled: the tables of
// ms_efficient.moe.fast_level.fast_level_tables (numpy balance_step), entry for entry.
//
// Build: g++ -O2 -shared -fPIC fast_level.cc -o fast_level.so
// (ms_efficient.moe.kernels.build_kernel_library does this on first use).
//
// Entry point, the ops.Custom(func_type="aot") signature (params = inputs then outputs):
//   FastLevelTables(counts [W,E] int32, home [W,Sh] int32, buffer [W] int64,
//                   cost [W,W] float64, conf [2] int64 = (spare slots, devices per node, 0: none))
//     -> sent [W,E,W] int32, slot [E,W] int32, spare_expert [W,P] int32,
//        spare_source [W,P] int32, home_slot [W,E] int32, stats [3+W] int32
//   with P = max(spare, 1) columns (the caller keeps the first `spare`).
// Returns 0, or 1 wrong parameter count, 2 bad dtype, 3 bad shape, 4 bad value (an expert id
// out of [-1, E), an expert without a home slot, a negative count, spare > P).
//
// The four steps and their tie-breaks are those of ms_efficient/moe/balance.py:
//   1. home split: EPLB's even split, then every replicated expert (largest count first,
//      ties to the lower id) water-filled over its holders, in rounds until a round changes
//      nothing (at most 16);
//   2. copies: while the busiest device (first of the largest) is above the mean, its
//      largest piece (first) is copied to the device with a free spare slot that does not
//      hold it with the least load + copy cost (float64, first), weights from the cheapest
//      home holder (first), kept when it relieves the busiest device by more rows than its
//      cost, or whatever it costs while that device is above its buffer;
//   3. buffers: each device above its buffer (in device order) moves its largest pieces
//      first (stable) to other holders with room, least loaded first, then drops the rest
//      from its largest pieces;
//   4. per-pair rows: own device, then own node (proportional split of what ranks and
//      holders have left, largest integer remainder first), then the rest, each a contiguous
//      cut (tokens in rank order over rows in device order).
// Water-filling is exact in integers: over the j least-loaded holders the level is N / j
// (N = amount + their loads); each holder below it takes floor(N / j) - load and the N mod j
// rows left go one each to the lowest-numbered of them.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace {

enum Status { kOk = 0, kBadArity = 1, kBadDtype = 2, kBadShape = 3, kBadValue = 4 };
constexpr int kSplitRounds = 16;

using I64 = int64_t;
using Vec = std::vector<I64>;

bool is_dtype(const char *dtype, const char *a, const char *b) {
  return std::strcmp(dtype, a) == 0 || (b != nullptr && std::strcmp(dtype, b) == 0);
}

// Rows added to the masked devices of `load` so the largest is as small as possible.
Vec water_fill(const Vec &load, const std::vector<char> &mask, I64 amount) {
  const size_t w = load.size();
  Vec out(w, 0);
  std::vector<size_t> held;
  for (size_t d = 0; d < w; ++d) {
    if (mask[d]) held.push_back(d);
  }
  if (held.empty() || amount <= 0) return out;
  std::stable_sort(held.begin(), held.end(),
                   [&](size_t a, size_t b) { return load[a] < load[b]; });
  I64 through = amount, total = 0;
  I64 j = 0;
  for (size_t k = 0; k < held.size(); ++k) {
    through += load[held[k]];
    if (k == 0 || load[held[k]] * static_cast<I64>(k + 1) < through) {
      j = static_cast<I64>(k + 1);
      total = through;
    } else {
      break;
    }
  }
  I64 left = amount;
  std::vector<char> filled(w, 0);
  for (size_t d = 0; d < w; ++d) {
    if (mask[d] && load[d] * j < total) {
      filled[d] = 1;
      out[d] = total / j - load[d];
      left -= out[d];
    }
  }
  for (size_t d = 0; d < w && left > 0; ++d) {
    if (filled[d]) {
      out[d] += 1;
      --left;
    }
  }
  return out;
}

// `total` over bins in proportion to `room`, never above a bin's room; the leftover one by
// one to the largest integer remainders (ties: lower bin).
Vec proportional_split(I64 total, const Vec &room) {
  const size_t n = room.size();
  I64 cap = 0;
  for (I64 r : room) cap += r;
  Vec out(n), frac(n);
  I64 left = total;
  for (size_t i = 0; i < n; ++i) {
    const I64 scaled = room[i] * total;
    out[i] = scaled / std::max<I64>(cap, 1);
    left -= out[i];
    frac[i] = out[i] < room[i] ? scaled - out[i] * cap : -1;
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return frac[a] > frac[b]; });
  for (size_t k = 0; k < n && static_cast<I64>(k) < left; ++k) {
    if (out[order[k]] < room[order[k]]) out[order[k]] += 1;
  }
  return out;
}

// Contiguous cut of one expert: rank r's tokens a[r] (in rank order) over device rows b[w]
// (in device order); adds the overlaps to out(r, w) through `add`.
template <typename Add>
void cut(const Vec &a, const Vec &b, Add add) {
  size_t r = 0, w = 0;
  I64 ra = a.empty() ? 0 : a[0], rb = b.empty() ? 0 : b[0];
  while (r < a.size() && w < b.size()) {
    if (ra == 0) {
      if (++r < a.size()) ra = a[r];
      continue;
    }
    if (rb == 0) {
      if (++w < b.size()) rb = b[w];
      continue;
    }
    const I64 m = std::min(ra, rb);
    add(r, w, m);
    ra -= m;
    rb -= m;
  }
}

}  // namespace

extern "C" int FastLevelTables(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **dtypes, void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 11) return kBadArity;
  const char *want[11][2] = {{"int32", "int"},     {"int32", "int"},   {"int64", nullptr},
                             {"float64", "double"}, {"int64", nullptr}, {"int32", "int"},
                             {"int32", "int"},     {"int32", "int"},   {"int32", "int"},
                             {"int32", "int"},     {"int32", "int"}};
  for (int i = 0; i < 11; ++i) {
    if (!is_dtype(dtypes[i], want[i][0], want[i][1])) return kBadDtype;
  }
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 1 || ndims[3] != 2 || ndims[4] != 1 ||
      shapes[4][0] != 2) {
    return kBadShape;
  }
  const I64 W = shapes[0][0], E = shapes[0][1], S = shapes[1][1];
  const I64 P = shapes[7][1];
  if (shapes[1][0] != W || shapes[2][0] != W || shapes[3][0] != W || shapes[3][1] != W ||
      W < 1 || E < 1) {
    return kBadShape;
  }
  const int32_t *counts = static_cast<const int32_t *>(params[0]);
  const int32_t *home = static_cast<const int32_t *>(params[1]);
  const I64 *buffer = static_cast<const I64 *>(params[2]);
  const double *cost = static_cast<const double *>(params[3]);
  const I64 spare = static_cast<const I64 *>(params[4])[0];
  const I64 dpn = static_cast<const I64 *>(params[4])[1];
  int32_t *sent_out = static_cast<int32_t *>(params[5]);
  int32_t *slot_out = static_cast<int32_t *>(params[6]);
  int32_t *spare_out = static_cast<int32_t *>(params[7]);
  int32_t *source_out = static_cast<int32_t *>(params[8]);
  int32_t *home_slot_out = static_cast<int32_t *>(params[9]);
  int32_t *stats_out = static_cast<int32_t *>(params[10]);
  if (spare < 0 || spare > P) return kBadValue;

  // holders and counts
  std::vector<char> held(E * W, 0);                     // [E, W]
  for (I64 w = 0; w < W; ++w) {
    for (I64 s = 0; s < S; ++s) {
      const int32_t e = home[w * S + s];
      if (e < -1 || e >= E) return kBadValue;
      if (e >= 0) held[e * W + w] = 1;
    }
  }
  Vec cnt(E, 0);
  for (I64 r = 0; r < W; ++r) {
    for (I64 e = 0; e < E; ++e) {
      if (counts[r * E + e] < 0) return kBadValue;
      cnt[e] += counts[r * E + e];
    }
  }
  Vec holders(E, 0);
  for (I64 e = 0; e < E; ++e) {
    for (I64 w = 0; w < W; ++w) holders[e] += held[e * W + w];
    if (holders[e] == 0) return kBadValue;
  }
  auto held_row = [&](I64 e) {
    return std::vector<char>(held.begin() + e * W, held.begin() + (e + 1) * W);
  };

  // Step 1: even split, then water-filling of the replicated experts.
  std::vector<Vec> rows(E, Vec(W, 0));
  Vec load(W, 0);
  for (I64 e = 0; e < E; ++e) {
    const I64 base = cnt[e] / holders[e];
    I64 index = 0;
    for (I64 w = 0; w < W; ++w) {
      if (!held[e * W + w]) continue;
      rows[e][w] = base + (index < cnt[e] - base * holders[e] ? 1 : 0);
      ++index;
      load[w] += rows[e][w];
    }
  }
  std::vector<I64> shared;
  for (I64 e = 0; e < E; ++e) {
    if (holders[e] > 1) shared.push_back(e);
  }
  std::stable_sort(shared.begin(), shared.end(),
                   [&](I64 a, I64 b) { return cnt[a] > cnt[b]; });
  for (int round = 0; round < kSplitRounds && !shared.empty(); ++round) {
    bool changed = false;
    for (I64 e : shared) {
      Vec base(W);
      for (I64 w = 0; w < W; ++w) base[w] = load[w] - rows[e][w];
      const Vec add = water_fill(base, held_row(e), cnt[e]);
      for (I64 w = 0; w < W; ++w) {
        changed |= add[w] != rows[e][w];
        rows[e][w] = add[w];
        load[w] = base[w] + add[w];
      }
    }
    if (!changed) break;
  }

  // Step 2: copies into spare slots.
  std::vector<char> home_held = held;
  Vec free_slots(W, spare), copies_of(E, 0);
  std::vector<I64> source_of(E * W, -1);
  I64 total = 0;
  for (I64 c : cnt) total += c;
  const double inf = std::numeric_limits<double>::infinity();
  for (I64 it = 0; spare > 0 && it < W * spare; ++it) {
    I64 busiest = 0;
    for (I64 w = 1; w < W; ++w) {
      if (load[w] > load[busiest]) busiest = w;
    }
    const I64 top = load[busiest];
    if (!(top * W > total)) break;
    I64 e = 0;
    for (I64 f = 1; f < E; ++f) {
      if (rows[f][busiest] > rows[e][busiest]) e = f;
    }
    Vec source_to(W, 0);
    std::vector<double> cost_to(W, inf);
    for (I64 d = 0; d < W; ++d) {
      for (I64 i = 0; i < W; ++i) {
        if (home_held[e * W + i] && cost[i * W + d] < cost_to[d]) {
          cost_to[d] = cost[i * W + d];
          source_to[d] = i;
        }
      }
    }
    I64 target = -1;
    double best = inf;
    for (I64 d = 0; d < W; ++d) {
      if (free_slots[d] > 0 && !held[e * W + d]) {
        const double score = static_cast<double>(load[d]) + cost_to[d];
        if (target < 0 || score < best) {
          best = score;
          target = d;
        }
      }
    }
    if (target < 0) break;
    std::vector<char> mask = held_row(e);
    mask[target] = 1;
    Vec base(W);
    for (I64 w = 0; w < W; ++w) base[w] = load[w] - rows[e][w];
    const Vec fresh = water_fill(base, mask, cnt[e]);
    const I64 relief = top - (base[busiest] + fresh[busiest]);
    const bool over = top > buffer[busiest];
    if (!(relief > 0 && (static_cast<double>(relief) > cost_to[target] || over))) break;
    for (I64 w = 0; w < W; ++w) {
      rows[e][w] = fresh[w];
      load[w] = base[w] + fresh[w];
    }
    held[e * W + target] = 1;
    free_slots[target] -= 1;
    copies_of[e] += 1;
    source_of[e * W + target] = source_to[target];
  }

  // Step 3: fixed buffers.
  I64 dropped = 0;
  std::vector<I64> over_devices;
  for (I64 w = 0; w < W; ++w) {
    if (load[w] > buffer[w]) over_devices.push_back(w);
  }
  auto largest_first = [&](I64 d) {
    std::vector<I64> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](I64 a, I64 b) { return rows[a][d] > rows[b][d]; });
    return order;
  };
  for (I64 d : over_devices) {
    I64 excess = load[d] - buffer[d];
    for (I64 e : largest_first(d)) {
      while (excess > 0 && rows[e][d] > 0) {
        I64 to = -1;
        for (I64 w = 0; w < W; ++w) {
          if (w == d || !held[e * W + w] || buffer[w] - load[w] <= 0) continue;
          if (to < 0 || load[w] < load[to]) to = w;
        }
        if (to < 0) break;
        const I64 moved = std::min({excess, rows[e][d], buffer[to] - load[to]});
        rows[e][d] -= moved;
        rows[e][to] += moved;
        load[d] -= moved;
        load[to] += moved;
        excess -= moved;
      }
      if (excess == 0) break;
    }
    if (excess > 0) {
      for (I64 e : largest_first(d)) {
        const I64 take = std::min(excess, rows[e][d]);
        rows[e][d] -= take;
        excess -= take;
        dropped += take;
        if (excess == 0) break;
      }
      load[d] = buffer[d];
    }
  }

  // Step 4: per-pair rows, own device, own node, the rest.
  std::vector<I64> sent(W * E * W, 0);                  // [R, E, W]
  std::vector<Vec> left(E, Vec(W, 0)), rest(E, Vec(W, 0));   // [E][R], [E][W]
  for (I64 e = 0; e < E; ++e) {
    for (I64 r = 0; r < W; ++r) {
      const I64 local = std::min<I64>(counts[r * E + e], rows[e][r]);
      sent[(r * E + e) * W + r] = local;
      left[e][r] = counts[r * E + e] - local;
      rest[e][r] = rows[e][r] - local;
    }
  }
  if (dpn > 0 && dpn < W && W % dpn == 0) {
    for (I64 n0 = 0; n0 < W; n0 += dpn) {
      for (I64 e = 0; e < E; ++e) {
        Vec c(left[e].begin() + n0, left[e].begin() + n0 + dpn);
        Vec h(rest[e].begin() + n0, rest[e].begin() + n0 + dpn);
        const I64 supply = std::min(std::accumulate(c.begin(), c.end(), I64{0}),
                                    std::accumulate(h.begin(), h.end(), I64{0}));
        const Vec c_take = proportional_split(supply, c);
        const Vec h_take = proportional_split(supply, h);
        cut(c_take, h_take, [&](size_t r, size_t w, I64 m) {
          sent[((n0 + r) * E + e) * W + n0 + w] += m;
        });
        for (I64 i = 0; i < dpn; ++i) {
          left[e][n0 + i] -= c_take[i];
          rest[e][n0 + i] -= h_take[i];
        }
      }
    }
  }
  for (I64 e = 0; e < E; ++e) {
    cut(left[e], rest[e], [&](size_t r, size_t w, I64 m) { sent[(r * E + e) * W + w] += m; });
  }

  // Tables.
  for (I64 i = 0; i < W * E * W; ++i) sent_out[i] = static_cast<int32_t>(sent[i]);
  for (I64 w = 0; w < W; ++w) {
    for (I64 e = 0; e < E; ++e) home_slot_out[w * E + e] = -1;
    for (I64 s = S - 1; s >= 0; --s) {
      const int32_t e = home[w * S + s];
      if (e >= 0) home_slot_out[w * E + e] = static_cast<int32_t>(s);
    }
    for (I64 j = 0; j < P; ++j) {
      spare_out[w * P + j] = -1;
      source_out[w * P + j] = -1;
    }
  }
  for (I64 e = 0; e < E; ++e) {
    for (I64 w = 0; w < W; ++w) slot_out[e * W + w] = home_slot_out[w * E + e];
  }
  I64 copies = 0;
  for (I64 w = 0; w < W; ++w) {
    I64 j = 0;
    for (I64 e = 0; e < E; ++e) {
      if (source_of[e * W + w] < 0) continue;
      spare_out[w * P + j] = static_cast<int32_t>(e);
      source_out[w * P + j] = static_cast<int32_t>(source_of[e * W + w]);
      slot_out[e * W + w] = static_cast<int32_t>(S + j);
      ++j;
      ++copies;
    }
  }
  I64 kept = 0;
  for (I64 w = 0; w < W; ++w) kept += load[w];
  stats_out[0] = static_cast<int32_t>(copies);
  stats_out[1] = static_cast<int32_t>(dropped);
  stats_out[2] = static_cast<int32_t>(kept);
  for (I64 w = 0; w < W; ++w) stats_out[3 + w] = static_cast<int32_t>(load[w]);
  return kOk;
}
