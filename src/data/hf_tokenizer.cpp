#include "loom/data/hf_tokenizer.h"

#include <fmt/format.h>
#include <unicode/uchar.h>

#include <array>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "bpe.h"
#include "hf_components.h"
#include "loom/core/error.h"
#include "utf8.h"

namespace loom::data {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool lstrip = false, rstrip = false, single_word = false, normalized = false;
};

// Text on its way to the model, or an added token already matched (id >= 0).
struct Section {
  std::string text;
  int32_t id = -1;
  bool at_text_start = false;
};

int32_t code_point_before(std::string_view s, size_t pos) {
  if (pos == 0) return -1;
  size_t start = pos - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  const auto c = utf8::at(s, start);
  return start + c.size == pos ? c.cp : -1;
}

bool is_word_char(int32_t cp) {
  return cp >= 0 && (cp == '_' || u_isalnum(cp));
}

struct TransparentHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, TransparentHash, std::equal_to<>>;

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Ids index a table as large as the largest id: past 2^24 (16.7 M, 60 times the largest real
// vocabulary) a file is taken for corrupt rather than allocated for.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

int32_t read_id(const json& value, const std::string& where, std::string_view token) {
  LOOM_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 &&
                 value.get<int64_t>() <= kMaxTokenId,
             "{}: token '{}' has id {}, expected an integer in 0..{}", where, token, value.dump(),
             kMaxTokenId);
  return static_cast<int32_t>(value.get<int64_t>());
}

}  // namespace

struct HfTokenizer::State {
  fs::path path;
  fs::path config_path;  // tokenizer_config.json beside it, if any
  std::string where;
  std::unique_ptr<hf::Normalizer> normalizer;
  std::unique_ptr<hf::PreTokenizer> pre_tokenizer;
  std::unique_ptr<hf::Decoder> decoder;

  Vocab vocab;
  std::vector<std::string> id_to_token;  // model tokens and added tokens
  std::unordered_map<uint64_t, BpeMerge> merges;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  int32_t unk_id = -1;
  std::array<int32_t, 256> byte_ids{};  // <0xXX> ids for byte fallback, -1 if absent
  std::vector<AddedToken> added;
  std::optional<int32_t> document_start;

  // Pre-token -> ids, in stripes with a lock each, so threads encoding at once (loom-prepare)
  // seldom wait for one another; bounded so a large corpus cannot grow it without limit.
  static constexpr size_t kStripes = 16;
  static constexpr size_t kMaxStripeEntries = (size_t{1} << 20) / kStripes;
  struct CacheStripe {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, TransparentHash, std::equal_to<>> map;
  };
  mutable std::array<CacheStripe, kStripes> cache;

  void load_model(const json& model);
  void load_added(const json& list);
  void find_document_start(const json& root);
  void split_on_added(std::vector<Section>& sections, bool normalized) const;
  void encode_word(std::string_view word, std::vector<int32_t>& ids) const;
  std::vector<int32_t> merge_word(std::string_view word) const;
};

