// The machine's peaks, for the prompt path's figures (benchmarks/README.md, issues 35 and 37):
// AVX-512 VNNI (vpdpbusd), BF16 (vdpbf16ps) and fp32 FMA instructions a second on 12 independent
// accumulators, on 1 thread and on every core, and the memory's read bandwidth.
//
//     g++ -O2 -march=native -fopenmp benchmarks/machine_peaks.cpp -o /tmp/peaks && /tmp/peaks
//
// ops count a multiply-add as 2: vpdpbusd zmm is 64 int8 multiply-adds, vdpbf16ps zmm 32,
// vfmadd231ps zmm 16. The native kernels' activations are 16 bits (two int8 halves), so their
// linears' ceiling in 16-bit multiply-adds is half the vpdpbusd figure.
#include <immintrin.h>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <omp.h>
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
#define R8(I) I(0) I(1) I(2) I(3) I(4) I(5) I(6) I(7) I(8) I(9) I(10) I(11)
#define DPB(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n"
#define DPBY(i) "vpdpbusd %%ymm30, %%ymm31, %%ymm" #i "\n"
#define BF(i) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #i "\n"
#define FM(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #i "\n"
#define ADD(i) "vpaddd %%zmm30, %%zmm" #i ", %%zmm" #i "\n"
#define LOOP(BODY) [](long n){ __asm__ volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n vpxord %%zmm31,%%zmm31,%%zmm31\n 1:\n" R8(BODY) "dec %0\n jnz 1b\n" : "+r"(n) :: "cc","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm30","xmm31"); }
template<class F> void run(const char* name, F f, double per, int T){
  long n=50000000; double best=1e9;
  for(int r=0;r<3;r++){ double t0=now();
#pragma omp parallel num_threads(T)
    f(n);
    double dt=now()-t0; if(dt<best) best=dt;}
  printf("%-14s T=%d: %.2f G instr/s/thread, %.1f G ops/s total\n", name, T, n*12/best/1e9, n*12*per*T/best/1e9);
}

// Read bandwidth: a 256 MB buffer summed by T threads, best of 5.
static double bandwidth(int T) {
    size_t n = 1ull << 28;
    char* buf = static_cast<char*>(aligned_alloc(64, n));
    memset(buf, 1, n);
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        long long total = 0;
#pragma omp parallel num_threads(T) reduction(+ : total)
        {
            __m512i acc = _mm512_setzero_si512();
#pragma omp for
            for (size_t i = 0; i < n; i += 64) acc = _mm512_add_epi64(acc, _mm512_load_si512(buf + i));
            total += _mm512_reduce_add_epi64(acc);
        }
        double dt = now() - t0;
        if (n / dt > best) best = n / dt;
        if (total == 42) printf(" ");
    }
    free(buf);
    return best;
}
int main(){
  int cores = omp_get_num_procs(); for(int T=1;T<=cores;T+=(cores>1?cores-1:1)){
  run("vpdpbusd zmm", LOOP(DPB), 128, T);
  run("vpdpbusd ymm", LOOP(DPBY), 64, T);
  run("vdpbf16ps zmm", LOOP(BF), 64, T);
  run("vfmadd zmm", LOOP(FM), 32, T);
  run("vpaddd zmm", LOOP(ADD), 16, T);
  printf("read bandwidth T=%d: %.1f GB/s\n", T, bandwidth(T) / 1e9);}
}
