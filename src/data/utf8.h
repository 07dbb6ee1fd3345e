#pragma once
// UTF-8 helpers shared by the tokenizers (private to src/data).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom::data::utf8 {

// One code point of a UTF-8 string. Bytes that do not start a valid sequence become a unit of
// their own with cp = -1, so arbitrary bytes still split (and round-trip) one at a time.
struct CodePoint {
  int32_t cp;
  size_t size;
};

inline CodePoint at(std::string_view s, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = byte(pos);
  if (lead < 0x80) {
    return {lead, 1};
  }
  size_t size = 0;
  int32_t cp = 0;
  int32_t min_cp = 0;  // smallest value this length may encode; smaller ones are overlong
  if ((lead & 0xE0) == 0xC0) {
    size = 2, cp = lead & 0x1F, min_cp = 0x80;
  } else if ((lead & 0xF0) == 0xE0) {
    size = 3, cp = lead & 0x0F, min_cp = 0x800;
  } else if ((lead & 0xF8) == 0xF0) {
    size = 4, cp = lead & 0x07, min_cp = 0x10000;
  } else {
    return {-1, 1};
  }
  if (pos + size > s.size()) {
    return {-1, 1};
  }
  for (size_t i = 1; i < size; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) {
      return {-1, 1};
    }
    cp = (cp << 6) | (byte(pos + i) & 0x3F);
  }
  if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    return {-1, 1};
  }
  return {cp, size};
}

inline void append(std::string& out, int32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Length of the maximal subpart of the ill-formed sequence at `pos` (Unicode's definition, which
// Python's and Rust's lossy decoders follow): what one U+FFFD replaces.
inline size_t invalid_length(std::string_view s, size_t pos) {
  const auto lead = static_cast<unsigned char>(s[pos]);
  size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2, lo = lead == 0xE0 ? 0xA0 : 0x80, hi = lead == 0xED ? 0x9F : 0xBF;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3, lo = lead == 0xF0 ? 0x90 : 0x80, hi = lead == 0xF4 ? 0x8F : 0xBF;
  } else {
    return 1;
  }
  size_t k = 1;
  for (; k <= need && pos + k < s.size(); ++k) {
    const auto b = static_cast<unsigned char>(s[pos + k]);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
  }
  return k;
}

// Bytes -> text as the reference decoders give it: each maximal ill-formed subpart -> U+FFFD.
inline std::string replace_invalid(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t pos = 0; pos < bytes.size();) {
    const CodePoint c = at(bytes, pos);
    if (c.cp < 0) {
      out += "\xEF\xBF\xBD";
      pos += invalid_length(bytes, pos);
    } else {
      out.append(bytes.substr(pos, c.size));
      pos += c.size;
    }
  }
  return out;
}

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves; the other 68 bytes
// map, in byte order, to U+0100 onwards, so every byte-level token is printable text.
inline int32_t byte_level_code_point(uint8_t b) {
  int32_t next = 256;
  for (int32_t v = 0; v < 256; ++v) {
    const bool printable = (v >= '!' && v <= '~') || (v >= 0xA1 && v <= 0xAC) || v >= 0xAE;
    if (v == b) return printable ? v : next;
    if (!printable) ++next;
  }
  return -1;
}

// The byte a byte-fallback token "<0xHH>" stands for (two hex digits, either case), or -1.
inline int byte_piece_value(std::string_view piece) {
  const auto hex = [](char c) {
    return c >= '0' && c <= '9' ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
  };
  if (piece.size() != 6 || !piece.starts_with("<0x") || piece[5] != '>') return -1;
  const int hi = hex(piece[3]), lo = hex(piece[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

}  // namespace loom::data::utf8