void HfTokenizer::State::load_model(const json& model) {
  LOOM_CHECK(model.is_object(), "{}: \"model\" must be an object", where);
  const std::string type = model.value("type", model.contains("merges") ? "BPE" : "");
  LOOM_CHECK(type == "BPE",
             "{}: model type '{}' is not supported: loom reads BPE tokenizer.json models (for a "
             "SentencePiece unigram model, convert it to BPE or use its .model file)",
             where, type.empty() ? model.dump().substr(0, 80) : type);
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    LOOM_CHECK(!model.contains(key) || model[key].is_null() ||
                   (model[key].is_string() && model[key].get<std::string>().empty()),
               "{}: BPE {} {} is not supported", where, key, model.contains(key) ? model[key].dump() : "");
  }
  LOOM_CHECK(!model.contains("dropout") || model["dropout"].is_null() ||
                 (model["dropout"].is_number() && model["dropout"].get<double>() == 0.0),
             "{}: BPE dropout {} makes encoding random; loom encodes deterministically (set it "
             "to null)",
             where, model.contains("dropout") ? model["dropout"].dump() : "");
  byte_fallback = model.value("byte_fallback", false);
  fuse_unk = model.value("fuse_unk", false);
  ignore_merges = model.value("ignore_merges", false);

  const json& v = model.value("vocab", json());
  LOOM_CHECK(v.is_object(), "{}: model.vocab must be an object of token -> id, got {}", where,
             v.type_name());
  for (const auto& [token, value] : v.items()) {
    const int32_t id = read_id(value, where, token);
    vocab.emplace(token, id);
    if (static_cast<size_t>(id) >= id_to_token.size()) id_to_token.resize(static_cast<size_t>(id) + 1);
    LOOM_CHECK(id_to_token[id].empty(), "{}: tokens '{}' and '{}' share id {}", where,
               id_to_token[id], token, id);
    id_to_token[id] = token;
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const auto it = vocab.find(model["unk_token"].get<std::string>());
    LOOM_CHECK(it != vocab.end(), "{}: unk_token '{}' is not in the vocabulary", where,
               model["unk_token"].get<std::string>());
    unk_id = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab.find(fmt::format("<0x{:02X}>", b));
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
  }

  const json& m = model.value("merges", json::array());
  LOOM_CHECK(m.is_array(), "{}: model.merges must be an array", where);
  int32_t rank = 0;
  for (const json& merge : m) {
    std::string left, right;
    if (merge.is_string()) {
      const std::string s = merge.get<std::string>();
      const size_t space = s.find(' ');
      LOOM_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                 "{}: merge {} '{}' must be two tokens separated by one space", where, rank, s);
      left = s.substr(0, space), right = s.substr(space + 1);
    } else {
      LOOM_CHECK(merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
                     merge[1].is_string(),
                 "{}: merge {} must be \"a b\" or [\"a\", \"b\"], got {}", where, rank,
                 merge.dump());
      left = merge[0].get<std::string>(), right = merge[1].get<std::string>();
    }
    const auto l = vocab.find(left), r = vocab.find(right), joined = vocab.find(left + right);
    LOOM_CHECK(l != vocab.end() && r != vocab.end() && joined != vocab.end(),
               "{}: merge {} ('{}' '{}') names a token that is not in the vocabulary", where, rank,
               left, right);
    // A repeated pair keeps its first (lowest) rank, as the library's map does.
    merges.try_emplace(pair_key(l->second, r->second),
                       BpeMerge{static_cast<double>(rank), joined->second});
    ++rank;
  }
}

void HfTokenizer::State::load_added(const json& list) {
  if (list.is_null()) return;
  LOOM_CHECK(list.is_array(), "{}: \"added_tokens\" must be an array", where);
  for (const json& t : list) {
    LOOM_CHECK(t.is_object() && t.contains("content") && t["content"].is_string() &&
                   t.contains("id"),
               "{}: an added token needs \"id\" and \"content\", got {}", where, t.dump());
    AddedToken a;
    a.content = t["content"].get<std::string>();
    a.id = read_id(t["id"], where, a.content);
    a.lstrip = t.value("lstrip", false);
    a.rstrip = t.value("rstrip", false);
    a.single_word = t.value("single_word", false);
    // Special tokens always match the raw text, as in the library.
    a.normalized = t.value("normalized", false) && !t.value("special", false);
    LOOM_CHECK(!a.content.empty(), "{}: added token {} has empty content", where, a.id);
    if (static_cast<size_t>(a.id) >= id_to_token.size()) id_to_token.resize(static_cast<size_t>(a.id) + 1);
    LOOM_CHECK(id_to_token[a.id].empty() || id_to_token[a.id] == a.content,
               "{}: added token '{}' takes id {}, which the vocabulary gives '{}'", where,
               a.content, a.id, id_to_token[a.id]);
    id_to_token[a.id] = a.content;
    added.push_back(std::move(a));
  }
  // Longest first, so a scan takes the longest token that matches at a position.
  std::stable_sort(added.begin(), added.end(), [](const AddedToken& x, const AddedToken& y) {
    return x.content.size() > y.content.size();
  });
}

void HfTokenizer::State::find_document_start(const json& root) {
  const auto id_of = [&](const std::string& token) -> std::optional<int32_t> {
    for (const auto& a : added)
      if (a.content == token) return a.id;
    const auto it = vocab.find(token);
    return it == vocab.end() ? std::nullopt : std::optional<int32_t>(it->second);
  };
  if (!config_path.empty()) {
    std::ifstream in(config_path, std::ios::binary);
    json config;
    try {
      config = json::parse(in);
    } catch (const json::exception& e) {
      fail("{} is not valid JSON: {}", config_path.string(), e.what());
    }
    const json bos = config.is_object() ? config.value("bos_token", json()) : json();
    std::string name;
    if (bos.is_string()) name = bos.get<std::string>();
    if (bos.is_object() && bos.contains("content") && bos["content"].is_string())
      name = bos["content"].get<std::string>();
    if (!name.empty()) {
      document_start = id_of(name);
      LOOM_CHECK(document_start.has_value(), "{}: bos_token '{}' is not a token of {}",
                 config_path.string(), name, path.string());
      return;
    }
  }
  // The post-processor's template for one sequence: "<s> $A" names the BOS.
  std::function<std::optional<int32_t>(const json&)> from_template =
      [&](const json& p) -> std::optional<int32_t> {
    if (!p.is_object()) return std::nullopt;
    if (p.value("type", "") == "Sequence")
      for (const json& q : p.value("processors", json::array()))
        if (auto id = from_template(q)) return id;
    if (p.value("type", "") != "TemplateProcessing") return std::nullopt;
    const json& single = p.value("single", json::array());
    if (!single.is_array() || single.empty() || !single[0].contains("SpecialToken"))
      return std::nullopt;
    const std::string name = single[0]["SpecialToken"].value("id", "");
    const json& entry = p.value("special_tokens", json::object()).value(name, json());
    if (entry.is_object() && entry.contains("ids") && !entry["ids"].empty() &&
        entry["ids"][0].is_number_integer())
      return entry["ids"][0].get<int32_t>();
    return id_of(name);
  };
  if ((document_start = from_template(root.value("post_processor", json())))) return;
  for (const char* name :
       {"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"}) {
    if ((document_start = id_of(name))) return;
  }
}

