/* An x86 CPU without AVX-512, VNNI, AVX-VNNI, bf16 or AMX, as CPUID reports it to one process tree.

LD_PRELOAD'ed by tools/avx2_host: it turns on the kernel's CPUID faulting (arch_prctl ARCH_SET_CPUID,
the `cpuid_fault` flag), so every CPUID instruction traps; the SIGSEGV handler runs the real CPUID and
clears those feature bits. Libraries that pick kernels by CPUID (ONNX Runtime's MLAS, oneDNN, fbgemm,
ATen) then run their AVX2 kernels, natively. A program's own SIGSEGV handler is kept and called for
every other fault. Faulting is inherited across fork and clone and reset by execve, where LD_PRELOAD
applies it again. glibc's own string functions were chosen before this library loads. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <asm/prctl.h>
#include <stdio.h>

/* CPUID leaf 7 bits cleared (Intel SDM vol. 2A, CPUID): */
#define BIT(n) (1u << (n))
/* EBX: avx512f 16, avx512dq 17, avx512ifma 21, avx512pf 26, avx512er 27, avx512cd 28, avx512bw 30, avx512vl 31 */
#define LEAF7_EBX_AVX512 (BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31))
/* ECX: avx512vbmi 1, avx512_vbmi2 6, avx512_vnni 11, avx512_bitalg 12, avx512_vpopcntdq 14 */
#define LEAF7_ECX_AVX512 (BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14))
/* EDX: avx512_4vnniw 2, avx512_4fmaps 3, avx512_vp2intersect 8, amx_bf16 22, avx512_fp16 23, amx_tile 24, amx_int8 25 */
#define LEAF7_EDX_AVX512_AMX (BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25))
/* leaf 7 subleaf 1, EAX: avx_vnni 4, avx512_bf16 5 */
#define LEAF7_1_EAX_VNNI_BF16 (BIT(4) | BIT(5))

static struct sigaction chained;  /* whatever the program itself asked for on SIGSEGV */
static int (*next_sigaction)(int, const struct sigaction *, struct sigaction *);

static int set_cpuid(int on) { return syscall(SYS_arch_prctl, ARCH_SET_CPUID, on); }

static void handler(int sig, siginfo_t *si, void *ctx) {
    ucontext_t *uc = ctx;
    greg_t *g = uc->uc_mcontext.gregs;
    unsigned char *ip = (unsigned char *)g[REG_RIP];
    if (si->si_code != SI_KERNEL || ip[0] != 0x0f || ip[1] != 0xa2) {
        if (chained.sa_flags & SA_SIGINFO) { chained.sa_sigaction(sig, si, ctx); return; }
        if (chained.sa_handler != SIG_DFL && chained.sa_handler != SIG_IGN) { chained.sa_handler(sig); return; }
        struct sigaction dfl; memset(&dfl, 0, sizeof dfl); dfl.sa_handler = SIG_DFL;
        next_sigaction(SIGSEGV, &dfl, 0); return;
    }
    uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
    set_cpuid(1);
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
    set_cpuid(0);
    if (leaf == 7 && sub == 0) {
        r[1] &= ~LEAF7_EBX_AVX512;
        r[2] &= ~LEAF7_ECX_AVX512;
        r[3] &= ~LEAF7_EDX_AVX512_AMX;
    } else if (leaf == 7 && sub == 1) {
        r[0] &= ~LEAF7_1_EAX_VNNI_BF16;
    }
    g[REG_RAX] = r[0]; g[REG_RBX] = r[1]; g[REG_RCX] = r[2]; g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!next_sigaction) next_sigaction = dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV) return next_sigaction(sig, act, old);
    if (old) *old = chained;
    if (act) chained = *act;
    return 0;
}

__attribute__((constructor)) static void init(void) {
    next_sigaction = dlsym(RTLD_NEXT, "sigaction");
    struct sigaction sa; memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler; sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    next_sigaction(SIGSEGV, &sa, 0);
    if (set_cpuid(0) != 0) {  /* never let a measurement run silently on the full CPU */
        perror("cpuid_mask: arch_prctl(ARCH_SET_CPUID, 0) (needs the cpuid_fault flag)");
        _exit(97);
    }
}
