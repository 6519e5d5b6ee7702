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

# The installed `quilt` must run on its own (RPATH to its lib/), without LD_LIBRARY_PATH.
# The suite runs once with the GEMM library chosen for this machine, then once more with each
# other library installed forced (QUILT_GEMM), so every test passes on every GEMM backend.
test: build examples
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900
	@chosen=$$($(BUILD)/bin/quilt gemm | sed -n 's/^gemm: \([a-z]*\).*/\1/p'); \
	for lib in $$($(BUILD)/bin/quilt gemm --list); do \
	  [ "$$lib" = "$$chosen" ] && continue; \
	  echo "quilt: the test suite again with QUILT_GEMM=$$lib (the default here is $$chosen)"; \
	  (cd $(BUILD) && QUILT_GEMM=$$lib ctest --output-on-failure -j $(JOBS) --timeout 900) || exit 1; \
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
