/* Thread count for the kernels' OpenMP regions. When this library binds to the libgomp torch
 * already loaded (the usual case: same soname), torch.set_num_threads has set it already; this
 * call keeps the share right if the kernels ever get an OpenMP runtime of their own. */
#include <omp.h>

void tidal_set_num_threads(int num_threads) {
    if (num_threads > 0) omp_set_num_threads(num_threads);
}
