#pragma once
// The byte-pair merge loop shared by the tokenizer.json and SentencePiece tokenizers (private to
// src/data). Both repeatedly join the adjacent pair that merges first — the lowest merge rank
// (tokenizer.json) or the highest piece score (SentencePiece) — ties going to the leftmost
// pair, until no adjacent pair merges.
#include <cstdint>
#include <optional>
#include <queue>
#include <string_view>
#include <vector>

namespace loom::data {

// One symbol of a word: a byte range of it and its vocabulary id (-1: not in the vocabulary).
// A frozen symbol (a user-defined piece) never merges.
struct BpeSymbol {
  uint32_t begin = 0;
  uint32_t end = 0;
  int32_t id = -1;
  bool frozen = false;
};

struct BpeMerge {
  double priority;  // lower merges first
  int32_t id;       // vocabulary id of the merged symbol
};

// Merges `symbols` (contiguous, in order) in place. `lookup(left, right)` says whether the pair
// merges, and how soon; it is called with live neighbours only.
template <typename Lookup>
void bpe_merge(std::vector<BpeSymbol>& symbols, Lookup&& lookup) {
  const int n = static_cast<int>(symbols.size());
  if (n < 2) return;
  std::vector<int> next(n), prev(n);
  for (int i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  struct Candidate {
    double priority;
    int left;
    int right;
    uint32_t left_end;   // the pair is stale if either side has grown since it was queued
    uint32_t right_end;
    int32_t id;
    bool operator>(const Candidate& o) const {
      return priority != o.priority ? priority > o.priority : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const BpeSymbol& l = symbols[left];
    const BpeSymbol& r = symbols[right];
    if (l.frozen || r.frozen) return;
    if (const std::optional<BpeMerge> m = lookup(l, r)) {
      queue.push({m->priority, left, right, l.end, r.end, m->id});
    }
  };
  for (int i = 0; i + 1 < n; ++i) consider(i, i + 1);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    BpeSymbol& l = symbols[c.left];
    BpeSymbol& r = symbols[c.right];
    if (next[c.left] != c.right || l.begin == l.end || r.begin == r.end ||
        l.end != c.left_end || r.end != c.right_end) {
      continue;
    }
    l.end = r.end;
    l.id = c.id;
    r.begin = r.end;  // dead
    next[c.left] = next[c.right];
    if (next[c.right] >= 0) prev[next[c.right]] = c.left;
    consider(prev[c.left], c.left);
    consider(c.left, next[c.left]);
  }
  std::vector<BpeSymbol> live;
  live.reserve(symbols.size());
  for (int i = 0; i >= 0; i = next[i]) live.push_back(symbols[i]);
  symbols = std::move(live);
}

}  // namespace loom::data
