#include "loom/data/prepare.h"

#include <fmt/format.h>
#include <fnmatch.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/data/token_shard.h"

namespace loom::data {

namespace fs = std::filesystem;

bool has_glob(std::string_view s) {
  return s.find_first_of("*?[") != std::string_view::npos;
}

namespace {

std::vector<fs::path> sorted_files_below(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

bool is_jsonl(const fs::path& file, const std::string& format) {
  if (format == "jsonl") return true;
  if (format == "text") return false;
  const std::string ext = file.extension().string();
  return ext == ".jsonl" || ext == ".ndjson";
}

// A batch of documents on its way to the workers, and the ids they became.
struct Batch {
  std::vector<std::string> documents;
  int64_t text_bytes = 0;
  std::vector<int32_t> ids;
};

// Reader -> workers -> writer, with at most `capacity` batches in flight so memory stays
// bounded; the writer takes results in the order the reader made them.
class Pipeline {
 public:
  Pipeline(const Tokenizer& tok, int threads, size_t capacity) : tok_(tok), capacity_(capacity) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~Pipeline() { stop(); }

  // Blocks while `capacity` batches are in flight. Rethrows a worker's or the writer's error.
  void submit(Batch batch) {
    std::unique_lock lock(mutex_);
    changed_.wait(
        lock, [&] { return static_cast<size_t>(next_submit_ - next_take_) < capacity_ || error_; });
    if (error_) std::rethrow_exception(error_);
    todo_.emplace_back(next_submit_++, std::move(batch));
    changed_.notify_all();
  }

  // The next batch in submission order, encoded; false once every submitted batch was taken
  // after close().
  bool take(Batch& out) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] {
      return done_.count(next_take_) > 0 || (closed_ && next_take_ == next_submit_) || error_;
    });
    if (error_) std::rethrow_exception(error_);
    const auto it = done_.find(next_take_);
    if (it == done_.end()) return false;
    out = std::move(it->second);
    done_.erase(it);
    ++next_take_;
    changed_.notify_all();
    return true;
  }

  void close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
    changed_.notify_all();
  }

  void fail(std::exception_ptr e) {
    std::lock_guard lock(mutex_);
    if (!error_) error_ = e;
    changed_.notify_all();
  }

  void stop() {
    fail(std::make_exception_ptr(Error("prepare stopped")));
    for (auto& w : workers_)
      if (w.joinable()) w.join();
  }

 private:
  void work() {
    while (true) {
      std::pair<int64_t, Batch> job;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return !todo_.empty() || closed_ || error_; });
        if (error_ || todo_.empty()) return;
        job = std::move(todo_.front());
        todo_.pop_front();
      }
      try {
        Batch& b = job.second;
        const auto start = tok_.document_start();
        for (const std::string& doc : b.documents) {
          if (start) b.ids.push_back(*start);
          const auto ids = tok_.encode(doc);
          b.ids.insert(b.ids.end(), ids.begin(), ids.end());
        }
        b.documents = {};
      } catch (...) {
        fail(std::current_exception());
        return;
      }
      std::lock_guard lock(mutex_);
      done_.emplace(job.first, std::move(job.second));
      changed_.notify_all();
    }
  }

  const Tokenizer& tok_;
  const size_t capacity_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::pair<int64_t, Batch>> todo_;
  std::map<int64_t, Batch> done_;
  int64_t next_submit_ = 0, next_take_ = 0;
  bool closed_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
};

// Batches of about this much text keep the workers busy without holding much in memory.
constexpr int64_t kBatchBytes = int64_t{1} << 20;
constexpr size_t kBatchDocuments = 1024;

// Reads every document of `files` into batches for `submit`.
template <typename Submit>
void read_documents(const std::vector<fs::path>& files, const PrepareOptions& o,
                    PrepareStats& stats, Submit&& submit) {
  Batch batch;
  const auto add = [&](std::string doc) {
    batch.text_bytes += static_cast<int64_t>(doc.size());
    batch.documents.push_back(std::move(doc));
    ++stats.documents;
    if (batch.text_bytes >= kBatchBytes || batch.documents.size() >= kBatchDocuments) {
      stats.text_bytes += batch.text_bytes;
      submit(std::move(batch));
      batch = Batch();
    }
  };
  for (const fs::path& file : files) {
    ++stats.files;
    std::ifstream in(file, std::ios::binary);
    LOOM_CHECK(in.good(), "cannot open '{}': {}", file.string(), std::strerror(errno));
    if (!is_jsonl(file, o.format)) {
      // Read as a stream: a pipe or standard input has no size to read up to.
      add(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
      LOOM_CHECK(!in.bad(), "reading '{}' failed", file.string());
      continue;
    }
    std::string line;
    for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        fail("{}:{}: not a JSON line: {}", file.string(), line_no, e.what());
      }
      LOOM_CHECK(j.is_object() && j.contains(o.text_field) && j[o.text_field].is_string(),
                 "{}:{}: expected an object with a string field \"{}\" (--text-field), got {}",
                 file.string(), line_no, o.text_field, j.dump().substr(0, 120));
      add(j[o.text_field].get<std::string>());
    }
    LOOM_CHECK(!in.bad(), "reading '{}' failed", file.string());
  }
  if (!batch.documents.empty()) {
    stats.text_bytes += batch.text_bytes;
    submit(std::move(batch));
  }
}

}  // namespace

