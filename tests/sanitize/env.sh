# Sanitizer settings for tests and fuzz targets of a QUILT_SANITIZE build (sourced by
# tests/sanitize/run.sh and tests/fuzz/run.sh): every report is fatal, stacks are printed, and
# the suppressions beside this file (third-party code only) apply.
_quilt_sanitize_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1
export LSAN_OPTIONS=suppressions=$_quilt_sanitize_dir/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=suppressions=$_quilt_sanitize_dir/ubsan.supp:print_stacktrace=1:halt_on_error=1
