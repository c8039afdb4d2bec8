/* Which AVX-512 instructions share a pipe with vpdpbusd: the bound on the K-quant kernels.

    gcc -O2 -mavx512f -mavx512bw -mavx512vnni forerun/kernels/microbench/pipe_mix.c -o /tmp/pipe_mix && /tmp/pipe_mix

Each line times a loop of 8 independent 512-bit vpdpbusd (64 multiply-accumulates each) plus
one or two of another instruction on other registers. Where the extra instructions cost
nothing, they run beside vpdpbusd; where each adds a cycle, they take its pipe. The packed GGUF
kernel (kernels/gguf_packed_rows.cpp) issues 64 vpdpbusd per token and Q4_K block of 16 rows,
plus, on the same pipe, a vpmulld per 32-value sub-block (its 6-bit scale), four vpdpwssd (the
minimums) and four float multiplies: 80 cycles for 64, so 8 tokens at once can reach at most
80% of vpdpbusd's rate. One core, nothing else running; ns per loop of 8 vpdpbusd.
*/
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define DP8                                                                                   \
  "vpdpbusd %%zmm8, %%zmm9, %%zmm0\n vpdpbusd %%zmm8, %%zmm9, %%zmm1\n"                       \
  "vpdpbusd %%zmm8, %%zmm9, %%zmm2\n vpdpbusd %%zmm8, %%zmm9, %%zmm3\n"                       \
  "vpdpbusd %%zmm8, %%zmm9, %%zmm4\n vpdpbusd %%zmm8, %%zmm9, %%zmm5\n"                       \
  "vpdpbusd %%zmm8, %%zmm9, %%zmm6\n vpdpbusd %%zmm8, %%zmm9, %%zmm7\n"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", "xmm11"
#define TIME(name, extra)                                                  \
  do {                                                                     \
    const long n = 20000000;                                               \
    double s = now();                                                      \
    for (long i = 0; i < n; i++) asm volatile(DP8 extra ::: CLOBBER);      \
    printf("%-26s %.3f ns\n", name, (now() - s) / n * 1e9);               \
  } while (0)

int main(void) {
  asm volatile("vpxord %%zmm8, %%zmm8, %%zmm8\n vpxord %%zmm9, %%zmm9, %%zmm9" ::: "xmm8", "xmm9");
  TIME("8 vpdpbusd", "");
  TIME("+ 1 vpmulld", "vpmulld %%zmm8, %%zmm9, %%zmm10\n");
  TIME("+ 2 vpmulld", "vpmulld %%zmm8, %%zmm9, %%zmm10\n vpmulld %%zmm8, %%zmm9, %%zmm11\n");
  TIME("+ 1 vpdpwssd", "vpdpwssd %%zmm8, %%zmm9, %%zmm10\n");
  TIME("+ 1 vfmadd231ps", "vfmadd231ps %%zmm8, %%zmm9, %%zmm10\n");
  TIME("+ 1 vmulps", "vmulps %%zmm8, %%zmm9, %%zmm10\n");
  TIME("+ 2 vcvtdq2ps", "vcvtdq2ps %%zmm8, %%zmm10\n vcvtdq2ps %%zmm9, %%zmm11\n");
  TIME("+ 2 vpaddd", "vpaddd %%zmm8, %%zmm9, %%zmm10\n vpaddd %%zmm8, %%zmm9, %%zmm11\n");
  TIME("+ 2 vpsrlw", "vpsrlw $4, %%zmm8, %%zmm10\n vpsrlw $4, %%zmm9, %%zmm11\n");
  TIME("+ 2 vpandd", "vpandd %%zmm8, %%zmm9, %%zmm10\n vpandd %%zmm8, %%zmm9, %%zmm11\n");
  return 0;
}