// Cuts each text section at the added tokens (those with the given `normalized` flag) in it,
// leftmost first and longest first, with lstrip/rstrip taking the whitespace beside a match and
// single_word refusing matches inside a word.
void HfTokenizer::State::split_on_added(std::vector<Section>& sections, bool normalized) const {
  bool any = false;
  for (const auto& a : added) any = any || a.normalized == normalized;
  if (!any) return;
  std::vector<Section> out;
  for (Section& s : sections) {
    if (s.id >= 0) {
      out.push_back(std::move(s));
      continue;
    }
    const std::string_view text = s.text;
    size_t done = 0;  // text before this is emitted
    for (size_t pos = 0; pos < text.size();) {
      const AddedToken* hit = nullptr;
      for (const auto& a : added) {
        if (a.normalized != normalized || text.compare(pos, a.content.size(), a.content) != 0)
          continue;
        const size_t end = pos + a.content.size();
        if (a.single_word &&
            (is_word_char(code_point_before(text, pos)) ||
             (end < text.size() && is_word_char(utf8::at(text, end).cp))))
          continue;
        hit = &a;
        break;
      }
      if (hit == nullptr) {
        ++pos;
        continue;
      }
      size_t begin = pos, end = pos + hit->content.size();
      if (hit->lstrip) {
        for (int32_t cp; begin > done && (cp = code_point_before(text, begin)) >= 0 &&
                         u_isUWhiteSpace(cp);) {
          std::string tmp;
          utf8::append(tmp, cp);
          begin -= tmp.size();
        }
      }
      if (hit->rstrip) {
        while (end < text.size()) {
          const auto c = utf8::at(text, end);
          if (c.cp < 0 || !u_isUWhiteSpace(c.cp)) break;
          end += c.size;
        }
      }
      if (begin > done)
        out.push_back({std::string(text.substr(done, begin - done)), -1,
                       s.at_text_start && done == 0});
      out.push_back({std::string(), hit->id, false});
      done = pos = end;
    }
    if (done < text.size())
      out.push_back({std::string(text.substr(done)), -1, s.at_text_start && done == 0});
  }
  sections = std::move(out);
}

// One pre-token's ids: characters looked up (bytes or <unk> when absent), then merged by rank.
std::vector<int32_t> HfTokenizer::State::merge_word(std::string_view word) const {
  if (ignore_merges) {
    if (const auto it = vocab.find(word); it != vocab.end()) return {it->second};
  }
  std::vector<BpeSymbol> symbols;
  for (size_t pos = 0; pos < word.size();) {
    const auto c = utf8::at(word, pos);
    const auto begin = static_cast<uint32_t>(pos), end = static_cast<uint32_t>(pos + c.size);
    pos += c.size;
    if (const auto it = vocab.find(word.substr(begin, end - begin)); it != vocab.end()) {
      symbols.push_back({begin, end, it->second});
      continue;
    }
    bool bytes_found = byte_fallback;
    for (uint32_t b = begin; bytes_found && b < end; ++b)
      bytes_found = byte_ids[static_cast<unsigned char>(word[b])] >= 0;
    if (bytes_found) {
      for (uint32_t b = begin; b < end; ++b)
        symbols.push_back({b, b + 1, byte_ids[static_cast<unsigned char>(word[b])]});
      continue;
    }
    LOOM_CHECK(unk_id >= 0,
               "{}: the text holds '{}' (bytes {}), which is neither in the vocabulary nor "
               "coverable by byte fallback, and the model has no unk_token",
               where, std::string(word.substr(begin, end - begin)),
               fmt::format("{:02x}", fmt::join(word.substr(begin, end - begin), " ")));
    if (fuse_unk && !symbols.empty() && symbols.back().id == unk_id && symbols.back().end == begin)
      symbols.back().end = end;
    else
      symbols.push_back({begin, end, unk_id});
  }
  bpe_merge(symbols, [&](const BpeSymbol& l, const BpeSymbol& r) -> std::optional<BpeMerge> {
    const auto it = merges.find(pair_key(l.id, r.id));
    if (it == merges.end()) return std::nullopt;
    return it->second;
  });
  std::vector<int32_t> ids;
  ids.reserve(symbols.size());
  for (const auto& s : symbols) ids.push_back(s.id);
  return ids;
}

