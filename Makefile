# mok: `make` builds libmok.so, libmok.a and the mok command under build/; `make test` builds
# everything (including the sm_90a compile of every kernel) and runs the CPU tests; `make install
# PREFIX=...` installs mok.h, the two libraries, mok.pc and the command (`pip install .` installs
# the Python package with them: pyproject.toml, setup.py); `make gpu-check` is the one command to
# send to the device: it builds, runs the GPU tests, then the benchmark. Jobs run in parallel, one
# per core, unless -j says otherwise.
#
# The CUDA backend is built where nvcc is found (WITH_CUDA=0 leaves it out; WITH_CUDA=1 insists).
# Without it libmok holds the CPU backend only, needs no CUDA toolkit or NCCL, and a context for
# MOK_BACKEND_CUDA fails with MOK_ERR_UNSUPPORTED saying why (src/cuda/absent.c).

CC      ?= gcc
NVCC    ?= nvcc
PYTHON  ?= python3
BUILD   ?= build
WITH_CUDA ?= $(if $(shell command -v $(NVCC) 2>/dev/null),1,0)

# (A sub-make shares its parent's jobs.)
ifeq ($(MAKELEVEL)$(filter -j%,$(MAKEFLAGS)),0)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 1)
endif

PREFIX  ?= /usr/local
LIBDIR  ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
BINDIR  ?= $(PREFIX)/bin
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig

# The version is mok.h's. The soname names the ABI: the major, and while that is 0, the minor too
# (a 0.x release may change the ABI).
version_part = $(shell sed -n 's/^\#define MOK_VERSION_$(1) \([0-9]*\)$$/\1/p' include/mok.h)
VERSION := $(call version_part,MAJOR).$(call version_part,MINOR).$(call version_part,PATCH)
SONAME  := libmok.so.$(if $(filter 0,$(call version_part,MAJOR)),0.$(call version_part,MINOR),$(call version_part,MAJOR))

# SANITIZE=1 (make asan): every object and binary built with AddressSanitizer and
# UndefinedBehaviorSanitizer, the first error of either ending the run.
SANITIZE ?= 0
ifeq ($(SANITIZE),1)
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
endif
# FUZZ=1 (make fuzz, with clang): objects instrumented for libFuzzer's coverage (where clang
# cannot vectorize the simd loops, which it would report as an error).
ifeq ($(FUZZ),1)
SAN_FLAGS += -fsanitize=fuzzer-no-link -Wno-pass-failed
endif

WARN    := -Wall -Wextra -Werror
DEPS    := -MMD -MP # each object's header dependencies, in its .d beside it
CFLAGS  := -std=c11 -O2 -g -fPIC -fopenmp $(SAN_FLAGS) $(WARN) $(DEPS) -Iinclude -Isrc -D_GNU_SOURCE
LDLIBS  := -lrt -ldl -lpthread -lm -fopenmp $(SAN_FLAGS)

