"""kernels: stateless OpenMP Cython kernels for GPT-2 training, as forward/backward pairs.

Every kernel works on C-contiguous float32 NumPy arrays, writes outputs first,
then reads inputs, then takes sizes (llm.c's convention).  Backward kernels
accumulate (+=) into gradient buffers.  ``kernels.threads`` resolves the thread
count once and keeps BLAS and OpenMP from oversubscribing the cores; every thread
count (``n_threads=``, ``set_num_threads``, ``OMP_NUM_THREADS``) must lie in
[1, ``kernels.threads.MAX_THREADS``] (4096), or the call raises ValueError.  A size
of 0 gives the empty result (a backward adds nothing), except where the operation
has no meaning: layernorm over C = 0 channels, a softmax over V = 0 classes.

The element-wise and row kernels (layers, loss, attention) run in sixteen lanes
where the CPU has AVX-512 and in eight otherwise; ``set_vector_lanes(8)`` forces
eight for all of them (tests check both widths on one machine) and
``vector_lanes()`` says which is in force.  The small matrix products of
``kernels.gemm`` have their own switch, ``gemm.set_skinny_lanes``.
"""
from kernels._common import set_vector_lanes, vector_lanes  # noqa: F401
