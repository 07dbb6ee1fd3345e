#pragma once
// fmt support for the LibTorch types that error messages print (shapes).
#include <c10/util/ArrayRef.h>
#include <fmt/ostream.h>

template <>
struct fmt::formatter<c10::ArrayRef<int64_t>> : fmt::ostream_formatter {};
