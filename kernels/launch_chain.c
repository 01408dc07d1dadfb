/* One host call makes all of a chain of launches (kernels/cuda_build.py's Chain; the MoE's is set up by
 * kernels/moe_cuda.py's _Call): it adds the call's base pointers to the argument slots' offsets, then
 * launches each kernel with the driver's cuLaunchKernelEx on the caller's stream. From Python that
 * is one ctypes call a MoE call instead of one a launch plus a numpy fill.
 *
 * Host code only, no CUDA headers: LaunchConfig is cuda.h's CUlaunchConfig (the ctypes mirror in
 * cuda_build.py is checked against the same offsets), and the driver's entry point comes from the
 * caller, so the launches go through the libcuda the process already uses. */
#include <stdint.h>

typedef struct {
    unsigned grid[3], block[3], smem;
    void *stream;
    void *attrs;
    unsigned num_attrs;
} LaunchConfig;

typedef int (*LaunchFn)(const LaunchConfig *config, void *fn, void **params, void **extra);

typedef struct {
    LaunchFn launch;        /* cuLaunchKernelEx */
    int64_t n_launches, n_args;
    int64_t *args;          /* n_args 8-byte slots, what the launches' params point to */
    const int64_t *which;   /* per slot: the base it adds to (0: none, the slot holds a plain value) */
    const int64_t *offset;  /* per slot: the offset from that base, or the value */
    const int64_t *bases;   /* bases[0] = 0; the rest written by the caller before each call */
    LaunchConfig **config;  /* per launch; its stream is written here */
    void **fn;              /* per launch: the CUfunction */
    void ***params;         /* per launch: its params array */
} Plan;

/* 0, or (the failed launch's index + 1) << 32 | the driver's error code: the launches after it are not made. */
int64_t launch_chain(const Plan *plan, void *stream) {
    for (int64_t i = 0; i < plan->n_args; ++i)
        plan->args[i] = plan->bases[plan->which[i]] + plan->offset[i];
    for (int64_t k = 0; k < plan->n_launches; ++k) {
        plan->config[k]->stream = stream;
        int rc = plan->launch(plan->config[k], plan->fn[k], plan->params[k], 0);
        if (rc != 0)
            return ((k + 1) << 32) | (uint32_t)rc;
    }
    return 0;
}
