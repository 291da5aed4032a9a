// The sampler's draw among each row's most probable tokens (sampler.among_candidates) as one op
// on the CPU: in torch it is about a hundred small operators, 0.5 ms a row here, where a decode
// step of SmolLM2 takes 6. Each row is one thread's, start to end, so its numbers do not depend
// on the other rows of the batch nor on the thread count.
//
// For each row of scaled logits (logits / temperature): its logsumexp in two passes over the
// vocabulary, the first of which keeps each block of BLOCK tokens' maximum. The n most probable
// tokens lie in the n blocks of largest maxima, so only values at least the n-th largest maximum
// are sorted. Then, over those n, the top-k and top-p set, whether it lies among them ("found"), and
// the exponential race with the hashed draws, all as among_candidates computes them in torch
// (float32; the cumulative sum in double as torch's; the race's ratios in double).
//
// A plain C function that sampler.py calls through ctypes: without torch's operator headers this
// file builds in 2 s instead of 7 (tests build it on each fresh machine).

// at::vec's widest vectors this build's flags allow (-march=native), as inductor's kernels take them
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK = 128;  // sampler.TOPK_BLOCK
constexpr uint64_t MASK32 = 0xFFFFFFFFull;

// sampler.mix32_
inline uint64_t mix32(uint64_t h) {
  for (int i = 0; i < 2; ++i) {
    h ^= h >> 16;
    h = (h * 0x45D9F3Bull) & MASK32;
  }
  return h ^ (h >> 16);
}

// sampler.race_draws for one token: q ~ Exp(1) from the row's keys and the token's id
inline double draw(int64_t id, uint64_t key0, uint64_t key1) {
  uint64_t h = mix32(mix32(static_cast<uint64_t>(id) ^ key0) ^ key1);
  return -std::log((static_cast<double>(h) + 0.5) / 4294967296.0);
}

struct Row {
  std::vector<float> block_max;
  std::vector<std::pair<float, int64_t>> top;  // (scaled value, token id)
};

template <class Op>
inline float reduce(const Vec& v, Op op) {
  float lanes[Vec::size()];
  v.store(lanes);
  float out = lanes[0];
  for (int i = 1; i < Vec::size(); ++i) out = op(out, lanes[i]);
  return out;
}

// each block's maximum of scaled into row.block_max; returns scaled's logsumexp
float block_maxima_and_lse(const float* scaled, int64_t vocab, Row& row) {
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  row.block_max.assign(blocks, -std::numeric_limits<float>::infinity());
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * BLOCK, end = std::min(vocab, start + BLOCK);
    Vec m(-std::numeric_limits<float>::infinity());
    int64_t i = start;
    for (; i + Vec::size() <= end; i += Vec::size()) m = at::vec::maximum(m, Vec::loadu(scaled + i));
    float bm = reduce(m, [](float a, float b) { return std::max(a, b); });
    for (; i < end; ++i) bm = std::max(bm, scaled[i]);
    row.block_max[b] = bm;
    most = std::max(most, bm);
  }
  const Vec mv(most);
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + Vec::size() <= vocab; i += Vec::size()) acc = acc + (Vec::loadu(scaled + i) - mv).exp_u20();
  float sum = reduce(acc, std::plus<float>());
  for (; i < vocab; ++i) sum += std::exp(scaled[i] - most);
  return std::log(sum) + most;
}

// row.top: the n largest of scaled (n <= vocab), in descending order (equal values by id)
void top_n(const float* scaled, int64_t vocab, int64_t n, Row& row) {
  std::vector<float> maxima(row.block_max);
  float least = -std::numeric_limits<float>::infinity();  // n blocks hold a value at least this large
  if (n <= static_cast<int64_t>(maxima.size())) {
    std::nth_element(maxima.begin(), maxima.begin() + (n - 1), maxima.end(), std::greater<float>());
    least = maxima[n - 1];
  }
  row.top.clear();
  for (int64_t b = 0; b < static_cast<int64_t>(row.block_max.size()); ++b) {
    if (row.block_max[b] < least) continue;
    for (int64_t i = b * BLOCK; i < std::min(vocab, (b + 1) * BLOCK); ++i)
      if (scaled[i] >= least) row.top.emplace_back(scaled[i], i);
  }
  auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::partial_sort(row.top.begin(), row.top.begin() + n, row.top.end(), larger);
  row.top.resize(n);
}

// among_candidates on one row's n most probable tokens: the drawn token, and whether the row's
// top-k and top-p set lies among them
std::pair<int64_t, bool> race_row(const Row& row, int64_t vocab, float lse, int64_t top_k, float top_p,
                                  uint64_t key0, uint64_t key1) {
  const int64_t n = static_cast<int64_t>(row.top.size());
  const bool cut = top_k > 0 && top_k < vocab;  // a top_k that leaves tokens out
  const int64_t k = cut && top_k <= n ? top_k : n;
  const float kth = row.top[k - 1].first;  // ties at the k-th stay in
  float norm = lse;
  if (cut) {  // the log of the top-k set's mass, as logsumexp over it
    const float most = row.top[0].first;
    float sum = 0.0f;
    for (const auto& [value, id] : row.top)
      if (value >= kth) sum += std::exp(value - most);
    norm = std::log(sum) + most;
  }
  std::vector<float> probs(n);
  for (int64_t j = 0; j < n; ++j) probs[j] = row.top[j].first >= kth ? std::exp(row.top[j].first - norm) : 0.0f;
  // sampler.top_p_count: tokens whose more probable ones hold less than top_p of the mass
  int64_t count = 0;
  double cumulative = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    cumulative += probs[j];
    const float before = static_cast<float>(cumulative) - probs[j];
    count += before < top_p && probs[j] > 0.0f;
  }
  const float least = probs[std::max<int64_t>(count, 1) - 1];
  const float outside = row.top[n - 1].first >= kth ? probs[n - 1] : 0.0f;
  const bool found = (outside < least && !(cut && top_k > n)) || n == vocab;
  int64_t best = 0;
  double best_ratio = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) {  // sampler.race: a probability of 0 is out, whatever its draw
    const float kept = probs[j] < least ? 0.0f : probs[j];
    const double ratio = kept == 0.0f ? -1.0 : static_cast<double>(kept) / draw(row.top[j].second, key0, key1);
    if (ratio > best_ratio) {
      best_ratio = ratio;
      best = j;
    }
  }
  return {row.top[best].second, found};
}

}  // namespace

// scaled (rows, vocab) float32, top_k (rows), top_p (rows), keys (rows, 2), all contiguous: each
// row's drawn token and whether its set lies among its n most probable tokens (n <= vocab)
extern "C" void among_candidates(const float* scaled, int64_t rows, int64_t vocab, const int64_t* top_k,
                                 const float* top_p, const int64_t* keys, int64_t n, int64_t* drawn, bool* found) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Row row;
    for (int64_t r = begin; r < end; ++r) {
      const float* s = scaled + r * vocab;
      const float lse = block_maxima_and_lse(s, vocab, row);
      top_n(s, vocab, n, row);
      auto [token, inside] = race_row(row, vocab, lse, top_k[r], top_p[r], static_cast<uint64_t>(keys[2 * r]),
                                      static_cast<uint64_t>(keys[2 * r + 1]));
      drawn[r] = token;
      found[r] = inside;
    }
  });
}
