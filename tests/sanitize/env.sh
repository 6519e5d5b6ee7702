# Sanitizer settings for tests and fuzz targets of a QUILT_SANITIZE build (sourced by
# tests/sanitize/run.sh and tests/fuzz/run.sh): every report is fatal, stacks are printed, and
# the suppressions beside this file (third-party code only) apply.
_quilt_sanitize_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# intercept_tls_get_addr=0: with clang 14's runtime on Debian 12's glibc, LeakSanitizer's tracer
# read the threads' dynamic-TLS vectors at garbage addresses ("Tracer caught signal 11", having
# checked nothing) in every test whose GEMM library had started threads: 77 of the unit tests.
# Without tracking __tls_get_addr those tests are leak-checked in full (all pass; a leak after an
# OpenMP region is still reported). What it gives up is the dynamic TLS of libraries dlopen()ed
# later as roots, so a pointer kept only there would show as a leak: a false report, never a
# missed one.
export ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1:intercept_tls_get_addr=0
export LSAN_OPTIONS=suppressions=$_quilt_sanitize_dir/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=suppressions=$_quilt_sanitize_dir/ubsan.supp:print_stacktrace=1:halt_on_error=1
