# loom_target_options(<target>): the options every target of our own code gets.
#  - warnings are errors in our code (third-party headers come in as SYSTEM includes);
#  - one precompiled header for <torch/torch.h>, built once on `loom` and reused elsewhere.
#  GCC 13 and newer report array-bounds / stringop / dangling-reference false positives inside
#  libstdc++ as inlined into torch's headers (std::vector<bool>::reserve in custom_function.h):
#  those stay warnings there. LOOM_WARNINGS_AS_ERRORS=OFF (scripts/gpu-check) keeps every
#  warning a warning, for a machine whose compiler nobody here has built with.
function(loom_target_options target)
  set(werror ${LOOM_WERROR})
  if(LOOM_WARNINGS_AS_ERRORS)
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 13)
      list(APPEND werror -Wno-error=array-bounds -Wno-error=stringop-overflow
        -Wno-error=stringop-overread -Wno-error=dangling-reference -Wno-error=maybe-uninitialized)
    endif()
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra ${werror} -Wno-unused-parameter -Wno-missing-field-initializers>)
  if(NOT target STREQUAL "loom")
    # The shared PCH was built with -fPIC; GCC refuses it under an executable's -fPIE.
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC>)
    target_precompile_headers(${target} REUSE_FROM loom)
  endif()
endfunction()
