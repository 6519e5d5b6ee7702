# Quilt: `make test` and `make demo` do all set-up (Debian packages, configure, build) first.
BUILD   ?= build
PREFIX  ?= $(CURDIR)/$(BUILD)/install
JOBS    ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: all deps configure build test demo bench install examples clean

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
# then once more with each installed library forced (QUILT_GEMM), so every test passes on every
# GEMM backend; the collectives tests (no GEMM) and the library tests (which loop over every
# library themselves) run in the first pass only. Last, the installed `quilt` must run on its
# own (RPATH to its lib/), without LD_LIBRARY_PATH.
test: build examples
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900
	@chosen=$$($(BUILD)/bin/quilt gemm | sed -n 's/^gemm: \([^(]*\) (.*/\1/p'); \
	for lib in $$($(BUILD)/bin/quilt gemm --list); do \
	  [ "$$lib" = "$$chosen" ] && continue; \
	  echo "quilt: the test suite again with QUILT_GEMM=$$lib (the choice here: $$chosen)"; \
	  (cd $(BUILD) && QUILT_GEMM=$$lib ctest --output-on-failure -j $(JOBS) --timeout 900 \
	    -E '^(collectives|kernels\.gemm libraries)') || exit 1; \
	  echo "quilt: all tests passed with QUILT_GEMM=$$lib"; \
	done
	$(BUILD)/examples/tiny_regression
	@env -u LD_LIBRARY_PATH $(PREFIX)/bin/quilt --help > /dev/null || \
	  { echo "installed $(PREFIX)/bin/quilt does not run (missing RPATH to libquilt?)"; exit 1; }

demo: build
	@bash tools/demo.sh $(BUILD)

bench: build
	@bash bench/run.sh $(BUILD)

clean:
	rm -rf $(BUILD)
