"""Workers: what owns a model.

worker.py   Worker: loads the model (its shard), picks kernels, sizes and allocates the KV
            pool, runs the steps it is handed
runner.py   ModelRunner: per-request state from the plans' deltas, one forward pass, sampling
cuda_graphs.py  DecodeGraphs: decode steps captured once per batch size and replayed (CUDA)
"""
