# Sanitizer and fuzzing builds (opt-in; `make test-sanitize` and `make fuzz` configure them).
#
#   cmake -S . -B build-asan -DQUILT_SANITIZE=address,undefined                       # gcc or clang
#   cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DQUILT_SANITIZE=address,undefined -DQUILT_FUZZ=ON
#
# QUILT_SANITIZE instruments every target of the tree (library, tests, tools) and makes any
# sanitizer report fatal, so a report fails its test. QUILT_FUZZ adds libFuzzer's coverage
# instrumentation (clang's -fsanitize=fuzzer-no-link) to the same objects and builds the
# targets of tests/fuzz/ (the coverage only in the sources tests/fuzz/coverage.allow names).
set(QUILT_SANITIZE "" CACHE STRING "Sanitizers for every target, e.g. address,undefined (empty: none)")
option(QUILT_FUZZ "Build the libFuzzer targets of tests/fuzz/ (needs clang)" OFF)

if(QUILT_SANITIZE)
  add_compile_options(-fsanitize=${QUILT_SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${QUILT_SANITIZE})
endif()
if(QUILT_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "QUILT_FUZZ=ON needs clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID}: "
                        "configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  # Coverage counters only where the fuzz targets look (tests/fuzz/coverage.allow).
  add_compile_options(-fsanitize=fuzzer-no-link
                      -fsanitize-coverage-allowlist=${CMAKE_CURRENT_SOURCE_DIR}/tests/fuzz/coverage.allow)
endif()
