# Warnings everywhere; vectorisation for AVX2/FMA through the compiler.
# (C and C++ alone: nvcc takes its own, below.)
add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-Wall> $<$<COMPILE_LANGUAGE:C,CXX>:-Wextra>)
if(LOOM_WERROR)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-Werror>)
endif()
# GCC 12 warns inside libstdc++'s own string concatenation at -O3 (a false
# -Wrestrict, GCC bug 105329, fixed in 13): off for that compiler alone.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-Wno-restrict>)
endif()
if(LOOM_CUDA)
  # Device code: every nvcc warning an error; host code as the C++ files.
  add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:SHELL:-Werror all-warnings>"
    "$<$<COMPILE_LANGUAGE:CUDA>:SHELL:-Xcompiler -Wall,-Wextra>")
  if(LOOM_WERROR)
    add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:SHELL:-Xcompiler -Werror>")
  endif()
endif()
# Neither changes results (no reassociation): loom never reads FP exception
# flags or errno from math calls, and without them GCC keeps branches that stop
# loops with min/max and float-to-int conversion (vexp, vtanh) from vectorising.
add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fno-trapping-math>
  $<$<COMPILE_LANGUAGE:C,CXX>:-fno-math-errno>)
if(LOOM_NATIVE)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-march=native>)
else()
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-mavx2> $<$<COMPILE_LANGUAGE:C,CXX>:-mfma>)
endif()
if(CMAKE_BUILD_TYPE STREQUAL "Release")
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-O3>)
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
