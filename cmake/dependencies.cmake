# Every dependency comes from a Debian package that scripts/setup.sh installs.
find_package(OpenMP REQUIRED)
find_package(MPI REQUIRED COMPONENTS C)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
find_package(PkgConfig REQUIRED)
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
# Unicode character classes for GPT-2's pre-tokenisation.
pkg_check_modules(ICU REQUIRED IMPORTED_TARGET icu-uc)
# OpenBLAS built on OpenMP shares loom's OpenMP thread pool; the pthread build
# (Debian's default) keeps its own threads, which spin against loom's between
# calls (about 15% slower training here). Link the OpenMP build when present;
# scripts/setup.sh installs it.
find_library(LOOM_OPENBLAS_OPENMP NAMES libopenblas.so.0
  PATHS /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp NO_DEFAULT_PATH)
if(LOOM_OPENBLAS_OPENMP)
  message(STATUS "BLAS: OpenBLAS (OpenMP build) ${LOOM_OPENBLAS_OPENMP}")
  set(LOOM_BLAS_LIBRARY ${LOOM_OPENBLAS_OPENMP})
else()
  message(STATUS "BLAS: OpenBLAS ${OPENBLAS_LINK_LIBRARIES} (install libopenblas0-openmp for the OpenMP build)")
  set(LOOM_BLAS_LIBRARY PkgConfig::OPENBLAS)
endif()
# oneDNN's OpenMP build: the second GEMM backend (kernels.gemm), the one that
# knows the newest x86 processors when OpenBLAS does not.
# (Found by hand: Debian's dnnl CMake package also demands OpenCL.)
if(LOOM_ONEDNN)
  find_library(LOOM_DNNL_LIBRARY NAMES dnnl)
  find_path(LOOM_DNNL_INCLUDE oneapi/dnnl/dnnl.h)
  if(NOT LOOM_DNNL_LIBRARY OR NOT LOOM_DNNL_INCLUDE)
    message(FATAL_ERROR "oneDNN not found: install libdnnl-dev (scripts/setup.sh does), or "
                        "configure with -DLOOM_ONEDNN=OFF for OpenBLAS alone")
  endif()
  add_library(loom_dnnl INTERFACE IMPORTED)
  target_link_libraries(loom_dnnl INTERFACE ${LOOM_DNNL_LIBRARY})
  target_include_directories(loom_dnnl INTERFACE ${LOOM_DNNL_INCLUDE})
  message(STATUS "GEMM: oneDNN ${LOOM_DNNL_LIBRARY} and OpenBLAS")
endif()
if(LOOM_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
# The CUDA backend: the toolkit's runtime and cuBLASLt, and NCCL (from the
# toolkit's folders or the system's).
if(LOOM_CUDA)
  find_package(CUDAToolkit REQUIRED)
  find_library(LOOM_NCCL_LIBRARY NAMES nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
  find_path(LOOM_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  if(NOT LOOM_NCCL_LIBRARY OR NOT LOOM_NCCL_INCLUDE)
    message(FATAL_ERROR "NCCL not found (nccl.h and libnccl): install it beside the CUDA toolkit, "
                        "or configure without -DLOOM_CUDA=ON")
  endif()
  add_library(loom_nccl INTERFACE IMPORTED)
  target_link_libraries(loom_nccl INTERFACE ${LOOM_NCCL_LIBRARY} CUDA::cudart)
  target_include_directories(loom_nccl INTERFACE ${LOOM_NCCL_INCLUDE})
  message(STATUS "CUDA: ${CUDAToolkit_VERSION} (sm ${CMAKE_CUDA_ARCHITECTURES}), NCCL ${LOOM_NCCL_LIBRARY}")
endif()
