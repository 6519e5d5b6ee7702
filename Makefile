# Quilt: `make test` and `make demo` do all set-up (Debian packages, configure, build) first.
BUILD   ?= build
PREFIX  ?= $(CURDIR)/$(BUILD)/install
JOBS    ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: all deps configure build test demo bench install examples clean test-sanitize test-sanitize-unit fuzz \
  fuzz-configure

all: build

deps:
	@bash tools/setup-deps.sh

configure: deps
	@if [ ! -f $(BUILD)/build.ninja ]; then \
	  cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_ARGS); \
	fi

build: configure
	cmake --build $(BUILD) -j $(JOBS)

install: build
	cmake --install $(BUILD) > /dev/null

# The standalone examples/ project, configured and built against the installed package.
examples: install
	cmake -S examples -B $(BUILD)/examples -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$(PREFIX)
	cmake --build $(BUILD)/examples -j $(JOBS)

# The suite runs once with the GEMM libraries chosen for this machine (one per transpose mode),
# then the tests that reach a GEMM once more with each installed library forced (QUILT_GEMM), so
# every unit test passes on every GEMM backend: tests/gemm_pass.sh, which runs each doctest suite
# as one process and says what it leaves out (the collectives, the library tests that loop over
# every library themselves, the whole-run trainer and launch tests). Last, the installed `quilt`
# must run on its own (RPATH to its lib/), without LD_LIBRARY_PATH.
test: build examples
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900
	@chosen=$$($(BUILD)/bin/quilt gemm | sed -n 's/^gemm: \([^(]*\) (.*/\1/p'); \
	for lib in $$($(BUILD)/bin/quilt gemm --list); do \
	  [ "$$lib" = "$$chosen" ] && continue; \
	  echo "quilt: the tests that reach a GEMM again with QUILT_GEMM=$$lib (the choice here: $$chosen)"; \
	  QUILT_GEMM=$$lib bash tests/gemm_pass.sh $(BUILD) $(JOBS) || exit 1; \
	  echo "quilt: all tests passed with QUILT_GEMM=$$lib"; \
	done
	$(BUILD)/examples/tiny_regression
	@env -u LD_LIBRARY_PATH $(PREFIX)/bin/quilt --help > /dev/null || \
	  { echo "installed $(PREFIX)/bin/quilt does not run (missing RPATH to libquilt?)"; exit 1; }

# Sanitizers (cmake/QuiltSanitize.cmake): `make test-sanitize` builds the suites with gcc's ASan +
# UBSan and runs the unit suites and a short multi-rank subset (SANITIZE_TESTS=unit|mpi|all,
# tests/sanitize/run.sh). `make fuzz` builds the libFuzzer targets of tests/fuzz/ with clang (the
# same sanitizers plus coverage; clang 14 cannot compile the test suites, which capture
# structured bindings in lambdas) and runs each for FUZZ_SECONDS (tests/fuzz/run.sh).
SANITIZE_BUILD ?= build-asan
SANITIZE_TESTS ?= all
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
SANITIZE_FLAGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQUILT_SANITIZE=address,undefined -DQUILT_CUDA=OFF \
  -DQUILT_BUILD_BENCH=OFF $(CMAKE_ARGS)
SANITIZE_UNIT_TARGETS = engine_tests kernels_tests collectives_tests dtensor_tests parallel_tests models_tests \
  tools_tests
SANITIZE_TARGETS = $(SANITIZE_UNIT_TARGETS) collectives_mpi_suite dtensor_mpi
FUZZ_TARGETS = $(patsubst tests/fuzz/%.cpp,%,$(wildcard tests/fuzz/*_fuzz.cpp))

test-sanitize: deps
	@[ -f $(SANITIZE_BUILD)/build.ninja ] || cmake -S . -B $(SANITIZE_BUILD) -G Ninja $(SANITIZE_FLAGS) \
	  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
	cmake --build $(SANITIZE_BUILD) -j $(JOBS) --target $(SANITIZE_TARGETS)
	bash tests/sanitize/run.sh $(SANITIZE_BUILD) $(SANITIZE_TESTS)

fuzz-configure: deps
	@echo '#include <omp.h>' | clang++ -fopenmp -x c++ -fsyntax-only - 2>/dev/null || \
	  { echo "make fuzz: clang++ -fopenmp finds no omp.h (install libomp-14-dev)"; exit 1; }
	@[ -f $(FUZZ_BUILD)/build.ninja ] || cmake -S . -B $(FUZZ_BUILD) -G Ninja $(SANITIZE_FLAGS) \
	  -DCMAKE_CXX_COMPILER=clang++ "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG" \
	  -DQUILT_FUZZ=ON

fuzz: fuzz-configure
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target $(FUZZ_TARGETS)
	bash tests/fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

# The unit suites under ASan + UBSan in the fuzz build (clang), reusing its library objects:
# what .ci/run runs after `make fuzz` (about 2.5 min to build the suites, 4 min to run them on
# 2 cores; the gcc build of `make test-sanitize` would first compile the library again).
# On a first run ctest has no timings of its own there and starts the tests in the order they
# are declared, so a long one declared late runs on alone at the end; the main build's timings
# (same test names) order them longest first instead.
test-sanitize-unit: fuzz-configure
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target $(SANITIZE_UNIT_TARGETS)
	@costs=Testing/Temporary/CTestCostData.txt; \
	if [ ! -f $(FUZZ_BUILD)/$$costs ] && [ -f $(BUILD)/$$costs ]; then \
	  mkdir -p $(FUZZ_BUILD)/Testing/Temporary && cp $(BUILD)/$$costs $(FUZZ_BUILD)/$$costs; fi
	bash tests/sanitize/run.sh $(FUZZ_BUILD) unit

demo: build
	@bash tools/demo.sh $(BUILD)

bench: build
	@bash bench/run.sh $(BUILD)

clean:
	rm -rf $(BUILD)
