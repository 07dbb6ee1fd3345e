# loom_target_options(<target>): the options every target of our own code gets.
#  - warnings are errors in our code (third-party headers come in as SYSTEM includes);
#  - one precompiled header for <torch/torch.h>, built once on `loom` and reused elsewhere.
function(loom_target_options target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -Wno-unused-parameter -Wno-missing-field-initializers>)
  if(NOT target STREQUAL "loom")
    # The shared PCH was built with -fPIC; GCC refuses it under an executable's -fPIE.
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC>)
    target_precompile_headers(${target} REUSE_FROM loom)
  endif()
endfunction()
