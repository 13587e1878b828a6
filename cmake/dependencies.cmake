# Every dependency comes from a Debian package that scripts/setup.sh installs.
find_package(OpenMP REQUIRED)
find_package(MPI REQUIRED COMPONENTS C)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
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
if(LOOM_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
