# Third-party dependencies. LibTorch is found through torch's cmake prefix path
# (scripts/build passes `python -c 'import torch; print(torch.utils.cmake_prefix_path)'`).
# Torch's CUDA config otherwise probes the local GPU with try_run; name the targets instead.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0a")
endif()
find_package(Torch REQUIRED)
include(LoomTorchIncludes)
loom_hide_torch_fmt()
find_package(MPI REQUIRED COMPONENTS CXX)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json 3.9 REQUIRED)
find_package(Threads REQUIRED)
# Tokenizers: PCRE2 runs tokenizer.json pre-tokenizer patterns, ICU its Unicode normalizers.
# Both are private to libloom.
find_package(PkgConfig REQUIRED)
pkg_check_modules(LOOM_PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
find_package(ICU REQUIRED COMPONENTS uc)

# NCCL for the CUDA backend of loom::dist: prefer the copy in torch's wheel (nvidia/nccl), which
# is the one libtorch_cuda loads at run time.
if(LOOM_WITH_CUDA)
  get_filename_component(_loom_site "${Torch_DIR}/../../../.." ABSOLUTE)
  find_path(LOOM_NCCL_INCLUDE_DIR nccl.h
    HINTS "${_loom_site}/nvidia/nccl/include" ENV NCCL_HOME PATH_SUFFIXES include)
  find_library(LOOM_NCCL_LIBRARY NAMES libnccl.so.2 nccl NAMES_PER_DIR
    HINTS "${_loom_site}/nvidia/nccl/lib" ENV NCCL_HOME PATH_SUFFIXES lib lib64)
  if(NOT LOOM_NCCL_INCLUDE_DIR OR NOT LOOM_NCCL_LIBRARY)
    message(FATAL_ERROR "LOOM_WITH_CUDA=ON needs NCCL (nccl.h and libnccl): install torch's "
      "nvidia-nccl wheel, set NCCL_HOME, or configure with -DLOOM_WITH_CUDA=OFF")
  endif()
  message(STATUS "NCCL: ${LOOM_NCCL_LIBRARY} (headers in ${LOOM_NCCL_INCLUDE_DIR})")
endif()
