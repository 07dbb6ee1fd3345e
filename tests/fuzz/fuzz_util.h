#pragma once
// What every loom fuzz target shares. A parser given hostile bytes may return, or throw
// loom::Error (a clear message for the user); anything else — another exception, a crash, a
// sanitizer report, a hang, an allocation past libFuzzer's -malloc_limit_mb — is a finding.
// Inputs holding several files separate them with kFileSeparator (a line of its own), so the
// seed corpus stays readable text.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/files.h"

namespace loom::fuzz {

inline constexpr std::string_view kFileSeparator = "\n#~#~#\n";

// A directory of this process's own, emptied once per process (each input overwrites its files).
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    auto d = std::filesystem::path(tmp && *tmp ? tmp : "/tmp") /
             ("loom-fuzz-" + std::to_string(::getpid()));
    std::error_code ec;
    loom::core::remove_tree(d, ec);
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.good()) {
    std::fprintf(stderr, "fuzz harness: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// The input cut at each separator into at most `parts` pieces (missing ones are empty).
inline std::vector<std::string_view> split_files(const uint8_t* data, size_t size, size_t parts) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> out;
  while (out.size() + 1 < parts) {
    const auto at = rest.find(kFileSeparator);
    if (at == std::string_view::npos) break;
    out.push_back(rest.substr(0, at));
    rest.remove_prefix(at + kFileSeparator.size());
  }
  out.push_back(rest);
  out.resize(parts);
  return out;
}

[[noreturn]] inline void finding(const char* what, const char* detail) {
  std::fprintf(stderr, "fuzz finding: %s: %s\n", what, detail);
  std::abort();
}

// Runs `parse` and says whether it accepted the input. Refusing it with a loom::Error is
// expected, and so is each of `Allowed...` (CLI11's parse errors for the config reader); any
// other exception is a finding.
template <typename... Allowed, typename F>
bool accepts(F&& parse) {
  try {
    parse();
    return true;
  } catch (const loom::Error& e) {
    if (std::string_view(e.what()).empty()) finding("loom::Error", "empty message");
    return false;
  } catch (const std::exception& e) {
    if ((dynamic_cast<const Allowed*>(&e) || ...)) return false;
    finding(typeid(e).name(), e.what());
  } catch (...) {
    finding("non-std exception", "?");
  }
}

// A broken invariant of an accepted input: the parser returned something it should not have.
inline void require(bool ok, const char* what) {
  if (!ok) finding("invariant", what);
}

}  // namespace loom::fuzz