void HfTokenizer::State::encode_word(std::string_view word, std::vector<int32_t>& ids) const {
  CacheStripe& stripe = cache[TransparentHash{}(word) % kStripes];
  {
    std::lock_guard lock(stripe.mutex);
    if (const auto it = stripe.map.find(word); it != stripe.map.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  // Merged outside the lock: threads on different words do not wait for each other.
  std::vector<int32_t> word_ids = merge_word(word);
  ids.insert(ids.end(), word_ids.begin(), word_ids.end());
  std::lock_guard lock(stripe.mutex);
  if (stripe.map.size() >= kMaxStripeEntries) stripe.map.clear();
  stripe.map.emplace(word, std::move(word_ids));
}

HfTokenizer::HfTokenizer(const fs::path& tokenizer_json) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.path = tokenizer_json;
  s.where = tokenizer_json.string();
  std::ifstream in(tokenizer_json, std::ios::binary);
  LOOM_CHECK(in.is_open(), "cannot open tokenizer file {}", s.where);
  json root;
  try {
    root = json::parse(in);
  } catch (const json::exception& e) {
    fail("tokenizer file {} is not valid JSON: {}", s.where, e.what());
  }
  LOOM_CHECK(root.is_object() && root.contains("model"),
             "tokenizer file {} is not a Hugging Face tokenizer.json (no \"model\")", s.where);
  s.load_model(root["model"]);
  s.load_added(root.value("added_tokens", json()));
  s.normalizer = hf::make_normalizer(root.value("normalizer", json()), s.where);
  s.pre_tokenizer = hf::make_pre_tokenizer(root.value("pre_tokenizer", json()), s.where);
  s.decoder = hf::make_decoder(root.value("decoder", json()), s.where);
  const fs::path config = tokenizer_json.parent_path() / "tokenizer_config.json";
  if (fs::is_regular_file(config)) s.config_path = config;
  s.find_document_start(root);
}

HfTokenizer::~HfTokenizer() = default;

int64_t HfTokenizer::vocab_size() const {
  return static_cast<int64_t>(state_->id_to_token.size());
}

std::optional<int32_t> HfTokenizer::document_start() const {
  return state_->document_start;
}

std::vector<Tokenizer::File> HfTokenizer::files() const {
  std::vector<File> f = {{state_->path, "tokenizer.json"}};
  if (!state_->config_path.empty()) f.push_back({state_->config_path, "tokenizer_config.json"});
  return f;
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  const State& s = *state_;
  std::vector<Section> sections = {{std::string(text), -1, true}};
  s.split_on_added(sections, false);
  if (s.normalizer)
    for (Section& sec : sections)
      if (sec.id < 0) s.normalizer->apply(sec.text);
  s.split_on_added(sections, true);
  std::vector<int32_t> ids;
  std::vector<hf::Split> splits;
  for (const Section& sec : sections) {
    if (sec.id >= 0) {
      ids.push_back(sec.id);
      continue;
    }
    if (sec.text.empty()) continue;
    splits.assign(1, {sec.text, sec.at_text_start});
    if (s.pre_tokenizer) s.pre_tokenizer->apply(splits);
    for (const hf::Split& split : splits) s.encode_word(split.text, ids);
  }
  return ids;
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  const State& s = *state_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    LOOM_CHECK(ids[i] >= 0 && static_cast<size_t>(ids[i]) < s.id_to_token.size() &&
                   !s.id_to_token[ids[i]].empty(),
               "HfTokenizer::decode: id {} at position {} is not a token of {} (vocabulary {})",
               ids[i], i, s.where, s.id_to_token.size());
    tokens.push_back(s.id_to_token[ids[i]]);
  }
  if (!s.decoder) {
    // The library joins undecoded tokens with spaces.
    return fmt::format("{}", fmt::join(tokens, " "));
  }
  s.decoder->apply(tokens);
  std::string text;
  for (const auto& t : tokens) text += t;
  return text;
}

}  // namespace loom::data
