"""A one-shot check of the engine on a lent GPU: kernel and greedy parity, CUDA graphs, throughput against
the memory roofline and the P/D hand-off, written to one JSON (`python -m loadtest.gpu_check`). It imports
only `workers` and `kernels` (no Ray, no pydantic): the GPU machine has neither."""
