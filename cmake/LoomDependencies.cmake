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
