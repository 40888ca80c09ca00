"""kernels: stateless OpenMP Cython kernels for GPT-2 training, as forward/backward pairs.

Every kernel works on C-contiguous float32 NumPy arrays, writes outputs first,
then reads inputs, then takes sizes (llm.c's convention).  Backward kernels
accumulate (+=) into gradient buffers.  ``kernels.threads`` resolves the thread
count once and keeps BLAS and OpenMP from oversubscribing the cores.
"""