std::vector<fs::path> expand_inputs(const std::vector<std::string>& inputs) {
  std::vector<fs::path> files;
  for (const std::string& input : inputs) {
    // "-": standard input, read once as it streams (JSON lines with --format jsonl).
    const fs::path path(input == "-" ? std::string("/dev/stdin") : input);
    std::error_code ec;
    if (input == "-" || fs::is_fifo(path, ec)) {
      files.push_back(path);
    } else if (fs::is_directory(path, ec)) {
      const auto below = sorted_files_below(path);
      LOOM_CHECK(!below.empty(), "input directory '{}' holds no files", input);
      files.insert(files.end(), below.begin(), below.end());
    } else if (fs::is_regular_file(path, ec)) {
      files.push_back(path);
    } else if (has_glob(path.filename().string()) && !has_glob(path.parent_path().string())) {
      const fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
      const std::string pattern = path.filename().string();
      std::vector<fs::path> matches;
      if (fs::is_directory(dir, ec)) {
        for (const auto& entry : fs::directory_iterator(dir)) {
          if (entry.is_regular_file() &&
              ::fnmatch(pattern.c_str(), entry.path().filename().c_str(), 0) == 0)
            matches.push_back(entry.path());
        }
      }
      LOOM_CHECK(!matches.empty(), "input '{}' matches no file", input);
      std::sort(matches.begin(), matches.end());
      files.insert(files.end(), matches.begin(), matches.end());
    } else {
      fail(
          "input '{}' does not exist (expected a file, a directory or a glob such as "
          "'shards/*.jsonl')",
          input);
    }
  }
  return files;
}

PrepareStats prepare_shards(const Tokenizer& tok, const PrepareOptions& o) {
  LOOM_CHECK(o.val_fraction >= 0 && o.val_fraction < 1, "--val-fraction {} must be in [0, 1)",
             o.val_fraction);
  LOOM_CHECK(o.format == "auto" || o.format == "text" || o.format == "jsonl",
             "--format '{}' is not one of auto, text, jsonl", o.format);
  LOOM_CHECK(o.threads >= 0, "--threads {} must be >= 0 (0: every core)", o.threads);
  const auto files = expand_inputs(o.inputs);
  core::ensure_writable_dir(o.out_dir);
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const int threads = o.threads > 0
                          ? o.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  PrepareStats stats;

  // Every token goes to one shard; the tail is moved to val.bin at the end, when the total is
  // known, so the split is the same as for text held in memory.
  const fs::path all = o.out_dir / "train.bin.all";
  LlmcShardWriter writer(all, tok.vocab_size());
  {
    Pipeline pipeline(tok, threads, static_cast<size_t>(2 * threads + 2));
    std::exception_ptr write_error;
    std::thread write([&] {
      try {
        Batch b;
        double last_report = 0;
        while (pipeline.take(b)) {
          writer.append(b.ids);
          const double now = elapsed();
          if (o.progress_seconds > 0 && now - last_report >= o.progress_seconds) {
            last_report = now;
            spdlog::info("prepare: {} tokens written, {:.1f} s", writer.size(), now);
          }
        }
      } catch (...) {
        write_error = std::current_exception();
        pipeline.fail(write_error);
      }
    });
    try {
      read_documents(files, o, stats, [&](Batch b) { pipeline.submit(std::move(b)); });
      pipeline.close();
    } catch (...) {
      pipeline.fail(std::current_exception());
      write.join();
      throw;
    }
    write.join();
    if (write_error) std::rethrow_exception(write_error);
  }
  stats.tokens = writer.size();
  LOOM_CHECK(stats.tokens >= 2, "the input holds {} tokens; at least 2 are needed", stats.tokens);
  writer.finish();

  stats.val_tokens = static_cast<int64_t>(static_cast<double>(stats.tokens) * o.val_fraction);
  stats.train_tokens = stats.tokens - stats.val_tokens;
  std::error_code ec;
  try {
    if (stats.val_tokens > 0) {
      const TokenShard shard(all, ShardFormat::kLlmc);
      LlmcShardWriter val(o.out_dir / "val.bin", tok.vocab_size());
      std::vector<int64_t> chunk;
      std::vector<int32_t> ids;
      for (int64_t at = stats.train_tokens; at < stats.tokens;) {
        const int64_t n = std::min<int64_t>(int64_t{1} << 20, stats.tokens - at);
        chunk.resize(n);
        shard.copy_to(at, n, chunk.data());
        ids.assign(chunk.begin(), chunk.end());
        val.append(ids);
        at += n;
      }
      val.finish();
    } else {
      // Nothing stale from an earlier run in the same directory may describe this data.
      fs::remove(o.out_dir / "val.bin", ec);
    }
    truncate_llmc_shard(all, stats.train_tokens);
    fs::rename(all, o.out_dir / "train.bin", ec);
    LOOM_CHECK(!ec, "cannot rename '{}' to train.bin: {}", all.string(), ec.message());
  } catch (...) {
    fs::remove(all, ec);
    throw;
  }
  save_tokenizer_meta(tok, o.out_dir);
  stats.seconds = elapsed();
  return stats;
}

}  // namespace loom::data
