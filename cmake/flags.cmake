# Warnings everywhere; vectorisation for AVX2/FMA through the compiler.
add_compile_options(-Wall -Wextra)
# Neither changes results (no reassociation): loom never reads FP exception
# flags or errno from math calls, and without them GCC keeps branches that stop
# loops with min/max and float-to-int conversion (vexp, vtanh) from vectorising.
add_compile_options(-fno-trapping-math -fno-math-errno)
if(LOOM_NATIVE)
  add_compile_options(-march=native)
else()
  add_compile_options(-mavx2 -mfma)
endif()
if(CMAKE_BUILD_TYPE STREQUAL "Release")
  add_compile_options(-O3)
endif()
if(LOOM_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()
if(LOOM_FUZZ)
  # libFuzzer's coverage everywhere (the targets link its runtime), with the
  # sanitizers that turn a bad read into a finding.
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()