ifeq ($(WITH_CUDA),1)
# The toolkit nvcc itself uses (its TOP), so that a wrapper script such as /usr/local/bin/nvcc
# does not make us look for the toolkit's headers and libraries under /usr/local.
ifndef CUDA
CUDA    := $(realpath $(shell $(NVCC) --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$$ TOP=//p'))
endif

# NCCL's headers (2.28 or later: nccl_device.h); the library itself is loaded at run time, any
# release from 2.28 on (src/nccl.c): the CUDA toolkit's headers, else the nvidia-nccl wheel of
# $(PYTHON) (torch's), else the system's.
ifndef NCCL_INC
NCCL_INC := $(wildcard $(CUDA)/include/nccl_device.h)
ifeq ($(NCCL_INC),)
NCCL_INC := $(wildcard $(shell $(PYTHON) -c "import nvidia.nccl as n; print(n.__path__[0])" \
            2>/dev/null)/include/nccl_device.h)
endif
ifeq ($(NCCL_INC),)
NCCL_INC := $(wildcard /usr/include/nccl_device.h /usr/local/include/nccl_device.h)
endif
NCCL_INC := $(patsubst %/nccl_device.h,%,$(firstword $(NCCL_INC)))
endif
ifeq ($(NCCL_INC),)
$(error no nccl_device.h (NCCL 2.28+ headers) in $(CUDA)/include, the nvidia-nccl wheel, /usr/include or /usr/local/include; set NCCL_INC, or WITH_CUDA=0 for the CPU backend alone)
endif
# -isystem: NCCL's headers do not build warning-free; /usr/include is a system directory already.
NCCL_FLAG := $(if $(filter /usr/include,$(NCCL_INC)),,-isystem $(NCCL_INC))

CFLAGS  += -I$(CUDA)/include $(NCCL_FLAG)
NVFLAGS := -std=c++17 -O3 -g -lineinfo -gencode arch=compute_90a,code=sm_90a -Werror all-warnings \
           -Xcompiler -fPIC,-Wall,-Wextra,-Werror $(DEPS) -Iinclude -Isrc -I$(CUDA)/include \
           $(NCCL_FLAG) $(NVEXTRA)
LDLIBS  := -L$(CUDA)/lib64 -lcudart_static $(LDLIBS) -lstdc++
LIB_SRC := $(wildcard src/*.c src/cpu/*.c src/cuda/*.cu)
else
CFLAGS  += -DMOK_NO_CUDA
LIB_SRC := $(filter-out src/nccl.c,$(wildcard src/*.c src/cpu/*.c)) src/cuda/absent.c
endif

# The seeded inputs and the float64 recomputation, for the tests and the mok command
# (libmok_check.a, never installed): not part of libmok.
CHECK_SRC := src/gen.c src/cpu/ref64.c
LIB_SRC := $(filter-out $(CHECK_SRC),$(LIB_SRC))
LIB_OBJ := $(patsubst %,$(BUILD)/%.o,$(basename $(LIB_SRC)))
CHECK_OBJ := $(CHECK_SRC:%.c=$(BUILD)/%.o)
# What the tests and the command link: both archives, the checking one first.
LINK_CHECK := $(BUILD)/libmok_check.a $(BUILD)/libmok.a
TEST_C  := $(filter-out tests/nccl_stub.c,$(wildcard tests/*.c))
FUZZ_OBJ := $(BUILD)/tests/fuzz/fuzz_api.o
# The mok command: every tools/*.c but the README's example.
TOOL_C  := $(filter-out tools/example.c,$(wildcard tools/*.c))
GPU_SRC := $(wildcard tests/gpu/*.c tests/gpu/*.cu)
GPU_OBJ := $(patsubst %,$(BUILD)/%.o,$(basename $(GPU_SRC))) $(BUILD)/tests/gpu/main.o
ALL_OBJ := $(LIB_OBJ) $(CHECK_OBJ) $(TEST_C:%.c=$(BUILD)/%.o) $(TOOL_C:%.c=$(BUILD)/%.o) \
           $(FUZZ_OBJ) $(BUILD)/tests/fuzz/replay.o \
           $(if $(filter 1,$(WITH_CUDA)),$(GPU_OBJ))

all: $(BUILD)/libmok.so $(BUILD)/libmok.a $(BUILD)/mok

# The compilers' flags (WITH_CUDA's, NVEXTRA: extra nvcc flags such as a probe's -D) are written
# to a stamp that every object depends on, rewritten only when they change: a build with other
# flags rebuilds them, and a probe object never outlives its flags.
FLAGS_STAMP := $(BUILD)/flags.stamp
$(shell mkdir -p $(BUILD) && { [ -f $(FLAGS_STAMP) ] && \
  [ "$$(cat $(FLAGS_STAMP))" = "$(CFLAGS) $(NVFLAGS)" ] || echo "$(CFLAGS) $(NVFLAGS)" > $(FLAGS_STAMP); })

$(BUILD)/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -c $< -o $@

ifeq ($(WITH_CUDA),1)
$(BUILD)/%.o: %.cu $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

# Every GEMM kernel file (src/cuda/gemm*.cu) is also checked for what ptxas only reports as
# information: a spill, or wgmma serialized or given extra warpgroup.arrive (C7511, C7519: a
# run-time branch between wgmma shapes inside the k-loop did that to every kernel,
# wip/narrow-tail's first form). The tile-clock probe (tools/tile-clock.sh) may spill a few bytes
# (20-36 in down dgrad, 4 in the forward's launch at 2 x 2), which it then measures a little
# slow; serialised wgmma would make it measure nothing, so that stays out.
GEMM_REFUSE := C75[0-9][0-9]$(if $(filter -DMOK_TILE_CLOCK -DMOK_TILE_CLOCK=%,$(NVEXTRA)),,|[1-9][0-9]* bytes spill)
$(BUILD)/src/cuda/gemm%.o: src/cuda/gemm%.cu $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Xptxas -v -c $< -o $@ 2> $@.ptxas || { cat $@.ptxas; rm -f $@; exit 1; }
	@if grep -E '$(GEMM_REFUSE)' $@.ptxas; then \
	  echo "$<: ptxas reports spills or serialized wgmma (above; full log $@.ptxas)"; rm -f $@; exit 1; fi
endif

$(BUILD)/libmok.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libmok_check.a: $(CHECK_OBJ)
	@rm -f $@
	ar rcs $@ $^

# libmok.so exports the functions mok.h declares and nothing else (tests/install.sh checks).
$(BUILD)/libmok.map: include/mok.h
	@mkdir -p $(dir $@)
	{ echo '{ global:'; grep -o 'mok_[a-z0-9_]*(' $< | tr -d '(' | sort -u | sed 's/$$/;/'; \
	  echo 'local: *; };'; } > $@

$(BUILD)/libmok.so: $(LIB_OBJ) $(BUILD)/libmok.map
	$(CC) -shared -Wl,-soname,$(SONAME) -Wl,--version-script=$(BUILD)/libmok.map -o $@ \
	  $(LIB_OBJ) $(LDLIBS)

$(BUILD)/mok: $(TOOL_C:%.c=$(BUILD)/%.o) $(LINK_CHECK)
	$(CC) -o $@ $^ $(LDLIBS)

# The README's C example, built (and run) by make test; tests/install.sh builds it again against
# the installed library, with pkg-config.
$(BUILD)/example: tools/example.c $(BUILD)/libmok.a
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/test_mok: $(TEST_C:%.c=$(BUILD)/%.o) $(BUILD)/tools/cli.o $(LINK_CHECK)
	$(CC) -o $@ $^ $(LDLIBS)

# The fuzz target on the corpus's inputs, once each (make test); make fuzz links it to libFuzzer.
$(BUILD)/fuzz_replay: $(FUZZ_OBJ) $(BUILD)/tests/fuzz/replay.o $(LINK_CHECK)
	$(CC) -o $@ $^ $(LDLIBS)

$(BUILD)/fuzz_api: $(FUZZ_OBJ) $(LINK_CHECK)
	$(CC) -fsanitize=fuzzer -o $@ $^ $(LDLIBS)

# The GPU test binary shares main.c with the CPU one; its tables.h lists the GPU test files.
$(BUILD)/tests/gpu/main.o: tests/main.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/gpu -Itests -c $< -o $@

$(BUILD)/tests/gpu/%.o: tests/gpu/%.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/gpu -Itests -c $< -o $@

$(BUILD)/tests/gpu/%.o: tests/gpu/%.cu $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Itests -c $< -o $@

$(BUILD)/test_gpu: $(GPU_OBJ) $(BUILD)/tests/harness.o $(LINK_CHECK)
	$(CC) -o $@ $^ $(LDLIBS)

# Stand-in NCCL libraries of an earlier and a later release than any headers mok takes, for
# python/tests/test_nccl_load.py (which NCCL src/nccl.c accepts).
NCCL_STUBS := $(if $(filter 1,$(WITH_CUDA)),$(BUILD)/nccl-stub/2.27.0/libnccl.so.2 \
                $(BUILD)/nccl-stub/2.99.0/libnccl.so.2)
$(BUILD)/nccl-stub/%/libnccl.so.2: tests/nccl_stub.c
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC $(WARN) -DSTUB_VERSION=$(shell echo $* | awk -F. '{print $$1 * 10000 + $$2 * 100 + $$3}') \
	  -Wl,-soname,libnccl.so.2 -o $@ $<

# make test: where nvcc is, also the GPU test binary (every kernel compiled for sm_90a), and a
# build without the CUDA backend, whose tests run too (tests/no-cuda.sh).
test: all $(BUILD)/test_mok $(BUILD)/example $(if $(filter 1,$(WITH_CUDA)),$(BUILD)/test_gpu) \
      $(NCCL_STUBS) $(BUILD)/fuzz_replay
	./$(BUILD)/test_mok
	./$(BUILD)/fuzz_replay tests/fuzz/corpus/*
	./tests/cli.sh
	MOK_LIB=$(BUILD)/libmok.so $(PYTHON) -m pytest -q python/tests
	./tests/install.sh
	./tests/wheel.sh
ifeq ($(WITH_CUDA),1)
	$(MAKE) --no-print-directory WITH_CUDA=0 BUILD=$(BUILD)/no-cuda test-no-cuda
endif

# The CPU-only build's checks (make test runs them where nvcc is): its CUDA backend says it is
# absent, and the C tests and the command's pass without it.
test-no-cuda: all $(BUILD)/test_mok
	./tests/no-cuda.sh $(BUILD)

# The C tests under AddressSanitizer and UndefinedBehaviorSanitizer, on a CPU-only build of
# their own (build/asan): a bad read or write, a leak or undefined behaviour fails them. CI runs
# it (.ci/run).
asan:
	$(MAKE) --no-print-directory WITH_CUDA=0 SANITIZE=1 BUILD=$(BUILD)/asan \
	  $(BUILD)/asan/test_mok $(BUILD)/asan/fuzz_replay
	UBSAN_OPTIONS=print_stacktrace=1 ./$(BUILD)/asan/test_mok
	UBSAN_OPTIONS=print_stacktrace=1 ./$(BUILD)/asan/fuzz_replay tests/fuzz/corpus/*

# libFuzzer (clang) on the C API, CPU backend, under ASan and UBSan, for FUZZ_SECONDS (CI: 60):
# new inputs go to $(BUILD)/fuzz/corpus, a failing one to $(BUILD)/fuzz/crash-*; copy the ones
# worth keeping into tests/fuzz/corpus, which make test replays.
FUZZ_SECONDS ?= 60
fuzz:
	$(MAKE) --no-print-directory CC=clang WITH_CUDA=0 SANITIZE=1 FUZZ=1 BUILD=$(BUILD)/fuzz \
	  $(BUILD)/fuzz/fuzz_api
	mkdir -p $(BUILD)/fuzz/corpus
	UBSAN_OPTIONS=print_stacktrace=1 ./$(BUILD)/fuzz/fuzz_api -max_total_time=$(FUZZ_SECONDS) \
	  -max_len=256 -len_control=0 -timeout=20 -rss_limit_mb=4096 -artifact_prefix=$(BUILD)/fuzz/ \
	  $(BUILD)/fuzz/corpus \
	  tests/fuzz/corpus

# DESTDIR stages the install elsewhere (for packaging); mok.pc gets the final paths.
install: all
	install -d $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(BINDIR) \
	  $(DESTDIR)$(PKGCONFIGDIR)
	install -m 644 include/mok.h $(DESTDIR)$(INCLUDEDIR)/mok.h
	install -m 644 $(BUILD)/libmok.a $(DESTDIR)$(LIBDIR)/libmok.a
	install -m 755 $(BUILD)/libmok.so $(DESTDIR)$(LIBDIR)/libmok.so.$(VERSION)
	ln -sf libmok.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libmok.so
	install -m 755 $(BUILD)/mok $(DESTDIR)$(BINDIR)/mok
	sed -e 's|@LIBDIR@|$(LIBDIR)|' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|' -e 's|@VERSION@|$(VERSION)|' \
	  -e 's|@LIBS_PRIVATE@|$(LDLIBS)|' mok.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/mok.pc

uninstall:
	rm -f $(DESTDIR)$(INCLUDEDIR)/mok.h $(DESTDIR)$(LIBDIR)/libmok.a \
	  $(DESTDIR)$(LIBDIR)/libmok.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME) \
	  $(DESTDIR)$(LIBDIR)/libmok.so $(DESTDIR)$(BINDIR)/mok $(DESTDIR)$(PKGCONFIGDIR)/mok.pc

gpu-check: all $(BUILD)/test_gpu
	./tools/gpu-check.sh

# The benchmark of DESIGN.md section 7 (on the device): mok, the PyTorch baselines, the ceiling.
bench: all
	PYTHONUNBUFFERED=1 MOK_LIB=$(BUILD)/libmok.so $(PYTHON) bench/run.py --out results/

clean:
	rm -rf $(BUILD)

-include $(ALL_OBJ:.o=.d)

.PHONY: all test test-no-cuda asan fuzz install uninstall gpu-check bench clean
