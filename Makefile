# mok: `make` builds libmok.so, libmok.a and the mok command; `make test` builds everything
# (including the sm_90a compile of every kernel) and runs the CPU tests; `make gpu-check` is the
# one command to send to the device: it builds, runs the GPU tests, then the benchmark.

CC      ?= gcc
NVCC    ?= nvcc
# The toolkit nvcc itself uses (its TOP), so that a wrapper script such as /usr/local/bin/nvcc
# does not make us look for the toolkit's headers and libraries under /usr/local.
ifndef CUDA
CUDA    := $(realpath $(shell $(NVCC) --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$$ TOP=//p'))
endif
PYTHON  ?= python3

# NCCL's headers (2.28 or later: nccl_device.h); the library itself is loaded at run time, so
# the headers should be those of the NCCL that will be loaded: the CUDA toolkit's, else the
# nvidia-nccl wheel of $(PYTHON) (torch's), else the system's.
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
$(error no nccl_device.h (NCCL 2.28+ headers) in $(CUDA)/include, the nvidia-nccl wheel, /usr/include or /usr/local/include; set NCCL_INC)
endif
# -isystem: NCCL's headers do not build warning-free; /usr/include is a system directory already.
NCCL_FLAG := $(if $(filter /usr/include,$(NCCL_INC)),,-isystem $(NCCL_INC))

WARN    := -Wall -Wextra -Werror
CFLAGS  := -std=c11 -O2 -g -fPIC -fopenmp $(WARN) -Iinclude -Isrc -D_GNU_SOURCE -I$(CUDA)/include $(NCCL_FLAG)
NVFLAGS := -std=c++17 -O3 -g -lineinfo -gencode arch=compute_90a,code=sm_90a -Werror all-warnings \
           -Xcompiler -fPIC,-Wall,-Wextra,-Werror -Iinclude -Isrc -I$(CUDA)/include $(NCCL_FLAG) $(NVEXTRA)
LDLIBS  := -L$(CUDA)/lib64 -lcudart_static -lrt -ldl -lpthread -lm -fopenmp -lstdc++

LIB_C   := $(wildcard src/*.c src/cpu/*.c)
LIB_CU  := $(wildcard src/cuda/*.cu)
LIB_OBJ := $(LIB_C:%.c=build/%.o) $(LIB_CU:%.cu=build/%.o)
TEST_C  := $(wildcard tests/*.c)
GPU_SRC := $(wildcard tests/gpu/*.c tests/gpu/*.cu)
GPU_OBJ := $(patsubst %,build/%.o,$(basename $(GPU_SRC))) build/tests/gpu/main.o

all: build/libmok.so build/libmok.a build/mok

build/%.o: %.c $(wildcard include/*.h src/*.h src/cpu/*.h tests/*.h tools/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -c $< -o $@

# NVEXTRA (extra nvcc flags, e.g. a probe's -D) is written to a stamp that every CUDA object
# depends on, rewritten only when it changes: a build with other flags rebuilds them, and a probe
# object never outlives its flags.
NVEXTRA_STAMP := build/nvextra.stamp
$(shell mkdir -p build && { [ -f $(NVEXTRA_STAMP) ] && \
  [ "$$(cat $(NVEXTRA_STAMP))" = "$(NVEXTRA)" ] || echo "$(NVEXTRA)" > $(NVEXTRA_STAMP); })
CU_DEPS := $(wildcard include/*.h src/*.h src/cuda/*.h src/cuda/*.cuh) $(NVEXTRA_STAMP)
build/%.o: %.cu $(CU_DEPS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

# The GEMM kernels are also checked for what ptxas only reports as information: a spill, or
# wgmma serialized or given extra warpgroup.arrive (C7511, C7519: a run-time branch between
# wgmma shapes inside the k-loop did that to every kernel, wip/narrow-tail's first form).
# The tile-clock probe (tools/tile-clock.sh) may spill a few bytes (20-36 in down dgrad, 4 in the
# forward's launch at 2 x 2), which it then measures a little slow; serialised wgmma would make it
# measure nothing, so that stays out.
GEMM_REFUSE := C75[0-9][0-9]$(if $(filter -DMOK_TILE_CLOCK -DMOK_TILE_CLOCK=%,$(NVEXTRA)),,|[1-9][0-9]* bytes spill)
build/src/cuda/gemm_kernels.o: src/cuda/gemm_kernels.cu $(CU_DEPS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Xptxas -v -c $< -o $@ 2> $@.ptxas || { cat $@.ptxas; rm -f $@; exit 1; }
	@if grep -E '$(GEMM_REFUSE)' $@.ptxas; then \
	  echo "$<: ptxas reports spills or serialized wgmma (above; full log $@.ptxas)"; rm -f $@; exit 1; fi

build/libmok.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

build/libmok.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDLIBS)

# The mok command: every tools/*.c but the README's example.
TOOL_C  := $(filter-out tools/example.c,$(wildcard tools/*.c))
build/mok: $(TOOL_C:%.c=build/%.o) build/libmok.a
	$(CC) -o $@ $^ $(LDLIBS)

# The README's C example, built (and run) by make test.
build/example: tools/example.c build/libmok.a
	$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

build/test_mok: $(TEST_C:%.c=build/%.o) build/tools/cli.o build/libmok.a
	$(CC) -o $@ $(filter %.o,$^) build/libmok.a $(LDLIBS)

# The GPU test binary shares main.c with the CPU one; its tables.h lists the GPU test files.
build/tests/gpu/main.o: tests/main.c tests/gpu/tables.h tests/check.h include/mok.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/gpu -Itests -c $< -o $@

build/tests/gpu/%.o: tests/gpu/%.c $(wildcard include/*.h src/*.h tests/*.h tests/gpu/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/gpu -Itests -c $< -o $@

build/tests/gpu/%.o: tests/gpu/%.cu $(wildcard include/*.h src/*.h src/cuda/*.cuh tests/*.h)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Itests -c $< -o $@

build/test_gpu: $(GPU_OBJ) build/tests/harness.o build/libmok.a
	$(CC) -o $@ $^ $(LDLIBS)

test: all build/test_mok build/test_gpu build/example
	./build/test_mok
	./tests/cli.sh
	MOK_LIB=build/libmok.so $(PYTHON) -m pytest -q python/tests

gpu-check: all build/test_gpu
	./tools/gpu-check.sh

# The benchmark of DESIGN.md section 7 (on the device): mok, the PyTorch baselines, the ceiling.
bench: all
	PYTHONUNBUFFERED=1 MOK_LIB=build/libmok.so $(PYTHON) bench/run.py --out results/

clean:
	rm -rf build

.PHONY: all test gpu-check bench clean
