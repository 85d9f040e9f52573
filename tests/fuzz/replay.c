/*
 * replay.c: runs the fuzz target (fuzz_api.c) once on each file named, as libFuzzer would, for
 * the corpus in tests/fuzz/corpus (make test; the inputs make fuzz found worth keeping). Prints
 * "N inputs" and exits 0; a broken promise aborts inside the target.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    FILE *f = fopen(argv[i], "rb");
    if (!f) {
      perror(argv[i]);
      return 1;
    }
    uint8_t *buf = malloc(1 << 16);
    const size_t n = buf ? fread(buf, 1, 1 << 16, f) : 0;
    fclose(f);
    if (!buf) return 1;
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
  }
  printf("%d inputs\n", argc - 1);
  return 0;
}
